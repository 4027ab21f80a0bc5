/*
 * telemetry.c - collecting the daemon's figures and rendering them (see
 * telemetry.h).
 *
 * DESIGN: collect() walks loop-owned state into a list of families of
 * samples; prometheus() and json() render the same list. Residency and
 * health measurements run on control jobs that read only their own struct
 * and report back on the loop, where the cache is updated.
 */
#include "telemetry.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "clock.h"
#include "json_strict.h"
#include "jsonutil.h"
#include "base/log.h"
#include "remote/fetch.h"
#include "remote/rroots.h"
#include "state/scrub.h"

/* ---- the cache ---------------------------------------------------------------------- */

struct telemetry {
  /* The page-cache bytes measured are kept on each checkpoint (reg_ckpt.page_cache_bytes). */
  uint64_t resident_at_ms; /* when they were measured; 0: never */
  bool resident_running;
  bool healthy;            /* the backend answered the last probe */
  char health_why[256];
  uint64_t health_at_ms;
  bool health_running;
};

int telemetry_create(struct daemon *d, struct telemetry **out, struct wd_error *err) {
  (void)d;
  struct telemetry *t = calloc(1, sizeof *t);
  if (t == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  t->healthy = true; /* the backend was just created: healthy until a probe says otherwise */
  *out = t;
  return 0;
}

void telemetry_destroy(struct telemetry *t) { free(t); }

/* ---- refresh jobs ---------------------------------------------------------------------- */

struct resident_job {
  struct job job;
  struct daemon *d; /* read on the loop only (done) */
  struct reg_ckpt **cks;
  uint64_t *bytes;
  size_t n;
};

static void resident_work(struct job *j) {
  struct resident_job *rj = (struct resident_job *)j;
  for (size_t i = 0; i < rj->n; i++) rj->bytes[i] = reg_resident_bytes(rj->cks[i]);
}

static void resident_done(struct job *j) {
  struct resident_job *rj = (struct resident_job *)j;
  struct telemetry *t = rj->d->tel;
  if (t != NULL) {
    for (size_t i = 0; i < rj->n; i++) {
      rj->cks[i]->page_cache_bytes = rj->bytes[i];
      rj->cks[i]->page_cache_known = true;
    }
    t->resident_at_ms = clock_ms();
    t->resident_running = false;
  }
  for (size_t i = 0; i < rj->n; i++) reg_unobserve(rj->cks[i]);
  free(rj->cks);
  free(rj->bytes);
  free(rj);
}

struct health_job {
  struct job job;
  struct daemon *d;
  const struct wd_backend *backend;
  int ndevices;
  int answered; /* devices that answered, in order: their free memory is below */
  int rc;
  struct wd_error err;
  uint64_t free_bytes[];
};

static void health_work(struct job *j) {
  struct health_job *hj = (struct health_job *)j;
  for (int i = 0; i < hj->ndevices && hj->rc == 0; i++) {
    struct wd_device_info info;
    hj->rc = hj->backend->ops->device_info(hj->backend->ctx, i, &info, &hj->err);
    if (hj->rc == 0) hj->free_bytes[hj->answered++] = info.memory_free;
  }
}

static void health_done(struct job *j) {
  struct health_job *hj = (struct health_job *)j;
  struct telemetry *t = hj->d->tel;
  if (t != NULL) {
    /* The probe's answers are the freshest free-memory figures (status measures its own too). */
    for (int i = 0; hj->d->res != NULL && i < hj->answered; i++)
      res_device(hj->d->res, i)->info.memory_free = hj->free_bytes[i];
    bool was = t->healthy;
    t->healthy = hj->rc == 0;
    snprintf(t->health_why, sizeof t->health_why, "%s", hj->rc == 0 ? "" : hj->err.msg);
    t->health_at_ms = clock_ms();
    t->health_running = false;
    if (was && !t->healthy) log_msg(LOG_WARN, "the %s backend stopped answering: %s", hj->d->backend_name, hj->err.msg);
    if (!was && t->healthy) log_msg(LOG_INFO, "the %s backend answers again", hj->d->backend_name);
  }
  free(hj);
}

/* Whether an open checkpoint has not been measured yet (opened since the last measurement). */
static bool resident_missing(struct daemon *d) {
  for (struct reg_ckpt *c = reg_first(d->reg); c != NULL; c = c->next)
    if (c->state == REG_OPEN && !c->page_cache_known) return true;
  return false;
}

void telemetry_refresh(struct daemon *d) {
  struct telemetry *t = d->tel;
  if (t == NULL || d->stopping || d->control_pool == NULL) return;
  uint64_t now = clock_ms();
  if (!t->health_running && (t->health_at_ms == 0 || now - t->health_at_ms >= TELEMETRY_HEALTH_MS)) {
    struct health_job *hj = calloc(1, sizeof *hj + (size_t)d->ndevices * sizeof hj->free_bytes[0]);
    if (hj != NULL) {
      hj->job.work = health_work;
      hj->job.done = health_done;
      hj->d = d;
      hj->backend = &d->backend;
      hj->ndevices = d->ndevices;
      t->health_running = true;
      jobs_submit(d->control_pool, &hj->job);
    }
  }
  if (!t->resident_running &&
      (t->resident_at_ms == 0 || now - t->resident_at_ms >= TELEMETRY_RESIDENCY_MS || resident_missing(d))) {
    size_t n = 0;
    for (struct reg_ckpt *c = reg_first(d->reg); c != NULL; c = c->next) n += c->state == REG_OPEN;
    struct resident_job *rj = calloc(1, sizeof *rj);
    if (rj == NULL || (rj->cks = calloc(n ? n : 1, sizeof *rj->cks)) == NULL ||
        (rj->bytes = calloc(n ? n : 1, sizeof *rj->bytes)) == NULL) {
      if (rj) free(rj->cks);
      free(rj);
      return;
    }
    for (struct reg_ckpt *c = reg_first(d->reg); c != NULL; c = c->next)
      if (c->state == REG_OPEN) {
        reg_observe(c); /* a measurement: close does not wait for it */
        rj->cks[rj->n++] = c;
      }
    rj->job.work = resident_work;
    rj->job.done = resident_done;
    rj->d = d;
    t->resident_running = true;
    jobs_submit(d->control_pool, &rj->job);
  }
}

bool telemetry_ready(struct daemon *d, char *why, size_t whylen) {
  const char *reason = NULL;
  if (d->stopping) reason = "the daemon is stopping";
  else if (!d->stats.listening) reason = "the daemon is not listening";
  else if (d->tel != NULL && !d->tel->healthy) reason = d->tel->health_why[0] ? d->tel->health_why : "the backend does not answer";
  if (why != NULL && whylen > 0) snprintf(why, whylen, "%s", reason ? reason : "");
  return reason == NULL;
}

/* ---- collection ------------------------------------------------------------------------ */

#define MAX_LABELS 2 /* the most any family has */

struct sample {
  const char *names[MAX_LABELS]; /* static strings */
  char *values[MAX_LABELS];      /* whole, valid UTF-8 (see label_value), owned; escaped only when rendered */
  int nlabels;
  double value;
};

struct family {
  const char *name, *type, *help;
  struct sample *v;
  size_t n, cap;
};

struct collection {
  struct family *f;
  size_t n, cap;
  bool failed;   /* out of memory: render what there is */
  bool no_paths; /* samples labelled with a checkpoint's path are left out (a reader who may not see them all) */
};

static struct family *family(struct collection *c, const char *name, const char *type, const char *help) {
  if (c->n == c->cap) {
    size_t cap = c->cap ? 2 * c->cap : 32;
    struct family *nf = realloc(c->f, cap * sizeof *nf);
    if (nf == NULL) {
      c->failed = true;
      return NULL;
    }
    c->f = nf;
    c->cap = cap;
  }
  struct family *f = &c->f[c->n++];
  memset(f, 0, sizeof *f);
  f->name = name;
  f->type = type;
  f->help = help;
  return f;
}

/*
 * A label value as both views show it (malloc'd; NULL when memory ran out):
 * v itself, whole, when it is UTF-8; otherwise v with each ill-formed
 * subpart replaced by U+FFFD (the one rule, sj_utf8_replace) and a hash of
 * the original bytes after it, " (not UTF-8: 16 hex digits)", so that two
 * paths differing only in such bytes stay two series.
 */
static char *label_value(const char *v) {
  size_t n = strlen(v), cn = 0;
  if (sj_utf8_valid((const unsigned char *)v, n, NULL)) return strdup(v);
  char *clean = sj_utf8_replace(v, n, &cn);
  char *out = clean != NULL ? malloc(cn + 40) : NULL;
  if (out != NULL)
    snprintf(out, cn + 40, "%s (not UTF-8: %016" PRIx64 ")", clean, (uint64_t)XXH3_64bits(v, n));
  free(clean);
  return out;
}

static void sample_free(struct sample *s) {
  for (int i = 0; i < s->nlabels; i++) free(s->values[i]);
}

/* Adds a sample; labels as NULL-terminated pairs of name (a static string), value. */
static void sample(struct collection *c, struct family *f, double value, ...) {
  if (f == NULL) return;
  if (c->no_paths) {
    va_list lp;
    va_start(lp, value);
    bool path = false;
    for (const char *k = va_arg(lp, const char *); k != NULL && !path; k = va_arg(lp, const char *)) {
      path = strcmp(k, "path") == 0;
      (void)va_arg(lp, const char *);
    }
    va_end(lp);
    if (path) return;
  }
  if (f->n == f->cap) {
    size_t cap = f->cap ? 2 * f->cap : 8;
    struct sample *nv = realloc(f->v, cap * sizeof *nv);
    if (nv == NULL) {
      c->failed = true;
      return;
    }
    f->v = nv;
    f->cap = cap;
  }
  struct sample *s = &f->v[f->n];
  memset(s, 0, sizeof *s);
  s->value = value;
  va_list ap;
  va_start(ap, value);
  for (const char *k = va_arg(ap, const char *); k != NULL && s->nlabels < MAX_LABELS; k = va_arg(ap, const char *)) {
    char *v = label_value(va_arg(ap, const char *));
    if (v == NULL) {
      c->failed = true;
      break;
    }
    s->names[s->nlabels] = k;
    s->values[s->nlabels++] = v;
  }
  va_end(ap);
  if (c->failed) sample_free(s);
  else f->n++;
}

static void collection_free(struct collection *c) {
  for (size_t i = 0; i < c->n; i++) {
    for (size_t k = 0; k < c->f[i].n; k++) sample_free(&c->f[i].v[k]);
    free(c->f[i].v);
  }
  free(c->f);
}

/* Open descriptors of this process (reads /proc/self/fd): limit when none is left to read it with; -1: unknown. */
static double open_fds(uint64_t limit) {
  DIR *dir = opendir("/proc/self/fd");
  if (dir == NULL) return errno == EMFILE ? (double)limit : -1;
  double n = 0;
  for (struct dirent *e = readdir(dir); e != NULL; e = readdir(dir))
    if (e->d_name[0] != '.') n++;
  closedir(dir);
  return n - 1; /* the directory's own descriptor */
}

static void collect_loads(struct daemon *d, struct collection *c) {
  const struct res_stats *st = res_stats(d->res);
  struct family *f = family(c, "weightd_loads_total", "counter", "Load jobs finished, by result and method.");
  for (int r = 0; r < RES_RESULT_COUNT; r++)
    for (int m = 0; m < LD_METHOD_COUNT; m++)
      sample(c, f, (double)st->loads[r][m], "result", res_result_name((enum res_result)r), "method",
             ld_method_name((enum ld_method)m), NULL);
  f = family(c, "weightd_load_duration_seconds", "histogram", "Time of successful load jobs, slab allocation included.");
  static const double bounds[RES_DURATION_BUCKETS] = RES_DURATION_BOUNDS;
  uint64_t cum = 0;
  char le[32];
  for (int b = 0; b < RES_DURATION_BUCKETS; b++) {
    cum += st->duration_le[b];
    snprintf(le, sizeof le, "%g", bounds[b]);
    sample(c, f, (double)cum, "le", le, NULL);
  }
  cum += st->duration_over;
  sample(c, f, (double)cum, "le", "+Inf", NULL);
  f = family(c, "weightd_load_duration_seconds_sum", NULL, NULL);
  sample(c, f, st->duration_sum, NULL);
  f = family(c, "weightd_load_duration_seconds_count", NULL, NULL);
  sample(c, f, (double)cum, NULL);
  f = family(c, "weightd_loaded_bytes_total", "counter", "Payload bytes of successful loads.");
  sample(c, f, (double)st->bytes_loaded, NULL);
  f = family(c, "weightd_read_bytes_total", "counter",
             "Checkpoint file bytes successful loads read from host memory, files or remote roots, by the source that read them.");
  for (int k = 0; k < LD_SOURCE_KINDS; k++)
    if (k != LD_SOURCE_ROUTE) /* a route reads through its members, which count */
      sample(c, f, (double)st->source_bytes[k], "source", ld_source_kind_name((enum ld_source_kind)k), NULL);
  f = family(c, "weightd_verified_chunks_total", "counter",
             "Manifest chunks (4 MiB of a shard file) that loads checked against the manifest (verify on_load).");
  sample(c, f, (double)st->verified_chunks, NULL);
  f = family(c, "weightd_verify_mismatches_total", "counter",
             "Of those, chunks whose bytes differed from the manifest (each failed its load with BAD_CHECKSUM).");
  sample(c, f, (double)st->verify_mismatches, NULL);
  if (d->scrub != NULL) {
    const struct scrub_stats *ss = scrub_stats(d->scrub);
    f = family(c, "weightd_scrubbed_bytes_total", "counter",
               "Bytes of resident sets that scrubs hashed again (background and asked for).");
    sample(c, f, (double)ss->scrubbed_bytes, NULL);
    f = family(c, "weightd_scrub_mismatches_total", "counter",
               "Tensors that scrubs found changed since their set was loaded (each time a scrub found one).");
    sample(c, f, (double)ss->mismatches, NULL);
    size_t corrupt = 0;
    for (const struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) corrupt += s->ncorrupt > 0;
    for (const struct res_set *s = res_first_orphan(d->res); s != NULL; s = s->next) corrupt += s->ncorrupt > 0;
    f = family(c, "weightd_sets_corrupt", "gauge",
               "Sets a scrub found corrupt still in memory (listed and refusing leases, or retired and still held).");
    sample(c, f, (double)corrupt, NULL);
  }
  f = family(c, "weightd_last_load_gib_per_second", "gauge", "Rate of the last successful load (payload GiB/s).");
  sample(c, f, st->last_gib_per_s, NULL);
  f = family(c, "weightd_sets_readopted_total", "counter",
             "Sets re-adopted after a restart from the service manager's fd store, without loading.");
  sample(c, f, (double)st->adopted, NULL);
  f = family(c, "weightd_evictions_total", "counter", "Sets evicted, by reason.");
  for (int r = 0; r < RES_EVICT_COUNT; r++)
    sample(c, f, (double)st->evictions[r], "reason", res_evict_reason_name((enum res_evict_reason)r), NULL);
}

static void collect_devices(struct daemon *d, struct collection *c) {
  struct family *sets = family(c, "weightd_resident_sets", "gauge", "Resident sets, by device and state.");
  struct family *bytes = family(c, "weightd_resident_bytes", "gauge", "Slab bytes of resident sets, by device.");
  struct family *budget = family(c, "weightd_device_budget_bytes", "gauge",
                                 "Budget of resident sets per device (0: the device's own memory).");
  struct family *total = family(c, "weightd_device_memory_bytes", "gauge", "Device memory, total.");
  struct family *freeb = family(c, "weightd_device_free_bytes", "gauge", "Device memory free at the last query.");
  static const char *const states[] = {"loading", "ready"};
  for (int i = 0; i < d->ndevices; i++) {
    const struct res_device *dev = res_device(d->res, i);
    const char *uuid = dev->info.uuid;
    size_t n[2] = {0, 0};
    uint64_t b = 0;
    for (const struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) {
      if (s->device != i || s->state == SET_FAILED) continue;
      n[s->state == SET_READY]++;
      if (s->state == SET_READY) b += s->plan->slab_bytes;
    }
    for (int k = 0; k < 2; k++) sample(c, sets, (double)n[k], "device", uuid, "state", states[k], NULL);
    sample(c, bytes, (double)b, "device", uuid, NULL);
    sample(c, budget, (double)res_device_budget(d->res, i), "device", uuid, NULL);
    sample(c, total, (double)dev->info.memory_total, "device", uuid, NULL);
    sample(c, freeb, (double)dev->info.memory_free, "device", uuid, NULL);
  }
  size_t nleases = 0;
  for (const struct lease *l = res_first_lease(d->res); l != NULL; l = l->next) nleases++;
  struct family *f = family(c, "weightd_leases", "gauge", "Leases held by clients.");
  sample(c, f, (double)nleases, NULL);
}

/* Shard bytes of an open checkpoint. */
static uint64_t checkpoint_size(const struct reg_ckpt *k) {
  uint64_t size = 0;
  for (size_t i = 0; i < k->ck->nshards; i++) size += k->ck->shards[i].size;
  return size;
}

/*
 * The TELEMETRY_CHECKPOINT_SERIES largest open checkpoints, largest first
 * (the first opened first among equals), in top[0..*n): one walk, each
 * checkpoint placed among at most that many.
 */
static void largest_checkpoints(struct daemon *d, struct reg_ckpt **top, uint64_t *sizes, size_t *n) {
  *n = 0;
  for (struct reg_ckpt *k = reg_first(d->reg); k != NULL; k = k->next) {
    if (k->state != REG_OPEN) continue;
    uint64_t size = checkpoint_size(k);
    size_t i = *n < TELEMETRY_CHECKPOINT_SERIES ? (*n)++ : TELEMETRY_CHECKPOINT_SERIES;
    while (i > 0 && sizes[i - 1] <= size) {
      if (i < TELEMETRY_CHECKPOINT_SERIES) top[i] = top[i - 1], sizes[i] = sizes[i - 1];
      i--;
    }
    if (i < TELEMETRY_CHECKPOINT_SERIES) top[i] = k, sizes[i] = size;
  }
}

static void collect_checkpoints(struct daemon *d, struct collection *c) {
  struct reg_counts rc;
  reg_counts(d->reg, &rc);
  size_t n = 0;
  uint64_t all_bytes = 0, all_cached = 0;
  for (struct reg_ckpt *k = reg_first(d->reg); k != NULL; k = k->next) {
    if (k->state != REG_OPEN) continue;
    n++;
    all_bytes += checkpoint_size(k);
    all_cached += k->page_cache_known ? k->page_cache_bytes : 0;
  }
  struct family *f = family(c, "weightd_checkpoints_open", "gauge", "Checkpoints open (validated and mapped).");
  sample(c, f, (double)n, NULL);
  struct reg_ckpt *top[TELEMETRY_CHECKPOINT_SERIES];
  uint64_t sizes[TELEMETRY_CHECKPOINT_SERIES];
  size_t ntop;
  largest_checkpoints(d, top, sizes, &ntop);
  f = family(c, "weightd_checkpoint_bytes", "gauge",
             "Shard bytes of each open checkpoint (the largest " TELEMETRY_CHECKPOINT_SERIES_TEXT "; the rest in "
             "weightd_checkpoints_unlisted_bytes).");
  struct family *res = family(c, "weightd_checkpoint_page_cache_bytes", "gauge",
                              "Shard bytes in the page cache, measured at most every 30 s (the checkpoints of "
                              "weightd_checkpoint_bytes).");
  uint64_t listed_bytes = 0, listed_cached = 0;
  for (size_t i = 0; i < ntop; i++) {
    sample(c, f, (double)sizes[i], "path", top[i]->path, NULL);
    listed_bytes += sizes[i];
    if (!top[i]->page_cache_known) continue;
    sample(c, res, (double)top[i]->page_cache_bytes, "path", top[i]->path, NULL);
    listed_cached += top[i]->page_cache_bytes;
  }
  f = family(c, "weightd_checkpoints_unlisted", "gauge",
             "Open checkpoints without series of their own (beyond the largest " TELEMETRY_CHECKPOINT_SERIES_TEXT ").");
  sample(c, f, (double)(n - ntop), NULL);
  f = family(c, "weightd_checkpoints_unlisted_bytes", "gauge", "Shard bytes of the unlisted checkpoints, together.");
  sample(c, f, (double)(all_bytes - listed_bytes), NULL);
  f = family(c, "weightd_checkpoints_unlisted_page_cache_bytes", "gauge",
             "Page-cache bytes last measured of the unlisted checkpoints, together.");
  sample(c, f, (double)(all_cached - listed_cached), NULL);
  f = family(c, "weightd_checkpoint_charged_bytes", "gauge",
             "Memory open checkpoints are charged (parsed headers and tables, mappings), against checkpoint_memory.");
  sample(c, f, (double)rc.charged, NULL);
  f = family(c, "weightd_checkpoint_mappings", "gauge",
             "Shard mappings of open checkpoints, against a quarter of vm.max_map_count.");
  sample(c, f, (double)rc.maps, NULL);
  f = family(c, "weightd_checkpoints_closed_total", "counter",
             "Checkpoints the daemon closed by itself: unused for checkpoint_idle_ms (idle), or idle and least "
             "recently used when an open needed room under a bound (room).");
  sample(c, f, (double)rc.closed_idle, "reason", "idle", NULL);
  sample(c, f, (double)rc.closed_room, "reason", "room", NULL);
  f = family(c, "weightd_checkpoint_opens_refused_total", "counter",
             "Opens answered LIMIT by a bound on open checkpoints (none of the holder's was idle).");
  sample(c, f, (double)rc.refused, NULL);
  f = family(c, "weightd_plans_reused_total", "counter",
             "Loads and attaches by path whose plan key a checkpoint remembered, so no plan was built.");
  sample(c, f, (double)rc.plans_reused, NULL);
  f = family(c, "weightd_pinned_bytes", "gauge", "Checkpoint bytes registered for direct DMA (the pinned tier).");
  sample(c, f, (double)reg_pinned_bytes(d->reg), NULL);
  f = family(c, "weightd_pin_budget_bytes", "gauge", "The pinned tier's budget (host_pin_budget).");
  sample(c, f, (double)reg_pin_budget(d->reg), NULL);
}

static void collect_daemon(struct daemon *d, struct collection *c) {
  struct family *f = family(c, "weightd_errors_total", "counter", "Error replies sent, by code.");
  for (int i = 1; i < DAEMON_ERROR_SLOTS; i++) {
    const char *name = weightd_err_name(-i);
    if (strcmp(name, "UNKNOWN") != 0) sample(c, f, (double)d->stats.errors[i], "code", name, NULL);
  }
  f = family(c, "weightd_connections", "gauge", "Client connections open.");
  sample(c, f, (double)d->stats.connections, NULL);
  f = family(c, "weightd_requests_total", "counter", "Requests started.");
  sample(c, f, (double)d->stats.requests, NULL);
  f = family(c, "weightd_requests_in_flight", "gauge", "Requests started and not finished.");
  sample(c, f, (double)d->stats.requests_inflight, NULL);
  f = family(c, "weightd_reply_bytes_queued", "gauge", "Reply bytes queued for clients and not yet sent.");
  sample(c, f, (double)d->stats.output_queued, NULL);
  f = family(c, "weightd_reply_disconnects_total", "counter",
             "Connections closed for replies they left unread, by the limit: twice max_queued_output (connection), "
             "twice max_uid_queued_output (uid), max_total_queued_output (total).");
  static const char *const reply_limits[REPLY_LIMIT_COUNT] = {"connection", "uid", "total"};
  for (int i = 0; i < REPLY_LIMIT_COUNT; i++)
    sample(c, f, (double)d->stats.reply_disconnects[i], "limit", reply_limits[i], NULL);
  f = family(c, "weightd_progress_events_dropped_total", "counter",
             "Progress events not sent because their client did not read its replies.");
  sample(c, f, (double)d->stats.events_dropped, NULL);
  f = family(c, "weightd_open_fds", "gauge", "Open file descriptors of the daemon.");
  sample(c, f, open_fds(d->stats.fd_limit), NULL);
  f = family(c, "weightd_max_fds", "gauge", "The daemon's descriptor limit (RLIMIT_NOFILE).");
  sample(c, f, (double)d->stats.fd_limit, NULL);
  f = family(c, "weightd_ready", "gauge", "1 when /readyz answers 200.");
  sample(c, f, telemetry_ready(d, NULL, 0) ? 1 : 0, NULL);
  f = family(c, "weightd_build_info", "gauge", "The build: version and backend.");
  sample(c, f, 1, "version", weightd_version_string(), "backend", d->backend_name, NULL);
  f = family(c, "weightd_uptime_seconds", "gauge", "Seconds since the daemon started serving.");
  sample(c, f, (double)(clock_ms() - d->started_ms) / 1000.0, NULL);
}

/* The range-GET engine's counters (remote roots configured only). */
static void collect_remote(struct daemon *d, struct collection *c) {
  if (d->remote == NULL) return;
  struct rf_stats st;
  rf_client_stats(rroots_client(d->remote), &st);
  struct family *f = family(c, "weightd_remote_bytes_total", "counter",
                            "Body bytes fetched from object stores and HTTP servers (remote roots).");
  sample(c, f, (double)st.bytes, NULL);
  f = family(c, "weightd_remote_responses_total", "counter",
             "Responses from remote roots by status class (none: no status line, a reset or a timeout).");
  static const char *const classes[6] = {"none", "1xx", "2xx", "3xx", "4xx", "5xx"};
  for (int i = 0; i < 6; i++) sample(c, f, (double)st.requests[i], "class", classes[i], NULL);
  f = family(c, "weightd_remote_retries_total", "counter", "Range requests tried again (5xx, 429, resets, stalls).");
  sample(c, f, (double)st.retries, NULL);
  f = family(c, "weightd_remote_stalls_total", "counter", "Requests cut for delivering no byte for the stall time.");
  sample(c, f, (double)st.stalls, NULL);
  f = family(c, "weightd_remote_requests_in_flight", "gauge", "Remote requests submitted and not yet completed.");
  sample(c, f, (double)st.in_flight, NULL);
}

static void collect(struct daemon *d, struct collection *c) {
  telemetry_refresh(d);
  collect_loads(d, c);
  collect_devices(d, c);
  collect_checkpoints(d, c);
  collect_daemon(d, c);
  collect_remote(d, c);
}

/* ---- rendering ---------------------------------------------------------------------------- */

struct text {
  char *s;
  size_t n, cap;
  bool failed;
};

static void put(struct text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(struct text *t, const char *fmt, ...) {
  for (int tries = 0; tries < 2 && !t->failed; tries++) {
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(t->s ? t->s + t->n : NULL, t->s ? t->cap - t->n : 0, fmt, ap);
    va_end(ap);
    if (w < 0) {
      t->failed = true;
      return;
    }
    if (t->s != NULL && (size_t)w < t->cap - t->n) {
      t->n += (size_t)w;
      return;
    }
    size_t cap = (t->cap ? t->cap * 2 : 16384) + (size_t)w;
    char *ns = realloc(t->s, cap);
    if (ns == NULL) {
      t->failed = true;
      return;
    }
    t->s = ns;
    t->cap = cap;
  }
}

/* A value as the text format writes it: integers exactly, others with 17 digits. */
static void put_value(struct text *t, double v) {
  if (v >= 0 && v < 9007199254740992.0 && v == (double)(uint64_t)v) put(t, "%" PRIu64, (uint64_t)v);
  else put(t, "%.17g", v);
}

/* A label value as the text format writes it: \\, \" and \n escaped, nothing cut. */
static void put_escaped(struct text *t, const char *v) {
  while (*v != '\0') {
    size_t run = strcspn(v, "\\\"\n");
    if (run > 0) put(t, "%.*s", (int)run, v);
    v += run;
    if (*v == '\0') break;
    put(t, "\\%c", *v == '\n' ? 'n' : *v);
    v++;
  }
}

/* '{k="v",k2="v2"}', or nothing for a sample without labels. */
static void put_labels(struct text *t, const struct sample *s) {
  for (int i = 0; i < s->nlabels; i++) {
    put(t, "%s%s=\"", i == 0 ? "{" : ",", s->names[i]);
    put_escaped(t, s->values[i]);
    put(t, "\"");
  }
  if (s->nlabels > 0) put(t, "}");
}

char *telemetry_prometheus(struct daemon *d) {
  struct collection c = {0};
  collect(d, &c);
  struct text t = {0};
  put(&t, "%s", "");
  for (size_t i = 0; i < c.n; i++) {
    const struct family *f = &c.f[i];
    if (f->help != NULL) put(&t, "# HELP %s %s\n# TYPE %s %s\n", f->name, f->help, f->name, f->type);
    const char *metric = f->name;
    bool bucket = f->type != NULL && strcmp(f->type, "histogram") == 0;
    for (size_t k = 0; k < f->n; k++) {
      put(&t, "%s%s", metric, bucket ? "_bucket" : "");
      put_labels(&t, &f->v[k]);
      put(&t, " ");
      put_value(&t, f->v[k].value);
      put(&t, "\n");
    }
  }
  collection_free(&c);
  if (t.failed) {
    free(t.s);
    return NULL;
  }
  return t.s;
}

static cJSON *labels_json(const struct sample *s) {
  cJSON *o = cJSON_CreateObject();
  for (int i = 0; o != NULL && i < s->nlabels; i++) cJSON_AddStringToObject(o, s->names[i], s->values[i]);
  return o;
}

cJSON *telemetry_json(struct daemon *d, bool paths) {
  struct collection c = {.no_paths = !paths};
  collect(d, &c);
  cJSON *out = cJSON_CreateObject();
  cJSON *fam = NULL;
  for (size_t i = 0; out != NULL && i < c.n; i++) {
    const struct family *f = &c.f[i];
    if (f->help != NULL) { /* a family of its own; _sum and _count belong to the histogram before them */
      fam = cJSON_AddObjectToObject(out, f->name);
      cJSON_AddStringToObject(fam, "type", f->type);
      cJSON_AddStringToObject(fam, "help", f->help);
      cJSON_AddArrayToObject(fam, "samples");
    }
    if (fam == NULL) continue;
    if (f->help == NULL) { /* _sum / _count of the histogram */
      cJSON_AddNumberToObject(fam, strstr(f->name, "_sum") ? "sum" : "count", f->n ? f->v[0].value : 0);
      continue;
    }
    cJSON *samples = cJSON_GetObjectItemCaseSensitive(fam, "samples");
    for (size_t k = 0; k < f->n; k++) {
      cJSON *s = cJSON_CreateObject();
      cJSON_AddItemToObject(s, "labels", labels_json(&f->v[k]));
      double v = f->v[k].value;
      if (v >= 0 && v < 9007199254740992.0 && v == (double)(uint64_t)v) json_u64_add(s, "value", (uint64_t)v);
      else cJSON_AddNumberToObject(s, "value", v);
      cJSON_AddItemToArray(samples, s);
    }
  }
  collection_free(&c);
  return out;
}
