/*
 * loader.c - moving a plan's bytes from the shard mappings into a slab.
 *
 * Three ways, chosen per load:
 *   direct  a GPU slab, and every source byte the plan reads lies in ranges
 *           registered with the GPU (the pinned-resident tier: a whole
 *           checkpoint, or the ranges of one plan): the copy engines read the
 *           mappings themselves, 2D copies for strided pieces, never one copy
 *           across two registrations; no CPU copy at all.
 *   memcpy  the backend's slab is host memory (host backend): fill threads
 *           gather slab windows straight from the mappings into the slab.
 *   staged  otherwise (loader_staged.c): fill threads fill each window of
 *           the plan's staging schedule (plan_stage.h: the slab image, or
 *           strided pieces as whole source rows) into a pinned staging slot,
 *           a stream copies the slot to the GPU (2D for whole rows) while
 *           the next slots fill; the only wait is for a slot's previous
 *           transfers.
 * With several devices, multigpu.c is asked first: it may copy a replica
 * from a peer's copy, or stripe the load over idle neighbours' links.
 *
 * The ready watermark (ld_target.ready_bytes, for early attach) promises that
 * every slab byte below it holds its final value, on the device: memcpy
 * raises it over the finished prefix of fill tasks; staged over the prefix of
 * the schedule's windows whose transfers are known complete (the slot's event
 * waited for: by the next window that reuses the slot, at a test-gate stop,
 * or in the final drain), each window being one contiguous slab range; direct
 * at sync points, after every stream has drained. Replicas and striped loads
 * (multigpu.c) raise it once, at the end, and never stop at the test gate.
 * The last byte is published only after ckpt_check_unchanged passed, so a
 * wait for the whole slab never succeeds for bytes a STALE load copied.
 *
 * Gathering is one routine: plan_gather writes the slab image of [lo, hi),
 * which is each output's pieces in order (rows of strided pieces one after
 * another) and zeros in the alignment gaps; plan_stage_fill uses it for the
 * staged windows. Every read of a mapping runs under the SIGBUS guard
 * (fault.h) so that a truncated shard fails the load, not the daemon.
 *
 * DESIGN (threads): ld_fill runs on a job thread and owns the target's slab
 * until it returns; it reads only the loader (immutable after ld_create, but
 * for the staging slots) and the target. Fill tasks run on the fill pool and
 * write disjoint byte ranges; the first error wins under `lock`. Each GPU's
 * staging slots, streams and events belong to one load at a time
 * (`staging.lock`). Progress is the target's atomic bytes_done, the ready
 * watermark its atomic ready_bytes (raised by whichever thread learns that a
 * prefix of the slab is complete: a compare-and-swap that only grows it);
 * cancellation is its atomic cancel flag, checked between windows.
 */
#include "loader_internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "base/fault.h"
#include "load_source.h"
#include "base/log.h"
#include "multigpu.h"

/* Bytes one direct copy moves at most (keeps progress and cancellation responsive). */
#define LD_DIRECT_CHUNK (256ull << 20)
/* Bytes a direct load issues between sync points, where the ready watermark moves (one drain each, ~10 ms of copies). */
#define LD_DIRECT_SYNC (512ull << 20)

/* ---- gathering ---------------------------------------------------------------- */

struct gather_args {
  const struct ld_target *set;
  const unsigned char *const *data; /* per shard: its data section in the mapping */
  uint64_t lo, hi;
  unsigned char *dst; /* receives slab bytes [lo, hi) */
};

static int gather_range(void *arg) {
  struct gather_args *g = arg;
  plan_gather(g->set->plan, g->data, g->lo, g->hi, g->dst);
  return 0;
}

/* ---- a run of fill tasks ---------------------------------------------------------- */

