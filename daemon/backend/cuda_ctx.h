/*
 * cuda_ctx.h - what the cuda backend's files share (backend_cuda.c,
 * backend_cuda_vmm.c): the context, device and slab types, the slab grain,
 * and the small helpers that turn CUDA errors into wd_error. Internal to the
 * backend; the contract for the rest of the daemon is backend.h.
 */
#ifndef WD_CUDA_CTX_H
#define WD_CUDA_CTX_H

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdatomic.h>
#include <stdint.h>

#include "backend.h"

/*
 * Slabs are allocated in whole 2 MiB units at least: measured on an H200
 * (driver 580), cudaIpcOpenMemHandle of a 7.49 GiB allocation takes 48 ms
 * when its size is not a multiple of 2 MiB and 0.25 ms when it is
 * (tests/gpu/dma_study.c). VMM slabs are also whole multiples of the
 * granularity the driver recommends for the device.
 */
#define CUDA_SLAB_GRAIN (2ull << 20)

/* The driver entry points VMM slabs need (cudaGetDriverEntryPointByVersion). */
struct cu_vmm_api {
  PFN_cuDeviceGet_v2000 device_get;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute;
  PFN_cuMemGetAllocationGranularity_v10020 granularity;
  PFN_cuMemCreate_v10020 create;
  PFN_cuMemAddressReserve_v10020 reserve;
  PFN_cuMemMap_v10020 map;
  PFN_cuMemSetAccess_v10020 set_access;
  PFN_cuMemExportToShareableHandle_v10020 export_handle;
  PFN_cuMemImportFromShareableHandle_v10020 import_handle;
  PFN_cuMemUnmap_v10020 unmap;
  PFN_cuMemAddressFree_v10020 address_free;
  PFN_cuMemRelease_v10020 release;
  PFN_cuGetErrorName_v6000 error_name;
};

struct cuda_dev {
  enum wd_handle_kind kind; /* what this device's slabs are exported as */
  CUdevice cudev;           /* the driver's device (VMM) */
  uint64_t grain;           /* VMM slabs are whole multiples of this */
  char why[192];            /* why kind is not what was asked for */
};

struct cuda_ctx {
  int ndev;
  struct cuda_dev *dev;
  struct cu_vmm_api api;     /* complete when any device uses VMM */
  struct wd_peer_info *peer; /* ndev * ndev: peer[src * ndev + dst], measured at creation */
};

/* wd_slab.impl */
struct cuda_slab {
  void *base;                      /* the slab in the daemon's address space */
  uint64_t alloc_bytes;            /* the whole allocation */
  CUmemGenericAllocationHandle h;  /* VMM: the allocation */
  int fd;                          /* VMM: the exported descriptor, dup'ed for each attach; else -1 */
  unsigned char alloc_id[WD_ALLOC_ID_BYTES];
  atomic_uint_fast64_t granted;    /* VMM: devices (bits) given access to the mapping for peer copies */
};

static inline int cuda_fail(struct wd_error *err, cudaError_t e, const char *what) {
  int code = (e == cudaErrorMemoryAllocation) ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE;
  return err_set(err, code, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

#define CK(call, what)                          \
  do {                                          \
    cudaError_t ck_e = (call);                  \
    if (ck_e != cudaSuccess) return cuda_fail(err, ck_e, what); \
  } while (0)

/* The driver's name of r ("CUDA_ERROR_OUT_OF_MEMORY"). */
static inline const char *cu_name(const struct cuda_ctx *c, CUresult r) {
  const char *name = NULL;
  if (c->api.error_name == NULL || c->api.error_name(r, &name) != CUDA_SUCCESS || name == NULL) return "CUDA error";
  return name;
}

static inline int cu_fail(const struct cuda_ctx *c, struct wd_error *err, CUresult r, const char *what) {
  return err_set(err, r == CUDA_ERROR_OUT_OF_MEMORY ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE, "%s: %s (%d)", what,
                 cu_name(c, r), (int)r);
}

/* A slab size in whole grains; an empty set still gets one grain, to export. */
static inline int round_to(uint64_t bytes, uint64_t grain, uint64_t *out, struct wd_error *err) {
  if (bytes > UINT64_MAX - grain)
    return err_set(err, WEIGHTD_E_DEVICE_NOMEM, "a slab of %llu bytes is larger than any device",
                   (unsigned long long)bytes);
  *out = bytes ? (bytes + grain - 1) / grain * grain : grain;
  return 0;
}

static inline int nomem_message(struct wd_error *err, int code, const char *what, uint64_t bytes, int device,
                                const char *name) {
  size_t free_b = 0, total_b = 0;
  cudaGetLastError();
  cudaMemGetInfo(&free_b, &total_b);
  return err_set(err, code, "%s of %llu bytes on GPU %d: %s (%llu of %llu bytes free)", what,
                 (unsigned long long)bytes, device, name, (unsigned long long)free_b, (unsigned long long)total_b);
}

#endif
