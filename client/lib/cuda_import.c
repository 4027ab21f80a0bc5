/*
 * cuda_import.c - the CUDA driver, loaded at run time, for importing handles
 * (legacy IPC handles and VMM descriptors) and for copies.
 *
 * DESIGN: one process-wide table of driver entry points, filled once by
 * pthread_once (dlopen("libcuda.so.1"), dlsym, cuInit). After that the table
 * is read-only and every function may run on any thread; the driver itself is
 * thread-safe. Nothing here links against CUDA.
 */
#include "cuda_import.h"

#include "cuda_abi.h"

#include <ctype.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* ---- the driver's entry points (types in cuda_abi.h) ------------------------ */

typedef cuabi_result CUresult;
typedef cuabi_device CUdevice;
typedef cuabi_deviceptr CUdeviceptr;

struct cu_driver {
  void *lib;
  CUresult (*init)(unsigned flags);
  CUresult (*device_get_count)(int *count);
  CUresult (*device_get)(CUdevice *dev, int ordinal);
  CUresult (*device_get_uuid)(cuabi_uuid *uuid, CUdevice dev);
  CUresult (*primary_ctx_retain)(cuabi_context *ctx, CUdevice dev);
  CUresult (*primary_ctx_release)(CUdevice dev);
  CUresult (*ctx_push)(cuabi_context ctx);
  CUresult (*ctx_pop)(cuabi_context *ctx);
  CUresult (*ipc_open)(CUdeviceptr *dptr, cuabi_ipc_mem_handle handle, unsigned flags);
  CUresult (*ipc_close)(CUdeviceptr dptr);
  CUresult (*memcpy_dtoh)(void *dst, CUdeviceptr src, size_t bytes);
  CUresult (*get_error_name)(CUresult r, const char **name); /* optional */
  /* VMM (cuda_vmm handles): optional, checked when such a handle is met. */
  CUresult (*device_get_attribute)(int *value, int attribute, CUdevice dev);
  CUresult (*mem_granularity)(size_t *granularity, const struct cuabi_mem_allocation_prop *prop, int option);
  CUresult (*mem_import)(cuabi_mem_handle *handle, void *os_handle, int handle_type);
  CUresult (*mem_reserve)(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags);
  CUresult (*mem_map)(CUdeviceptr ptr, size_t size, size_t offset, cuabi_mem_handle handle, unsigned long long flags);
  CUresult (*mem_set_access)(CUdeviceptr ptr, size_t size, const struct cuabi_mem_access_desc *desc, size_t count);
  CUresult (*mem_unmap)(CUdeviceptr ptr, size_t size);
  CUresult (*mem_address_free)(CUdeviceptr ptr, size_t size);
  CUresult (*mem_release)(cuabi_mem_handle handle);
  const char *vmm_missing; /* the first VMM entry point the driver lacks, or NULL */
  int status;      /* 0 when usable, else a WEIGHTD_E_* code */
  char why[256];   /* why it is not usable */
};

static struct cu_driver drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void *sym(const char *primary, const char *fallback) {
  void *p = dlsym(drv.lib, primary);
  if (p == NULL && fallback != NULL) p = dlsym(drv.lib, fallback);
  return p;
}

