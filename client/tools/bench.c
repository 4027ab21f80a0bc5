/*
 * bench.c - weightd-bench: how close a running weightd gets to the hardware.
 *
 * In one run it measures the ceilings (pinned-source host-to-device copies on
 * the chosen GPU; page cache -> pinned memory fill rates with the daemon's
 * fill thread count, for the staging schedule of each staged_strided mode),
 * then loads a checkpoint's plan through the daemon in the ways the phases
 * ask for, evicting in between so that each timed load starts with no
 * resident set and includes slab allocation, times a fresh process attaching
 * the resident set (CUDA context creation reported apart from the attach; the
 * attach split into the request/reply round trip and opening the handle
 * alone: cudaIpcOpenMemHandle for a legacy cuda_ipc set, import + reserve +
 * map + set access for a cuda_vmm set, whichever the daemon's cuda_handles
 * setting makes), and reads the daemon's anonymous RSS. Each figure is
 * printed with its ratio to the ceiling measured in this same run. Attach
 * figures name the set's tensor count (the attach reply's size no longer
 * grows with it: the table is a shared binary memfd). --attach-only is
 * --phases attach: it loads the set once and times the attaches
 * (tests/gpu/bench.sh runs it against a second daemon with the other handle
 * kind; tests/gpu/attach.sh at several tensor counts). --early adds the
 * early phase (after the others).
 *
 * weightd-bench --checkpoint DIR --socket PATH [--device N] [--runs N] [--plan JSON]
 *               [--phases LIST] [--alt-socket PATH] [--label TEXT] [--fill-threads N]
 *               [--settle-ms MS] [--no-b2b] [--ceiling-max-gib N] [--attach-only]
 *               [--early] [--json] [--json-out FILE]
 * weightd-bench --attach-probe SET --socket PATH   (the fresh process)
 * weightd-bench --early-probe DIR --socket PATH    (the fresh process, early attach)
 *
 * Phases (comma-separated; default ceiling,fill,staged,pin,pinned,attach,rss):
 *   open     the daemon's `open` of the checkpoint, closed first (every shard
 *            header validated and mapped), and here ckpt_open + plan_build
 *   ceiling  pinned-source H2D copies of the plan's bytes (at most
 *            --ceiling-max-gib of them, the rate scaled), median of 3
 *   fill     page cache -> pinned memory with --fill-threads threads, the
 *            staging schedule of each staged_strided mode (gather, rows),
 *            median of 3 each
 *   prefetch `prefetch` of the plan's bytes with wait (a plan: only its ranges)
 *   staged   --runs staged loads (the checkpoint closed first, so unpinned);
 *            with --alt-socket, loads alternate between the two daemons
 *            (each labelled by its staged_strided setting)
 *   pin      `prefetch` with pin and wait, per plan when --plan is given
 *   pinned   --runs loads after pin (direct)
 *   auto     the pin policy: the checkpoint closed, one load (staged), the
 *            wait until the daemon has pinned it by itself, then --runs loads
 *   attach   a fresh process attaches the resident set (--runs, at most 16):
 *            context, round trip (with the binary tensor table, as
 *            libweightd asks), handle open (per the set's handle kind), the
 *            whole attach through libweightd, the set's tensor count
 *   rss      the daemon's RssAnon (smaps_rollup Anonymous)
 *   early    early attach (--early): a fresh process attaches the set while
 *            it loads (the device's sets evicted first, so the load starts
 *            with the attach) and times the attach, the moment the first
 *            layer's tensors (every tensor up to the last one named
 *            *.layers.0.* in slab order) are in place and usable, and the
 *            whole load, all from the attach call (--runs, at most 16)
 *   cold     the page cache dropped (root: /proc/sys/vm/drop_caches; else
 *            posix_fadvise DONTNEED, checked with mincore): O_DIRECT 16 MiB
 *            reads of the plan's ranges with 1 and 4 threads (the disk's
 *            ceiling), then a cold load through the daemon; page cache warm
 *            again afterwards
 */
#include <cjson/cJSON.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "clock.h"
#include "msg.h"
#include "plan.h"
#include "plan_stage.h"
#include "weightd.h"
#include "wire.h"

