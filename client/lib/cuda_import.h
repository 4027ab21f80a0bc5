/*
 * cuda_import.h - opening weightd's CUDA handles without linking CUDA: legacy
 * IPC handles, and VMM allocations received as file descriptors.
 *
 * libweightd and weightctl must load and run on a machine without a GPU, so
 * the CUDA driver (libcuda.so.1) is opened with dlopen the first time a cuda
 * handle is met, never at load time, and only the driver API is used (no
 * cudart). The few driver types needed are declared in cuda_import.c.
 *
 * A device is found by its UUID ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"),
 * matched against every device this process sees, so a CUDA_VISIBLE_DEVICES
 * that differs from the daemon's does not matter. Work runs in the device's
 * primary context (the one the CUDA runtime uses, so pointers are usable by
 * PyTorch and friends), pushed for the call and popped after it: the calling
 * thread's current context is left as it was.
 *
 * Threads: every function may be called from any thread; the driver table is
 * set up once under a lock.
 */
#ifndef WD_CUDA_IMPORT_H
#define WD_CUDA_IMPORT_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "handles.h"

/* A device of this process, found by UUID; its primary context is retained. */
struct cuimp_device {
  int ordinal; /* the CUdevice of this process */
  void *ctx;   /* the retained primary context */
};

/*
 * Loads the driver (once) and finds the device whose UUID is uuid; retains
 * its primary context. Fails with WEIGHTD_E_UNSUPPORTED when there is no
 * CUDA driver, WEIGHTD_E_DEVICE when no visible device has that UUID (the
 * message lists the UUIDs this process sees) or the driver fails.
 */
int cuimp_device_find(const char *uuid, struct cuimp_device *out, struct wd_error *err);

/* Releases the primary context that cuimp_device_find retained. */
void cuimp_device_put(struct cuimp_device *dev);

/*
 * Opens a 64-byte IPC memory handle on dev (lazy peer access enabled);
 * *dptr receives the device address.
 */
int cuimp_ipc_open(const struct cuimp_device *dev, const unsigned char handle[WD_IPC_HANDLE_BYTES],
                   uint64_t *dptr, struct wd_error *err);

/* Closes a mapping that cuimp_ipc_open returned. */
int cuimp_ipc_close(const struct cuimp_device *dev, uint64_t dptr, struct wd_error *err);

/* A VMM allocation mapped into this process by cuimp_vmm_map. */
struct cuimp_vmm {
  uint64_t va;    /* the device address of its first byte */
  uint64_t bytes; /* the whole allocation, all of it mapped */
  int read_only;  /* the device's access is read-only (else the driver refused that: read-write) */
};

/*
 * Imports the VMM allocation behind fd (a cuda_vmm handle's descriptor, which
 * stays the caller's to close) on dev and maps all of its bytes at a new
 * address, read-only for dev where the driver allows it, read-write where it
 * does not. WEIGHTD_E_UNSUPPORTED when the driver or device cannot import
 * VMM memory (the message says how to configure the daemon instead),
 * WEIGHTD_E_PROTOCOL when bytes is not a whole number of granules.
 */
int cuimp_vmm_map(const struct cuimp_device *dev, int fd, uint64_t bytes, struct cuimp_vmm *out,
                  struct wd_error *err);

/* Unmaps what cuimp_vmm_map mapped and frees its address range. */
int cuimp_vmm_unmap(const struct cuimp_device *dev, const struct cuimp_vmm *m, struct wd_error *err);

/* Copies len bytes from device address src to host memory dst (synchronous). */
int cuimp_copy_to_host(const struct cuimp_device *dev, void *dst, uint64_t src, size_t len,
                       struct wd_error *err);

/*
 * Same as cuimp_copy_to_host for an address opened by anyone in this process
 * on the device with that UUID (finds the device, copies, lets go of it).
 */
int cuimp_copy_to_host_uuid(const char *uuid, void *dst, uint64_t src, size_t len,
                            struct wd_error *err);

#endif
