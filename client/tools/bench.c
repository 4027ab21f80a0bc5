/*
 * bench.c - weightd-bench: how close a running weightd gets to the hardware.
 *
 * In one run it measures the ceilings (pinned-source host-to-device copies on
 * the chosen GPU; page cache -> pinned memory fill rate with the daemon's
 * fill thread count), then loads a checkpoint through the daemon, staged and
 * pinned-resident, several times each (evicting in between so that each timed
 * load starts with no resident set and includes slab allocation), times a
 * fresh process attaching the resident set (CUDA context creation reported
 * apart from the attach; the attach split into the request/reply round trip
 * and opening the handle alone: cudaIpcOpenMemHandle for a legacy cuda_ipc
 * set, import + reserve + map + set access for a cuda_vmm set, whichever
 * the daemon's cuda_handles setting makes), and reads the daemon's anonymous
 * RSS. Each figure is printed with its ratio to the ceiling measured in this
 * same run. --attach-only skips the ceilings and loads: it loads the set
 * once and times the attaches (tests/gpu/bench.sh runs it against a second
 * daemon with the other handle kind).
 *
 * weightd-bench --checkpoint DIR [--socket PATH] [--device N] [--runs N]
 *               [--fill-threads N] [--attach-only] [--json]
 * weightd-bench --attach-probe SET --socket PATH   (the fresh process)
 * weightd-bench --multi MODE ...                   (several GPUs: bench_multi.c)
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_multi.h"
#include "checkpoint.h"
#include "clock.h"
#include "msg.h"
#include "plan.h"
#include "weightd.h"
#include "wire.h"

#define GiB (1024.0 * 1024.0 * 1024.0)
#define SLOT (64u << 20)

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static _Noreturn void die(const char *what, const char *detail) {
  fprintf(stderr, "weightd-bench: %s: %s\n", what, detail);
  exit(1);
}

#define CUDA_OK(call)                                           \
  do {                                                          \
    cudaError_t e_ = (call);                                    \
    if (e_ != cudaSuccess) die(#call, cudaGetErrorString(e_));  \
  } while (0)

/* ---- ceilings ------------------------------------------------------------------ */

/* Pinned-source H2D: `bytes` in 64 MiB copies from two pinned buffers on two streams. */
static double h2d_ceiling(int device, uint64_t bytes) {
  CUDA_OK(cudaSetDevice(device));
  void *src[2], *dst;
  cudaStream_t st[2];
  size_t dst_bytes = 2ull << 30;
  for (int i = 0; i < 2; i++) {
    CUDA_OK(cudaHostAlloc(&src[i], SLOT, cudaHostAllocPortable));
    memset(src[i], 0x5a, SLOT);
    CUDA_OK(cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking));
  }
  CUDA_OK(cudaMalloc(&dst, dst_bytes));
  for (int i = 0; i < 4; i++) /* warm up */
    CUDA_OK(cudaMemcpyAsync((char *)dst + (size_t)i * SLOT, src[i & 1], SLOT, cudaMemcpyHostToDevice, st[i & 1]));
  CUDA_OK(cudaDeviceSynchronize());
  double t0 = clock_s();
  uint64_t k = 0;
  for (uint64_t off = 0; off < bytes; off += SLOT, k++) {
    size_t n = bytes - off < SLOT ? (size_t)(bytes - off) : SLOT;
    size_t d = (size_t)((k * SLOT) % (dst_bytes - SLOT));
    CUDA_OK(cudaMemcpyAsync((char *)dst + d, src[k & 1], n, cudaMemcpyHostToDevice, st[k & 1]));
  }
  CUDA_OK(cudaDeviceSynchronize());
  double t = clock_s() - t0;
  for (int i = 0; i < 2; i++) {
    cudaFreeHost(src[i]);
    cudaStreamDestroy(st[i]);
  }
  cudaFree(dst);
  return t;
}

struct fill_arg {
  const struct plan *plan;
  const unsigned char **data; /* per shard: its data section */
  unsigned char *pinned;      /* nthreads slots of SLOT bytes */
  unsigned nthreads;
  atomic_uint_fast64_t next; /* 8 MiB task counter over the slab */
  atomic_uint ids;
};

