/*
 * bench_phases.c - weightd-bench's timed phases that are more than a
 * request: the ceilings (pinned-source H2D copies; page cache -> pinned
 * fill with the staging schedule), the timed loads, the pin policy's auto
 * phase and the cold path (page cache dropped, O_DIRECT reads, a cold load).
 * DESIGN: bench_fill_rate and odirect_read start their own threads and join them
 * before returning; the threads share only their argument struct (an atomic
 * task counter, read-only inputs, per-thread slots or buffers).
 */
#include <cjson/cJSON.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench_daemon.h"
#include "bench_disk.h"
#include "bench_phases.h"
#include "bench_report.h"
#include "clock.h"
#include "plan.h"
#include "plan_stage.h"
#include "stream_copy.h"

/* ---- ceilings ------------------------------------------------------------------ */

/* Pinned-source H2D: `bytes` in 64 MiB copies from two pinned buffers on two streams. */
double bench_h2d_ceiling(int device, uint64_t bytes) {
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

void bench_map_ckpt(const struct ckpt *c, const struct plan_range *r, size_t nr, struct mapped *m) {
  m->c = c;
  m->maps = calloc(c->nshards, sizeof *m->maps);
  m->data = calloc(c->nshards, sizeof *m->data);
  for (size_t i = 0; i < c->nshards; i++) {
    if (c->shards[i].size == 0) continue;
    m->maps[i] = mmap(NULL, c->shards[i].size, PROT_READ, MAP_SHARED, c->shards[i].fd, 0);
    if (m->maps[i] == MAP_FAILED) bench_die("mmap", strerror(errno));
    m->data[i] = (const unsigned char *)m->maps[i] + c->shards[i].hdr->data_start;
  }
  for (size_t k = 0; k < nr; k++)
    for (uint64_t o = r[k].off; o < r[k].off + r[k].len; o += 4096) (void)((volatile char *)m->maps[r[k].shard])[o];
}

void bench_unmap_ckpt(struct mapped *m) {
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
  plan_copy_fn copy;
  bool fence;
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
    plan_stage_fill(f->sched, f->plan, f->data, w, lo, hi, slot + lo % SLOT, f->copy);
    if (f->fence) stream_copy_fence();
  }
}

/*
 * Page cache -> pinned memory with nthreads threads, as the staging pipeline
 * fills its slots for this plan under mode (8 MiB tasks): returns seconds,
 * and the bytes the CPU copied in *copied.
 */
double bench_fill_rate(const struct mapped *m, const struct plan *plan, enum plan_strided mode,
                       enum bench_writes writes, unsigned nthreads, uint64_t *copied) {
  struct plan_stage *sched = NULL;
  struct wd_error err = {0};
  if (plan_stage_build(plan, NULL, SLOT, mode, 1, &sched, &err) != 0) bench_die("staging schedule", err.msg);
  struct fill_arg f = {.plan = plan,
                       .sched = sched,
                       .data = m->data,
                       .nthreads = nthreads,
                       .copy = writes == BENCH_WRITES_STREAMING ? stream_copy : memcpy,
                       .fence = writes != BENCH_WRITES_CACHED};
  for (size_t w = 0; w < sched->nwindows; w++) f.ntasks += (size_t)((sched->windows[w].used + (8u << 20) - 1) >> 23);
  f.task_window = malloc((f.ntasks ? f.ntasks : 1) * sizeof *f.task_window);
  f.task_lo = malloc((f.ntasks ? f.ntasks : 1) * sizeof *f.task_lo);
  size_t t = 0;
  for (size_t w = 0; w < sched->nwindows; w++)
    for (uint64_t lo = 0; lo < sched->windows[w].used; lo += 8u << 20, t++) {
      f.task_window[t] = w;
      f.task_lo[t] = lo;
    }
  unsigned how = cudaHostAllocPortable | (writes == BENCH_WRITES_WRITE_COMBINED ? cudaHostAllocWriteCombined : 0);
  CUDA_OK(cudaHostAlloc((void **)&f.pinned, (size_t)nthreads * SLOT, how));
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

/* ---- phases ---------------------------------------------------------------------------------- */

/* --runs loads through daemon d (and, alternating, its partner), recorded under key; source: as bench_timed_load_from. */
void bench_run_loads(const char *abs, const char *key, const char *what, int with_alt, const char *source) {
  int nd = with_alt && bench_ndaemons > 1 ? 2 : 1, runs = bench_cfg.runs;
  double v[2][MAX_RUNS], b2b[2][MAX_RUNS];
  char method[2][16] = {"?", "?"}, read_from[2][48] = {"", ""};
  for (int i = 0; i < runs; i++)
    for (int k = 0; k < nd; k++)
      v[k][i] = bench_timed_load_from(&bench_daemons[k], abs, source, method[k], sizeof method[k], read_from[k],
                                      sizeof read_from[k], bench_cfg.settle_ms);
  if (bench_cfg.b2b)
    for (int i = 0; i < runs; i++)
      for (int k = 0; k < nd; k++) b2b[k][i] = bench_timed_load_from(&bench_daemons[k], abs, source, NULL, 0, NULL, 0, 0);
  for (int k = 0; k < nd; k++) {
    char name[96], label[96];
    if (nd > 1) snprintf(name, sizeof name, "%s_%s", key, bench_daemons[k].name);
    else snprintf(name, sizeof name, "%s", key);
    cJSON *o = cJSON_AddObjectToObject(bench_result, name);
    bench_put_num(o, "median_s", bench_median(v[k], runs));
    bench_put_runs(o, "runs_s", v[k], runs);
    cJSON_AddStringToObject(o, "method", method[k]);
    cJSON_AddStringToObject(o, "read_from", read_from[k]);
    cJSON_AddStringToObject(o, "daemon", bench_daemons[k].name);
    cJSON_AddStringToObject(o, "staged_strided", bench_daemons[k].strided);
    cJSON_AddStringToObject(o, "pin", bench_daemons[k].pin);
    if (bench_cfg.b2b) {
      bench_put_num(o, "back_to_back_median_s", bench_median(b2b[k], runs));
      bench_put_runs(o, "back_to_back_runs_s", b2b[k], runs);
    }
    if (strcmp(key, "staged") == 0 && strcmp(method[k], "staged") != 0)
      fprintf(bench_out, "  (note: these loads went %s: the daemon pins by itself; run it with --set pin=off)\n",
              method[k]);
    snprintf(label, sizeof label, "load, %s (%s%s%s%s%s)", what, method[k], read_from[k][0] ? " from " : "",
             read_from[k], nd > 1 ? ", " : "", nd > 1 ? bench_daemons[k].name : "");
    bench_row(label, bench_median(v[k], runs));
    if (bench_cfg.b2b) {
      snprintf(label, sizeof label, "  same, right after an evict");
      bench_row(label, bench_median(b2b[k], runs));
    }
  }
}

/* Waits until the daemon has pinned (part of) the checkpoint by itself; seconds, or -1 after a minute. */
static double wait_auto_pin(struct daemon_conn *d, const char *abs, uint64_t *pinned) {
  double t0 = clock_s();
  for (;;) {
    cJSON *e = bench_ckpt_status(d, abs);
    bool pinning = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "pinning"));
    *pinned = (uint64_t)bench_jnum(e, "pinned_bytes");
    cJSON_Delete(e);
    if (!pinning && *pinned > 0) return clock_s() - t0;
    if (clock_s() - t0 > 60) return -1;
    usleep(10000);
  }
}