#define GiB (1024.0 * 1024.0 * 1024.0)
#define SLOT (64u << 20)
#define MAX_RUNS 64

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The median of v[0..n) (v is left as it was). */
static double median(const double *v, int n) {
  if (n <= 0) return 0;
  double *c = malloc((size_t)n * sizeof *c);
  memcpy(c, v, (size_t)n * sizeof *c);
  qsort(c, (size_t)n, sizeof *c, cmp_double);
  double m = n % 2 ? c[n / 2] : (c[n / 2 - 1] + c[n / 2]) / 2;
  free(c);
  return m;
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

/* ---- options and the JSON result ---------------------------------------------------- */

static struct {
  const char *path, *sock, *alt_sock, *label, *json_out;
  const char *plan_json; /* --plan, or NULL for every tensor whole */
  int device, runs, settle_ms, json, b2b;
  unsigned fill_threads;
  double ceiling_max_gib;
  char phases[256];
} opt = {.runs = 5, .settle_ms = 500, .b2b = 1, .ceiling_max_gib = 16, .phases = "ceiling,fill,staged,pin,pinned,attach,rss"};

static bool phase(const char *name) {
  size_t n = strlen(name);
  for (const char *p = opt.phases; (p = strstr(p, name)) != NULL; p += n)
    if ((p == opt.phases || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return true;
  return false;
}

static cJSON *result; /* everything measured, written with --json / --json-out */
static FILE *out;     /* the table: stdout, or nowhere with --json */

static void put_num(cJSON *o, const char *k, double v) { cJSON_AddNumberToObject(o, k, v); }

static void put_runs(cJSON *o, const char *k, const double *v, int n) {
  cJSON *a = cJSON_AddArrayToObject(o, k);
  for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
}

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

/* The checkpoint mapped here, with the plan's ranges touched (page cache warm for them). */
struct mapped {
  const struct ckpt *c;
  void **maps;
  const unsigned char **data; /* per shard: its data section */
};

static void map_ckpt(const struct ckpt *c, const struct plan_range *r, size_t nr, struct mapped *m) {
  m->c = c;
  m->maps = calloc(c->nshards, sizeof *m->maps);
  m->data = calloc(c->nshards, sizeof *m->data);
  for (size_t i = 0; i < c->nshards; i++) {
    if (c->shards[i].size == 0) continue;
    m->maps[i] = mmap(NULL, c->shards[i].size, PROT_READ, MAP_SHARED, c->shards[i].fd, 0);
    if (m->maps[i] == MAP_FAILED) die("mmap", strerror(errno));
    m->data[i] = (const unsigned char *)m->maps[i] + c->shards[i].hdr->data_start;
  }
  for (size_t k = 0; k < nr; k++)
    for (uint64_t o = r[k].off; o < r[k].off + r[k].len; o += 4096) (void)((volatile char *)m->maps[r[k].shard])[o];
}

static void unmap_ckpt(struct mapped *m) {
  for (size_t i = 0; i < m->c->nshards; i++)
    if (m->maps[i] != NULL) munmap(m->maps[i], m->c->shards[i].size);
  free(m->maps);
  free(m->data);
}

struct fill_arg {
  const struct plan *plan;
  const struct plan_stage *sched;
  const unsigned char **data;
  unsigned char *pinned; /* nthreads slots of SLOT bytes */
  unsigned nthreads;
  size_t ntasks, *task_window;
  uint64_t *task_lo;
  atomic_size_t next;
  atomic_uint ids;
};

static void *fill_thread(void *arg) {
  struct fill_arg *f = arg;
  unsigned me = atomic_fetch_add(&f->ids, 1) % f->nthreads;
  unsigned char *slot = f->pinned + (size_t)me * SLOT;
  for (;;) {
    size_t t = atomic_fetch_add(&f->next, 1);
    if (t >= f->ntasks) return NULL;
    size_t w = f->task_window[t];
    uint64_t lo = f->task_lo[t], used = f->sched->windows[w].used;
    uint64_t hi = lo + (8u << 20) < used ? lo + (8u << 20) : used;
    plan_stage_fill(f->sched, f->plan, f->data, w, lo, hi, slot + lo % SLOT);
  }
}

/*
 * Page cache -> pinned memory with nthreads threads, as the staging pipeline
 * fills its slots for this plan under mode (8 MiB tasks): returns seconds,
 * and the bytes the CPU copied in *copied.
 */
static double fill_rate(const struct mapped *m, const struct plan *plan, enum plan_strided mode, unsigned nthreads,
                        uint64_t *copied) {
  struct plan_stage *sched = NULL;
  struct wd_error err = {0};
  if (plan_stage_build(plan, SLOT, mode, &sched, &err) != 0) die("staging schedule", err.msg);
  struct fill_arg f = {.plan = plan, .sched = sched, .data = m->data, .nthreads = nthreads};
  for (size_t w = 0; w < sched->nwindows; w++) f.ntasks += (size_t)((sched->windows[w].used + (8u << 20) - 1) >> 23);
  f.task_window = malloc((f.ntasks ? f.ntasks : 1) * sizeof *f.task_window);
  f.task_lo = malloc((f.ntasks ? f.ntasks : 1) * sizeof *f.task_lo);
  size_t t = 0;
  for (size_t w = 0; w < sched->nwindows; w++)
    for (uint64_t lo = 0; lo < sched->windows[w].used; lo += 8u << 20, t++) {
      f.task_window[t] = w;
      f.task_lo[t] = lo;
    }
  CUDA_OK(cudaHostAlloc((void **)&f.pinned, (size_t)nthreads * SLOT, cudaHostAllocPortable));
  memset(f.pinned, 0, (size_t)nthreads * SLOT);
  atomic_init(&f.next, 0);
  atomic_init(&f.ids, 0);
  pthread_t *th = calloc(nthreads, sizeof *th);
  double t0 = clock_s();
  for (unsigned i = 0; i < nthreads; i++) pthread_create(&th[i], NULL, fill_thread, &f);
  for (unsigned i = 0; i < nthreads; i++) pthread_join(th[i], NULL);
  double dt = clock_s() - t0;
  free(th);
  cudaFreeHost(f.pinned);
  *copied = sched->staged_bytes;
  free(f.task_window);
  free(f.task_lo);
  plan_stage_free(sched);
  return dt;
}

/* ---- the daemons ------------------------------------------------------------------ */

struct daemon_conn {
  weightd_client *c;
  const char *sock;
  char strided[16], pin[16], method[16]; /* its settings, from status */
  int pid;
};

static struct daemon_conn daemons[2];
static int ndaemons;

static weightd_client *connect_or_die(const char *sock) {
  weightd_client *c = NULL;
  if (weightd_connect(sock, &c) != 0) die("connect", weightd_last_error(c));
  return c;
}

/* Sends one request; returns the parsed reply (cJSON_Delete it). */
static cJSON *request_json(weightd_client *c, const char *json, int *rc) {
  char *r = NULL;
  int e = weightd_request(c, json, &r, NULL, NULL);
  if (rc != NULL) *rc = e;
  else if (e != 0) die(json, r ? r : weightd_last_error(c));
  cJSON *j = r ? cJSON_Parse(r) : NULL;
  weightd_free(r);
  return j;
}

static void request_or_die(weightd_client *c, const char *json) { cJSON_Delete(request_json(c, json, NULL)); }

static const char *jstr(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsString(v) ? v->valuestring : "";
}

static double jnum(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

static void daemon_attach(struct daemon_conn *d, const char *sock) {
  d->sock = sock;
  d->c = connect_or_die(sock);
  if (strcmp(weightd_backend(d->c), "cuda") != 0) die(sock, "the daemon does not use the cuda backend");
  cJSON *st = request_json(d->c, "{\"op\":\"status\"}", NULL);
  const cJSON *dm = cJSON_GetObjectItemCaseSensitive(st, "daemon");
  snprintf(d->strided, sizeof d->strided, "%s", jstr(dm, "staged_strided"));
  snprintf(d->pin, sizeof d->pin, "%s", jstr(dm, "pin"));
  snprintf(d->method, sizeof d->method, "%s", jstr(dm, "load_method"));
  d->pid = (int)jnum(dm, "pid");
  cJSON_Delete(st);
}

/* The checkpoint's entry in the daemon's status (a new object), or NULL when it is not open. */
static cJSON *ckpt_status(struct daemon_conn *d, const char *abs) {
  cJSON *st = request_json(d->c, "{\"op\":\"status\"}", NULL), *found = NULL;
  const cJSON *e;
  cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(st, "checkpoints"))
    if (strcmp(jstr(e, "path"), abs) == 0) found = cJSON_Duplicate(e, 1);
  cJSON_Delete(st);
  return found;
}

static void evict_all(int device) {
  char req[96];
  snprintf(req, sizeof req, "{\"op\":\"evict\",\"device\":%d}", device);
  for (int i = 0; i < ndaemons; i++) request_or_die(daemons[i].c, req);
}

/* Closes the checkpoint in every daemon (which unpins it); its sets are evicted first. */
static void close_all(const char *abs, int device) {
  evict_all(device);
  char req[PATH_MAX + 64];
  snprintf(req, sizeof req, "{\"op\":\"close\",\"path\":\"%s\"}", abs);
  for (int i = 0; i < ndaemons; i++) {
    int rc;
    cJSON *r = request_json(daemons[i].c, req, &rc);
    if (rc != 0 && rc != WEIGHTD_E_NOT_FOUND) die("close (is another client using the checkpoint?)", jstr(r, "error"));
    cJSON_Delete(r);
  }
}

/* A request object with op, path and (when given) the plan. */
static char *plan_request(const char *op, const char *abs, const char *extra) {
  char *s = NULL;
  if (asprintf(&s, "{\"op\":\"%s\",\"path\":\"%s\"%s%s%s}", op, abs, opt.plan_json ? ",\"plan\":" : "",
               opt.plan_json ? opt.plan_json : "", extra ? extra : "") < 0)
    die("asprintf", "out of memory");
  return s;
}

/*
 * One timed load from request to result, slab allocation included, after
 * evicting every set of the device (in every daemon) and waiting settle_ms:
 * the driver reclaims (scrubs) freed device memory in the background with the
 * copy engines, which slows copies that start right after an eviction
 * (tests/gpu/dma_study.c). The method the daemon used goes to method.
 */
static double timed_load(struct daemon_conn *d, const char *abs, char *method, size_t mlen, int settle_ms) {
  evict_all(opt.device);
  if (settle_ms > 0) usleep((useconds_t)settle_ms * 1000);
  char *req = NULL, extra[32];
  snprintf(extra, sizeof extra, ",\"device\":%d", opt.device);
  req = plan_request("load", abs, extra);
  double t0 = clock_s();
  cJSON *r = request_json(d->c, req, NULL);
  double dt = clock_s() - t0;
  if (method != NULL) snprintf(method, mlen, "%s", jstr(r, "method"));
  cJSON_Delete(r);
  free(req);
  return dt;
}

static uint64_t daemon_rss_anon(int pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/smaps_rollup", pid);
  FILE *f = fopen(path, "r");
  uint64_t kb = 0;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "Anonymous:", 10) == 0) kb = strtoull(line + 10, NULL, 10);
  if (f) fclose(f);
  return kb * 1024;
}

/* ---- attach from a fresh process ------------------------------------------------------- */

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
 * "ctx_s attach_s roundtrip_s open_s kind tensors": the round trip and the open split
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
  /* The binary tensor table, as libweightd asks for it: the reply's size does not grow with the tensors. */
  cJSON_Delete(raw_call(raw,
                        "{\"op\":\"hello\",\"id\":1,\"protocol\":1,\"handles\":[\"fd\",\"cuda_ipc\",\"cuda_vmm\"],"
                        "\"features\":[\"tensor_table\"]}",
                        &f));
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
  const cJSON *fdi = cJSON_GetObjectItemCaseSensitive(h, "fd_index");
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
    int i = cJSON_IsNumber(fdi) ? fdi->valueint : 0;
    if (i < 0 || (size_t)i >= f.nfds) die("attach", "a cuda_vmm reply without its descriptor");
    t_open = vmm_open_time(f.fds[i], (uint64_t)hbytes->valuedouble, device);
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
  size_t ntensors = weightd_set_tensor_count(s);
  weightd_tensor t;
  if (weightd_set_tensor(s, ntensors / 2, &t) != 0 || t.data == NULL) die("attach", "no usable pointer");
  double t_attach = clock_s() - t0;
  /* Touch the memory through the pointer to show it is usable. */
  unsigned char byte;
  CUDA_OK(cudaMemcpy(&byte, t.data, 1, cudaMemcpyDeviceToHost));
  printf("%.6f %.6f %.6f %.6f %s %zu\n", t_ctx, t_attach, t_rt, t_open, kind_name, ntensors);
  weightd_release(s);
  weightd_close(c);
  return 0;
}

