/*
 * bench_multi.c - weightd-bench --multi MODE: the multi-GPU measurements,
 * each against ceilings measured in the same run.
 *
 *   all      every GPU loads at once: the aggregate against the sum of the
 *            per-link ceilings (each link alone) and against the links all
 *            at once; prints the link_rates line for the daemon's config
 *   replica  a set resident on GPU 0 loaded onto GPU 1: against the peer
 *            copy ceiling (cudaMemcpyPeer GPU 0 -> 1)
 *   striped  a load onto GPU 0 striped over the idle GPUs' links (the
 *            daemon runs with striping=auto): against GPU 0's own link and
 *            the NVLink inbound ceiling (peer copies into GPU 0 from the
 *            others at once)
 *   group    a whole TP group (--tp-size N, default 2) through load_group:
 *            rank r on GPU r, or every rank on GPU 0 when there are fewer
 *            GPUs than ranks; against the links of the GPUs it uses
 *
 * all, replica and striped need two GPUs: with one they print "needs >= 2
 * GPUs" and skip (exit 0); group runs anywhere.
 *
 * weightd-bench --multi MODE --checkpoint DIR --socket PATH [--runs N] [--tp-size N] [--plan JSON] [--json]
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_multi.h"
#include "checkpoint.h"
#include "clock.h"
#include "plan.h"
#include "weightd.h"

#define MAX_GPUS 16
#define CHUNK (64u << 20)
#define GIB (1024.0 * 1024.0 * 1024.0)

static _Noreturn void fail(const char *what, const char *detail) {
  fprintf(stderr, "weightd-bench --multi: %s: %s\n", what, detail);
  exit(1);
}

static void cuda_check(cudaError_t e, const char *what) {
  if (e != cudaSuccess) fail(what, cudaGetErrorString(e));
}

/* ---- ceilings -------------------------------------------------------------------- */

struct link_run {
  int device;
  uint64_t bytes;
  double seconds;
  pthread_barrier_t *start; /* NULL: runs alone */
};

/* Pinned-source host-to-device copies of r->bytes onto r->device in 64 MiB chunks, alternating two streams. */
static void *link_run(void *arg) {
  struct link_run *r = arg;
  cuda_check(cudaSetDevice(r->device), "cudaSetDevice");
  unsigned char *host = NULL, *dev = NULL;
  cudaStream_t s[2];
  cuda_check(cudaHostAlloc((void **)&host, 2 * (size_t)CHUNK, cudaHostAllocPortable), "cudaHostAlloc");
  memset(host, 0x3c, 2 * (size_t)CHUNK);
  cuda_check(cudaMalloc((void **)&dev, 16 * (size_t)CHUNK), "cudaMalloc");
  for (int i = 0; i < 2; i++) cuda_check(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_check(cudaMemcpy(dev, host, CHUNK, cudaMemcpyHostToDevice), "warm-up copy");
  if (r->start != NULL) pthread_barrier_wait(r->start);
  double t0 = clock_s();
  for (uint64_t off = 0, k = 0; off < r->bytes; off += CHUNK, k++) {
    size_t n = r->bytes - off < CHUNK ? (size_t)(r->bytes - off) : CHUNK;
    cuda_check(cudaMemcpyAsync(dev + (k % 16) * (size_t)CHUNK, host + (k & 1) * (size_t)CHUNK, n,
                               cudaMemcpyHostToDevice, s[k & 1]),
               "cudaMemcpyAsync H2D");
  }
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  r->seconds = clock_s() - t0;
  for (int i = 0; i < 2; i++) cudaStreamDestroy(s[i]);
  cudaFree(dev);
  cudaFreeHost(host);
  return NULL;
}

/* The links of devices[0..n) at once; each r[i].seconds is its own time. Returns the wall time. */
static double links_at_once(const int *devices, int n, uint64_t bytes, struct link_run *r) {
  pthread_t t[MAX_GPUS];
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, (unsigned)n + 1);
  for (int i = 0; i < n; i++) {
    r[i] = (struct link_run){.device = devices[i], .bytes = bytes, .start = &start};
    pthread_create(&t[i], NULL, link_run, &r[i]);
  }
  pthread_barrier_wait(&start);
  double t0 = clock_s();
  for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
  pthread_barrier_destroy(&start);
  return clock_s() - t0;
}

