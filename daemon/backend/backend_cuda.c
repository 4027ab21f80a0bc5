/*
 * backend_cuda.c - the cuda backend: one device allocation per resident set,
 * shared with clients through a handle whose kind is fixed at allocation:
 *   cuda_vmm (the default): cuMemCreate with POSIX-descriptor export, mapped
 *     read-write in the daemon to fill it; exported once, at allocation, to a
 *     descriptor the slab keeps, so an attach only dup()s it.
 *   cuda_ipc (legacy): one cudaMalloc, exported with cudaIpcGetMemHandle.
 * Pinned staging buffers come from cudaHostAlloc; the pinned-resident tier is
 * cudaHostRegister. Copies use the runtime on either kind of slab (a VMM
 * mapping is an ordinary device address to cudaMemcpyAsync).
 *
 * The daemon links the runtime only: the driver's VMM entry points come from
 * cudaGetDriverEntryPointByVersion, so that weightd still starts (with the
 * host backend) on a machine that has the toolkit but no driver.
 * The VMM part (the entry points, the probe, allocation and adoption) is
 * backend_cuda_vmm.c; the types both files use are in cuda_ctx.h.
 *
 * Several GPUs: at creation every ordered pair is asked for peer access
 * (cudaDeviceCanAccessPeer both ways), its performance rank
 * (cudaDeviceGetP2PAttribute) and, where NVML can be loaded at run time, for
 * an NVLink path (nvmlDeviceGetP2PStatus); pairs with access get
 * cudaDeviceEnablePeerAccess both ways (what legacy allocations need for a
 * direct copy). A peer copy of a VMM slab first grants the copying device
 * access to the daemon's mapping (cuMemSetAccess), once per slab and device.
 *
 * Every CUDA call is checked; a failure becomes WEIGHTD_E_DEVICE (or
 * WEIGHTD_E_DEVICE_NOMEM for allocation failures) with the CUDA error's name
 * in the message. The CUDA runtime and driver are thread-safe; each entry
 * point selects its device on the calling thread first (cudaSetDevice is per
 * thread, and makes the device's primary context current for the driver
 * calls too). The context below is written only by backend_cuda_create.
 */
#include <ctype.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "backend_cuda_vmm.h"
#include "cuda_ctx.h"
#include "manifest.h"
#include "slab_hash_cuda.h"

/* cudaHostRegister is asked for at most this much at once. */
#define CUDA_REGISTER_CHUNK (64ull << 30)

_Static_assert(sizeof(cudaIpcMemHandle_t) == WD_IPC_HANDLE_BYTES, "the IPC handle size libweightd expects");

struct wd_stream {
  int device;
  cudaStream_t s;
};

struct wd_event {
  int device;
  cudaEvent_t e;
};

static int cu_device_count(void *ctx) { return ((struct cuda_ctx *)ctx)->ndev; }

