/*
 * backend_cuda_vmm.c - the cuda backend's VMM slabs: the driver entry points
 * (through cudaGetDriverEntryPointByVersion, since the daemon links the
 * runtime only), each device's VMM support and granularity, a slab's
 * allocation (cuMemCreate, reserve, map, access, export once) and the
 * adoption of one an earlier daemon exported (restart survival).
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "backend_cuda_vmm.h"
#include "cuda_ctx.h"

/*
 * The CUDA version whose driver ABI is asked for: every driver entry point
 * used here has had one signature since 10.2, and asking for a version newer
 * than the installed driver fails.
 */
#define CUDA_DRIVER_ABI 12000

/* ---- VMM: the driver, the devices, the granularity ------------------------------- */

/* Fills *fn with the driver's entry point sym; 0, or -1 when the driver has none. */
static int entry_point(const char *sym, void **fn) {
  enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  *fn = NULL;
  cudaError_t e = cudaGetDriverEntryPointByVersion(sym, fn, CUDA_DRIVER_ABI, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || *fn == NULL) {
    cudaGetLastError();
    *fn = NULL;
    return -1;
  }
  return 0;
}

/* Loads the VMM entry points; 0, or -1 with the first one missing named in why. */
int vmm_api_load(struct cu_vmm_api *a, char *why, size_t len) {
  static const struct {
    const char *sym;
    size_t off;
  } syms[] = {
      {"cuGetErrorName", offsetof(struct cu_vmm_api, error_name)},
      {"cuDeviceGet", offsetof(struct cu_vmm_api, device_get)},
      {"cuDeviceGetAttribute", offsetof(struct cu_vmm_api, device_get_attribute)},
      {"cuMemGetAllocationGranularity", offsetof(struct cu_vmm_api, granularity)},
      {"cuMemCreate", offsetof(struct cu_vmm_api, create)},
      {"cuMemAddressReserve", offsetof(struct cu_vmm_api, reserve)},
      {"cuMemMap", offsetof(struct cu_vmm_api, map)},
      {"cuMemSetAccess", offsetof(struct cu_vmm_api, set_access)},
      {"cuMemExportToShareableHandle", offsetof(struct cu_vmm_api, export_handle)},
      {"cuMemImportFromShareableHandle", offsetof(struct cu_vmm_api, import_handle)},
      {"cuMemUnmap", offsetof(struct cu_vmm_api, unmap)},
      {"cuMemAddressFree", offsetof(struct cu_vmm_api, address_free)},
      {"cuMemRelease", offsetof(struct cu_vmm_api, release)},
  };
  memset(a, 0, sizeof *a);
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    /* Function pointers travel as void *, as dlsym's do (POSIX guarantees the conversion). */
    if (entry_point(syms[i].sym, (void **)((char *)a + syms[i].off)) != 0) {
      snprintf(why, len, "the CUDA driver has no %s", syms[i].sym);
      memset(a, 0, sizeof *a);
      return -1;
    }
  }
  return 0;
}

/* The properties of a device-resident allocation exportable as a POSIX descriptor. */
static CUmemAllocationProp vmm_prop(CUdevice dev) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