/* One link alone: GiB/s. */
static double link_alone(int device, uint64_t bytes) {
  struct link_run r = {.device = device, .bytes = bytes};
  link_run(&r);
  return (double)bytes / GIB / r.seconds;
}

/* Peer copies of `bytes` from each of srcs[0..n) into dst at once: the aggregate GiB/s into dst. */
static double peer_ceiling(const int *srcs, int n, int dst, uint64_t bytes) {
  void *to[MAX_GPUS], *from[MAX_GPUS];
  cudaStream_t s[MAX_GPUS];
  for (int i = 0; i < n; i++) {
    cuda_check(cudaSetDevice(dst), "cudaSetDevice");
    cuda_check(cudaMalloc(&to[i], (size_t)bytes), "cudaMalloc (peer target)");
    cuda_check(cudaSetDevice(srcs[i]), "cudaSetDevice");
    if (cudaDeviceEnablePeerAccess(dst, 0) != cudaSuccess) cudaGetLastError();
    cuda_check(cudaMalloc(&from[i], (size_t)bytes), "cudaMalloc (peer source)");
    cuda_check(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaMemcpyPeerAsync(to[i], dst, from[i], srcs[i], CHUNK, s[i]), "warm-up peer copy");
  }
  for (int i = 0; i < n; i++) cuda_check(cudaStreamSynchronize(s[i]), "cudaStreamSynchronize");
  double t0 = clock_s();
  for (int i = 0; i < n; i++)
    cuda_check(cudaMemcpyPeerAsync(to[i], dst, from[i], srcs[i], (size_t)bytes, s[i]), "cudaMemcpyPeerAsync");
  for (int i = 0; i < n; i++) cuda_check(cudaStreamSynchronize(s[i]), "cudaStreamSynchronize");
  double t = clock_s() - t0;
  for (int i = 0; i < n; i++) {
    cudaStreamDestroy(s[i]);
    cudaFree(to[i]);
    cudaFree(from[i]);
  }
  return (double)n * (double)bytes / GIB / t;
}

/* ---- the daemon ------------------------------------------------------------------------ */

struct bench_ctx {
  const char *sock, *path, *plan_json;
  uint64_t bytes; /* a rank's payload */
  int runs, json, ngpus, tp_size;
};

static weightd_client *client(const struct bench_ctx *b) {
  weightd_client *c = NULL;
  if (weightd_connect(b->sock, &c) != 0) fail("connect", weightd_last_error(c));
  if (strcmp(weightd_backend(c), "cuda") != 0) fail("daemon", "the daemon does not use the cuda backend");
  return c;
}

static void evict_device(weightd_client *c, int device) {
  char req[64], *r = NULL;
  snprintf(req, sizeof req, "{\"op\":\"evict\",\"device\":%d}", device);
  if (weightd_request(c, req, &r, NULL, NULL) != 0) fail("evict", r ? r : weightd_last_error(c));
  weightd_free(r);
}