/*
 * Runs this program as a fresh process, `self flag arg --socket S --device D
 * [--plan P]`, and reads what it prints into buf (NUL-terminated; empty when
 * it printed nothing).
 */
static void run_probe(const char *self, const char *flag, const char *arg, const char *sock, int device, char *buf,
                      size_t len) {
  int p[2];
  if (pipe(p) != 0) die("pipe", strerror(errno));
  pid_t pid = fork();
  if (pid == 0) {
    dup2(p[1], 1);
    char dev[16];
    snprintf(dev, sizeof dev, "%d", device);
    if (opt.plan_json != NULL)
      execl(self, self, flag, arg, "--socket", sock, "--device", dev, "--plan", opt.plan_json, (char *)NULL);
    else
      execl(self, self, flag, arg, "--socket", sock, "--device", dev, (char *)NULL);
    _exit(127);
  }
  close(p[1]);
  size_t got = 0;
  for (;;) { /* until the probe closes its end: one line, perhaps in pieces */
    ssize_t n = read(p[0], buf + got, len - 1 - got);
    if (n > 0 && (got += (size_t)n) < len - 1) continue;
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  buf[got] = '\0';
  close(p[0]);
  int st;
  waitpid(pid, &st, 0);
}

static void probe_attach(const char *self, const char *sock, const char *set, int device, double *ctx,
                         double *att, double *rt, double *opn, char kind[16], size_t *ntensors) {
  char buf[160];
  run_probe(self, "--attach-probe", set, sock, device, buf, sizeof buf);
  if (sscanf(buf, "%lf %lf %lf %lf %15s %zu", ctx, att, rt, opn, kind, ntensors) != 6) die("attach probe", "no result");
}

/* ---- early attach ------------------------------------------------------------------- */

/*
 * The fresh process of an early attach: a context, then attach the
 * checkpoint early (the parent evicted its set, so the load starts with
 * the attach); prints "ctx_s attach_s first_layer_s all_s tensors
 * first_layer_tensors", every time from the attach call.
 */
static int early_probe(const char *path, const char *sock, int device) {
  double t0 = clock_s();
  CUDA_OK(cudaSetDevice(device));
  CUDA_OK(cudaFree(0));
  double t_ctx = clock_s() - t0;
  weightd_client *c = connect_or_die(sock);
  char dev[16];
  snprintf(dev, sizeof dev, "%d", device);
  struct weightd_load_options o = {
      .struct_size = sizeof o, .device = dev, .plan_json = opt.plan_json, .flags = WEIGHTD_ATTACH_EARLY};
  weightd_set *s = NULL;
  t0 = clock_s();
  if (weightd_attach_path(c, path, &o, &s) != 0) die("early attach", weightd_last_error(c));
  double t_attach = clock_s() - t0;
  size_t n = weightd_set_tensor_count(s), last = 0;
  weightd_tensor t;
  for (size_t i = 0; i < n; i++)
    if (weightd_set_tensor(s, i, &t) == 0 && strstr(t.name, ".layers.0.") != NULL) last = i;
  int rc = weightd_set_wait_tensor(s, last, 600000);
  if (rc != 0) die("waiting for the first layer", weightd_strerror(rc));
  weightd_set_tensor(s, last, &t);
  unsigned char byte;
  CUDA_OK(cudaMemcpy(&byte, t.data, 1, cudaMemcpyDeviceToHost)); /* usable: a read through its pointer */
  double t_first = clock_s() - t0;
  if ((rc = weightd_set_wait(s, NULL, 600000)) != 0) die("waiting for the set", weightd_strerror(rc));
  double t_all = clock_s() - t0;
  printf("%.6f %.6f %.6f %.6f %zu %zu\n", t_ctx, t_attach, t_first, t_all, n, last + 1);
  weightd_release(s);
  weightd_close(c);
  return 0;
}

/* The early phase: evicts the device's sets, then times fresh processes attaching the checkpoint early (medians). */
static void phase_early(const char *self, const char *abs) {
  double att[16], first[16], all[16], ctx;
  size_t tensors = 0, first_tensors = 0;
  int probes = opt.runs < 16 ? opt.runs : 16;
  for (int i = 0; i < probes; i++) {
    evict_all(opt.device);
    if (opt.settle_ms > 0) usleep((useconds_t)opt.settle_ms * 1000);
    char buf[256];
    run_probe(self, "--early-probe", abs, daemons[0].sock, opt.device, buf, sizeof buf);
    if (sscanf(buf, "%lf %lf %lf %lf %zu %zu", &ctx, &att[i], &first[i], &all[i], &tensors, &first_tensors) != 6)
      die("early probe", "no result");
  }
  double a = median(att, probes), f = median(first, probes), w = median(all, probes);
  put_num(result, "early_attach_s", a);
  put_num(result, "early_first_layer_s", f);
  put_num(result, "early_all_s", w);
  put_num(result, "early_tensors", (double)tensors);
  put_num(result, "early_first_layer_tensors", (double)first_tensors);
  put_num(result, "early_first_layer_ratio", w > 0 ? f / w : 0);
  put_num(result, "early_probes", probes);
  fprintf(out, "%-46s %8.3f ms   (the set still loading; median of %d)\n", "early attach: attach returns", a * 1e3,
          probes);
  char label[64];
  snprintf(label, sizeof label, "early attach: first layer usable (%zu tensors)", first_tensors);
  fprintf(out, "%-46s %8.1f ms   (%.1f%% of the whole load; target <= 10%%)\n", label, f * 1e3,
          w > 0 ? 100 * f / w : 0);
  snprintf(label, sizeof label, "early attach: whole set ready (%zu tensors)", tensors);
  fprintf(out, "%-46s %8.1f ms   (from the attach call: plan, allocation and load)\n", label, w * 1e3);
}

/* ---- the cold path ------------------------------------------------------------------------- */

/* Fraction of the ranges' pages in the page cache. */
static double cached_fraction(const struct ckpt *c, const struct plan_range *r, size_t nr) {
  uint64_t in = 0, all = 0;
  unsigned char *vec = malloc(1 << 16);
  for (size_t k = 0; k < nr; k++) {
    int fd = c->shards[r[k].shard].fd;
    for (uint64_t off = r[k].off; off < r[k].off + r[k].len; off += (1ull << 16) * 4096) {
      uint64_t len = r[k].off + r[k].len - off < (1ull << 16) * 4096 ? r[k].off + r[k].len - off : (1ull << 16) * 4096;
      void *p = mmap(NULL, (size_t)len, PROT_READ, MAP_SHARED, fd, (off_t)off);
      if (p == MAP_FAILED) continue;
      size_t pages = (size_t)((len + 4095) / 4096);
      if (mincore(p, (size_t)len, vec) == 0)
        for (size_t i = 0; i < pages; i++) in += vec[i] & 1;
      all += pages;
      munmap(p, (size_t)len);
    }
  }
  free(vec);
  return all ? (double)in / (double)all : 0;
}

/* Drops the page cache: all of it as root, else the checkpoint's files (DONTNEED). Returns what remains cached. */
static double drop_cache(const struct ckpt *c, const struct plan_range *r, size_t nr, const char **how) {
  sync();
  int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (fd >= 0 && write(fd, "3\n", 2) == 2) {
    *how = "drop_caches";
  } else {
    *how = "fadvise";
    for (size_t i = 0; i < c->nshards; i++) posix_fadvise(c->shards[i].fd, 0, 0, POSIX_FADV_DONTNEED);
  }
  if (fd >= 0) close(fd);
  return cached_fraction(c, r, nr);
}

struct odirect_arg {
  const struct ckpt *c;
  const struct plan_range *r;
  size_t nr;
  atomic_size_t next; /* 16 MiB task counter over the ranges */
  size_t *task_range;
  uint64_t *task_off;
  size_t ntasks;
  atomic_uint_fast64_t bytes;
  int failed;
};

static void *odirect_thread(void *arg) {
  struct odirect_arg *a = arg;
  void *buf = NULL;
  if (posix_memalign(&buf, 4096, 16u << 20) != 0) return NULL;
  int *fds = calloc(a->c->nshards, sizeof *fds);
  for (size_t i = 0; i < a->c->nshards; i++) fds[i] = -1;
  for (;;) {
    size_t t = atomic_fetch_add(&a->next, 1);
    if (t >= a->ntasks) break;
    const struct plan_range *g = &a->r[a->task_range[t]];
    if (fds[g->shard] < 0) fds[g->shard] = open(a->c->shards[g->shard].real, O_RDONLY | O_DIRECT);
    if (fds[g->shard] < 0) {
      a->failed = 1;
      break;
    }
    uint64_t off = a->task_off[t], end = g->off + g->len;
    size_t n = end - off < (16u << 20) ? (size_t)(end - off) : (16u << 20);
    size_t want = (n + 4095) & ~(size_t)4095; /* O_DIRECT wants whole blocks; a short read at EOF is fine */
    ssize_t got = pread(fds[g->shard], buf, want, (off_t)off);
    if (got < 0) {
      a->failed = 1;
      break;
    }
    atomic_fetch_add(&a->bytes, (uint64_t)(got < (ssize_t)n ? got : (ssize_t)n));
  }
  for (size_t i = 0; i < a->c->nshards; i++)
    if (fds[i] >= 0) close(fds[i]);
  free(fds);
  free(buf);
  return NULL;
}

/* Reads the ranges with O_DIRECT in 16 MiB reads on nthreads threads: seconds, bytes in *bytes (0 on failure). */
static double odirect_read(const struct ckpt *c, const struct plan_range *r, size_t nr, unsigned nthreads,
                           uint64_t *bytes) {
  struct odirect_arg a = {.c = c, .r = r, .nr = nr};
  for (size_t k = 0; k < nr; k++) a.ntasks += (size_t)((r[k].len + (16u << 20) - 1) >> 24);
  a.task_range = malloc((a.ntasks ? a.ntasks : 1) * sizeof *a.task_range);
  a.task_off = malloc((a.ntasks ? a.ntasks : 1) * sizeof *a.task_off);
  size_t t = 0;
  for (size_t k = 0; k < nr; k++)
    for (uint64_t off = r[k].off; off < r[k].off + r[k].len; off += 16u << 20, t++) {
      a.task_range[t] = k;
      a.task_off[t] = off;
    }
  atomic_init(&a.next, 0);
  atomic_init(&a.bytes, 0);
  pthread_t th[16];
  if (nthreads > 16) nthreads = 16;
  double t0 = clock_s();
  for (unsigned i = 0; i < nthreads; i++) pthread_create(&th[i], NULL, odirect_thread, &a);
  for (unsigned i = 0; i < nthreads; i++) pthread_join(th[i], NULL);
  double dt = clock_s() - t0;
  *bytes = a.failed ? 0 : atomic_load(&a.bytes);
  free(a.task_range);
  free(a.task_off);
  return dt;
}

/* ---- printing -------------------------------------------------------------------------------- */

static double ceiling_s; /* for the plan's bytes */
static double gib;       /* the plan's payload in GiB */

static void row(const char *label, double s) {
  fprintf(out, "%-46s %8.1f ms %9.1f %8.0f%%\n", label, s * 1e3, gib / s, ceiling_s > 0 ? 100 * ceiling_s / s : 0);
}

static void row_plain(const char *label, double s, const char *note) {
  fprintf(out, "%-46s %8.1f ms   %s\n", label, s * 1e3, note);
}

/* ---- phases ---------------------------------------------------------------------------------- */

/* --runs loads through daemon d (and, alternating, its partner), recorded under key. */
static void run_loads(const char *abs, const char *key, const char *what, int with_alt) {
  int nd = with_alt && ndaemons > 1 ? 2 : 1, runs = opt.runs;
  double v[2][MAX_RUNS], b2b[2][MAX_RUNS];
  char method[2][16] = {"?", "?"};
  for (int i = 0; i < runs; i++)
    for (int k = 0; k < nd; k++) v[k][i] = timed_load(&daemons[k], abs, method[k], sizeof method[k], opt.settle_ms);
  if (opt.b2b)
    for (int i = 0; i < runs; i++)
      for (int k = 0; k < nd; k++) b2b[k][i] = timed_load(&daemons[k], abs, NULL, 0, 0);
  for (int k = 0; k < nd; k++) {
    char name[96], label[96];
    if (nd > 1) snprintf(name, sizeof name, "%s_%s", key, daemons[k].strided);
    else snprintf(name, sizeof name, "%s", key);
    cJSON *o = cJSON_AddObjectToObject(result, name);
    put_num(o, "median_s", median(v[k], runs));
    put_runs(o, "runs_s", v[k], runs);
    cJSON_AddStringToObject(o, "method", method[k]);
    cJSON_AddStringToObject(o, "staged_strided", daemons[k].strided);
    cJSON_AddStringToObject(o, "pin", daemons[k].pin);
    if (opt.b2b) {
      put_num(o, "back_to_back_median_s", median(b2b[k], runs));
      put_runs(o, "back_to_back_runs_s", b2b[k], runs);
    }
    if (strcmp(key, "staged") == 0 && strcmp(method[k], "staged") != 0)
      fprintf(out, "  (note: these loads went %s: the daemon pins by itself; run it with --set pin=off)\n",
              method[k]);
    snprintf(label, sizeof label, "load, %s (%s%s%s)", what, method[k], nd > 1 ? ", " : "",
             nd > 1 ? daemons[k].strided : "");
    row(label, median(v[k], runs));
    if (opt.b2b) {
      snprintf(label, sizeof label, "  same, right after an evict");
      row(label, median(b2b[k], runs));
    }
  }
}

/* Waits until the daemon has pinned (part of) the checkpoint by itself; seconds, or -1 after a minute. */
static double wait_auto_pin(struct daemon_conn *d, const char *abs, uint64_t *pinned) {
  double t0 = clock_s();
  for (;;) {
    cJSON *e = ckpt_status(d, abs);
    bool pinning = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "pinning"));
    *pinned = (uint64_t)jnum(e, "pinned_bytes");
    cJSON_Delete(e);
    if (!pinning && *pinned > 0) return clock_s() - t0;
    if (clock_s() - t0 > 60) return -1;
    usleep(10000);
  }
}