void bench_phase_auto(const char *abs) {
  struct daemon_conn *d = &bench_daemons[0];
  if (strcmp(d->pin, "off") == 0) bench_die("auto", "the daemon runs with pin off");
  bench_close_all(abs, bench_cfg.device);
  char m1[16] = "?", m2[16] = "?";
  double first = bench_timed_load(d, abs, m1, sizeof m1, bench_cfg.settle_ms);
  uint64_t pinned = 0;
  double wait = wait_auto_pin(d, abs, &pinned);
  double v[MAX_RUNS];
  for (int i = 0; i < bench_cfg.runs; i++) v[i] = bench_timed_load(d, abs, m2, sizeof m2, bench_cfg.settle_ms);
  cJSON *o = cJSON_AddObjectToObject(bench_result, "auto");
  cJSON_AddStringToObject(o, "pin", d->pin);
  bench_put_num(o, "first_s", first);
  cJSON_AddStringToObject(o, "first_method", m1);
  bench_put_num(o, "pinned_after_s", wait);
  bench_put_num(o, "pinned_bytes", (double)pinned);
  bench_put_num(o, "later_median_s", bench_median(v, bench_cfg.runs));
  bench_put_runs(o, "later_runs_s", v, bench_cfg.runs);
  cJSON_AddStringToObject(o, "later_method", m2);
  char label[96];
  snprintf(label, sizeof label, "pin %s: first load (%s)", d->pin, m1);
  bench_row(label, first);
  char note[96];
  snprintf(note, sizeof note, "(%.2f GiB pinned by the daemon itself)", (double)pinned / GiB);
  bench_row_plain("  then pinned in the background, after", wait, wait < 0 ? "(not within 60 s)" : note);
  snprintf(label, sizeof label, "pin %s: later loads (%s)", d->pin, m2);
  bench_row(label, bench_median(v, bench_cfg.runs));
}

struct drop_arg {
  const struct ckpt *c;
  const struct plan_range *r;
  size_t nr;
};

static void drop_again(void *arg) {
  const struct drop_arg *d = arg;
  const char *how;
  drop_cache(d->c, d->r, d->nr, &how);
}