static void format_uuid(const unsigned char *b, char *out, size_t len) {
  snprintf(out, len,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
           b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static int cu_device_info(void *ctx, int device, struct wd_device_info *out, struct wd_error *err) {
  struct cuda_ctx *c = ctx;
  if (device < 0 || device >= c->ndev)
    return err_set(err, WEIGHTD_E_NOT_FOUND, "no GPU %d (%d present)", device, c->ndev);
  struct cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  memset(out, 0, sizeof *out);
  out->index = device;
  snprintf(out->name, sizeof out->name, "%s", prop.name);
  format_uuid((const unsigned char *)prop.uuid.bytes, out->uuid, sizeof out->uuid);
  CK(cudaSetDevice(device), "cudaSetDevice");
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  out->memory_total = total_b;
  out->memory_free = free_b;
  out->handles = c->dev[device].kind;
  snprintf(out->handles_why, sizeof out->handles_why, "%s", c->dev[device].why);
  return 0;
}

/* ---- slabs -------------------------------------------------------------------------------- */

/* Legacy: one cudaMalloc (the current device is `device`). */
static int ipc_alloc(int device, uint64_t bytes, struct cuda_slab *cs, struct wd_error *err) {
  uint64_t alloc = 0;
  int rc = round_to(bytes, CUDA_SLAB_GRAIN, &alloc, err);
  if (rc != 0) return rc;
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, alloc);
  if (e != cudaSuccess)
    return nomem_message(err, e == cudaErrorMemoryAllocation ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE,
                         "cudaMalloc", bytes, device, cudaGetErrorName(e));
  cs->base = p;
  cs->alloc_bytes = alloc;
  return 0;
}

/* A slab of `kind` on device: VMM (exported once) or one cudaMalloc. */
static int slab_make(const struct cuda_ctx *c, int device, uint64_t bytes, enum wd_handle_kind kind,
                     struct wd_slab **out, struct wd_error *err) {
  *out = NULL;
  if (device < 0 || device >= c->ndev)
    return err_set(err, WEIGHTD_E_NOT_FOUND, "no GPU %d (%d present)", device, c->ndev);
  CK(cudaSetDevice(device), "cudaSetDevice");
  struct wd_slab *s = calloc(1, sizeof *s);
  struct cuda_slab *cs = calloc(1, sizeof *cs);
  if (s == NULL || cs == NULL) {
    free(s);
    free(cs);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  cs->fd = -1;
  int rc = kind == WD_HANDLE_CUDA_VMM ? vmm_alloc(c, device, bytes, cs, err) : ipc_alloc(device, bytes, cs, err);
  if (rc != 0) {
    free(cs);
    free(s);
    return rc;
  }
  s->device = device;
  s->kind = kind;
  s->bytes = bytes;
  s->export_while_filling = 1; /* the handle exists from allocation; importers cannot write a VMM mapping */
  s->impl = cs;
  *out = s;
  return 0;
}

static int cu_slab_alloc(void *ctx, int device, uint64_t bytes, struct wd_slab **out, struct wd_error *err) {
  const struct cuda_ctx *c = ctx;
  if (device < 0 || device >= c->ndev) {
    *out = NULL;
    return err_set(err, WEIGHTD_E_NOT_FOUND, "no GPU %d (%d present)", device, c->ndev);
  }
  return slab_make(c, device, bytes, c->dev[device].kind, out, err);
}

/* An export costs no driver call for VMM slabs (a dup), one cheap call for legacy ones. */
static int cu_slab_export(void *ctx, struct wd_slab *s, struct wd_handle *out, struct wd_error *err) {
  (void)ctx;
  const struct cuda_slab *cs = s->impl;
  memset(out, 0, sizeof *out);
  out->kind = s->kind;
  out->fd = -1;
  if (s->kind == WD_HANDLE_CUDA_VMM) {
    out->fd = fcntl(cs->fd, F_DUPFD_CLOEXEC, 0);
    if (out->fd < 0)
      return err_set(err, errno == EMFILE || errno == ENFILE ? WEIGHTD_E_LIMIT : WEIGHTD_E_DEVICE,
                     "dup of the slab's descriptor: %s", strerror(errno));
    out->bytes = cs->alloc_bytes;
    memcpy(out->alloc_id, cs->alloc_id, sizeof out->alloc_id);
    return 0;
  }
  CK(cudaSetDevice(s->device), "cudaSetDevice");
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, cs->base), "cudaIpcGetMemHandle");
  out->bytes = s->bytes;
  memcpy(out->ipc, &h, sizeof h);
  return 0;
}

/*
 * Frees the daemon's share of a slab. A VMM allocation's memory goes back to
 * the device once no process maps it and no exported descriptor or handle is
 * left: a client that still maps it keeps it (weightd never frees a leased
 * set, so that happens only when a client outlives its lease).
 */
static void cu_slab_free(void *ctx, struct wd_slab *s) {
  const struct cuda_ctx *c = ctx;
  if (s == NULL) return;
  struct cuda_slab *cs = s->impl;
  cudaSetDevice(s->device);
  if (s->kind == WD_HANDLE_CUDA_VMM) {
    CUdeviceptr va = (CUdeviceptr)(uintptr_t)cs->base;
    c->api.unmap(va, (size_t)cs->alloc_bytes);
    c->api.address_free(va, (size_t)cs->alloc_bytes);
    c->api.release(cs->h);
    close(cs->fd);
  } else {
    cudaFree(cs->base);
  }
  free(cs);
  free(s);
}

static int cu_pinned_alloc(void *ctx, int device, size_t bytes, unsigned flags, void **out, struct wd_error *err) {
  (void)ctx;
  *out = NULL;
  unsigned how = cudaHostAllocPortable | (flags & WD_PINNED_WRITE_COMBINED ? cudaHostAllocWriteCombined : 0);
  CK(cudaSetDevice(device), "cudaSetDevice");
  CK(cudaHostAlloc(out, bytes, how), "cudaHostAlloc");
  return 0;
}

