/*
 * loader.c - choosing how a load moves its bytes, and the in-place way.
 *
 * A load reads through one source (source.h), chosen per load (t->choice):
 * the checkpoint's mmap source, O_DIRECT, or for auto past
 * LD_AUTO_DIRECT_PERCENT of host memory a route that takes warm ranges from
 * the page cache and the rest with O_DIRECT. Then one of these ways:
 *   replica  multi.c: a peer's copy, device to device;
 *   striped  multi.c: the pipeline over several devices' host links;
 *   direct   every source byte the plan reads lies in ranges registered with
 *            the GPU (the pinned-resident tier), and the load reads the
 *            mappings: the pipeline's direct windows, no CPU copy;
 *   memcpy   the backend's slab is host memory (host backend): fill threads
 *            read slab windows from the source straight into the slab;
 *   staged   otherwise: the pipeline's staged windows through the GPU's
 *            pinned slots (pipeline.c).
 *
 * The ready watermark (ld_target.ready_bytes, for early attach) promises that
 * every slab byte below it holds its final value, on the device: memcpy
 * raises it over the finished prefix of fill tasks; the pipeline over the
 * prefix of the schedule's windows whose transfers are known complete;
 * replicas once, at the end. The last byte is published only after the
 * source said its files are unchanged, so a wait for the whole slab never
 * succeeds for bytes a STALE load copied.
 *
 * DESIGN (threads): ld_fill runs on a job thread and owns the target's slab
 * until it returns; it reads only the loader (immutable after
 * ld_staging_start, but for the links, each taken by one load at a time with
 * its lock, and the busy counts, atomics) and the target. Fill tasks run on
 * the fill pool and write disjoint byte ranges; the first error wins under
 * the window's `lock`. Progress is the target's atomic bytes_done,
 * cancellation its atomic cancel flag, checked between windows and tasks.
 */
#include "internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/fault.h"
#include "base/hostmem.h"
#include "base/log.h"
#include "base/topology.h"
#include "clock.h"

static const char *const method_names[LD_METHOD_COUNT] = {
    [LD_METHOD_MEMCPY] = "memcpy", [LD_METHOD_STAGED] = "staged",   [LD_METHOD_DIRECT] = "direct",
    [LD_METHOD_PEER] = "peer",     [LD_METHOD_STRIPED] = "striped",
};

const char *ld_method_name(enum ld_method m) { return (unsigned)m < LD_METHOD_COUNT ? method_names[m] : "?"; }

/* ---- memcpy: the slab is host memory --------------------------------------------------- */

struct window_fill {
  struct ld_target *t;
  const struct ld_source *src;
  uint64_t lo, hi; /* the window being read */
  unsigned char *dst;
  size_t ntasks;
  uint64_t task;
  pthread_mutex_t lock;    /* guards rc, err, finished, next */
  unsigned char *finished; /* per task */
  size_t next;             /* tasks [0, next) have all finished */
  int rc;
  struct wd_error err;
};

struct image_args {
  const struct plan *plan;
  uint64_t lo, hi;
  unsigned char *dst;
  struct ld_reader *rd;
};

static int image_range(void *arg) {
  struct image_args *a = arg;
  int rc = plan_image_read(a->plan, a->lo, a->hi, a->dst, ld_reader_read, a->rd);
  return rc == 0 ? ld_reader_flush(a->rd) : rc;
}

static void memcpy_task(void *arg, size_t i) {
  struct window_fill *r = arg;
  pthread_mutex_lock(&r->lock);
  int failed = r->rc != 0;
  pthread_mutex_unlock(&r->lock);
  if (failed) return;
  uint64_t a = r->lo + (uint64_t)i * r->task;
  uint64_t b = a + r->task < r->hi ? a + r->task : r->hi;
  struct ld_reader rd = {.src = r->src, .copy = memcpy, .cancel = &r->t->cancel};
  struct image_args g = {r->t->plan, a, b, r->dst + (a - r->lo), &rd};
  int rc = fault_call(image_range, &g);
  ld_reader_clear(&rd);
  ld_count_reads(r->t, &rd);
  if (rc != 0) {
    struct wd_error err = rd.err;
    if (rc == WEIGHTD_E_FAULT) {
      ld_fault_error(r->t, a, &err);
    } else {
      const struct plan_output *o = plan_output_at(r->t->plan, a);
      err_prefix(&err, "tensor '%s'", o != NULL ? o->name : "?");
    }
    pthread_mutex_lock(&r->lock);
    if (r->rc == 0) {
      r->rc = rc;
      r->err = err;
    }
    pthread_mutex_unlock(&r->lock);
    return;
  }
  atomic_fetch_add(&r->t->bytes_done, b - a);
  /* The window's tasks finish in any order; the watermark covers the finished prefix. */
  pthread_mutex_lock(&r->lock);
  r->finished[i] = 1;
  size_t before = r->next;
  while (r->next < r->ntasks && r->finished[r->next]) r->next++;
  uint64_t upto = r->lo + (uint64_t)r->next * r->task;
  int moved = r->next != before;
  pthread_mutex_unlock(&r->lock);
  if (moved) ld_publish_ready(r->t, upto < r->hi ? upto : r->hi);
}