/* One cold load through daemon 0 with the given source (NULL: the daemon's setting): a row, and its figures in o. */
static void cold_load(const char *abs, const char *source, const char *key, uint64_t read_bytes, double ceiling,
                      const struct drop_arg *d, cJSON *o) {
  bench_close_all(abs, bench_cfg.device); /* the daemon's mappings hold no page then */
  /*
   * Opened again first: reading the headers brings the kernel's readahead
   * of the first data bytes into the page cache (hundreds of KiB a shard),
   * which is the open's doing, not the load's. Then the cache is dropped.
   */
  char oreq[PATH_MAX + 64];
  snprintf(oreq, sizeof oreq, "{\"op\":\"open\",\"path\":\"%s\"}", abs);
  bench_request_or_die(bench_daemons[0].c, oreq);
  /* A pinned checkpoint's pages stay locked until its unpin job has run: drop until they go (5 s at most). */
  double before = 1;
  for (int i = 0; i < 50 && before > 0.001; i++) {
    if (i > 0) usleep(100 * 1000);
    drop_again((void *)d);
    before = cached_fraction(d->c, d->r, d->nr);
  }
  char m[16] = "?", from[48] = "";
  double s = bench_timed_load_from(&bench_daemons[0], abs, source, m, sizeof m, from, sizeof from, 0);
  double after = cached_fraction(d->c, d->r, d->nr);
  double gbps = (double)read_bytes / 1e9 / s;
  cJSON *e = cJSON_AddObjectToObject(o, key);
  bench_put_num(e, "s", s);
  bench_put_num(e, "gbps", gbps);
  bench_put_num(e, "of_odirect", ceiling > 0 ? gbps / ceiling : 0);
  bench_put_num(e, "cached_before", before);
  bench_put_num(e, "cached_after", after);
  cJSON_AddStringToObject(e, "method", m);
  cJSON_AddStringToObject(e, "read_from", from);
  char label[96];
  snprintf(label, sizeof label, "cold load (%s from %s)", m, from[0] ? from : "?");
  fprintf(bench_out, "%-46s %8.1f ms %7.2f GB/s  %5.0f%% of O_DIRECT; page cache %.1f%% -> %.1f%%\n", label,
          s * 1e3, gbps, ceiling > 0 ? 100 * gbps / ceiling : 0, 100 * before, 100 * after);
}

void bench_phase_cold(const char *abs, const struct ckpt *c, const struct plan *plan, const struct plan_range *r,
                      size_t nr, uint64_t read_bytes) {
  cJSON *o = cJSON_AddObjectToObject(bench_result, "cold");
  bench_close_all(abs, bench_cfg.device); /* the daemon's mappings hold no page then */
  const char *how = "?";
  double left = drop_cache(c, r, nr, &how);
  cJSON_AddStringToObject(o, "dropped_by", how);
  bench_put_num(o, "cached_after_drop", left);
  if (left > 0.05) {
    fprintf(bench_out, "%-46s skipped: %.0f%% of the checkpoint stayed in the page cache (%s)\n", "cold path",
            100 * left, how);
    cJSON_AddStringToObject(o, "skipped", "page cache not dropped");
    return;
  }
  struct drop_arg d = {c, r, nr};
  struct bench_disk sw;
  if (bench_disk_sweep(c, r, nr, drop_again, &d, &sw) != 0) bench_die("O_DIRECT sweep", "out of memory");
  cJSON *pts = cJSON_AddArrayToObject(o, "odirect_sweep");
  for (size_t i = 0; i < sw.npoints; i++) {
    const struct bench_disk_point *q = &sw.points[i];
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "way", q->uring ? "io_uring" : "pread");
    bench_put_num(e, q->uring ? "depth" : "threads", q->threads);
    bench_put_num(e, "read_bytes", (double)q->size);
    bench_put_num(e, "gbps", q->gbps);
    cJSON_AddItemToArray(pts, e);
    char label[96];
    snprintf(label, sizeof label, "disk: O_DIRECT %s %llu MiB x %u%s", q->uring ? "io_uring" : "preads",
             (unsigned long long)(q->size >> 20), q->threads, q->uring ? " in flight" : " threads");
    fprintf(bench_out, "%-46s %19.2f GB/s (a slice)\n", label, q->gbps);
  }
  if (!sw.have_uring) fprintf(bench_out, "  (built without liburing: no io_uring points)\n");
  cJSON *b = cJSON_AddObjectToObject(o, "odirect_best");
  cJSON_AddStringToObject(b, "way", sw.best.uring ? "io_uring" : "pread");
  bench_put_num(b, sw.best.uring ? "depth" : "threads", sw.best.threads);
  bench_put_num(b, "read_bytes", (double)sw.best.size);
  bench_put_num(o, "odirect_best_gbps", sw.ceiling_gbps);
  char label[96];
  snprintf(label, sizeof label, "disk ceiling: the best of the two fastest, whole");
  fprintf(bench_out, "%-46s %19.2f GB/s (%s %llu MiB x %u)\n", label, sw.ceiling_gbps,
          sw.best.uring ? "io_uring" : "preads", (unsigned long long)(sw.best.size >> 20), sw.best.threads);
  cold_load(abs, NULL, "load", read_bytes, sw.ceiling_gbps, &d, o);
  cold_load(abs, "direct", "direct_load", read_bytes, sw.ceiling_gbps, &d, o);
  (void)plan;
  /* Warm again for whatever runs next. */
  char *req = bench_plan_request("prefetch", abs, ",\"wait\":true");
  bench_request_or_die(bench_daemons[0].c, req);
  free(req);
}