static void *fill_thread(void *arg) {
  struct fill_arg *f = arg;
  unsigned me = atomic_fetch_add(&f->ids, 1) % f->nthreads;
  unsigned char *dst = f->pinned + (size_t)me * SLOT;
  const uint64_t chunk = 8u << 20;
  for (;;) {
    uint64_t lo = atomic_fetch_add(&f->next, 1) * chunk;
    if (lo >= f->plan->slab_bytes) return NULL;
    uint64_t hi = lo + chunk < f->plan->slab_bytes ? lo + chunk : f->plan->slab_bytes;
    plan_gather(f->plan, f->data, lo, hi, dst + lo % SLOT);
  }
}

/*
 * Page cache -> pinned memory with nthreads threads: the same gathering the
 * staging pipeline's fill threads do for this plan (row gathers included).
 */
static double fill_ceiling(const struct ckpt *c, const struct plan *plan, unsigned nthreads) {
  void **maps = calloc(c->nshards, sizeof *maps);
  const unsigned char **data = calloc(c->nshards, sizeof *data);
  for (size_t i = 0; i < c->nshards; i++) {
    maps[i] = mmap(NULL, c->shards[i].size, PROT_READ, MAP_SHARED, c->shards[i].fd, 0);
    if (maps[i] == MAP_FAILED) die("mmap", strerror(errno));
    for (uint64_t o = 0; o < c->shards[i].size; o += 4096) (void)((volatile char *)maps[i])[o];
    data[i] = (const unsigned char *)maps[i] + c->shards[i].hdr->data_start;
  }
  unsigned char *pinned;
  CUDA_OK(cudaHostAlloc((void **)&pinned, (size_t)nthreads * SLOT, cudaHostAllocPortable));
  memset(pinned, 0, (size_t)nthreads * SLOT);
  struct fill_arg f = {.plan = plan, .data = data, .pinned = pinned, .nthreads = nthreads};
  atomic_init(&f.next, 0);
  atomic_init(&f.ids, 0);
  pthread_t *t = calloc(nthreads, sizeof *t);
  double t0 = clock_s();
  for (unsigned i = 0; i < nthreads; i++) pthread_create(&t[i], NULL, fill_thread, &f);
  for (unsigned i = 0; i < nthreads; i++) pthread_join(t[i], NULL);
  double dt = clock_s() - t0;
  free(t);
  cudaFreeHost(pinned);
  for (size_t i = 0; i < c->nshards; i++) munmap(maps[i], c->shards[i].size);
  free(maps);
  free(data);
  return dt;
}

/* ---- through the daemon ----------------------------------------------------------- */

static weightd_client *connect_or_die(const char *sock) {
  weightd_client *c = NULL;
  if (weightd_connect(sock, &c) != 0) die("connect", weightd_last_error(c));
  return c;
}

/* Sends one request; returns the reply text (free it with weightd_free). */
static char *request_or_die(weightd_client *c, const char *json) {
  char *r = NULL;
  if (weightd_request(c, json, &r, NULL, NULL) != 0) die(json, r ? r : weightd_last_error(c));
  return r;
}

/*
 * One timed load from request to result, slab allocation included, after
 * evicting every set of the device and waiting settle_ms: the driver reclaims
 * (scrubs) freed device memory in the background with the copy engines, which
 * slows copies that start right after an eviction (tests/gpu/dma_study.c).
 */
static const char *plan_json; /* --plan, or NULL for every tensor whole */

static double timed_load(weightd_client *c, const char *path, int device, char *method, size_t mlen,
                         int settle_ms) {
  char dev[16], set[32];
  snprintf(dev, sizeof dev, "%d", device);
  struct weightd_load_options o = {sizeof o, dev, plan_json, NULL, NULL};
  char req[PATH_MAX + 128];
  snprintf(req, sizeof req, "{\"op\":\"evict\",\"device\":%d}", device);
  weightd_free(request_or_die(c, req));
  if (settle_ms > 0) usleep((useconds_t)settle_ms * 1000);
  double t0 = clock_s();
  if (weightd_load(c, path, &o, set, sizeof set) != 0) die("load", weightd_last_error(c));
  double dt = clock_s() - t0;
  /* The reply is read in this function, where the pointer filled in stays alive. */
  char *reply = NULL;
  if (weightd_request(c, "{\"op\":\"status\"}", &reply, NULL, NULL) != 0) die("status", weightd_last_error(c));
  const char *m = strstr(reply, "\"method\":\"");
  if (m != NULL && method != NULL) snprintf(method, mlen, "%.*s", (int)strcspn(m + 10, "\""), m + 10);
  weightd_free(reply);
  return dt;
}