/* Reads slab bytes [lo, hi) into dst on the fill threads, counting progress. */
static int memcpy_window(struct loader *ld, struct ld_target *t, const struct ld_source *src, uint64_t lo,
                         uint64_t hi, unsigned char *dst, struct wd_error *err) {
  struct window_fill r = {.t = t, .src = src, .lo = lo, .hi = hi, .dst = dst};
  r.task = ld_task_bytes(ld, hi - lo, src);
  r.ntasks = (size_t)((hi - lo + r.task - 1) / r.task);
  r.finished = calloc(r.ntasks ? r.ntasks : 1, 1);
  if (r.finished == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  pthread_mutex_init(&r.lock, NULL);
  ld_pool_run(ld->pool, r.ntasks, memcpy_task, &r);
  pthread_mutex_destroy(&r.lock);
  free(r.finished);
  if (r.rc != 0) *err = r.err;
  return r.rc;
}

static int fill_memcpy(struct loader *ld, struct ld_target *t, const struct ld_source *src, struct wd_error *err) {
  const uint64_t window = 256ull << 20; /* cancellation is checked between windows */
  int gate = ld_gate_open(ld);
  int rc = 0;
  for (uint64_t lo = 0; lo < t->plan->slab_bytes && rc == 0; lo += window) {
    if ((rc = ld_gate_pass(&gate, t, err)) != 0 || (rc = ld_check_cancel(t, err)) != 0) break;
    uint64_t hi = lo + window < t->plan->slab_bytes ? lo + window : t->plan->slab_bytes;
    rc = memcpy_window(ld, t, src, lo, hi, (unsigned char *)t->slab->host_view + lo, err);
  }
  if (gate >= 0) close(gate);
  return rc;
}

/* ---- the source of a load ---------------------------------------------------------------- */

/* The sources a load opened for itself (closed when it ends): a direct source, a pagecache view, a route. */
struct opened {
  struct ld_source *v[3];
  size_t n;
};

static void opened_close(struct opened *o) {
  while (o->n > 0) ld_source_close(o->v[--o->n]);
}

/*
 * True when auto reads O_DIRECT: the plan's bytes exceed auto_direct_bytes,
 * or by default LD_AUTO_DIRECT_PERCENT of the host memory the daemon may use.
 */
static bool auto_direct(const struct loader *ld, const struct ld_target *t) {
  if (ld->auto_direct_bytes > 0) return t->plan->payload_bytes > ld->auto_direct_bytes;
  struct hostmem hm;
  hostmem_read(&hm);
  return hm.limit != UINT64_MAX && hm.limit > 0 && t->plan->payload_bytes > hm.limit / 100 * LD_AUTO_DIRECT_PERCENT;
}

/*
 * The source t reads through: t->mmap, or one opened for it (kept in o). A
 * filesystem that refuses O_DIRECT falls back to the mmap source, with a
 * log line. A remote checkpoint's source is its own whatever the choice. 0, or an error (a file replaced since the open: STALE).
 */
static int open_source(struct loader *ld, struct ld_target *t, struct opened *o, const struct ld_source **out,
                       struct wd_error *err) {
  *out = t->mmap;
  if (t->mmap->ops->kind == LD_SOURCE_REMOTE) return 0; /* no local files: the source choice is the files' */
  bool want_direct = t->choice == LD_CHOOSE_DIRECT || (t->choice == LD_CHOOSE_AUTO && auto_direct(ld, t));
  if (!want_direct) return 0;
  struct ld_source *direct = NULL;
  int rc = ld_source_direct_open(t->ck, ld->refuse_odirect, &direct, err);
  if (rc == WEIGHTD_E_UNSUPPORTED) {
    log_msg(LOG_WARN, "%s: %s: reading through the page cache (mmap) instead", t->name, err->msg);
    memset(err, 0, sizeof *err);
    return 0;
  }
  if (rc != 0) return rc;
  o->v[o->n++] = direct;
  if (t->choice == LD_CHOOSE_DIRECT) {
    *out = direct;
    return 0;
  }
  /* auto: what the page cache holds from there, the rest with O_DIRECT. */
  struct ld_source *warm = NULL, *route = NULL;
  if ((rc = ld_source_pagecache_open(t->mmap, &warm, err)) != 0) return rc;
  o->v[o->n++] = warm;
  struct ld_source *members[2] = {warm, direct};
  if ((rc = ld_source_route_open(members, 2, &route, err)) != 0) return rc;
  o->v[o->n++] = route;
  *out = route;
  return 0;
}

/* ---- entry points ------------------------------------------------------------------------ */

bool ld_can_direct(const struct loader *ld) { return ld->home != NULL && !ld->staged_only; }

bool ld_has_peers(const struct loader *ld) { return ld != NULL && ld->peers; }

/* The pipeline over the target's own link: its lock held while it runs. */
static int fill_own_link(struct loader *ld, struct ld_target *t, const struct ld_source *src, bool direct,
                         struct wd_error *err) {
  struct ld_link *l = &ld->home[t->device];
  pthread_mutex_lock(&l->lock);
  int rc = ld_pipe_run(ld, t, src, &l, NULL, 1, direct, err);
  pthread_mutex_unlock(&l->lock);
  return rc;
}

int ld_fill(struct loader *ld, struct ld_target *t, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  int rc;
  t->source_device = -1;
  t->nshares = 0;
  t->read_failed = false;
  atomic_store(&t->reading_kind, -1);
  atomic_store(&t->reading_device, -1);
  t->method = LD_METHOD_MEMCPY;
  t->verified_chunks = t->verify_mismatches = 0;
  atomic_store(&t->source_checked, 0);
  atomic_store(&t->source_mismatches, 0);
  bool verify = ld->verify && t->ck->manifest != NULL;
  for (int k = 0; k < LD_SOURCE_KINDS; k++) atomic_store(&t->source_bytes[k], 0);
  if (t->slab == NULL) { /* else a load run again: it refills the slab that clients may map already */
    double t0 = clock_s();
    rc = ops->slab_alloc(ctx, t->device, t->plan->slab_bytes, &t->slab, err);
    t->alloc_seconds = clock_s() - t0;
    if (rc != 0) {
      t->slab = NULL;
      return rc;
    }
    if (t->allocated != NULL) t->allocated(t);
  }
  /* Registered bytes are read by the copy engines, whatever the choice but an explicit O_DIRECT or source. */
  bool dma = ld_can_direct(ld) && t->choice != LD_CHOOSE_DIRECT && t->src == NULL && ld_plan_pinned(t);
  struct opened o = {.n = 0};
  const struct ld_source *src = t->src != NULL ? t->src : t->mmap;
  rc = dma || t->src != NULL ? 0 : open_source(ld, t, &o, &src, err);
  if (rc != 0) {
    opened_close(&o); /* what open_source opened before it failed */
    return rc;
  }
  /* A remote source checks every chunk against the manifest as it fetches it: nothing to check again after. */
  if (src->ops->kind == LD_SOURCE_REMOTE) verify = false;
  /* Early attachers see no byte until a check that could still fail the load is done (verify, or the set's
   * digests against the manifest's whole tensors). */
  t->hold_ready = verify || (ld->digests && t->ck->manifest != NULL);
  snprintf(t->source, sizeof t->source, "%s", src->label);
  t->source_kind = src->ops->kind;
  atomic_store(&t->reading_kind, (int)src->ops->kind);
  ld_pool_set_home(ld->nodes != NULL ? ld->nodes[t->device] : -1); /* fill threads near the device first */
  bool filled = false;
  rc = ld_multi_fill(ld, t, src, &filled, err); /* a replica from a peer, or striped over neighbours */
  if (rc != 0 || filled) {
    /* multi.c moved the bytes, or failed: nothing more to copy */
  } else if (ld->staged_only) {
    t->method = LD_METHOD_STAGED;
    rc = fill_own_link(ld, t, src, false, err);
  } else if (dma) {
    t->method = LD_METHOD_DIRECT;
    rc = fill_own_link(ld, t, src, true, err);
  } else if (t->slab->host_view != NULL) {
    t->method = LD_METHOD_MEMCPY;
    rc = fill_memcpy(ld, t, src, err);
  } else {
    t->method = LD_METHOD_STAGED;
    rc = fill_own_link(ld, t, src, false, err);
  }
  if (t->method == LD_METHOD_PEER) t->source[0] = '\0'; /* no host bytes were read */
  if (rc == 0) atomic_store(&t->bytes_done, t->plan->slab_bytes);
  /* verify on_load: the files hold what the manifest names (a host source's bytes: not after a replica). */
  if (rc == 0 && verify && t->method != LD_METHOD_PEER) rc = ld_verify(ld, t, src, err);
  t->verified_chunks += atomic_load(&t->source_checked);
  t->verify_mismatches += atomic_load(&t->source_mismatches);
  /* A shard rewritten while we copied (or verified) would have given a mix of old and new bytes. */
  if (rc == 0) rc = ld_source_unchanged(src, err);
  /* The set's own digests, for scrubs; whole tensors checked against the manifest (before the final watermark). */
  if (rc == 0) rc = ld_digest(ld, t, err);
  if (rc == 0) ld_publish_final(t);
  if (rc == 0 && ops->slab_seal != NULL) rc = ops->slab_seal(ctx, t->slab, err);
  ld_pool_set_home(-1);
  opened_close(&o);
  return rc;
}

void ld_reserve(struct loader *ld, int device) {
  if (ld != NULL && ld->busy != NULL) atomic_fetch_add(&ld->busy[device], 1);
}

void ld_unreserve(struct loader *ld, int device) {
  if (ld != NULL && ld->busy != NULL) atomic_fetch_sub(&ld->busy[device], 1);
}

int ld_busy(const struct loader *ld, int device) {
  return ld != NULL && ld->busy != NULL ? atomic_load(&ld->busy[device]) : 0;
}

/* ---- the loader and its memory -------------------------------------------------------------- */

int ld_create(const struct ld_params *p, struct loader **out, struct wd_error *err) {
  struct loader *ld = calloc(1, sizeof *ld);
  if (ld == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  *out = ld;
  ld->backend = p->backend;
  ld->pool = p->pool;
  ld->topo = p->topo;
  ld->ndevices = p->ndevices;
  ld->staged_only = p->staged_only;
  ld->strided = p->strided;
  ld->writes = p->writes;
  ld->staging_slots = p->staging_slots;
  ld->staging_slot_bytes = p->staging_slot_bytes;
  ld->refuse_odirect = p->test_refuse_odirect;
  ld->auto_direct_bytes = p->auto_direct_bytes;
  ld->verify = p->verify;
  ld->digests = p->digests;
  ld->place = p->place;
  ld->place_arg = p->place_arg;
  const struct wd_backend_ops *ops = p->backend->ops;
  ld->peers = p->topo != NULL && p->topo->ndev >= 2 && ops->copy_peer != NULL && ops->peer_query != NULL &&
              ops->scratch_alloc != NULL;
  ld->replicas = ld->peers && p->replicas;
  ld->striping = ld->peers && p->striping;
  ld->stripe_min_bytes = p->stripe_min_bytes;
  if ((ld->busy = calloc(p->ndevices > 0 ? (size_t)p->ndevices : 1, sizeof *ld->busy)) == NULL)
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (int d = 0; d < p->ndevices; d++) atomic_init(&ld->busy[d], 0);
  if (p->test_load_gate != NULL && p->test_load_gate[0] != '\0') {
    if ((ld->gate = strdup(p->test_load_gate)) == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    log_msg(LOG_WARN, "test_load_gate %s: loads wait for it at every window (for tests only)", ld->gate);
  }
  if (p->test_refuse_odirect) log_msg(LOG_WARN, "test_refuse_odirect: every O_DIRECT open fails (for tests only)");
  if (p->device_nodes != NULL && p->ndevices > 0) {
    if ((ld->nodes = malloc((size_t)p->ndevices * sizeof *ld->nodes)) == NULL)
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    memcpy(ld->nodes, p->device_nodes, (size_t)p->ndevices * sizeof *ld->nodes);
  }
  return 0;
}

/* Allocates a link of n slots of `bytes` on device d, with a bounce buffer per slot when lend. */
static int link_init(struct loader *ld, struct ld_link *l, int d, size_t n, uint64_t bytes, bool lend,
                     struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  pthread_mutex_init(&l->lock, NULL);
  l->device = d;
  l->nslots = n;
  l->slot_bytes = bytes;
  l->slots = calloc(n, sizeof *l->slots);
  l->streams = calloc(n, sizeof *l->streams);
  l->events = calloc(n, sizeof *l->events);
  if (lend) l->bounce = calloc(n, sizeof *l->bounce);
  if (l->slots == NULL || l->streams == NULL || l->events == NULL || (lend && l->bounce == NULL))
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  unsigned flags = ld->writes == LD_WRITES_WRITE_COMBINED ? WD_PINNED_WRITE_COMBINED : 0;
  for (size_t k = 0; k < n; k++) {
    int rc = ops->pinned_alloc(ctx, d, (size_t)bytes, flags, &l->slots[k], err);
    if (rc == 0 && lend) rc = ops->scratch_alloc(ctx, d, bytes, &l->bounce[k], err);
    if (rc == 0) rc = ops->stream_create(ctx, d, &l->streams[k], err);
    if (rc == 0) rc = ops->event_create(ctx, d, &l->events[k], err);
    if (rc != 0) return err_prefix(err, "%s slot %zu of device %d", lend ? "lending" : "staging", k, d);
  }
  return 0;
}

static void link_fini(struct loader *ld, struct ld_link *l) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  for (size_t k = 0; k < l->nslots; k++) {
    if (l->events && l->events[k]) ops->event_destroy(ctx, l->events[k]);
    if (l->streams && l->streams[k]) ops->stream_destroy(ctx, l->streams[k]);
    if (l->bounce && l->bounce[k]) ops->slab_free(ctx, l->bounce[k]);
    if (l->slots && l->slots[k]) ops->pinned_free(ctx, l->device, l->slots[k]);
  }
  free(l->slots);
  free(l->streams);
  free(l->events);
  free(l->bounce);
  pthread_mutex_destroy(&l->lock);
}

int ld_staging_start(struct loader *ld, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  if (ld->home != NULL || ld->lanes != NULL) return 0;
  int n = ld->ndevices;
  /* Host slabs are filled in place and need no staging, unless staging is forced or loads stripe. */
  bool home = !(ops->caps & WD_CAP_HOST_SLABS) || ld->staged_only || ld->striping;
  if (home) {
    if ((ld->home = calloc((size_t)n, sizeof *ld->home)) == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    int rc = ops->pinned_alloc(ctx, 0, LD_ZEROS, 0, &ld->zeros, err);
    if (rc != 0) return err_prefix(err, "pinned zeros");
    memset(ld->zeros, 0, LD_ZEROS);
    for (int d = 0; d < n; d++) {
      if (ld->place != NULL) ld->place(ld->place_arg, d);
      ld->nhome = d + 1;
      if ((rc = link_init(ld, &ld->home[d], d, ld->staging_slots, ld->staging_slot_bytes, false, err)) != 0) return rc;
      log_msg(LOG_INFO, "device %d: %zu pinned staging slots of %zu MiB", d, ld->staging_slots,
              ld->staging_slot_bytes >> 20);
    }
  }
  if (ld->striping) {
    if ((ld->lend = calloc((size_t)n, sizeof *ld->lend)) == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    for (int d = 0; d < n; d++) {
      if (ld->place != NULL) ld->place(ld->place_arg, d);
      ld->nlend = d + 1;
      int rc = link_init(ld, &ld->lend[d], d, LD_LEND_SLOTS, ld->staging_slot_bytes, true, err);
      if (rc != 0) return rc;
    }
    log_msg(LOG_INFO, "striping: every device lends its host link through %d pinned slots and %d bounce buffers of %zu MiB",
            LD_LEND_SLOTS, LD_LEND_SLOTS, ld->staging_slot_bytes >> 20);
  }
  if (ld->replicas) {
    if ((ld->lanes = calloc((size_t)n, sizeof *ld->lanes)) == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    for (int d = 0; d < n; d++) {
      pthread_mutex_init(&ld->lanes[d].lock, NULL);
      ld->nlanes = d + 1;
      int rc = ops->stream_create(ctx, d, &ld->lanes[d].stream, err);
      if (rc == 0) rc = ops->event_create(ctx, d, &ld->lanes[d].event, err);
      if (rc != 0) return err_prefix(err, "replica lane of device %d", d);
    }
  }
  return 0;
}

void ld_destroy(struct loader *ld) {
  if (ld == NULL) return;
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  for (int d = 0; d < ld->nhome; d++) link_fini(ld, &ld->home[d]);
  for (int d = 0; d < ld->nlend; d++) link_fini(ld, &ld->lend[d]);
  for (int d = 0; d < ld->nlanes; d++) {
    if (ld->lanes[d].event != NULL) ops->event_destroy(ctx, ld->lanes[d].event);
    if (ld->lanes[d].stream != NULL) ops->stream_destroy(ctx, ld->lanes[d].stream);
    pthread_mutex_destroy(&ld->lanes[d].lock);
  }
  if (ld->zeros != NULL) ops->pinned_free(ctx, 0, ld->zeros);
  free(ld->home);
  free(ld->lend);
  free(ld->lanes);
  free(ld->busy);
  free(ld->gate);
  free(ld->nodes);
  free(ld);
}