/* A load onto device: its time; the reply's method and source go to method/source. */
static double timed_load(weightd_client *c, const struct bench_ctx *b, int device, char method[24], char source[80]) {
  char req[PATH_MAX + 256], *r = NULL;
  snprintf(req, sizeof req, "{\"op\":\"load\",\"path\":\"%s\",\"device\":%d%s%s}", b->path, device,
           b->plan_json ? ",\"plan\":" : "", b->plan_json ? b->plan_json : "");
  double t0 = clock_s();
  if (weightd_request(c, req, &r, NULL, NULL) != 0) fail("load", r ? r : weightd_last_error(c));
  double t = clock_s() - t0;
  const char *m = strstr(r, "\"method\":\""), *s = strstr(r, "\"source\":\"");
  if (method) snprintf(method, 24, "%.*s", m ? (int)strcspn(m + 10, "\"") : 1, m ? m + 10 : "?");
  if (source) snprintf(source, 80, "%.*s", s ? (int)strcspn(s + 10, "\"") : 1, s ? s + 10 : "?");
  weightd_free(r);
  return t;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The median of b->runs loads onto device, each after evicting the device; the last reply's method and source. */
static double median_load(const struct bench_ctx *b, weightd_client *c, int device, char method[24], char source[80]) {
  double runs[64];
  for (int k = 0; k < b->runs; k++) {
    evict_device(c, device);
    runs[k] = timed_load(c, b, device, method, source);
  }
  return median(runs, b->runs);
}

static int needs_two(const struct bench_ctx *b, const char *mode) {
  if (b->ngpus >= 2) return 0;
  if (b->json) printf("{\"mode\":\"%s\",\"skipped\":\"needs >= 2 GPUs\",\"gpus\":%d}\n", mode, b->ngpus);
  else printf("weightd-bench --multi %s: needs >= 2 GPUs (this machine has %d): skipped\n", mode, b->ngpus);
  return 1;
}

/* ---- modes ------------------------------------------------------------------------------ */

struct load_thread {
  const struct bench_ctx *b;
  int device;
  double seconds;
  char method[24], source[80];
};

static void *load_thread(void *arg) {
  struct load_thread *l = arg;
  weightd_client *c = client(l->b);
  l->seconds = timed_load(c, l->b, l->device, l->method, l->source);
  weightd_close(c);
  return NULL;
}

static int mode_all(const struct bench_ctx *b) {
  if (needs_two(b, "all")) return 0;
  int n = b->ngpus, devs[MAX_GPUS];
  double alone[MAX_GPUS], sum = 0;
  for (int i = 0; i < n; i++) {
    devs[i] = i;
    alone[i] = link_alone(i, b->bytes);
    sum += alone[i];
  }
  struct link_run r[MAX_GPUS];
  double wall = links_at_once(devs, n, b->bytes, r);
  double at_once = (double)n * (double)b->bytes / GIB / wall;
  weightd_client *c = client(b);
  double runs[64];
  int nruns = b->runs;
  char method[24] = "?";
  for (int k = 0; k < nruns; k++) {
    for (int i = 0; i < n; i++) evict_device(c, i);
    struct load_thread lt[MAX_GPUS];
    pthread_t t[MAX_GPUS];
    double t0 = clock_s();
    for (int i = 0; i < n; i++) {
      lt[i] = (struct load_thread){.b = b, .device = i};
      pthread_create(&t[i], NULL, load_thread, &lt[i]);
    }
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    runs[k] = clock_s() - t0;
    snprintf(method, sizeof method, "%s", lt[0].method);
  }
  weightd_close(c);
  double t = median(runs, nruns), agg = (double)n * (double)b->bytes / GIB / t;
  if (b->json) {
    printf("{\"mode\":\"all\",\"gpus\":%d,\"bytes_per_gpu\":%" PRIu64 ",\"link_gib_s\":[", n, b->bytes);
    for (int i = 0; i < n; i++) printf("%s%.2f", i ? "," : "", alone[i]);
    printf("],\"sum_of_links_gib_s\":%.2f,\"links_at_once_gib_s\":%.2f,\"weightd_gib_s\":%.2f,\"weightd_s\":%.6f,"
           "\"method\":\"%s\"}\n",
           sum, at_once, agg, t, method);
  } else {
    printf("weightd-bench --multi all: %d GPUs, %.2f GiB each, median of %d\n", n, (double)b->bytes / GIB, nruns);
    for (int i = 0; i < n; i++) printf("  link of GPU %d alone                 %8.1f GiB/s\n", i, alone[i]);
    printf("  sum of the links                      %8.1f GiB/s\n", sum);
    printf("  all links at once (ceiling)           %8.1f GiB/s  (%.0f%% of the sum)\n", at_once, 100 * at_once / sum);
    printf("  weightd, one load per GPU at once     %8.1f GiB/s  %.0f%% of the sum, %.0f%% of the ceiling (%s)\n", agg,
           100 * agg / sum, 100 * agg / at_once, method);
    printf("  for the daemon's config: \"link_rates\": \"");
    for (int i = 0; i < n; i++) printf("%s%.1f", i ? "," : "", alone[i]);
    printf("\"\n");
  }
  return 0;
}

static int mode_replica(const struct bench_ctx *b) {
  if (needs_two(b, "replica")) return 0;
  int src[1] = {0};
  double ceiling = peer_ceiling(src, 1, 1, b->bytes);
  weightd_client *c = client(b);
  char method[24] = "?", source[80] = "?";
  timed_load(c, b, 0, NULL, NULL); /* the copy on GPU 0 (resident after the first time) */
  double t = median_load(b, c, 1, method, source), rate = (double)b->bytes / GIB / t;
  weightd_close(c);
  if (b->json)
    printf("{\"mode\":\"replica\",\"bytes\":%" PRIu64 ",\"peer_ceiling_gib_s\":%.2f,\"weightd_gib_s\":%.2f,"
           "\"weightd_s\":%.6f,\"method\":\"%s\",\"source\":\"%s\"}\n",
           b->bytes, ceiling, rate, t, method, source);
  else
    printf("weightd-bench --multi replica: %.2f GiB onto GPU 1, resident on GPU 0, median of %d\n"
           "  peer copy GPU 0 -> 1 (ceiling)        %8.1f GiB/s\n"
           "  weightd load onto GPU 1              %8.1f GiB/s  %.0f%% of the ceiling (%s from %s)\n",
           (double)b->bytes / GIB, b->runs, ceiling, rate, 100 * rate / ceiling, method, source);
  return 0;
}

static int mode_striped(const struct bench_ctx *b) {
  if (needs_two(b, "striped")) return 0;
  int others[MAX_GPUS], n = 0;
  for (int i = 1; i < b->ngpus; i++) others[n++] = i;
  double own = link_alone(0, b->bytes);
  double nvlink = peer_ceiling(others, n, 0, b->bytes / (uint64_t)n);
  weightd_client *c = client(b);
  for (int i = 0; i < b->ngpus; i++) evict_device(c, i); /* every neighbour idle and empty */
  char method[24] = "?";
  double t = median_load(b, c, 0, method, NULL), rate = (double)b->bytes / GIB / t;
  weightd_close(c);
  if (b->json)
    printf("{\"mode\":\"striped\",\"gpus\":%d,\"bytes\":%" PRIu64 ",\"own_link_gib_s\":%.2f,\"nvlink_inbound_gib_s\":%.2f,"
           "\"weightd_gib_s\":%.2f,\"weightd_s\":%.6f,\"method\":\"%s\"}\n",
           b->ngpus, b->bytes, own, nvlink, rate, t, method);
  else {
    printf("weightd-bench --multi striped: %.2f GiB onto GPU 0 with %d idle GPUs, median of %d\n"
           "  GPU 0's own link                      %8.1f GiB/s\n"
           "  peer copies into GPU 0 (NVLink in)    %8.1f GiB/s\n"
           "  weightd load onto GPU 0               %8.1f GiB/s  %.2fx its own link (%s)\n",
           (double)b->bytes / GIB, n, b->runs, own, nvlink, rate, rate / own, method);
    if (strcmp(method, "striped") != 0)
      printf("  (the load was not striped: run the daemon with \"striping\": \"auto\" and \"stripe_min_bytes\" below "
             "the rank's size)\n");
  }
  return 0;
}

static int mode_group(const struct bench_ctx *b) {
  int tp = b->tp_size > 0 ? b->tp_size : 2, devs[256];
  if (tp > 256) fail("--tp-size", "at most 256");
  bool spread = b->ngpus >= tp;
  char names[256][12];
  const char *dev_names[256];
  int distinct = spread ? tp : 1;
  for (int r = 0; r < tp; r++) {
    devs[r] = spread ? r : 0;
    snprintf(names[r], sizeof names[r], "%d", devs[r]);
    dev_names[r] = names[r];
  }
  double ceiling = 0;
  for (int i = 0; i < distinct; i++) ceiling += link_alone(devs[i], b->bytes);
  weightd_client *c = client(b);
  struct weightd_group_options o = {.struct_size = sizeof o, .tp_size = (unsigned)tp, .devices = dev_names,
                                    .ndevices = (size_t)tp, .plan_json = b->plan_json};
  double runs[64];
  int nruns = b->runs;
  uint64_t bytes = 0;
  char method[24] = "?";
  for (int k = 0; k < nruns; k++) {
    for (int i = 0; i < distinct; i++) evict_device(c, devs[i]);
    weightd_group *g = NULL;
    double t0 = clock_s();
    int rc = weightd_load_group(c, b->path, &o, &g);
    runs[k] = clock_s() - t0;
    if (rc != 0) fail("load_group", weightd_last_error(c));
    bytes = 0;
    for (size_t i = 0; i < weightd_group_size(g); i++) {
      struct weightd_group_rank r = {.struct_size = sizeof r};
      weightd_group_rank(g, i, &r);
      bytes += r.bytes;
      snprintf(method, sizeof method, "%s", r.method);
    }
    weightd_group_free(g);
  }
  weightd_close(c);
  double t = median(runs, nruns), rate = (double)bytes / GIB / t;
  if (b->json)
    printf("{\"mode\":\"group\",\"tp_size\":%d,\"gpus_used\":%d,\"bytes\":%" PRIu64 ",\"links_gib_s\":%.2f,"
           "\"weightd_gib_s\":%.2f,\"weightd_s\":%.6f,\"method\":\"%s\"}\n",
           tp, distinct, bytes, ceiling, rate, t, method);
  else
    printf("weightd-bench --multi group: TP=%d on %d GPU%s (%s), %.2f GiB in all, median of %d\n"
           "  host links of the GPUs used           %8.1f GiB/s\n"
           "  weightd load_group                    %8.1f GiB/s  %.0f%% of the links (%s)\n",
           tp, distinct, distinct == 1 ? "" : "s", spread ? "rank r on GPU r" : "every rank on GPU 0",
           (double)bytes / GIB, nruns, ceiling, rate, 100 * rate / ceiling, method);
  return 0;
}

/* ---- the entry point ------------------------------------------------------------------- */

int bench_multi_main(int argc, char **argv) {
  struct bench_ctx b = {.runs = 3, .tp_size = 2};
  const char *mode = NULL, *path = NULL;
  for (int i = 0; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--json") == 0) b.json = 1;
    else if (v && strcmp(argv[i], "--multi") == 0) mode = argv[++i];
    else if (v && strcmp(argv[i], "--checkpoint") == 0) path = argv[++i];
    else if (v && strcmp(argv[i], "--socket") == 0) b.sock = argv[++i];
    else if (v && strcmp(argv[i], "--runs") == 0) b.runs = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--tp-size") == 0) b.tp_size = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--plan") == 0) b.plan_json = argv[++i];
    else {
      fprintf(stderr, "usage: weightd-bench --multi all|replica|striped|group --checkpoint DIR --socket PATH\n"
                      "                     [--runs N] [--tp-size N] [--plan JSON] [--json]\n");
      return 2;
    }
  }
  if (b.runs > 64) b.runs = 64;
  if (mode == NULL || path == NULL || b.runs < 1) {
    fprintf(stderr, "weightd-bench --multi: MODE and --checkpoint DIR are required\n");
    return 2;
  }
  char *abs = realpath(path, NULL);
  if (abs == NULL) fail(path, strerror(errno));
  b.path = abs;
  struct ckpt *ck = NULL;
  struct plan *plan = NULL;
  struct wd_error err = {0};
  cJSON *spec = b.plan_json ? cJSON_Parse(b.plan_json) : NULL;
  if (ckpt_open(abs, NULL, &ck, &err) != 0 || plan_build(ck, spec, &plan, &err) != 0) fail("checkpoint", err.msg);
  cJSON_Delete(spec);
  b.bytes = plan->payload_bytes;
  if (cudaGetDeviceCount(&b.ngpus) != cudaSuccess) b.ngpus = 0;
  if (b.ngpus > MAX_GPUS) b.ngpus = MAX_GPUS;
  if (b.ngpus < 1) fail("CUDA", "no GPU");
  int rc;
  if (strcmp(mode, "all") == 0) rc = mode_all(&b);
  else if (strcmp(mode, "replica") == 0) rc = mode_replica(&b);
  else if (strcmp(mode, "striped") == 0) rc = mode_striped(&b);
  else if (strcmp(mode, "group") == 0) rc = mode_group(&b);
  else {
    fprintf(stderr, "weightd-bench --multi: unknown mode '%s' (all, replica, striped, group)\n", mode);
    rc = 2;
  }
  plan_free(plan);
  ckpt_free(ck);
  free(abs);
  return rc;
}
