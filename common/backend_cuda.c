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
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"

/*
 * Slabs are allocated in whole 2 MiB units at least: measured on an H200
 * (driver 580), cudaIpcOpenMemHandle of a 7.49 GiB allocation takes 48 ms
 * when its size is not a multiple of 2 MiB and 0.25 ms when it is
 * (tests/gpu/dma_study.c). VMM slabs are also whole multiples of the
 * granularity the driver recommends for the device.
 */
#define CUDA_SLAB_GRAIN (2ull << 20)

/* cudaHostRegister is asked for at most this much at once. */
#define CUDA_REGISTER_CHUNK (64ull << 30)

/*
 * The CUDA version whose driver ABI is asked for: every driver entry point
 * used here has had one signature since 10.2, and asking for a version newer
 * than the installed driver fails.
 */
#define CUDA_DRIVER_ABI 12000

_Static_assert(sizeof(cudaIpcMemHandle_t) == WD_IPC_HANDLE_BYTES, "the IPC handle size libweightd expects");

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

/* The driver's name of r ("CUDA_ERROR_OUT_OF_MEMORY"). */
static const char *cu_name(const struct cuda_ctx *c, CUresult r) {
  const char *name = NULL;
  if (c->api.error_name == NULL || c->api.error_name(r, &name) != CUDA_SUCCESS || name == NULL) return "CUDA error";
  return name;
}

static int cu_fail(const struct cuda_ctx *c, struct wd_error *err, CUresult r, const char *what) {
  return err_set(err, r == CUDA_ERROR_OUT_OF_MEMORY ? WEIGHTD_E_DEVICE_NOMEM : WEIGHTD_E_DEVICE, "%s: %s (%d)", what,
                 cu_name(c, r), (int)r);
}

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
static int vmm_api_load(struct cu_vmm_api *a, char *why, size_t len) {
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
static void vmm_probe(struct cuda_ctx *c, int i) {
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

/* ---- slabs -------------------------------------------------------------------------------- */

/* A slab size in whole grains; an empty set still gets one grain, to export. */
static int round_to(uint64_t bytes, uint64_t grain, uint64_t *out, struct wd_error *err) {
  if (bytes > UINT64_MAX - grain)
    return err_set(err, WEIGHTD_E_DEVICE_NOMEM, "a slab of %llu bytes is larger than any device",
                   (unsigned long long)bytes);
  *out = bytes ? (bytes + grain - 1) / grain * grain : grain;
  return 0;
}

static int nomem_message(struct wd_error *err, int code, const char *what, uint64_t bytes, int device,
                         const char *name) {
  size_t free_b = 0, total_b = 0;
  cudaGetLastError();
  cudaMemGetInfo(&free_b, &total_b);
  return err_set(err, code, "%s of %llu bytes on GPU %d: %s (%llu of %llu bytes free)", what,
                 (unsigned long long)bytes, device, name, (unsigned long long)free_b, (unsigned long long)total_b);
}

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

/*
 * VMM: create, reserve an address range, map, allow the daemon's device to
 * read and write it, and export the descriptor clients will get (the current
 * device is `device`).
 */
static int vmm_alloc(const struct cuda_ctx *c, int device, uint64_t bytes, struct cuda_slab *cs,
                     struct wd_error *err) {
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

/*
 * A VMM allocation an earlier daemon exported (restart survival): imported
 * from its descriptor, mapped read-write as a fresh slab is (the daemon
 * never writes it again), and exported by dup of that same descriptor.
 */
static int cu_slab_adopt(void *ctx, int device, enum wd_handle_kind kind, int fd, uint64_t bytes,
                         uint64_t alloc_bytes, const unsigned char *alloc_id, struct wd_slab **out,
                         struct wd_error *err) {
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
    .slab_adopt = cu_slab_adopt,
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