static void cu_pinned_free(void *ctx, int device, void *p) {
  (void)ctx;
  cudaSetDevice(device);
  cudaFreeHost(p);
}

static int cu_host_register(void *ctx, void *p, size_t len, struct wd_error *err) {
  (void)ctx;
  for (size_t off = 0; off < len; off += CUDA_REGISTER_CHUNK) {
    size_t n = len - off < CUDA_REGISTER_CHUNK ? len - off : CUDA_REGISTER_CHUNK;
    cudaError_t e = cudaHostRegister((char *)p + off, n, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
    if (e == cudaErrorNotSupported || e == cudaErrorInvalidValue) {
      /* A driver without read-only registration: the mapping is PROT_READ, so plain
       * registration may still work where the kernel allows pinning it. */
      cudaGetLastError();
      e = cudaHostRegister((char *)p + off, n, cudaHostRegisterPortable);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      for (size_t undo = 0; undo < off; undo += CUDA_REGISTER_CHUNK) cudaHostUnregister((char *)p + undo);
      return cuda_fail(err, e, "cudaHostRegister");
    }
  }
  return 0;
}

static void cu_host_unregister(void *ctx, void *p, size_t len) {
  (void)ctx;
  for (size_t off = 0; off < len; off += CUDA_REGISTER_CHUNK) cudaHostUnregister((char *)p + off);
}

static int cu_stream_create(void *ctx, int device, struct wd_stream **out, struct wd_error *err) {
  (void)ctx;
  *out = NULL;
  struct wd_stream *s = calloc(1, sizeof *s);
  if (s == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  s->device = device;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s->s, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    free(s);
    return cuda_fail(err, e, "cudaStreamCreate");
  }
  *out = s;
  return 0;
}

static void cu_stream_destroy(void *ctx, struct wd_stream *s) {
  (void)ctx;
  if (s == NULL) return;
  cudaSetDevice(s->device);
  cudaStreamDestroy(s->s);
  free(s);
}

static int cu_event_create(void *ctx, int device, struct wd_event **out, struct wd_error *err) {
  (void)ctx;
  *out = NULL;
  struct wd_event *ev = calloc(1, sizeof *ev);
  if (ev == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  ev->device = device;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev->e, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    free(ev);
    return cuda_fail(err, e, "cudaEventCreate");
  }
  *out = ev;
  return 0;
}

static void cu_event_destroy(void *ctx, struct wd_event *ev) {
  (void)ctx;
  if (ev == NULL) return;
  cudaSetDevice(ev->device);
  cudaEventDestroy(ev->e);
  free(ev);
}

static int cu_event_record(void *ctx, struct wd_event *ev, struct wd_stream *s, struct wd_error *err) {
  (void)ctx;
  CK(cudaSetDevice(s->device), "cudaSetDevice");
  CK(cudaEventRecord(ev->e, s->s), "cudaEventRecord");
  return 0;
}

static int cu_event_wait(void *ctx, struct wd_event *ev, struct wd_error *err) {
  (void)ctx;
  CK(cudaSetDevice(ev->device), "cudaSetDevice");
  CK(cudaEventSynchronize(ev->e), "cudaEventSynchronize");
  return 0;
}

static int cu_copy_h2d(void *ctx, struct wd_slab *dst, uint64_t dst_offset, size_t dst_pitch,
                       const void *src, size_t src_pitch, size_t width, size_t height,
                       struct wd_stream *s, struct wd_error *err) {
  (void)ctx;
  uint64_t span = height ? (uint64_t)(height - 1) * dst_pitch + width : 0;
  if (dst_offset > dst->bytes || span > dst->bytes - dst_offset)
    return err_set(err, WEIGHTD_E_INTERNAL, "copy past the end of the slab");
  char *d = (char *)((const struct cuda_slab *)dst->impl)->base + dst_offset;
  cudaStream_t st = s ? s->s : 0;
  CK(cudaSetDevice(dst->device), "cudaSetDevice");
  if (height == 1 || (dst_pitch == width && src_pitch == width))
    CK(cudaMemcpyAsync(d, src, width * height, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync H2D");
  else
    CK(cudaMemcpy2DAsync(d, dst_pitch, src, src_pitch, width, height, cudaMemcpyHostToDevice, st),
       "cudaMemcpy2DAsync H2D");
  if (s == NULL) CK(cudaStreamSynchronize(0), "cudaStreamSynchronize");
  return 0;
}

/* ---- several GPUs --------------------------------------------------------------------- */

/* The few NVML entry points the link probe uses, loaded at run time (nvml.h is not needed to build). */
typedef struct nvml_device *nvml_device_t;
#define NVML_OK 0
#define NVML_P2P_CAPS_INDEX_NVLINK 2
#define NVML_P2P_STATUS_OK 0
struct nvml_api {
  void *lib;
  int (*init)(void);
  int (*shutdown)(void);
  int (*by_uuid)(const char *uuid, nvml_device_t *out);
  int (*p2p_status)(nvml_device_t a, nvml_device_t b, int caps_index, int *status);
};

/* Loads and starts NVML; 0, or -1 (no NVML: links are named only as peer access). */
static int nvml_open(struct nvml_api *n) {
  memset(n, 0, sizeof *n);
  n->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (n->lib == NULL) return -1;
  /* Function pointers travel as void *, as dlsym's do (POSIX guarantees the conversion). */
  *(void **)&n->init = dlsym(n->lib, "nvmlInit_v2");
  *(void **)&n->shutdown = dlsym(n->lib, "nvmlShutdown");
  *(void **)&n->by_uuid = dlsym(n->lib, "nvmlDeviceGetHandleByUUID");
  *(void **)&n->p2p_status = dlsym(n->lib, "nvmlDeviceGetP2PStatus");
  if (n->init == NULL || n->shutdown == NULL || n->by_uuid == NULL || n->p2p_status == NULL ||
      n->init() != NVML_OK) {
    dlclose(n->lib);
    n->lib = NULL;
    return -1;
  }
  return 0;
}

static void nvml_close(struct nvml_api *n) {
  if (n->lib == NULL) return;
  n->shutdown();
  dlclose(n->lib);
  n->lib = NULL;
}

/* The NVML handle of GPU i (by its UUID), or NULL. */
static nvml_device_t nvml_device(const struct nvml_api *n, int i) {
  struct cudaDeviceProp prop;
  char uuid[WD_UUID_MAX];
  nvml_device_t h = NULL;
  if (n->lib == NULL || cudaGetDeviceProperties(&prop, i) != cudaSuccess) return NULL;
  format_uuid((const unsigned char *)prop.uuid.bytes, uuid, sizeof uuid);
  return n->by_uuid(uuid, &h) == NVML_OK ? h : NULL;
}

/* Measures every ordered pair (c->peer) and enables peer access where the driver allows it. */
static int peer_probe(struct cuda_ctx *c) {
  int n = c->ndev;
  c->peer = calloc((size_t)n * (size_t)n, sizeof *c->peer);
  if (c->peer == NULL) return -1;
  struct nvml_api nv;
  int have_nvml = n > 1 && nvml_open(&nv) == 0;
  nvml_device_t *h = have_nvml ? calloc((size_t)n, sizeof *h) : NULL;
  for (int i = 0; h != NULL && i < n; i++) h[i] = nvml_device(&nv, i);
  for (int a = 0; a < n; a++)
    for (int b = 0; b < n; b++) {
      struct wd_peer_info *p = &c->peer[a * n + b];
      p->performance_rank = -1;
      int ab = 0, ba = 0, rank = -1, st = -1;
      if (a == b || cudaDeviceCanAccessPeer(&ab, b, a) != cudaSuccess || cudaDeviceCanAccessPeer(&ba, a, b) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      if (!ab || !ba) continue;
      p->access = 1;
      if (cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, a, b) == cudaSuccess) p->performance_rank = rank;
      cudaGetLastError();
      p->link = WD_LINK_PEER;
      if (h != NULL && h[a] != NULL && h[b] != NULL)
        p->link = nv.p2p_status(h[a], h[b], NVML_P2P_CAPS_INDEX_NVLINK, &st) == NVML_OK && st == NVML_P2P_STATUS_OK
                      ? WD_LINK_NVLINK
                      : WD_LINK_PCIE;
      /* Legacy allocations copy directly only with peer access enabled (VMM ones use cuMemSetAccess). */
      if (cudaSetDevice(b) == cudaSuccess && cudaDeviceEnablePeerAccess(a, 0) != cudaSuccess) cudaGetLastError();
    }
  free(h);
  if (have_nvml) nvml_close(&nv);
  return 0;
}

static int cu_peer_query(void *ctx, int src, int dst, struct wd_peer_info *out, struct wd_error *err) {
  const struct cuda_ctx *c = ctx;
  if (src < 0 || src >= c->ndev) return err_set(err, WEIGHTD_E_NOT_FOUND, "no GPU %d (%d present)", src, c->ndev);
  if (dst < 0 || dst >= c->ndev) return err_set(err, WEIGHTD_E_NOT_FOUND, "no GPU %d (%d present)", dst, c->ndev);
  *out = c->peer[src * c->ndev + dst];
  return 0;
}

/* Lets `device` read and write a VMM slab of another device through the daemon's mapping (once). */
static int grant_access(const struct cuda_ctx *c, const struct wd_slab *s, int device, struct wd_error *err) {
  struct cuda_slab *cs = s->impl;
  if (s->kind != WD_HANDLE_CUDA_VMM || s->device == device) return 0;
  if (device < 0 || device >= 64 || device >= c->ndev)
    return err_set(err, WEIGHTD_E_NOT_FOUND, "no GPU %d (%d present)", device, c->ndev);
  uint64_t bit = 1ull << device;
  if (atomic_load(&cs->granted) & bit) return 0;
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = c->dev[device].cudev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult r = c->api.set_access((CUdeviceptr)(uintptr_t)cs->base, (size_t)cs->alloc_bytes, &access, 1);
  if (r != CUDA_SUCCESS) {
    char what[96];
    snprintf(what, sizeof what, "cuMemSetAccess for GPU %d on a slab of GPU %d", device, s->device);
    return cu_fail(c, err, r, what);
  }
  atomic_fetch_or(&cs->granted, bit);
  return 0;
}

static int cu_copy_peer(void *ctx, struct wd_slab *dst, uint64_t dst_offset, const struct wd_slab *src,
                        uint64_t src_offset, uint64_t bytes, struct wd_stream *s, struct wd_error *err) {
  const struct cuda_ctx *c = ctx;
  if (dst_offset > dst->bytes || bytes > dst->bytes - dst_offset || src_offset > src->bytes ||
      bytes > src->bytes - src_offset)
    return err_set(err, WEIGHTD_E_INTERNAL, "peer copy past the end of a slab");
  int on = s != NULL ? s->device : src->device;
  CK(cudaSetDevice(on), "cudaSetDevice"); /* the copying device's context is current for the grants too */
  int rc = grant_access(c, src, on, err);
  if (rc == 0) rc = grant_access(c, dst, on, err);
  if (rc != 0) return rc;
  char *d = (char *)((const struct cuda_slab *)dst->impl)->base + dst_offset;
  const char *p = (const char *)((const struct cuda_slab *)src->impl)->base + src_offset;
  cudaStream_t st = s ? s->s : 0;
  if (src->device != dst->device && src->kind != WD_HANDLE_CUDA_VMM && dst->kind != WD_HANDLE_CUDA_VMM)
    CK(cudaMemcpyPeerAsync(d, dst->device, p, src->device, (size_t)bytes, st), "cudaMemcpyPeerAsync");
  else
    CK(cudaMemcpyAsync(d, p, (size_t)bytes, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync D2D");
  if (s == NULL) CK(cudaStreamSynchronize(0), "cudaStreamSynchronize");
  return 0;
}

/* A bounce buffer: cudaMalloc memory (freed by cu_slab_free as a legacy slab), never exported. */
/* Tensor digests of ranges of the slab by the scrub kernels, on a stream of its own of the slab's device. */
static int cu_slab_hash(void *ctx, const struct wd_slab *s, const struct wd_hash_range *ranges, size_t n,
                        unsigned char (*out)[WD_DIGEST_BYTES], struct wd_error *err) {
  (void)ctx;
  const struct cuda_slab *cs = s->impl;
  for (size_t i = 0; i < n; i++)
    if (ranges[i].off > s->bytes || ranges[i].len > s->bytes - ranges[i].off)
      return err_set(err, WEIGHTD_E_INTERNAL, "digest of bytes %llu+%llu past the end of a slab of %llu",
                     (unsigned long long)ranges[i].off, (unsigned long long)ranges[i].len,
                     (unsigned long long)s->bytes);
  if (n == 0) return 0;
  _Static_assert(sizeof(struct wd_hash_range) == 2 * sizeof(uint64_t), "ranges are (offset, length) pairs");
  CK(cudaSetDevice(s->device), "cudaSetDevice");
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  char what[160];
  cudaError_t e = xxh3_cuda_tree(cs->base, (const uint64_t *)ranges, n, MF_LEAF_BYTES, &out[0][0], st, what,
                                 sizeof what);
  cudaStreamDestroy(st);
  if (e != cudaSuccess) return cuda_fail(err, e, what[0] != '\0' ? what : "the digest kernels");
  return 0;
}

static int cu_scratch_alloc(void *ctx, int device, uint64_t bytes, struct wd_slab **out, struct wd_error *err) {
  return slab_make(ctx, device, bytes, WD_HANDLE_CUDA_IPC, out, err);
}

static int cu_pci_bus_id(void *ctx, int device, char *buf, size_t len, struct wd_error *err) {
  const struct cuda_ctx *c = ctx;
  if (device < 0 || device >= c->ndev)
    return err_set(err, WEIGHTD_E_NOT_FOUND, "no GPU %d (%d present)", device, c->ndev);
  CK(cudaDeviceGetPCIBusId(buf, (int)len, device), "cudaDeviceGetPCIBusId");
  for (char *p = buf; *p; p++) *p = (char)tolower((unsigned char)*p);
  return 0;
}

static void cu_destroy(void *ctx) {
  struct cuda_ctx *c = ctx;
  if (c == NULL) return;
  free(c->peer);
  free(c->dev);
  free(c);
}

static const struct wd_backend_ops cuda_ops = {
    .name = "cuda",
    .caps = 0,
    .device_count = cu_device_count,
    .device_info = cu_device_info,
    .slab_alloc = cu_slab_alloc,
    .slab_seal = NULL, /* nothing to seal: VMM importers map read-only themselves, legacy IPC cannot */
    .slab_export = cu_slab_export,
    .slab_free = cu_slab_free,
    .slab_adopt = vmm_slab_adopt,
    .pinned_alloc = cu_pinned_alloc,
    .pinned_free = cu_pinned_free,
    .host_register = cu_host_register,
    .host_unregister = cu_host_unregister,
    .stream_create = cu_stream_create,
    .stream_destroy = cu_stream_destroy,
    .event_create = cu_event_create,
    .event_destroy = cu_event_destroy,
    .event_record = cu_event_record,
    .event_wait = cu_event_wait,
    .copy_h2d = cu_copy_h2d,
    .peer_query = cu_peer_query,
    .copy_peer = cu_copy_peer,
    .slab_hash = cu_slab_hash,
    .scratch_alloc = cu_scratch_alloc,
    .pci_bus_id = cu_pci_bus_id,
    .destroy = cu_destroy,
};

int backend_cuda_create(struct wd_backend *out, enum wd_handle_kind handles, struct wd_error *err) {
  out->ops = NULL;
  out->ctx = NULL;
  if (handles != WD_HANDLE_CUDA_VMM && handles != WD_HANDLE_CUDA_IPC)
    return err_set(err, WEIGHTD_E_INVALID, "the cuda backend exports cuda_vmm or cuda_ipc handles, not %s",
                   wd_handle_kind_name(handles));
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return err_set(err, WEIGHTD_E_DEVICE, "no usable GPU: cudaGetDeviceCount: %s", cudaGetErrorName(e));
  }
  if (n == 0) return err_set(err, WEIGHTD_E_DEVICE, "no GPU present");
  struct cuda_ctx *c = calloc(1, sizeof *c);
  if (c != NULL) c->dev = calloc((size_t)n, sizeof *c->dev);
  if (c == NULL || c->dev == NULL) {
    free(c);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  c->ndev = n;
  char why[sizeof c->dev[0].why] = "";
  bool vmm = handles == WD_HANDLE_CUDA_VMM && vmm_api_load(&c->api, why, sizeof why) == 0;
  for (int i = 0; i < n; i++) {
    c->dev[i].kind = WD_HANDLE_CUDA_IPC;
    if (vmm) vmm_probe(c, i);
    else if (handles == WD_HANDLE_CUDA_VMM) snprintf(c->dev[i].why, sizeof c->dev[i].why, "%s", why);
  }
  if (peer_probe(c) != 0) {
    cu_destroy(c);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  out->ops = &cuda_ops;
  out->ctx = c;
  return 0;
}