struct window_fill {
  struct loader *ld;
  struct ld_target *set;
  const unsigned char **data; /* per shard: its data section in the mapping */
  uint64_t lo, hi; /* the window being gathered */
  unsigned char *dst;
  size_t ntasks;
  uint64_t task;
  pthread_mutex_t lock;    /* guards rc, err, finished, next */
  unsigned char *finished; /* per task */
  size_t next;             /* tasks [0, next) have all finished */
  int rc;
  struct wd_error err;
};

static void fill_task(void *arg, size_t i) {
  struct window_fill *r = arg;
  pthread_mutex_lock(&r->lock);
  int failed = r->rc != 0;
  pthread_mutex_unlock(&r->lock);
  if (failed) return;
  uint64_t a = r->lo + (uint64_t)i * r->task;
  uint64_t b = a + r->task < r->hi ? a + r->task : r->hi;
  struct gather_args g = {r->set, r->data, a, b, r->dst + (a - r->lo)};
  if (fault_call(gather_range, &g) != 0) {
    pthread_mutex_lock(&r->lock);
    if (r->rc == 0) r->rc = ld_fault_error(r->set, a, &r->err);
    pthread_mutex_unlock(&r->lock);
    return;
  }
  atomic_fetch_add(&r->set->bytes_done, b - a);
  /* The window's tasks finish in any order; the watermark covers the finished prefix. */
  pthread_mutex_lock(&r->lock);
  r->finished[i] = 1;
  size_t before = r->next;
  while (r->next < r->ntasks && r->finished[r->next]) r->next++;
  uint64_t upto = r->lo + (uint64_t)r->next * r->task;
  int moved = r->next != before;
  pthread_mutex_unlock(&r->lock);
  if (moved) ld_publish_ready(r->set, upto < r->hi ? upto : r->hi);
}