static uint64_t daemon_rss_anon(weightd_client *c) {
  char *reply = NULL;
  reply = request_or_die(c, "{\"op\":\"status\"}");
  const char *p = strstr(reply, "\"pid\":");
  int pid = p ? atoi(p + 6) : 0;
  weightd_free(reply);
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/smaps_rollup", pid);
  FILE *f = fopen(path, "r");
  uint64_t kb = 0;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "Anonymous:", 10) == 0) kb = strtoull(line + 10, NULL, 10);
  if (f) fclose(f);
  return kb * 1024;
}

/* ---- the fresh process ------------------------------------------------------------- */

/* A raw protocol connection (proto/wire.h): the handle's parts are timed without libweightd. */
static int raw_connect(const char *sock) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) die("connect", strerror(errno));
  return fd;
}

/* Sends json and returns the final reply (skipping events); f keeps the reply's descriptors. */
static cJSON *raw_call(int fd, const char *json, struct wire_frame *f) {
  struct wd_error err = {0};
  if (wire_send_frame(fd, json, strlen(json), NULL, 0, &err) != 0) die("send", err.msg);
  for (;;) {
    memset(f, 0, sizeof *f);
    if (wire_recv_frame(fd, 60000, f, &err) != 0) die("receive", err.msg);
    cJSON *m = cJSON_Parse(f->json);
    if (m != NULL && cJSON_GetObjectItemCaseSensitive(m, "event") == NULL) return m;
    cJSON_Delete(m);
    wire_frame_clear(f);
  }
}

/* A driver entry point through the runtime (the bench links no libcuda). */
static void *driver_fn(const char *sym) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(sym, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess || fn == NULL)
    die("driver entry point", sym);
  return fn;
}

