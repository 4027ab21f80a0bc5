/*
 * fake_cudart.c - a stand-in libcudart.so.13 for dry runs of the GPU
 * benchmark on a machine without a GPU (tests/gpu/dryrun.sh). Not a test
 * of anything CUDA does: it exists so that the scripts, weightd-bench's
 * phases and the daemon's cuda backend paths can be run end to end before
 * the one short session on the GPU host, and their bugs found here.
 *
 * One "GPU" of 139 GiB whose memory is anonymous host memory; copies are
 * memcpy (synchronous, so streams and events are always complete);
 * cudaHostRegister records ranges and refuses an overlap, as CUDA does;
 * IPC handles carry the pointer, and cannot be opened in another process
 * (the attach phase is left out of dry runs). There is no driver: every
 * driver entry point is missing, so the daemon's cuda_handles=vmm falls back
 * to legacy cuda_ipc handles (with its warning), as on a driver without VMM.
 * Timings mean nothing.
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define FAKE_TOTAL (139ull << 30)

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  void *p;
  size_t len;
} allocs[4096], regs[65536];
static size_t nallocs, nregs;
static uint64_t used;
static __thread cudaError_t last;

static cudaError_t fail(cudaError_t e) {
  last = e;
  return e;
}

cudaError_t cudaGetDeviceCount(int *n) {
  *n = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice); }

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d) {
  if (d != 0) return fail(cudaErrorInvalidDevice);
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "FAKE GPU (dry run, no timings)");
  for (int i = 0; i < 16; i++) p->uuid.bytes[i] = (char)(0xf0 + i);
  p->totalGlobalMem = FAKE_TOTAL;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char *buf, int len, int d) {
  if (d != 0) return fail(cudaErrorInvalidDevice);
  snprintf(buf, (size_t)len, "0000:00:00.0"); /* no NUMA node: the topology says "none" */
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total) {
  pthread_mutex_lock(&mu);
  *total = FAKE_TOTAL;
  *free_b = FAKE_TOTAL - used;
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t len) {
  pthread_mutex_lock(&mu);
  if (used + len > FAKE_TOTAL || nallocs == sizeof allocs / sizeof allocs[0]) {
    pthread_mutex_unlock(&mu);
    return fail(cudaErrorMemoryAllocation);
  }
  void *m = mmap(NULL, len ? len : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    pthread_mutex_unlock(&mu);
    return fail(cudaErrorMemoryAllocation);
  }
  allocs[nallocs].p = m;
  allocs[nallocs++].len = len ? len : 1;
  used += len;
  *p = m;
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
  if (p == NULL) return cudaSuccess; /* cudaFree(0): context creation */
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < nallocs; i++)
    if (allocs[i].p == p) {
      munmap(p, allocs[i].len);
      used -= allocs[i].len;
      allocs[i] = allocs[--nallocs];
      pthread_mutex_unlock(&mu);
      return cudaSuccess;
    }
  pthread_mutex_unlock(&mu);
  return fail(cudaErrorInvalidValue);
}

cudaError_t cudaHostAlloc(void **p, size_t len, unsigned flags) {
  (void)flags;
  return posix_memalign(p, 4096, len ? len : 1) == 0 ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaFreeHost(void *p) {
  free(p);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void *p, size_t len, unsigned flags) {
  (void)flags;
  pthread_mutex_lock(&mu);
  const char *a = p;
  for (size_t i = 0; i < nregs; i++)
    if (a < (const char *)regs[i].p + regs[i].len && (const char *)regs[i].p < a + len) {
      pthread_mutex_unlock(&mu);
      return fail(cudaErrorHostMemoryAlreadyRegistered);
    }
  if (nregs == sizeof regs / sizeof regs[0]) {
    pthread_mutex_unlock(&mu);
    return fail(cudaErrorMemoryAllocation);
  }
  regs[nregs].p = p;
  regs[nregs++].len = len;
  pthread_mutex_unlock(&mu);
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *p) {
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < nregs; i++)
    if (regs[i].p == p) {
      regs[i] = regs[--nregs];
      pthread_mutex_unlock(&mu);
      return cudaSuccess;
    }
  pthread_mutex_unlock(&mu);
  return fail(cudaErrorHostMemoryNotRegistered);
}

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p) {
  memset(h, 0, sizeof *h);
  memcpy(h->reserved, &p, sizeof p);
  return cudaSuccess;
}

cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags) {
  (void)p;
  (void)h;
  (void)flags;
  return fail(cudaErrorNotSupported);
}

cudaError_t cudaIpcCloseMemHandle(void *p) {
  (void)p;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
  (void)flags;
  *s = (cudaStream_t)malloc(1);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  free(s);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  (void)s;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  (void)flags;
  *e = (cudaEvent_t)malloc(1);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  free(e);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  (void)e;
  (void)s;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  (void)e;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) {
  (void)k;
  memcpy(d, s, n);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) {
  (void)k;
  (void)st;
  memcpy(d, s, n);
  return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h,
                              enum cudaMemcpyKind k, cudaStream_t st) {
  (void)k;
  (void)st;
  if (dp < w || sp < w) return fail(cudaErrorInvalidPitchValue);
  for (size_t r = 0; r < h; r++) memcpy((char *)d + r * dp, (const char *)s + r * sp, w);
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = last;
  last = cudaSuccess;
  return e;
}

const char *cudaGetErrorName(cudaError_t e) {
  static __thread char buf[32];
  snprintf(buf, sizeof buf, "cudaError%d", (int)e);
  return buf;
}

const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "fake cudart error"; }

/* No driver behind this runtime: no entry point (the daemon's VMM probe then gives legacy handles). */
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags, enum cudaDriverEntryPointQueryResult *status) {
  (void)symbol;
  (void)version;
  (void)flags;
  *fn = NULL;
  if (status != NULL) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

/* One device, so no peer access; the multi-GPU paths are never taken here. */
cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer) {
  (void)dev;
  (void)peer;
  *can = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  (void)peer;
  (void)flags;
  return cudaErrorNotSupported;
}

cudaError_t cudaDeviceGetP2PAttribute(int *value, enum cudaDeviceP2PAttr attr, int src, int dst) {
  (void)attr;
  (void)src;
  (void)dst;
  *value = 0;
  return cudaSuccess;
}

cudaError_t cudaMemcpyPeerAsync(void *dst, int dd, const void *src, int sd, size_t n, cudaStream_t s) {
  (void)dd;
  (void)sd;
  (void)s;
  memcpy(dst, src, n);
  return cudaSuccess;
}

/*
 * The hooks nvcc's generated code calls to register and launch kernels (the
 * scrub kernel, daemon/backend/slab_hash_cuda.cu). Registration does nothing;
 * a launch fails, so a dry run's loads with scrub on record no digests (the
 * daemon logs it) and its scrubs say so.
 */
static void *fake_fatbin_handle;
void **__cudaRegisterFatBinary(void *fatbin) {
  (void)fatbin;
  return &fake_fatbin_handle;
}
void __cudaRegisterFatBinaryEnd(void **h) { (void)h; }
void __cudaUnregisterFatBinary(void **h) { (void)h; }
void __cudaRegisterFunction(void **h, const char *host_fn, char *dev_fn, const char *name, int limit, void *tid,
                            void *bid, void *bdim, void *gdim, int *wsize) {
  (void)h, (void)host_fn, (void)dev_fn, (void)name, (void)limit, (void)tid, (void)bid, (void)bdim, (void)gdim,
      (void)wsize;
}
void __cudaRegisterVar(void **h, char *host_var, char *dev_addr, const char *name, int ext, size_t size, int constant,
                       int global) {
  (void)h, (void)host_var, (void)dev_addr, (void)name, (void)ext, (void)size, (void)constant, (void)global;
}
unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shmem, void *stream) {
  (void)grid, (void)block, (void)shmem, (void)stream;
  return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3 *grid, dim3 *block, size_t *shmem, void *stream) {
  (void)stream;
  *grid = (dim3){1, 1, 1};
  *block = (dim3){1, 1, 1};
  *shmem = 0;
  return cudaSuccess;
}
cudaError_t __cudaGetKernel(void **kernel, const void *fn) {
  (void)fn;
  *kernel = NULL;
  return cudaErrorNotSupported;
}
cudaError_t __cudaLaunchKernel(const void *fn, dim3 grid, dim3 block, void **args, size_t shmem, cudaStream_t s) {
  (void)fn, (void)grid, (void)block, (void)args, (void)shmem, (void)s;
  return cudaErrorNotSupported;
}
cudaError_t cudaLaunchKernel(const void *fn, dim3 grid, dim3 block, void **args, size_t shmem, cudaStream_t s) {
  return __cudaLaunchKernel(fn, grid, block, args, shmem, s);
}