static uint64_t gcd64(uint64_t a, uint64_t b) {
  while (b != 0) {
    uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

static uint64_t lcm64(uint64_t a, uint64_t b) { return a / gcd64(a, b) * b; }

/*
 * Decides device i's handle kind under a VMM request: cuda_vmm when the
 * device supports virtual memory management and POSIX-descriptor export,
 * with the granularity it recommends (never below CUDA_SLAB_GRAIN); else
 * cuda_ipc, with the reason in why.
 */
void vmm_probe(struct cuda_ctx *c, int i) {
  struct cuda_dev *d = &c->dev[i];
  const struct cu_vmm_api *a = &c->api;
  d->kind = WD_HANDLE_CUDA_IPC;
  int vmm = 0, posix = 0;
  CUresult r = a->device_get(&d->cudev, i);
  if (r == CUDA_SUCCESS)
    r = a->device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d->cudev);
  if (r == CUDA_SUCCESS)
    r = a->device_get_attribute(&posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, d->cudev);
  if (r != CUDA_SUCCESS) {
    snprintf(d->why, sizeof d->why, "querying VMM support: %s", cu_name(c, r));
    return;
  }
  if (!vmm) {
    snprintf(d->why, sizeof d->why, "the device does not support CUDA virtual memory management");
    return;
  }
  if (!posix) {
    snprintf(d->why, sizeof d->why, "the driver cannot export the device's memory as POSIX file descriptors");
    return;
  }
  CUmemAllocationProp prop = vmm_prop(d->cudev);
  size_t min = 0, rec = 0;
  r = a->granularity(&min, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r == CUDA_SUCCESS) r = a->granularity(&rec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS || min == 0 || rec == 0) {
    snprintf(d->why, sizeof d->why, "cuMemGetAllocationGranularity: %s", r != CUDA_SUCCESS ? cu_name(c, r) : "0");
    return;
  }
  d->grain = lcm64(lcm64(min, rec), CUDA_SLAB_GRAIN);
  d->kind = WD_HANDLE_CUDA_VMM;
}

/* Random bytes that name one allocation (see WD_ALLOC_ID_BYTES). */
static void alloc_id_draw(unsigned char id[WD_ALLOC_ID_BYTES]) {
  if (getrandom(id, WD_ALLOC_ID_BYTES, 0) == (ssize_t)WD_ALLOC_ID_BYTES) return;
  /* No entropy source: unique on this machine is enough (pid, clock, a counter). */
  static atomic_uint_fast64_t serial;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t v[2] = {((uint64_t)getpid() << 32) ^ (uint64_t)atomic_fetch_add(&serial, 1),
                   (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec};
  _Static_assert(sizeof v == WD_ALLOC_ID_BYTES, "the fallback fills the id");
  memcpy(id, v, sizeof v);
}

/*
 * VMM: create, reserve an address range, map, allow the daemon's device to
 * read and write it, and export the descriptor clients will get (the current
 * device is `device`).
 */
int vmm_alloc(const struct cuda_ctx *c, int device, uint64_t bytes, struct cuda_slab *cs, struct wd_error *err) {
  const struct cu_vmm_api *a = &c->api;
  const struct cuda_dev *d = &c->dev[device];
  uint64_t alloc = 0;
  int rc = round_to(bytes, d->grain, &alloc, err);
  if (rc != 0) return rc;
  CUmemAllocationProp prop = vmm_prop(d->cudev);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = a->create(&h, (size_t)alloc, &prop, 0);
  if (r != CUDA_SUCCESS)
    return nomem_message(err, r == CUDA_ERROR_OUT_OF_MEMORY ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE,
                         "cuMemCreate", bytes, device, cu_name(c, r));
  CUdeviceptr va = 0;
  bool reserved = false, mapped = false;
  int fd = -1;
  /* Aligned to the grain, so that the mapping can use the largest pages. */
  size_t align = (d->grain & (d->grain - 1)) == 0 ? (size_t)d->grain : 0;
  if ((r = a->reserve(&va, (size_t)alloc, align, 0, 0)) != CUDA_SUCCESS) {
    rc = cu_fail(c, err, r, "cuMemAddressReserve");
    goto fail;
  }
  reserved = true;
  if ((r = a->map(va, (size_t)alloc, 0, h, 0)) != CUDA_SUCCESS) {
    rc = cu_fail(c, err, r, "cuMemMap");
    goto fail;
  }
  mapped = true;
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = d->cudev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if ((r = a->set_access(va, (size_t)alloc, &access, 1)) != CUDA_SUCCESS) {
    rc = cu_fail(c, err, r, "cuMemSetAccess");
    goto fail;
  }
  if ((r = a->export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) != CUDA_SUCCESS) {
    rc = cu_fail(c, err, r, "cuMemExportToShareableHandle");
    fd = -1;
    goto fail;
  }
  /* The daemon never execs, but a descriptor that outlives a fork must not leak into a child's exec. */
  int fl = fcntl(fd, F_GETFD);
  if (fl >= 0) fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
  alloc_id_draw(cs->alloc_id);
  cs->base = (void *)(uintptr_t)va;
  cs->alloc_bytes = alloc;
  cs->h = h;
  cs->fd = fd;
  return 0;
fail:
  if (mapped) a->unmap(va, (size_t)alloc);
  if (reserved) a->address_free(va, (size_t)alloc);
  a->release(h);
  return rc;
}

/*
 * A VMM allocation an earlier daemon exported (restart survival): imported
 * from its descriptor, mapped read-write as a fresh slab is (the daemon
 * never writes it again), and exported by dup of that same descriptor.
 */
int vmm_slab_adopt(void *ctx, int device, enum wd_handle_kind kind, int fd, uint64_t bytes, uint64_t alloc_bytes,
                   const unsigned char *alloc_id, struct wd_slab **out, struct wd_error *err) {
  const struct cuda_ctx *c = ctx;
  *out = NULL;
  if (device < 0 || device >= c->ndev)
    return err_set(err, WEIGHTD_E_NOT_FOUND, "no GPU %d (%d present)", device, c->ndev);
  if (kind != WD_HANDLE_CUDA_VMM || c->dev[device].kind != WD_HANDLE_CUDA_VMM)
    return err_set(err, WEIGHTD_E_UNSUPPORTED, "GPU %d adopts only cuda_vmm slabs while it uses them (not %s)",
                   device, wd_handle_kind_name(kind));
  if (alloc_bytes < bytes || alloc_bytes % c->dev[device].grain != 0)
    return err_set(err, WEIGHTD_E_INVALID, "allocation of %llu bytes is not whole grains of %llu holding %llu",
                   (unsigned long long)alloc_bytes, (unsigned long long)c->dev[device].grain,
                   (unsigned long long)bytes);
  CK(cudaSetDevice(device), "cudaSetDevice");
  const struct cu_vmm_api *a = &c->api;
  CUmemGenericAllocationHandle h = 0;
  CUresult r = a->import_handle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) return cu_fail(c, err, r, "cuMemImportFromShareableHandle");
  struct wd_slab *s = calloc(1, sizeof *s);
  struct cuda_slab *cs = calloc(1, sizeof *cs);
  CUdeviceptr va = 0;
  bool reserved = false, mapped = false;
  int rc = 0;
  if (s == NULL || cs == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  size_t grain = (size_t)c->dev[device].grain, align = (grain & (grain - 1)) == 0 ? grain : 0;
  if ((r = a->reserve(&va, (size_t)alloc_bytes, align, 0, 0)) != CUDA_SUCCESS) {
    rc = cu_fail(c, err, r, "cuMemAddressReserve");
    goto fail;
  }
  reserved = true;
  if ((r = a->map(va, (size_t)alloc_bytes, 0, h, 0)) != CUDA_SUCCESS) {
    rc = cu_fail(c, err, r, "cuMemMap");
    goto fail;
  }
  mapped = true;
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = c->dev[device].cudev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if ((r = a->set_access(va, (size_t)alloc_bytes, &access, 1)) != CUDA_SUCCESS) {
    rc = cu_fail(c, err, r, "cuMemSetAccess");
    goto fail;
  }
  int fl = fcntl(fd, F_GETFD);
  if (fl >= 0) fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
  cs->base = (void *)(uintptr_t)va;
  cs->alloc_bytes = alloc_bytes;
  cs->h = h;
  cs->fd = fd;
  memcpy(cs->alloc_id, alloc_id, sizeof cs->alloc_id);
  s->device = device;
  s->kind = WD_HANDLE_CUDA_VMM;
  s->bytes = bytes;
  s->export_while_filling = 1;
  s->impl = cs;
  *out = s;
  return 0;
fail:
  if (mapped) a->unmap(va, (size_t)alloc_bytes);
  if (reserved) a->address_free(va, (size_t)alloc_bytes);
  a->release(h);
  free(cs);
  free(s);
  return rc;
}