#define CU_OK(call)                                    \
  do {                                                 \
    CUresult r_ = (call);                              \
    if (r_ != CUDA_SUCCESS) {                          \
      char n_[32];                                     \
      snprintf(n_, sizeof n_, "CUresult %d", (int)r_); \
      die(#call, n_);                                  \
    }                                                  \
  } while (0)

/*
 * What libweightd does with a cuda_vmm descriptor, timed alone: import,
 * reserve an address range, map, grant this device read access (read-write
 * where the driver refuses read-only); then undone, untimed.
 */
static double vmm_open_time(int fd, uint64_t bytes, int device) {
  PFN_cuDeviceGet_v2000 device_get = (PFN_cuDeviceGet_v2000)driver_fn("cuDeviceGet");
  PFN_cuMemImportFromShareableHandle_v10020 import =
      (PFN_cuMemImportFromShareableHandle_v10020)driver_fn("cuMemImportFromShareableHandle");
  PFN_cuMemAddressReserve_v10020 reserve = (PFN_cuMemAddressReserve_v10020)driver_fn("cuMemAddressReserve");
  PFN_cuMemMap_v10020 map = (PFN_cuMemMap_v10020)driver_fn("cuMemMap");
  PFN_cuMemRelease_v10020 release = (PFN_cuMemRelease_v10020)driver_fn("cuMemRelease");
  PFN_cuMemSetAccess_v10020 set_access = (PFN_cuMemSetAccess_v10020)driver_fn("cuMemSetAccess");
  PFN_cuMemUnmap_v10020 unmap = (PFN_cuMemUnmap_v10020)driver_fn("cuMemUnmap");
  PFN_cuMemAddressFree_v10020 address_free = (PFN_cuMemAddressFree_v10020)driver_fn("cuMemAddressFree");
  CUdevice dev;
  CU_OK(device_get(&dev, device));
  CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev},
                            .flags = CU_MEM_ACCESS_FLAGS_PROT_READ};
  CUmemGenericAllocationHandle h;
  CUdeviceptr va = 0;
  double t0 = clock_s();
  CU_OK(import(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CU_OK(reserve(&va, (size_t)bytes, 0, 0, 0));
  CU_OK(map(va, (size_t)bytes, 0, h, 0));
  CU_OK(release(h));
  if (set_access(va, (size_t)bytes, &access, 1) != CUDA_SUCCESS) {
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_OK(set_access(va, (size_t)bytes, &access, 1));
  }
  double t = clock_s() - t0;
  CU_OK(unmap(va, (size_t)bytes));
  CU_OK(address_free(va, (size_t)bytes));
  return t;
}

/*
 * The fresh process: context creation, then attach, each timed; prints
 * "ctx_s attach_s roundtrip_s open_s kind": the round trip and the open split
 * the attach into a bare request/reply (with its descriptor, if any) and
 * opening the handle alone.
 */
static int attach_probe(const char *set, const char *sock, int device) {
  double t0 = clock_s();
  CUDA_OK(cudaSetDevice(device));
  CUDA_OK(cudaFree(0));
  double t_ctx = clock_s() - t0;
  /* The parts: one raw attach (reply only), then opening its handle alone. */
  int raw = raw_connect(sock);
  struct wire_frame f;
  cJSON_Delete(raw_call(raw, "{\"op\":\"hello\",\"id\":1,\"protocol\":1,\"handles\":[\"fd\",\"cuda_ipc\",\"cuda_vmm\"]}", &f));
  wire_frame_clear(&f);
  char req[128];
  snprintf(req, sizeof req, "{\"op\":\"attach\",\"id\":2,\"set\":\"%s\"}", set);
  t0 = clock_s();
  cJSON *reply = raw_call(raw, req, &f);
  double t_rt = clock_s() - t0;
  const cJSON *h = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(reply, "handles"), 0);
  const cJSON *kind = cJSON_GetObjectItemCaseSensitive(h, "kind");
  const cJSON *lease = cJSON_GetObjectItemCaseSensitive(reply, "lease");
  const cJSON *hbytes = cJSON_GetObjectItemCaseSensitive(h, "bytes");
  if (!cJSON_IsString(kind) || !cJSON_IsString(lease) || !cJSON_IsNumber(hbytes)) die("attach", f.json);
  char kind_name[16];
  snprintf(kind_name, sizeof kind_name, "%s", kind->valuestring);
  double t_open = -1;
  if (strcmp(kind_name, "cuda_ipc") == 0) {
    const cJSON *hex = cJSON_GetObjectItemCaseSensitive(h, "handle");
    cudaIpcMemHandle_t ih;
    if (!cJSON_IsString(hex) || msg_hex_decode(hex->valuestring, &ih, sizeof ih) != 0) die("attach", "bad handle");
    void *p = NULL;
    t0 = clock_s();
    CUDA_OK(cudaIpcOpenMemHandle(&p, ih, cudaIpcMemLazyEnablePeerAccess));
    t_open = clock_s() - t0;
    CUDA_OK(cudaIpcCloseMemHandle(p));
  } else if (strcmp(kind_name, "cuda_vmm") == 0) {
    if (f.nfds < 1) die("attach", "a cuda_vmm reply without its descriptor");
    t_open = vmm_open_time(f.fds[0], (uint64_t)hbytes->valuedouble, device);
  }
  wire_frame_clear(&f); /* closes the descriptor */
  snprintf(req, sizeof req, "{\"op\":\"release\",\"id\":3,\"lease\":\"%s\"}", lease->valuestring);
  cJSON_Delete(reply);
  cJSON_Delete(raw_call(raw, req, &f));
  wire_frame_clear(&f);
  close(raw);
  /* The whole attach through libweightd, to pointers the process can use. */
  weightd_client *c = connect_or_die(sock);
  weightd_set *s = NULL;
  t0 = clock_s();
  if (weightd_attach(c, set, &s) != 0) die("attach", weightd_last_error(c));
  weightd_tensor t;
  if (weightd_set_tensor(s, 0, &t) != 0 || t.data == NULL) die("attach", "no usable pointer");
  double t_attach = clock_s() - t0;
  /* Touch the memory through the pointer to show it is usable. */
  unsigned char byte;
  CUDA_OK(cudaMemcpy(&byte, t.data, 1, cudaMemcpyDeviceToHost));
  printf("%.6f %.6f %.6f %.6f %s\n", t_ctx, t_attach, t_rt, t_open, kind_name);
  weightd_release(s);
  weightd_close(c);
  return 0;
}