static void phase_auto(const char *abs) {
  struct daemon_conn *d = &daemons[0];
  if (strcmp(d->pin, "off") == 0) die("auto", "the daemon runs with pin off");
  close_all(abs, opt.device);
  char m1[16] = "?", m2[16] = "?";
  double first = timed_load(d, abs, m1, sizeof m1, opt.settle_ms);
  uint64_t pinned = 0;
  double wait = wait_auto_pin(d, abs, &pinned);
  double v[MAX_RUNS];
  for (int i = 0; i < opt.runs; i++) v[i] = timed_load(d, abs, m2, sizeof m2, opt.settle_ms);
  cJSON *o = cJSON_AddObjectToObject(result, "auto");
  cJSON_AddStringToObject(o, "pin", d->pin);
  put_num(o, "first_s", first);
  cJSON_AddStringToObject(o, "first_method", m1);
  put_num(o, "pinned_after_s", wait);
  put_num(o, "pinned_bytes", (double)pinned);
  put_num(o, "later_median_s", median(v, opt.runs));
  put_runs(o, "later_runs_s", v, opt.runs);
  cJSON_AddStringToObject(o, "later_method", m2);
  char label[96];
  snprintf(label, sizeof label, "pin %s: first load (%s)", d->pin, m1);
  row(label, first);
  char note[96];
  snprintf(note, sizeof note, "(%.2f GiB pinned by the daemon itself)", (double)pinned / GiB);
  row_plain("  then pinned in the background, after", wait, wait < 0 ? "(not within 60 s)" : note);
  snprintf(label, sizeof label, "pin %s: later loads (%s)", d->pin, m2);
  row(label, median(v, opt.runs));
}

