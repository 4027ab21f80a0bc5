/*
 * cuda_import.c - the CUDA driver, loaded at run time, for importing handles.
 *
 * DESIGN: one process-wide table of driver entry points, filled once by
 * pthread_once (dlopen("libcuda.so.1"), dlsym, cuInit). After that the table
 * is read-only and every function may run on any thread; the driver itself is
 * thread-safe. Nothing here links against CUDA.
 */
#include "cuda_import.h"

#include <ctype.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ---- the driver types we need (ABI of the CUDA driver API) ---------------- */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct {
  char bytes[16];
} CUuuid;
typedef struct {
  char reserved[WD_IPC_HANDLE_BYTES];
} CUipcMemHandle;

#define CUDA_SUCCESS 0
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1

struct cu_driver {
  void *lib;
  CUresult (*init)(unsigned flags);
  CUresult (*device_get_count)(int *count);
  CUresult (*device_get)(CUdevice *dev, int ordinal);
  CUresult (*device_get_uuid)(CUuuid *uuid, CUdevice dev);
  CUresult (*primary_ctx_retain)(CUcontext *ctx, CUdevice dev);
  CUresult (*primary_ctx_release)(CUdevice dev);
  CUresult (*ctx_push)(CUcontext ctx);
  CUresult (*ctx_pop)(CUcontext *ctx);
  CUresult (*ipc_open)(CUdeviceptr *dptr, CUipcMemHandle handle, unsigned flags);
  CUresult (*ipc_close)(CUdeviceptr dptr);
  CUresult (*memcpy_dtoh)(void *dst, CUdeviceptr src, size_t bytes);
  CUresult (*get_error_name)(CUresult r, const char **name); /* optional */
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
#undef LOAD
  if (!drv.init || !drv.device_get_count || !drv.device_get || !drv.device_get_uuid ||
      !drv.primary_ctx_retain || !drv.primary_ctx_release || !drv.ctx_push || !drv.ctx_pop ||
      !drv.ipc_open || !drv.ipc_close || !drv.memcpy_dtoh) {
    drv.status = WEIGHTD_E_UNSUPPORTED;
    snprintf(drv.why, sizeof drv.why, "libcuda.so.1 lacks a needed entry point (driver too old)");
    return;
  }
  CUresult r = drv.init(0);
  if (r != CUDA_SUCCESS) {
    const char *name = NULL;
    if (drv.get_error_name == NULL || drv.get_error_name(r, &name) != CUDA_SUCCESS) name = NULL;
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
  if (drv.get_error_name == NULL || drv.get_error_name(r, &name) != CUDA_SUCCESS) name = NULL;
  return err_set(err, WEIGHTD_E_DEVICE, "%s: %s (%d)", what, name ? name : "CUDA error", r);
}

/* ---- device lookup by UUID -------------------------------------------------- */

static void uuid_format(const CUuuid *u, char *buf, size_t len) {
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
  if (r != CUDA_SUCCESS) return cu_fail(err, r, "cuDeviceGetCount");
  char seen[512] = "";
  size_t seen_len = 0;
  for (int i = 0; i < count; i++) {
    CUdevice dev;
    CUuuid u;
    char text[48], digits[33];
    if ((r = drv.device_get(&dev, i)) != CUDA_SUCCESS) return cu_fail(err, r, "cuDeviceGet");
    if ((r = drv.device_get_uuid(&u, dev)) != CUDA_SUCCESS) return cu_fail(err, r, "cuDeviceGetUuid");
    uuid_format(&u, text, sizeof text);
    uuid_digits(text, digits);
    if (strcmp(digits, want) == 0) {
      CUcontext ctx = NULL;
      if ((r = drv.primary_ctx_retain(&ctx, dev)) != CUDA_SUCCESS)
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
  return r == CUDA_SUCCESS ? 0 : cu_fail(err, r, "cuCtxPushCurrent");
}

static void ctx_leave(void) {
  CUcontext popped;
  drv.ctx_pop(&popped);
}

int cuimp_ipc_open(const struct cuimp_device *dev, const unsigned char handle[WD_IPC_HANDLE_BYTES],
                   uint64_t *dptr, struct wd_error *err) {
  int rc = ctx_enter(dev, err);
  if (rc != 0) return rc;
  CUipcMemHandle h;
  memcpy(h.reserved, handle, sizeof h.reserved);
  CUdeviceptr p = 0;
  CUresult r = drv.ipc_open(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  ctx_leave();
  if (r != CUDA_SUCCESS) return cu_fail(err, r, "cuIpcOpenMemHandle");
  *dptr = (uint64_t)p;
  return 0;
}

int cuimp_ipc_close(const struct cuimp_device *dev, uint64_t dptr, struct wd_error *err) {
  int rc = ctx_enter(dev, err);
  if (rc != 0) return rc;
  CUresult r = drv.ipc_close((CUdeviceptr)dptr);
  ctx_leave();
  return r == CUDA_SUCCESS ? 0 : cu_fail(err, r, "cuIpcCloseMemHandle");
}

int cuimp_copy_to_host(const struct cuimp_device *dev, void *dst, uint64_t src, size_t len,
                       struct wd_error *err) {
  int rc = ctx_enter(dev, err);
  if (rc != 0) return rc;
  CUresult r = drv.memcpy_dtoh(dst, (CUdeviceptr)src, len);
  ctx_leave();
  return r == CUDA_SUCCESS ? 0 : cu_fail(err, r, "cuMemcpyDtoH");
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