static void probe_attach(const char *self, const char *sock, const char *set, int device, double *ctx,
                         double *att, double *rt, double *open, char kind[16]) {
  int p[2];
  if (pipe(p) != 0) die("pipe", strerror(errno));
  pid_t pid = fork();
  if (pid == 0) {
    dup2(p[1], 1);
    char dev[16];
    snprintf(dev, sizeof dev, "%d", device);
    execl(self, self, "--attach-probe", set, "--socket", sock, "--device", dev, (char *)NULL);
    _exit(127);
  }
  close(p[1]);
  char buf[128] = "";
  ssize_t n = read(p[0], buf, sizeof buf - 1);
  close(p[0]);
  int st;
  waitpid(pid, &st, 0);
  if (n <= 0 || sscanf(buf, "%lf %lf %lf %lf %15s", ctx, att, rt, open, kind) != 5) die("attach probe", "no result");
}

/* Attach figures: medians over the probes (fresh processes). */
struct attach_figures {
  double ctx, attach, roundtrip, open;
  char handles[16]; /* the set's handle kind */
  int probes;
};

/* Loads the set (if needed) and times fresh processes attaching it. */
static void measure_attach(const char *self, weightd_client *cl, const char *sock, const char *abs, int device,
                           int runs, struct attach_figures *out) {
  char dev[16], set[32];
  snprintf(dev, sizeof dev, "%d", device);
  struct weightd_load_options o = {sizeof o, dev, plan_json, NULL, NULL};
  if (weightd_load(cl, abs, &o, set, sizeof set) != 0) die("load", weightd_last_error(cl));
  double ctx_all[16], att_all[16], rt_all[16], open_all[16];
  int probes = runs < 16 ? runs : 16;
  for (int i = 0; i < probes; i++)
    probe_attach(self, sock, set, device, &ctx_all[i], &att_all[i], &rt_all[i], &open_all[i], out->handles);
  out->ctx = median(ctx_all, probes);
  out->attach = median(att_all, probes);
  out->roundtrip = median(rt_all, probes);
  out->open = median(open_all, probes);
  out->probes = probes;
}

static const char *open_label(const char *handles) {
  return strcmp(handles, "cuda_vmm") == 0 ? "  of which: VMM import + map + access" : "  of which: cudaIpcOpenMemHandle";
}

static void print_attach(const struct attach_figures *a) {
  printf("%-44s %8.2f ms   (one-time per process)\n", "fresh process: CUDA context", a->ctx * 1e3);
  char label[64];
  snprintf(label, sizeof label, "fresh process: attach (%s handles)", a->handles);
  printf("%-44s %8.3f ms   (to usable pointers; median of %d)\n", label, a->attach * 1e3, a->probes);
  printf("%-44s %8.3f ms\n", "  of which: request/reply round trip", a->roundtrip * 1e3);
  printf("%-44s %8.3f ms\n", open_label(a->handles), a->open * 1e3);
}