static void phase_cold(const char *abs, const struct ckpt *c, const struct plan *plan, const struct plan_range *r,
                       size_t nr, uint64_t read_bytes) {
  cJSON *o = cJSON_AddObjectToObject(result, "cold");
  close_all(abs, opt.device); /* the daemon's mappings hold no page then */
  const char *how = "?";
  double left = drop_cache(c, r, nr, &how);
  cJSON_AddStringToObject(o, "dropped_by", how);
  put_num(o, "cached_after_drop", left);
  if (left > 0.05) {
    fprintf(out, "%-46s skipped: %.0f%% of the checkpoint stayed in the page cache (%s)\n", "cold path", 100 * left, how);
    cJSON_AddStringToObject(o, "skipped", "page cache not dropped");
    return;
  }
  double best = 0;
  for (unsigned th = 1; th <= 4; th *= 4) {
    uint64_t bytes = 0;
    if (th > 1) drop_cache(c, r, nr, &how);
    double s = odirect_read(c, r, nr, th, &bytes);
    char k[32], label[96];
    snprintf(k, sizeof k, "odirect_%u_threads_gbps", th);
    double gbps = bytes ? (double)bytes / 1e9 / s : 0;
    put_num(o, k, gbps);
    if (gbps > best) best = gbps;
    snprintf(label, sizeof label, "disk: O_DIRECT 16 MiB reads, %u thread%s", th, th == 1 ? "" : "s");
    fprintf(out, "%-46s %8.1f ms %7.2f GB/s\n", label, s * 1e3, gbps);
  }
  put_num(o, "odirect_best_gbps", best);
  drop_cache(c, r, nr, &how);
  char m[16] = "?";
  double s = timed_load(&daemons[0], abs, m, sizeof m, 0);
  double gbps = (double)read_bytes / 1e9 / s;
  put_num(o, "load_s", s);
  put_num(o, "load_gbps", gbps);
  cJSON_AddStringToObject(o, "load_method", m);
  put_num(o, "of_odirect", best > 0 ? gbps / best : 0);
  char label[96];
  snprintf(label, sizeof label, "cold load through the daemon (%s)", m);
  fprintf(out, "%-46s %8.1f ms %7.2f GB/s  %5.0f%% of O_DIRECT\n", label, s * 1e3, gbps, best > 0 ? 100 * gbps / best : 0);
  (void)plan;
  /* Warm again for whatever runs next. */
  char *req = plan_request("prefetch", abs, ",\"wait\":true");
  request_or_die(daemons[0].c, req);
  free(req);
}

