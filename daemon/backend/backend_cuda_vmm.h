/*
 * backend_cuda_vmm.h - the cuda backend's VMM slabs (backend_cuda_vmm.c):
 * the driver entry points, the per-device probe, allocation and adoption.
 * Internal to the backend.
 */
#ifndef WD_BACKEND_CUDA_VMM_H
#define WD_BACKEND_CUDA_VMM_H

#include <stddef.h>
#include <stdint.h>

#include "cuda_ctx.h"

/* Loads the VMM entry points; 0, or -1 with the first one missing named in why. */
int vmm_api_load(struct cu_vmm_api *a, char *why, size_t len);

/*
 * Decides device i's handle kind under a VMM request: cuda_vmm when the
 * device supports virtual memory management and POSIX-descriptor export;
 * else cuda_ipc, with the reason in the device's why.
 */
void vmm_probe(struct cuda_ctx *c, int i);

/* A VMM slab's allocation, mapped read-write and exported (the current device is `device`). */
int vmm_alloc(const struct cuda_ctx *c, int device, uint64_t bytes, struct cuda_slab *cs, struct wd_error *err);

/* The backend's slab_adopt: a VMM allocation an earlier daemon exported, imported and mapped. */
int vmm_slab_adopt(void *ctx, int device, enum wd_handle_kind kind, int fd, uint64_t bytes, uint64_t alloc_bytes,
                   const unsigned char *alloc_id, struct wd_slab **out, struct wd_error *err);

#endif