/* Only the attach figures (--attach-only): for a daemon with the other cuda_handles. */
static int attach_only(const char *self, const char *sock, const char *abs, int device, int runs, int json) {
  weightd_client *cl = connect_or_die(sock);
  if (strcmp(weightd_backend(cl), "cuda") != 0) die("daemon", "the daemon does not use the cuda backend");
  struct attach_figures a;
  measure_attach(self, cl, sock, abs, device, runs, &a);
  if (json)
    printf("{\"checkpoint\":\"%s\",\"attach_handles\":\"%s\",\"attach_context_s\":%.6f,\"attach_s\":%.6f,"
           "\"attach_roundtrip_s\":%.6f,\"attach_open_s\":%.6f,\"attach_probes\":%d}\n",
           abs, a.handles, a.ctx, a.attach, a.roundtrip, a.open, a.probes);
  else
    print_attach(&a);
  weightd_close(cl);
  return 0;
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--multi") == 0) return bench_multi_main(argc - 1, argv + 1);
  const char *path = NULL, *sock = NULL, *probe = NULL;
  int device = 0, runs = 5, json = 0, settle_ms = 500, only_attach = 0;
  unsigned fill_threads = (unsigned)sysconf(_SC_NPROCESSORS_ONLN);
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--json") == 0) json = 1;
    else if (strcmp(argv[i], "--attach-only") == 0) only_attach = 1;
    else if (v && strcmp(argv[i], "--checkpoint") == 0) path = argv[++i];
    else if (v && strcmp(argv[i], "--socket") == 0) sock = argv[++i];
    else if (v && strcmp(argv[i], "--device") == 0) device = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--runs") == 0) runs = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--settle-ms") == 0) settle_ms = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--plan") == 0) plan_json = argv[++i];
    else if (v && strcmp(argv[i], "--fill-threads") == 0) fill_threads = (unsigned)atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--attach-probe") == 0) probe = argv[++i];
    else {
      fprintf(stderr,
              "usage: weightd-bench --checkpoint DIR [--socket PATH] [--device N] [--runs N]\n"
              "                     [--fill-threads N] [--settle-ms MS] [--plan JSON] [--attach-only] [--json]\n");
      return 2;
    }
  }
  if (probe) return attach_probe(probe, sock, device);
  if (path == NULL || runs < 1 || fill_threads < 1) {
    fprintf(stderr, "weightd-bench: --checkpoint DIR is required\n");
    return 2;
  }
  char *abs = realpath(path, NULL);
  if (abs == NULL) die(path, strerror(errno));
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  if (ckpt_open(abs, NULL, &c, &err) != 0) die("checkpoint", err.msg);
  cJSON *spec = plan_json ? cJSON_Parse(plan_json) : NULL;
  if (plan_json != NULL && spec == NULL) die("--plan", "not valid JSON");
  struct plan *plan = NULL;
  if (plan_build(c, spec, &plan, &err) != 0) die("plan", err.msg);
  cJSON_Delete(spec);
  uint64_t bytes = plan->payload_bytes; /* what this rank moves */
  if (only_attach) {
    int rc = attach_only(argv[0], sock, abs, device, runs, json);
    free(abs);
    plan_free(plan);
    ckpt_free(c);
    return rc;
  }

  weightd_client *cl = connect_or_die(sock);
  if (strcmp(weightd_backend(cl), "cuda") != 0) die("daemon", "the daemon does not use the cuda backend");
  char req[PATH_MAX + 128];
  /* Start from an unpinned checkpoint: evict its sets and close it (which unpins), then warm it. */
  snprintf(req, sizeof req, "{\"op\":\"evict\",\"device\":%d}", device);
  weightd_free(request_or_die(cl, req));
  snprintf(req, sizeof req, "{\"op\":\"close\",\"path\":\"%s\"}", abs);
  char *closed = NULL;
  int crc = weightd_request(cl, req, &closed, NULL, NULL);
  if (crc != 0 && crc != WEIGHTD_E_NOT_FOUND) die("close (is another client using the checkpoint?)", closed ? closed : "");
  weightd_free(closed);
  snprintf(req, sizeof req, "{\"op\":\"prefetch\",\"path\":\"%s\",\"wait\":true}", abs);
  weightd_free(request_or_die(cl, req)); /* page cache warm */

  double *v = calloc((size_t)runs, sizeof *v);
  double t_ceiling[3], t_fill[3];
  for (int i = 0; i < 3; i++) t_ceiling[i] = h2d_ceiling(device, bytes);
  for (int i = 0; i < 3; i++) t_fill[i] = fill_ceiling(c, plan, fill_threads);
  double ceiling = median(t_ceiling, 3), fill = median(t_fill, 3);

  char m_staged[16] = "?", m_direct[16] = "?";
  double staged_all[64], direct_all[64], staged_b2b_all[64], direct_b2b_all[64];
  if (runs > 64) runs = 64;
  for (int i = 0; i < runs; i++) staged_all[i] = timed_load(cl, abs, device, m_staged, sizeof m_staged, settle_ms);
  for (int i = 0; i < runs; i++) staged_b2b_all[i] = timed_load(cl, abs, device, NULL, 0, 0);
  double t0 = clock_s();
  snprintf(req, sizeof req, "{\"op\":\"prefetch\",\"path\":\"%s\",\"pin\":true,\"wait\":true}", abs);
  weightd_free(request_or_die(cl, req));
  double t_pin = clock_s() - t0;
  for (int i = 0; i < runs; i++) direct_all[i] = timed_load(cl, abs, device, m_direct, sizeof m_direct, settle_ms);
  for (int i = 0; i < runs; i++) direct_b2b_all[i] = timed_load(cl, abs, device, NULL, 0, 0);
  memcpy(v, staged_all, sizeof(double) * (size_t)runs);
  double staged = median(v, runs);
  memcpy(v, direct_all, sizeof(double) * (size_t)runs);
  double direct = median(v, runs);
  memcpy(v, staged_b2b_all, sizeof(double) * (size_t)runs);
  double staged_b2b = median(v, runs);
  memcpy(v, direct_b2b_all, sizeof(double) * (size_t)runs);
  double direct_b2b = median(v, runs);

  /* A resident set for the attach probes. */
  struct attach_figures a;
  measure_attach(argv[0], cl, sock, abs, device, runs, &a);
  uint64_t rss = daemon_rss_anon(cl);

  struct cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, device);
  double gb = (double)bytes / GiB;
  if (json) {
    printf("{\"gpu\":\"%s\",\"plan\":%s,\"checkpoint\":\"%s\",\"bytes\":%" PRIu64 ",\"runs\":%d,\"fill_threads\":%u,"
           "\"ceiling_h2d_s\":%.6f,\"fill_rate_s\":%.6f,\"staged_s\":%.6f,\"staged_method\":\"%s\","
           "\"pinned_s\":%.6f,\"pinned_method\":\"%s\",\"settle_ms\":%d,\"staged_back_to_back_s\":%.6f,"
           "\"pinned_back_to_back_s\":%.6f,\"pin_once_s\":%.6f,\"attach_context_s\":%.6f,"
           "\"attach_handles\":\"%s\",\"attach_s\":%.6f,\"attach_roundtrip_s\":%.6f,\"attach_open_s\":%.6f,"
           "\"daemon_rss_anon_bytes\":%" PRIu64 ",\"staged_runs_s\":[",
           prop.name, plan->key, abs, bytes, runs, fill_threads, ceiling, fill, staged, m_staged, direct, m_direct, settle_ms,
           staged_b2b, direct_b2b, t_pin,
           a.ctx, a.handles, a.attach, a.roundtrip, a.open, rss);
    for (int i = 0; i < runs; i++) printf("%s%.6f", i ? "," : "", staged_all[i]);
    printf("],\"pinned_runs_s\":[");
    for (int i = 0; i < runs; i++) printf("%s%.6f", i ? "," : "", direct_all[i]);
    printf("]}\n");
  } else {
    printf("weightd-bench: %s, %s, %.2f GiB (%" PRIu64 " bytes), %d runs each, medians\n", prop.name, abs, gb,
           bytes, runs);
    printf("plan: %s (%zu outputs)\n", plan->key, plan->noutputs);
    printf("%-44s %10s %9s %9s\n", "", "time", "GiB/s", "ceiling");
    printf("%-44s %8.1f ms %9.1f %8.0f%%\n", "H2D ceiling (pinned source, 64 MiB copies)", ceiling * 1e3,
           gb / ceiling, 100.0);
    char label[64];
    snprintf(label, sizeof label, "host fill (page cache -> pinned, %u thr)", fill_threads);
    printf("%-44s %8.1f ms %9.1f %8.0f%%\n", label, fill * 1e3, gb / fill, 100 * ceiling / fill);
    snprintf(label, sizeof label, "load, staged (%s)", m_staged);
    printf("%-44s %8.1f ms %9.1f %8.0f%%   (%.0f%% of fill)\n", label, staged * 1e3, gb / staged,
           100 * ceiling / staged, 100 * fill / staged);
    snprintf(label, sizeof label, "load, pinned-resident (%s)", m_direct);
    printf("%-44s %8.1f ms %9.1f %8.0f%%\n", label, direct * 1e3, gb / direct, 100 * ceiling / direct);
    printf("  (each load %d ms after evicting the previous set; right after it:)\n", settle_ms);
    printf("%-44s %8.1f ms %9.1f %8.0f%%\n", "load, staged, right after an evict", staged_b2b * 1e3,
           gb / staged_b2b, 100 * ceiling / staged_b2b);
    printf("%-44s %8.1f ms %9.1f %8.0f%%\n", "load, pinned-resident, right after an evict", direct_b2b * 1e3,
           gb / direct_b2b, 100 * ceiling / direct_b2b);
    printf("%-44s %8.1f ms   (one-time)\n", "pinning the checkpoint (prefetch --pin)", t_pin * 1e3);
    print_attach(&a);
    printf("%-44s %8.1f MiB\n", "daemon RssAnon (smaps_rollup Anonymous)", (double)rss / (1 << 20));
  }
  free(v);
  free(abs);
  plan_free(plan);
  weightd_close(cl);
  ckpt_free(c);
  return 0;
}