/* Gathers slab bytes [lo, hi) into dst on the fill threads, counting progress. */
static int fill_window(struct loader *ld, struct ld_target *s, const unsigned char **data, uint64_t lo,
                       uint64_t hi, unsigned char *dst, struct wd_error *err) {
  struct window_fill r = {.ld = ld, .set = s, .data = data, .lo = lo, .hi = hi, .dst = dst};
  r.task = ld_task_bytes(ld, hi - lo);
  r.ntasks = (size_t)((hi - lo + r.task - 1) / r.task);
  r.finished = calloc(r.ntasks ? r.ntasks : 1, 1);
  if (r.finished == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  pthread_mutex_init(&r.lock, NULL);
  fill_run(ld->fill, r.ntasks, fill_task, &r);
  pthread_mutex_destroy(&r.lock);
  free(r.finished);
  if (r.rc != 0) *err = r.err;
  return r.rc;
}

/* ---- memcpy: the slab is host memory ------------------------------------------------ */

static int fill_memcpy(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  const uint64_t window = 256ull << 20; /* cancellation is checked between windows */
  const unsigned char **data = ld_shard_data(s);
  if (data == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  int gate = ld_gate_open(ld);
  int rc = 0;
  for (uint64_t lo = 0; lo < s->plan->slab_bytes && rc == 0; lo += window) {
    if ((rc = ld_gate_pass(&gate, s, err)) != 0 || (rc = ld_check_cancel(s, err)) != 0) break;
    uint64_t hi = lo + window < s->plan->slab_bytes ? lo + window : s->plan->slab_bytes;
    rc = fill_window(ld, s, data, lo, hi, (unsigned char *)s->slab->host_view + lo, err);
  }
  if (gate >= 0) close(gate);
  free(data);
  return rc;
}

/* ---- direct: the copy engines read the registered mappings ---------------------------- */

/* Copies `len` contiguous source bytes at file offset `off` to slab offset dst, one registration at a time. */
static int direct_span(struct loader *ld, struct ld_target *s, uint32_t shard, uint64_t off, uint64_t len,
                       uint64_t dst, struct wd_stream *stream, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  const unsigned char *map = s->ck->maps[shard];
  int rc = 0;
  for (uint64_t done = 0; done < len && rc == 0;) {
    uint64_t run = ld_pinned_run(s, shard, off + done);
    uint64_t m = len - done;
    if (run < m) m = run;
    if (m > LD_DIRECT_CHUNK) m = LD_DIRECT_CHUNK;
    if (m == 0) return err_set(err, WEIGHTD_E_INTERNAL, "a direct copy reached unregistered bytes");
    rc = ops->copy_h2d(ld->backend->ctx, s->slab, dst + done, (size_t)m, map + off + done, (size_t)m, (size_t)m, 1,
                       stream, err);
    done += m;
  }
  return rc;
}

/* Copies a strided piece: 2D copies of the rows that lie in one registration, rows split where one straddles two. */
static int direct_rows(struct loader *ld, struct ld_target *s, const struct plan_piece *pc, uint64_t dst,
                       struct wd_stream *stream, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  uint32_t shard = pc->src->shard;
  uint64_t base = ld_piece_file_off(s, pc);
  const unsigned char *map = s->ck->maps[shard];
  int rc = 0;
  for (uint64_t r = 0; r < pc->height && rc == 0;) {
    uint64_t a = base + r * pc->src_pitch, run = ld_pinned_run(s, shard, a);
    if (run < pc->width) { /* this row crosses into the next registration */
      rc = direct_span(ld, s, shard, a, pc->width, dst + r * pc->width, stream, err);
      r++;
      continue;
    }
    uint64_t n = (run - pc->width) / pc->src_pitch + 1;
    if (n > pc->height - r) n = pc->height - r;
    rc = ops->copy_h2d(ld->backend->ctx, s->slab, dst + r * pc->width, (size_t)pc->width, map + a,
                       (size_t)pc->src_pitch, (size_t)pc->width, (size_t)n, stream, err);
    r += n;
  }
  return rc;
}

/* Waits for every copy issued on the staging streams; keeps the first error in rc/err. */
static int direct_sync(struct loader *ld, struct staging *st, int rc, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  for (size_t k = 0; k < st->nslots; k++) {
    struct wd_error e2 = {0};
    int r2 = ops->event_record(ld->backend->ctx, st->events[k], st->streams[k], &e2);
    if (r2 == 0) r2 = ops->event_wait(ld->backend->ctx, st->events[k], &e2);
    if (rc == 0 && r2 != 0) {
      rc = r2;
      *err = e2;
    }
  }
  return rc;
}

/*
 * Copies output by output, piece by piece, round robin over the streams
 * (zeros synchronously). The watermark moves at sync points: after an output
 * that ends LD_DIRECT_SYNC bytes or more past the last one, every stream is
 * drained, and then everything before that output's end is in place.
 */
/* Writes zeros to slab bytes [dst, dst + len) (a synchronous copy from a static page of zeros). */
static int zero_span(const struct wd_backend *b, struct wd_slab *slab, uint64_t dst, uint64_t len,
                     struct wd_error *err) {
  static const unsigned char zeros[1u << 16];
  int rc = 0;
  for (uint64_t off = 0; off < len && rc == 0; off += sizeof zeros) {
    size_t m = len - off < sizeof zeros ? (size_t)(len - off) : sizeof zeros;
    rc = b->ops->copy_h2d(b->ctx, slab, dst + off, m, zeros, m, m, 1, NULL, err);
  }
  return rc;
}

static int fill_direct(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  struct staging *st = &ld->stagings[s->device];
  pthread_mutex_lock(&st->lock);
  int rc = 0;
  size_t n = 0;
  uint64_t synced = 0; /* slab bytes below the last sync point */
  uint64_t written = 0; /* slab bytes below the end of the last output */
  const struct plan *p = s->plan;
  for (size_t o = 0; o < p->noutputs && rc == 0; o++) {
    uint64_t dst = p->outputs[o].offset;
    /* The alignment gap before it: zero, as the other methods leave it. */
    if (dst > written) rc = zero_span(ld->backend, s->slab, written, dst - written, err);
    written = dst + p->outputs[o].nbytes;
    for (size_t k = 0; k < p->outputs[o].npieces && rc == 0; k++) {
      const struct plan_piece *pc = &p->outputs[o].pieces[k];
      uint64_t len = pc->width * pc->height;
      if ((rc = ld_check_cancel(s, err)) != 0) break;
      struct wd_stream *stream = st->streams[n++ % st->nslots];
      if (pc->src == NULL) {
        rc = zero_span(ld->backend, s->slab, dst, len, err);
      } else if (len == 0) {
        /* nothing to copy */
      } else if (pc->height <= 1 || pc->src_pitch == pc->width) {
        rc = direct_span(ld, s, pc->src->shard, ld_piece_file_off(s, pc), len, dst, stream, err);
      } else {
        rc = direct_rows(ld, s, pc, dst, stream, err);
      }
      dst += len;
      atomic_fetch_add(&s->bytes_done, len);
    }
    /* A sync point: what was issued up to here has landed, so the watermark may pass it. */
    uint64_t end = p->outputs[o].offset + p->outputs[o].nbytes;
    if (rc == 0 && end - synced >= LD_DIRECT_SYNC && (rc = direct_sync(ld, st, rc, err)) == 0) {
      synced = end;
      ld_publish_ready(s, end);
    }
  }
  if (rc == 0 && p->slab_bytes > written) rc = zero_span(ld->backend, s->slab, written, p->slab_bytes - written, err);
  rc = direct_sync(ld, st, rc, err);
  pthread_mutex_unlock(&st->lock);
  return rc;
}

/* ---- entry points ------------------------------------------------------------------------ */

bool ld_can_direct(const struct loader *ld) { return ld->stagings != NULL && ld->method != CFG_LOAD_STAGED; }

int ld_fill(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  int rc;
  s->source_device = -1;
  s->nshares = 0;
  if (s->slab == NULL) { /* else a load run again: it refills the slab that clients may map already */
    double t0 = clock_s();
    rc = ops->slab_alloc(ctx, s->device, s->plan->slab_bytes, &s->slab, err);
    s->alloc_seconds = clock_s() - t0;
    if (rc != 0) {
      s->slab = NULL;
      return rc;
    }
    if (s->allocated != NULL) s->allocated(s);
  }
  fill_set_home(ld->nodes != NULL ? ld->nodes[s->device] : -1); /* fill threads near the device first */
  bool filled = false;
  rc = mg_fill(ld->mg, s, &filled, err); /* a replica from a peer, or striped over neighbours */
  if (rc != 0 || filled) {
    /* mg_fill moved the bytes, or failed: nothing more to copy */
  } else if (ld->method == CFG_LOAD_STAGED) {
    s->method = "staged";
    rc = ld_fill_staged(ld, s, err);
  } else if (ld->stagings != NULL && ld_plan_pinned(s)) {
    s->method = "direct";
    rc = fill_direct(ld, s, err);
  } else if (s->slab->host_view != NULL) {
    s->method = "memcpy";
    rc = fill_memcpy(ld, s, err);
  } else {
    s->method = "staged";
    rc = ld_fill_staged(ld, s, err);
  }
  if (rc == 0) atomic_store(&s->bytes_done, s->plan->slab_bytes);
  /* A shard rewritten while we copied would have given a mix of old and new bytes. */
  if (rc == 0) rc = ckpt_check_unchanged(s->ck->ck, err);
  if (rc == 0) ld_publish_final(s);
  if (rc == 0 && ops->slab_seal != NULL) rc = ops->slab_seal(ctx, s->slab, err);
  fill_set_home(-1);
  return rc;
}

void ld_reserve(struct loader *ld, int device) {
  if (ld != NULL) mg_reserve(ld->mg, device);
}

void ld_unreserve(struct loader *ld, int device) {
  if (ld != NULL) mg_release(ld->mg, device);
}

int ld_create(const struct ld_params *p, struct loader **out, struct wd_error *err) {
  struct loader *ld = calloc(1, sizeof *ld);
  if (ld == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  ld->backend = p->backend;
  ld->fill = p->fill;
  ld->mg = p->mg;
  ld->method = p->method;
  ld->strided = p->strided;
  ld->writes = p->writes;
  *out = ld;
  if (p->test_load_gate != NULL && p->test_load_gate[0] != '\0') {
    if ((ld->gate = strdup(p->test_load_gate)) == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    log_msg(LOG_WARN, "test_load_gate %s: loads wait for it at every window (for tests only)", ld->gate);
  }
  if (p->device_nodes != NULL && p->ndevices > 0) {
    if ((ld->nodes = malloc((size_t)p->ndevices * sizeof *ld->nodes)) == NULL)
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    memcpy(ld->nodes, p->device_nodes, (size_t)p->ndevices * sizeof *ld->nodes);
  }
  ld->ndevices = p->ndevices;
  ld->staging_slots = p->staging_slots;
  ld->staging_slot_bytes = p->staging_slot_bytes;
  ld->place = p->place;
  ld->place_arg = p->place_arg;
  return 0;
}

int ld_staging_start(struct loader *ld, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  if (ld->stagings != NULL) return 0;
  /* Host slabs are filled in place and need no staging, unless staging is forced. */
  if ((ops->caps & WD_CAP_HOST_SLABS) && ld->method != CFG_LOAD_STAGED) return 0;
  ld->stagings = calloc((size_t)ld->ndevices, sizeof *ld->stagings);
  if (ld->stagings == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (int d = 0; d < ld->ndevices; d++) {
    struct staging *st = &ld->stagings[d];
    pthread_mutex_init(&st->lock, NULL);
    ld->nstagings = d + 1;
    st->nslots = ld->staging_slots;
    st->slot_bytes = ld->staging_slot_bytes;
    st->slots = calloc(st->nslots, sizeof *st->slots);
    st->streams = calloc(st->nslots, sizeof *st->streams);
    st->events = calloc(st->nslots, sizeof *st->events);
    if (st->slots == NULL || st->streams == NULL || st->events == NULL)
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    if (ld->place != NULL) ld->place(ld->place_arg, d);
    unsigned flags = ld->writes == LD_WRITES_WRITE_COMBINED ? WD_PINNED_WRITE_COMBINED : 0;
    for (size_t k = 0; k < st->nslots; k++) {
      int rc = ops->pinned_alloc(ctx, d, st->slot_bytes, flags, &st->slots[k], err);
      if (rc == 0) rc = ops->stream_create(ctx, d, &st->streams[k], err);
      if (rc == 0) rc = ops->event_create(ctx, d, &st->events[k], err);
      if (rc != 0) return err_prefix(err, "staging slot %zu of GPU %d", k, d);
    }
    log_msg(LOG_INFO, "device %d: %zu pinned staging slots of %zu MiB", d, st->nslots, st->slot_bytes >> 20);
  }
  return 0;
}

void ld_destroy(struct loader *ld) {
  if (ld == NULL) return;
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  for (int d = 0; d < ld->nstagings; d++) {
    struct staging *st = &ld->stagings[d];
    for (size_t k = 0; k < st->nslots; k++) {
      if (st->events && st->events[k]) ops->event_destroy(ctx, st->events[k]);
      if (st->streams && st->streams[k]) ops->stream_destroy(ctx, st->streams[k]);
      if (st->slots && st->slots[k]) ops->pinned_free(ctx, d, st->slots[k]);
    }
    free(st->slots);
    free(st->streams);
    free(st->events);
    pthread_mutex_destroy(&st->lock);
  }
  free(ld->stagings);
  free(ld->gate);
  free(ld->nodes);
  free(ld);
}
