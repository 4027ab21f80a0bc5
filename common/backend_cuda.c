/*
 * backend_cuda.c - the cuda backend: one cudaMalloc slab per resident set,
 * exported with cudaIpcGetMemHandle; pinned staging buffers from
 * cudaHostAlloc; the pinned-resident tier through cudaHostRegister.
 *
 * Every CUDA call is checked; a failure becomes WEIGHTD_E_DEVICE (or
 * WEIGHTD_E_DEVICE_NOMEM for allocation failures) with the CUDA error's name
 * in the message. The CUDA runtime is thread-safe; each entry point selects
 * its device on the calling thread first (cudaSetDevice is per thread).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

/*
 * Slabs are allocated in whole 2 MiB units: measured on an H200 (driver 580),
 * cudaIpcOpenMemHandle of a 7.49 GiB allocation takes 48 ms when its size is
 * not a multiple of 2 MiB and 0.25 ms when it is (tests/gpu/dma_study.c).
 */
#define CUDA_SLAB_GRAIN (2ull << 20)

/* cudaHostRegister is asked for at most this much at once. */
#define CUDA_REGISTER_CHUNK (64ull << 30)

_Static_assert(sizeof(cudaIpcMemHandle_t) == WD_IPC_HANDLE_BYTES, "the IPC handle size libweightd expects");

struct cuda_ctx {
  int ndev;
};

struct wd_stream {
  int device;
  cudaStream_t s;
};

struct wd_event {
  int device;
  cudaEvent_t e;
};

static int cuda_fail(struct wd_error *err, cudaError_t e, const char *what) {
  int code = (e == cudaErrorMemoryAllocation) ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE;
  return err_set(err, code, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

#define CK(call, what)                          \
  do {                                          \
    cudaError_t ck_e = (call);                  \
    if (ck_e != cudaSuccess) return cuda_fail(err, ck_e, what); \
  } while (0)

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
  return 0;
}

static int cu_slab_alloc(void *ctx, int device, uint64_t bytes, struct wd_slab **out, struct wd_error *err) {
  (void)ctx;
  *out = NULL;
  CK(cudaSetDevice(device), "cudaSetDevice");
  void *p = NULL;
  /* Whole 2 MiB units (see CUDA_SLAB_GRAIN); an empty set still gets one, to export. */
  uint64_t alloc = bytes ? (bytes + CUDA_SLAB_GRAIN - 1) / CUDA_SLAB_GRAIN * CUDA_SLAB_GRAIN : CUDA_SLAB_GRAIN;
  cudaError_t e = cudaMalloc(&p, alloc);
  if (e != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    cudaGetLastError();
    cudaMemGetInfo(&free_b, &total_b);
    return err_set(err, e == cudaErrorMemoryAllocation ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE,
                   "cudaMalloc of %llu bytes on GPU %d: %s (%llu of %llu bytes free)",
                   (unsigned long long)bytes, device, cudaGetErrorName(e),
                   (unsigned long long)free_b, (unsigned long long)total_b);
  }
  struct wd_slab *s = calloc(1, sizeof *s);
  if (s == NULL) {
    cudaFree(p);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  s->device = device;
  s->bytes = bytes;
  s->impl = p;
  *out = s;
  return 0;
}

static int cu_slab_export(void *ctx, struct wd_slab *s, struct wd_handle *out, struct wd_error *err) {
  (void)ctx;
  memset(out, 0, sizeof *out);
  CK(cudaSetDevice(s->device), "cudaSetDevice");
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, s->impl), "cudaIpcGetMemHandle");
  out->kind = WD_HANDLE_CUDA_IPC;
  out->fd = -1;
  out->bytes = s->bytes;
  memcpy(out->ipc, &h, sizeof h);
  return 0;
}

static void cu_slab_free(void *ctx, struct wd_slab *s) {
  (void)ctx;
  if (s == NULL) return;
  cudaSetDevice(s->device);
  cudaFree(s->impl);
  free(s);
}

static int cu_pinned_alloc(void *ctx, int device, size_t bytes, void **out, struct wd_error *err) {
  (void)ctx;
  *out = NULL;
  CK(cudaSetDevice(device), "cudaSetDevice");
  CK(cudaHostAlloc(out, bytes, cudaHostAllocPortable), "cudaHostAlloc");
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
  char *d = (char *)dst->impl + dst_offset;
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

static void cu_destroy(void *ctx) { free(ctx); }

static const struct wd_backend_ops cuda_ops = {
    .name = "cuda",
    .caps = 0,
    .device_count = cu_device_count,
    .device_info = cu_device_info,
    .slab_alloc = cu_slab_alloc,
    .slab_seal = NULL, /* device memory cannot be made read-only for IPC importers */
    .slab_export = cu_slab_export,
    .slab_free = cu_slab_free,
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
    .destroy = cu_destroy,
};

int backend_cuda_create(struct wd_backend *out, struct wd_error *err) {
  out->ops = NULL;
  out->ctx = NULL;
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return err_set(err, WEIGHTD_E_DEVICE, "no usable GPU: cudaGetDeviceCount: %s", cudaGetErrorName(e));
  }
  if (n == 0) return err_set(err, WEIGHTD_E_DEVICE, "no GPU present");
  struct cuda_ctx *c = calloc(1, sizeof *c);
  if (c == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  c->ndev = n;
  out->ops = &cuda_ops;
  out->ctx = c;
  return 0;
}