int main(int argc, char **argv) {
  const char *probe = NULL, *eprobe = NULL;
  int attach_only = 0, early = 0;
  opt.fill_threads = (unsigned)sysconf(_SC_NPROCESSORS_ONLN);
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--json") == 0) opt.json = 1;
    else if (strcmp(argv[i], "--no-b2b") == 0) opt.b2b = 0;
    else if (strcmp(argv[i], "--attach-only") == 0) attach_only = 1;
    else if (strcmp(argv[i], "--early") == 0) early = 1;
    else if (v && strcmp(argv[i], "--checkpoint") == 0) opt.path = argv[++i];
    else if (v && strcmp(argv[i], "--socket") == 0) opt.sock = argv[++i];
    else if (v && strcmp(argv[i], "--alt-socket") == 0) opt.alt_sock = argv[++i];
    else if (v && strcmp(argv[i], "--label") == 0) opt.label = argv[++i];
    else if (v && strcmp(argv[i], "--json-out") == 0) opt.json_out = argv[++i];
    else if (v && strcmp(argv[i], "--device") == 0) opt.device = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--runs") == 0) opt.runs = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--settle-ms") == 0) opt.settle_ms = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--plan") == 0) opt.plan_json = argv[++i];
    else if (v && strcmp(argv[i], "--phases") == 0) snprintf(opt.phases, sizeof opt.phases, "%s", argv[++i]);
    else if (v && strcmp(argv[i], "--ceiling-max-gib") == 0) opt.ceiling_max_gib = atof(argv[++i]);
    else if (v && strcmp(argv[i], "--fill-threads") == 0) opt.fill_threads = (unsigned)atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--attach-probe") == 0) probe = argv[++i];
    else if (v && strcmp(argv[i], "--early-probe") == 0) eprobe = argv[++i];
    else {
      fprintf(stderr,
              "usage: weightd-bench --checkpoint DIR --socket PATH [--device N] [--runs N] [--plan JSON]\n"
              "                     [--phases LIST] [--alt-socket PATH] [--label TEXT] [--fill-threads N]\n"
              "                     [--settle-ms MS] [--no-b2b] [--ceiling-max-gib N] [--attach-only]\n"
              "                     [--early] [--json] [--json-out FILE]\n");
      return 2;
    }
  }
  if (probe) return attach_probe(probe, opt.sock, opt.device);
  if (eprobe) return early_probe(eprobe, opt.sock, opt.device);
  /* Only the attach figures: for a daemon with the other cuda_handles (tests/gpu/bench.sh). */
  if (attach_only) snprintf(opt.phases, sizeof opt.phases, "attach");
  if (early && !phase("early")) {
    size_t n = strlen(opt.phases);
    snprintf(opt.phases + n, sizeof opt.phases - n, "%searly", n ? "," : "");
  }
  if (opt.path == NULL || opt.sock == NULL || opt.runs < 1 || opt.fill_threads < 1) {
    fprintf(stderr, "weightd-bench: --checkpoint DIR and --socket PATH are required\n");
    return 2;
  }
  if (opt.runs > MAX_RUNS) opt.runs = MAX_RUNS;
  out = opt.json ? fopen("/dev/null", "w") : stdout;
  if (out == NULL) die("/dev/null", strerror(errno));

  char *abs = realpath(opt.path, NULL);
  if (abs == NULL) die(opt.path, strerror(errno));
  result = cJSON_CreateObject();
  if (opt.label) cJSON_AddStringToObject(result, "label", opt.label);
  cJSON_AddStringToObject(result, "checkpoint", abs);
  daemon_attach(&daemons[ndaemons++], opt.sock);
  if (opt.alt_sock) daemon_attach(&daemons[ndaemons++], opt.alt_sock);

  /* Here: open the checkpoint and build the plan (timed), and list its byte ranges. */
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  double t0 = clock_s();
  if (ckpt_open(abs, NULL, &c, &err) != 0) die("checkpoint", err.msg);
  double t_ckpt_open = clock_s() - t0;
  cJSON *spec = opt.plan_json ? cJSON_Parse(opt.plan_json) : NULL;
  if (opt.plan_json != NULL && spec == NULL) die("--plan", "not valid JSON");
  struct plan *plan = NULL;
  t0 = clock_s();
  if (plan_build(c, spec, &plan, &err) != 0) die("plan", err.msg);
  double t_plan = clock_s() - t0;
  cJSON_Delete(spec);
  struct plan_range *ranges = NULL;
  size_t nranges = 0;
  if (plan_ranges(plan, c, 4096, 0, &ranges, &nranges, &err) != 0) die("plan ranges", err.msg);
  uint64_t bytes = plan->payload_bytes, read_bytes = 0;
  for (size_t i = 0; i < plan->noutputs; i++)
    for (size_t k = 0; k < plan->outputs[i].npieces; k++)
      if (plan->outputs[i].pieces[k].src != NULL)
        read_bytes += plan->outputs[i].pieces[k].width * plan->outputs[i].pieces[k].height;
  gib = (double)bytes / GiB;

  struct cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, opt.device));
  cJSON_AddStringToObject(result, "gpu", prop.name);
  cJSON_AddItemToObject(result, "plan", cJSON_Parse(plan->key));
  put_num(result, "bytes", (double)bytes);
  put_num(result, "outputs", (double)plan->noutputs);
  put_num(result, "shards", (double)c->nshards);
  put_num(result, "tensors", (double)c->ntensors);
  put_num(result, "runs", opt.runs);
  put_num(result, "fill_threads", opt.fill_threads);
  put_num(result, "settle_ms", opt.settle_ms);
  cJSON *ds = cJSON_AddArrayToObject(result, "daemons");
  for (int i = 0; i < ndaemons; i++) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "staged_strided", daemons[i].strided);
    cJSON_AddStringToObject(o, "pin", daemons[i].pin);
    cJSON_AddStringToObject(o, "load_method", daemons[i].method);
    cJSON_AddItemToArray(ds, o);
  }
  fprintf(out, "weightd-bench: %s, %s, %.2f GiB (%" PRIu64 " bytes), %zu outputs, %d runs each, medians%s%s\n", prop.name,
         abs, gib, bytes, plan->noutputs, opt.runs, opt.label ? "; " : "", opt.label ? opt.label : "");
  fprintf(out, "plan: %s\n", plan->key);
  fprintf(out, "%-46s %11s %9s %9s\n", "", "time", "GiB/s", "ceiling");

  if (phase("open")) {
    close_all(abs, opt.device);
    char req[PATH_MAX + 64];
    snprintf(req, sizeof req, "{\"op\":\"open\",\"path\":\"%s\"}", abs);
    t0 = clock_s();
    request_or_die(daemons[0].c, req);
    double t_open = clock_s() - t0;
    put_num(result, "daemon_open_s", t_open);
    put_num(result, "ckpt_open_s", t_ckpt_open);
    put_num(result, "plan_build_s", t_plan);
    char note[96];
    snprintf(note, sizeof note, "(%zu shards, %zu tensors; request to reply)", c->nshards, c->ntensors);
    row_plain("open in the daemon (headers validated, mapped)", t_open, note);
    row_plain("  same here (ckpt_open)", t_ckpt_open, "");
    snprintf(note, sizeof note, "(%zu outputs)", plan->noutputs);
    row_plain("  plan_build here", t_plan, note);
  }

  if (phase("ceiling")) {
    uint64_t cb = bytes, cap = (uint64_t)(opt.ceiling_max_gib * GiB);
    if (cap > 0 && cb > cap) cb = cap;
    double v[3];
    for (int i = 0; i < 3; i++) v[i] = h2d_ceiling(opt.device, cb);
    ceiling_s = median(v, 3) * ((double)bytes / (double)cb);
    put_num(result, "ceiling_h2d_s", ceiling_s);
    put_num(result, "ceiling_measured_bytes", (double)cb);
    put_runs(result, "ceiling_runs_s", v, 3);
    row(cb < bytes ? "H2D ceiling (pinned source, 64 MiB copies; scaled)" : "H2D ceiling (pinned source, 64 MiB copies)",
        ceiling_s);
  }

  if (phase("prefetch")) {
    char *req = plan_request("prefetch", abs, ",\"wait\":true");
    t0 = clock_s();
    cJSON *r = request_json(daemons[0].c, req, NULL);
    double s = clock_s() - t0;
    free(req);
    put_num(result, "prefetch_s", s);
    put_num(result, "prefetch_read_s", jnum(r, "read_seconds"));
    cJSON_Delete(r);
    row_plain("prefetch of the plan's bytes (wait)", s, "(page cache warm for it)");
  }

  if (phase("fill")) {
    struct mapped m;
    map_ckpt(c, ranges, nranges, &m);
    static const struct {
      enum plan_strided mode;
      const char *name;
    } modes[] = {{PLAN_STRIDED_GATHER, "gather"}, {PLAN_STRIDED_ROWS, "rows"}};
    for (size_t k = 0; k < 2; k++) {
      double v[3];
      uint64_t copied = 0;
      for (int i = 0; i < 3; i++) v[i] = fill_rate(&m, plan, modes[k].mode, opt.fill_threads, &copied);
      char key[48], label[96];
      snprintf(key, sizeof key, "fill_%s_s", modes[k].name);
      put_num(result, key, median(v, 3));
      snprintf(key, sizeof key, "fill_%s_copied_bytes", modes[k].name);
      put_num(result, key, (double)copied);
      snprintf(label, sizeof label, "host fill, %s (%u thr, %.2f GiB copied)", modes[k].name, opt.fill_threads,
               (double)copied / GiB);
      row(label, median(v, 3));
    }
    unmap_ckpt(&m);
  }

  if (phase("staged")) {
    close_all(abs, opt.device);
    char *req = plan_request("prefetch", abs, ",\"wait\":true");
    for (int i = 0; i < ndaemons; i++) request_or_die(daemons[i].c, req); /* page cache warm, nothing pinned */
    free(req);
    run_loads(abs, "staged", "staged", 1);
  }

  if (phase("pin")) {
    char *req = plan_request("prefetch", abs, ",\"pin\":true,\"wait\":true");
    t0 = clock_s();
    cJSON *r = request_json(daemons[0].c, req, NULL);
    double s = clock_s() - t0;
    free(req);
    put_num(result, "pin_once_s", s);
    put_num(result, "pin_registered_bytes", jnum(r, "registered_bytes"));
    put_num(result, "pin_seconds_daemon", jnum(r, "pin_seconds"));
    char note[96];
    snprintf(note, sizeof note, "(one-time; %.2f GiB registered%s)", jnum(r, "registered_bytes") / GiB,
             opt.plan_json ? ", this plan's ranges" : "");
    cJSON_Delete(r);
    row_plain("pinning (prefetch --pin --wait)", s, note);
  }

  if (phase("pinned")) run_loads(abs, "pinned", "pinned-resident", 0);

  if (phase("auto")) phase_auto(abs);

  if (phase("attach") || phase("rss")) {
    char *req = NULL, extra[32];
    snprintf(extra, sizeof extra, ",\"device\":%d", opt.device);
    req = plan_request("load", abs, extra);
    cJSON *r = request_json(daemons[0].c, req, NULL);
    free(req);
    char set[32];
    snprintf(set, sizeof set, "%s", jstr(r, "set"));
    cJSON_Delete(r);
    if (phase("attach")) {
      double ctx_all[16], att_all[16], rt_all[16], open_all[16];
      char handles[16] = "?"; /* the set's handle kind: cuda_vmm or cuda_ipc, per the daemon's cuda_handles */
      size_t tensors = 0;
      int probes = opt.runs < 16 ? opt.runs : 16;
      for (int i = 0; i < probes; i++)
        probe_attach(argv[0], daemons[0].sock, set, opt.device, &ctx_all[i], &att_all[i], &rt_all[i], &open_all[i],
                     handles, &tensors);
      cJSON_AddStringToObject(result, "attach_handles", handles);
      put_num(result, "attach_tensors", (double)tensors);
      put_num(result, "attach_context_s", median(ctx_all, probes));
      put_num(result, "attach_s", median(att_all, probes));
      put_num(result, "attach_roundtrip_s", median(rt_all, probes));
      put_num(result, "attach_open_s", median(open_all, probes));
      put_num(result, "attach_probes", probes);
      char label[64];
      snprintf(label, sizeof label, "fresh process: attach (%s handles)", handles);
      fprintf(out, "%-46s %8.2f ms   (one-time per process)\n", "fresh process: CUDA context", median(ctx_all, probes) * 1e3);
      fprintf(out, "%-46s %8.3f ms   (to usable pointers, %zu tensors; median of %d)\n", label,
              median(att_all, probes) * 1e3, tensors, probes);
      fprintf(out, "%-46s %8.3f ms\n", "  of which: request/reply round trip", median(rt_all, probes) * 1e3);
      fprintf(out, "%-46s %8.3f ms\n",
              strcmp(handles, "cuda_vmm") == 0 ? "  of which: VMM import + map + access" : "  of which: cudaIpcOpenMemHandle",
              median(open_all, probes) * 1e3);
    }
    if (phase("rss")) {
      uint64_t rss = daemon_rss_anon(daemons[0].pid);
      put_num(result, "daemon_rss_anon_bytes", (double)rss);
      fprintf(out, "%-46s %8.1f MiB\n", "daemon RssAnon (smaps_rollup Anonymous)", (double)rss / (1 << 20));
    }
  }

  if (phase("cold")) phase_cold(abs, c, plan, ranges, nranges, read_bytes);

  if (phase("early")) phase_early(argv[0], abs);

  char *text = cJSON_PrintUnformatted(result);
  if (opt.json) printf("%s\n", text);
  if (opt.json_out) {
    FILE *f = fopen(opt.json_out, "w");
    if (f == NULL) die(opt.json_out, strerror(errno));
    fprintf(f, "%s\n", text);
    fclose(f);
  }
  free(text);
  cJSON_Delete(result);
  free(ranges);
  free(abs);
  plan_free(plan);
  for (int i = 0; i < ndaemons; i++) weightd_close(daemons[i].c);
  ckpt_free(c);
  return 0;
}