static void driver_load(void) {
  drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (drv.lib == NULL) {
    const char *e = dlerror();
    drv.status = WEIGHTD_E_UNSUPPORTED;
    snprintf(drv.why, sizeof drv.why, "the CUDA driver (libcuda.so.1) cannot be loaded: %s",
             e ? e : "not found");
    return;
  }
  /* Function pointers come from dlsym as void *; POSIX guarantees the conversion. */
#define LOAD(field, a, b) *(void **)(&drv.field) = sym(a, b)
  LOAD(init, "cuInit", NULL);
  LOAD(device_get_count, "cuDeviceGetCount", NULL);
  LOAD(device_get, "cuDeviceGet", NULL);
  LOAD(device_get_uuid, "cuDeviceGetUuid_v2", "cuDeviceGetUuid");
  LOAD(primary_ctx_retain, "cuDevicePrimaryCtxRetain", NULL);
  LOAD(primary_ctx_release, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
  LOAD(ctx_push, "cuCtxPushCurrent_v2", "cuCtxPushCurrent");
  LOAD(ctx_pop, "cuCtxPopCurrent_v2", "cuCtxPopCurrent");
  LOAD(ipc_open, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle");
  LOAD(ipc_close, "cuIpcCloseMemHandle", NULL);
  LOAD(memcpy_dtoh, "cuMemcpyDtoH_v2", "cuMemcpyDtoH");
  LOAD(get_error_name, "cuGetErrorName", NULL);
  LOAD(device_get_attribute, "cuDeviceGetAttribute", NULL);
  LOAD(mem_granularity, "cuMemGetAllocationGranularity", NULL);
  LOAD(mem_import, "cuMemImportFromShareableHandle", NULL);
  LOAD(mem_reserve, "cuMemAddressReserve", NULL);
  LOAD(mem_map, "cuMemMap", NULL);
  LOAD(mem_set_access, "cuMemSetAccess", NULL);
  LOAD(mem_unmap, "cuMemUnmap", NULL);
  LOAD(mem_address_free, "cuMemAddressFree", NULL);
  LOAD(mem_release, "cuMemRelease", NULL);
#undef LOAD
  static const char *const vmm_names[] = {"cuDeviceGetAttribute", "cuMemGetAllocationGranularity",
                                          "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
                                          "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"};
  const void *vmm_fns[] = {(const void *)drv.device_get_attribute, (const void *)drv.mem_granularity,
                           (const void *)drv.mem_import, (const void *)drv.mem_reserve, (const void *)drv.mem_map,
                           (const void *)drv.mem_set_access, (const void *)drv.mem_unmap,
                           (const void *)drv.mem_address_free, (const void *)drv.mem_release};
  _Static_assert(sizeof vmm_names / sizeof vmm_names[0] == sizeof vmm_fns / sizeof vmm_fns[0], "one name each");
  for (size_t i = 0; i < sizeof vmm_fns / sizeof vmm_fns[0] && drv.vmm_missing == NULL; i++)
    if (vmm_fns[i] == NULL) drv.vmm_missing = vmm_names[i];
  if (!drv.init || !drv.device_get_count || !drv.device_get || !drv.device_get_uuid ||
      !drv.primary_ctx_retain || !drv.primary_ctx_release || !drv.ctx_push || !drv.ctx_pop ||
      !drv.ipc_open || !drv.ipc_close || !drv.memcpy_dtoh) {
    drv.status = WEIGHTD_E_UNSUPPORTED;
    snprintf(drv.why, sizeof drv.why, "libcuda.so.1 lacks a needed entry point (driver too old)");
    return;
  }
  CUresult r = drv.init(0);
  if (r != CUABI_SUCCESS) {
    const char *name = NULL;
    if (drv.get_error_name == NULL || drv.get_error_name(r, &name) != CUABI_SUCCESS) name = NULL;
    drv.status = WEIGHTD_E_DEVICE;
    snprintf(drv.why, sizeof drv.why, "cuInit failed: %s (%d)", name ? name : "CUDA error", r);
  }
}

static int driver_get(struct wd_error *err) {
  pthread_once(&drv_once, driver_load);
  if (drv.status != 0) return err_set(err, drv.status, "%s", drv.why);
  return 0;
}

/* Fills err with "what: CUDA_ERROR_NAME (n)" and returns WEIGHTD_E_DEVICE. */
static int cu_fail(struct wd_error *err, CUresult r, const char *what) {
  const char *name = NULL;
  if (drv.get_error_name == NULL || drv.get_error_name(r, &name) != CUABI_SUCCESS) name = NULL;
  return err_set(err, WEIGHTD_E_DEVICE, "%s: %s (%d)", what, name ? name : "CUDA error", r);
}

/* ---- device lookup by UUID -------------------------------------------------- */

static void uuid_format(const cuabi_uuid *u, char *buf, size_t len) {
  const unsigned char *b = (const unsigned char *)u->bytes;
  snprintf(buf, len,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
           b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The hex digits of a UUID, lower case, without "GPU-" and dashes; 0 when malformed. */
static int uuid_digits(const char *s, char out[33]) {
  if (strncmp(s, "GPU-", 4) == 0) s += 4;
  size_t n = 0;
  for (; *s; s++) {
    if (*s == '-') continue;
    if (!isxdigit((unsigned char)*s) || n == 32) return 0;
    out[n++] = (char)tolower((unsigned char)*s);
  }
  out[n] = '\0';
  return n == 32;
}

int cuimp_device_find(const char *uuid, struct cuimp_device *out, struct wd_error *err) {
  int rc = driver_get(err);
  if (rc == WEIGHTD_E_DEVICE)
    return err_set(err, rc, "cannot reach device %s: %s; check CUDA_VISIBLE_DEVICES", uuid ? uuid : "(null)",
                   drv.why);
  if (rc != 0) return rc;
  char want[33];
  if (uuid == NULL || !uuid_digits(uuid, want))
    return err_set(err, WEIGHTD_E_DEVICE, "'%s' is not a CUDA device UUID", uuid ? uuid : "(null)");
  int count = 0;
  CUresult r = drv.device_get_count(&count);
  if (r != CUABI_SUCCESS) return cu_fail(err, r, "cuDeviceGetCount");
  char seen[512] = "";
  size_t seen_len = 0;
  for (int i = 0; i < count; i++) {
    CUdevice dev;
    cuabi_uuid u;
    char text[48], digits[33];
    if ((r = drv.device_get(&dev, i)) != CUABI_SUCCESS) return cu_fail(err, r, "cuDeviceGet");
    if ((r = drv.device_get_uuid(&u, dev)) != CUABI_SUCCESS) return cu_fail(err, r, "cuDeviceGetUuid");
    uuid_format(&u, text, sizeof text);
    uuid_digits(text, digits);
    if (strcmp(digits, want) == 0) {
      cuabi_context ctx = NULL;
      if ((r = drv.primary_ctx_retain(&ctx, dev)) != CUABI_SUCCESS)
        return cu_fail(err, r, "cuDevicePrimaryCtxRetain");
      out->ordinal = dev;
      out->ctx = ctx;
      return 0;
    }
    if (seen_len + strlen(text) + 3 < sizeof seen)
      seen_len += (size_t)snprintf(seen + seen_len, sizeof seen - seen_len, "%s%s",
                                   seen_len ? ", " : "", text);
  }
  return err_set(err, WEIGHTD_E_DEVICE,
                 "device %s is not visible to this process (it sees %d CUDA device%s%s%s); "
                 "check CUDA_VISIBLE_DEVICES",
                 uuid, count, count == 1 ? "" : "s", count ? ": " : "", seen);
}

void cuimp_device_put(struct cuimp_device *dev) {
  if (dev == NULL || dev->ctx == NULL) return;
  drv.primary_ctx_release(dev->ordinal);
  dev->ctx = NULL;
}

/* ---- handles and copies ----------------------------------------------------- */

static int ctx_enter(const struct cuimp_device *dev, struct wd_error *err) {
  if (driver_get(err) != 0) return err->code;
  CUresult r = drv.ctx_push(dev->ctx);
  return r == CUABI_SUCCESS ? 0 : cu_fail(err, r, "cuCtxPushCurrent");
}

static void ctx_leave(void) {
  cuabi_context popped;
  drv.ctx_pop(&popped);
}

int cuimp_ipc_open(const struct cuimp_device *dev, const unsigned char handle[WD_IPC_HANDLE_BYTES],
                   uint64_t *dptr, struct wd_error *err) {
  int rc = ctx_enter(dev, err);
  if (rc != 0) return rc;
  cuabi_ipc_mem_handle h;
  memcpy(h.reserved, handle, sizeof h.reserved);
  CUdeviceptr p = 0;
  CUresult r = drv.ipc_open(&p, h, CUABI_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  ctx_leave();
  if (r != CUABI_SUCCESS) return cu_fail(err, r, "cuIpcOpenMemHandle");
  *dptr = (uint64_t)p;
  return 0;
}

int cuimp_ipc_close(const struct cuimp_device *dev, uint64_t dptr, struct wd_error *err) {
  int rc = ctx_enter(dev, err);
  if (rc != 0) return rc;
  CUresult r = drv.ipc_close((CUdeviceptr)dptr);
  ctx_leave();
  return r == CUABI_SUCCESS ? 0 : cu_fail(err, r, "cuIpcCloseMemHandle");
}

/* ---- VMM allocations (cuda_vmm handles) ------------------------------------------ */

static int vmm_usable(struct wd_error *err) {
  if (drv.vmm_missing == NULL) return 0;
  return err_set(err, WEIGHTD_E_UNSUPPORTED,
                 "this CUDA driver cannot import cuda_vmm handles (libcuda.so.1 has no %s); run the daemon with "
                 "\"cuda_handles\": \"legacy\" or update the driver",
                 drv.vmm_missing);
}

/* A failed import: UNSUPPORTED, saying why, when the device cannot take VMM memory at all. */
static int import_fail(const struct cuimp_device *dev, CUresult r, struct wd_error *err) {
  int vmm = 1, posix = 1;
  if (drv.device_get_attribute(&vmm, CUABI_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev->ordinal) !=
          CUABI_SUCCESS ||
      drv.device_get_attribute(&posix, CUABI_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                               dev->ordinal) != CUABI_SUCCESS)
    vmm = posix = 1;
  if (!vmm || !posix)
    return err_set(err, WEIGHTD_E_UNSUPPORTED,
                   "this process's CUDA device %d cannot import VMM memory from a file descriptor%s; run the "
                   "daemon with \"cuda_handles\": \"legacy\"",
                   dev->ordinal, !vmm ? " (no virtual memory management)" : "");
  return cu_fail(err, r, "cuMemImportFromShareableHandle");
}

int cuimp_vmm_map(const struct cuimp_device *dev, int fd, uint64_t bytes, struct cuimp_vmm *out,
                  struct wd_error *err) {
  memset(out, 0, sizeof *out);
  int rc = ctx_enter(dev, err);
  if (rc != 0) return rc;
  if ((rc = vmm_usable(err)) != 0) {
    ctx_leave();
    return rc;
  }
  struct cuabi_mem_allocation_prop prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CUABI_MEM_ALLOCATION_TYPE_PINNED;
  prop.requested_handle_types = CUABI_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CUABI_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev->ordinal;
  size_t min = 0, rec = 0;
  cuabi_mem_handle h = 0;
  CUdeviceptr va = 0;
  int have_handle = 0, reserved = 0, mapped = 0;
  CUresult r = drv.mem_granularity(&min, &prop, CUABI_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r == CUABI_SUCCESS) r = drv.mem_granularity(&rec, &prop, CUABI_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUABI_SUCCESS) {
    rc = cu_fail(err, r, "cuMemGetAllocationGranularity");
    goto fail;
  }
  /* The daemon sends the whole allocation's size, a multiple of its granularity. */
  if (bytes == 0 || min == 0 || bytes % min != 0 || bytes > SIZE_MAX) {
    rc = err_set(err, WEIGHTD_E_PROTOCOL,
                 "the cuda_vmm handle covers %llu bytes, not a whole number of this device's %zu-byte granules",
                 (unsigned long long)bytes, min);
    goto fail;
  }
  /* A descriptor travels as the osHandle pointer's value (CUDA's convention for POSIX descriptors). */
  if ((r = drv.mem_import(&h, (void *)(uintptr_t)fd, CUABI_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) != CUABI_SUCCESS) {
    rc = import_fail(dev, r, err);
    goto fail;
  }
  have_handle = 1;
  size_t align = rec != 0 && (rec & (rec - 1)) == 0 && bytes % rec == 0 ? rec : 0;
  if ((r = drv.mem_reserve(&va, (size_t)bytes, align, 0, 0)) != CUABI_SUCCESS) {
    rc = cu_fail(err, r, "cuMemAddressReserve");
    goto fail;
  }
  reserved = 1;
  if ((r = drv.mem_map(va, (size_t)bytes, 0, h, 0)) != CUABI_SUCCESS) {
    rc = cu_fail(err, r, "cuMemMap");
    goto fail;
  }
  mapped = 1;
  /* The mapping holds the memory from here on: the imported handle is not needed. */
  drv.mem_release(h);
  have_handle = 0;
  struct cuabi_mem_access_desc access;
  memset(&access, 0, sizeof access);
  access.location.type = CUABI_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev->ordinal;
  access.flags = CUABI_MEM_ACCESS_FLAGS_PROT_READ;
  out->read_only = 1;
  CUresult ro = drv.mem_set_access(va, (size_t)bytes, &access, 1);
  if (ro != CUABI_SUCCESS) {
    /* A driver that refuses read-only device mappings: read-write, as legacy IPC always is. */
    access.flags = CUABI_MEM_ACCESS_FLAGS_PROT_READWRITE;
    out->read_only = 0;
    if ((r = drv.mem_set_access(va, (size_t)bytes, &access, 1)) != CUABI_SUCCESS) {
      rc = cu_fail(err, r, "cuMemSetAccess");
      goto fail;
    }
  }
  ctx_leave();
  out->va = (uint64_t)va;
  out->bytes = bytes;
  return 0;
fail:
  if (mapped) drv.mem_unmap(va, (size_t)bytes);
  if (reserved) drv.mem_address_free(va, (size_t)bytes);
  if (have_handle) drv.mem_release(h);
  ctx_leave();
  return rc;
}

int cuimp_vmm_unmap(const struct cuimp_device *dev, const struct cuimp_vmm *m, struct wd_error *err) {
  int rc = ctx_enter(dev, err);
  if (rc != 0) return rc;
  CUresult r = drv.mem_unmap((CUdeviceptr)m->va, (size_t)m->bytes);
  CUresult f = drv.mem_address_free((CUdeviceptr)m->va, (size_t)m->bytes);
  ctx_leave();
  if (r != CUABI_SUCCESS) return cu_fail(err, r, "cuMemUnmap");
  return f == CUABI_SUCCESS ? 0 : cu_fail(err, f, "cuMemAddressFree");
}

int cuimp_copy_to_host(const struct cuimp_device *dev, void *dst, uint64_t src, size_t len,
                       struct wd_error *err) {
  int rc = ctx_enter(dev, err);
  if (rc != 0) return rc;
  CUresult r = drv.memcpy_dtoh(dst, (CUdeviceptr)src, len);
  ctx_leave();
  return r == CUABI_SUCCESS ? 0 : cu_fail(err, r, "cuMemcpyDtoH");
}

int cuimp_copy_to_host_uuid(const char *uuid, void *dst, uint64_t src, size_t len,
                            struct wd_error *err) {
  struct cuimp_device dev;
  int rc = cuimp_device_find(uuid, &dev, err);
  if (rc != 0) return rc;
  rc = cuimp_copy_to_host(&dev, dst, src, len, err);
  cuimp_device_put(&dev);
  return rc;
}
