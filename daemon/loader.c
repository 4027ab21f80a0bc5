/*
 * loader.c - moving a plan's bytes from the shard mappings into a slab.
 *
 * Three ways, chosen per load:
 *   memcpy  the backend's slab is host memory (host backend): fill threads
 *           gather slab windows straight from the mappings into the slab.
 *   staged  a GPU slab, checkpoint in the page cache only: fill threads
 *           gather each window of the slab image into a pinned staging slot,
 *           a stream copies the slot to the GPU while the next slot fills;
 *           the only wait is for a slot's previous transfer (its event).
 *   direct  a GPU slab, checkpoint registered with the GPU (the
 *           pinned-resident tier): the copy engines read the mappings
 *           themselves, 2D copies for strided pieces; no CPU copy at all.
 *
 * Gathering is one routine: gather() writes the slab image of [lo, hi), which
 * is each output's pieces in order (rows of strided pieces one after another)
 * and zeros in the alignment gaps, reading the mappings under the SIGBUS
 * guard (fault.h) so that a truncated shard fails the load, not the daemon.
 *
 * DESIGN (threads): ld_fill runs on a job thread and owns the target's slab
 * until it returns; it reads only the loader (immutable after ld_create, but
 * for the staging slots) and the target. Fill tasks run on the fill pool and
 * write disjoint byte ranges; the first error wins under `lock`. Each GPU's
 * staging slots, streams and events belong to one load at a time
 * (`staging.lock`). Progress is the target's atomic bytes_done; cancellation
 * is its atomic cancel flag, checked between windows.
 */
#include "loader.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "fault.h"
#include "log.h"
#include "multigpu.h"

/* Bytes one fill task gathers: enough tasks per window to keep every fill thread busy. */
#define LD_TASK_MIN (1ull << 20)
#define LD_TASK_MAX (8ull << 20)
/* Bytes one direct copy moves at most (keeps progress and cancellation responsive). */
#define LD_DIRECT_CHUNK (256ull << 20)

struct staging {
  pthread_mutex_t lock;
  size_t nslots;
  size_t slot_bytes;
  void **slots;
  struct wd_stream **streams;
  struct wd_event **events;
};

struct loader {
  const struct wd_backend *backend;
  struct fillpool *fill;
  struct mg *mg;
  enum cfg_load_method method;
  struct staging *stagings; /* one per device, for backends without host-visible slabs */
  int nstagings;
  int *nodes; /* per device, its NUMA node (-1: none) */
};

/* ---- gathering ---------------------------------------------------------------- */

static const unsigned char *piece_src(const struct ld_target *s, const struct plan_piece *pc) {
  const struct ckpt *c = s->ck->ck;
  const struct ckpt_shard *sh = &c->shards[pc->src->shard];
  return (const unsigned char *)s->ck->maps[pc->src->shard] + sh->hdr->data_start + pc->src->t->begin +
         pc->src_offset;
}

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

/* Names the tensor at slab offset off, for a FAULT message. */
static int fault_error(const struct ld_target *s, uint64_t off, struct wd_error *err) {
  const struct plan_output *o = plan_output_at(s->plan, off);
  const char *shard = "?", *name = o ? o->name : "?";
  if (o != NULL && o->npieces > 0 && o->pieces[0].src != NULL)
    shard = s->ck->ck->shards[o->pieces[0].src->shard].rel;
  return err_set(err, WEIGHTD_E_FAULT,
                 "%s: tensor '%s': the shard was truncated or became unreadable while it was read", shard,
                 name);
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
  pthread_mutex_t lock;
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
    if (r->rc == 0) r->rc = fault_error(r->set, a, &r->err);
    pthread_mutex_unlock(&r->lock);
    return;
  }
  atomic_fetch_add(&r->set->bytes_done, b - a);
}

/* Per shard, where its data section starts in the mapping (a new array, or NULL). */
static const unsigned char **shard_data(const struct ld_target *s) {
  const struct ckpt *c = s->ck->ck;
  const unsigned char **data = malloc((c->nshards ? c->nshards : 1) * sizeof *data);
  for (size_t i = 0; data != NULL && i < c->nshards; i++)
    data[i] = s->ck->maps[i] ? (const unsigned char *)s->ck->maps[i] + c->shards[i].hdr->data_start : NULL;
  return data;
}

/* Bytes per fill task for a window: two tasks per fill thread, 1 to 8 MiB each, in 64 KiB multiples. */
static uint64_t task_bytes(const struct loader *ld, uint64_t window) {
  uint64_t task = window / (2 * (uint64_t)fill_threads(ld->fill));
  task = task < LD_TASK_MIN ? LD_TASK_MIN : task > LD_TASK_MAX ? LD_TASK_MAX : task;
  return (task + 65535) / 65536 * 65536;
}

/* Gathers slab bytes [lo, hi) into dst on the fill threads, counting progress. */
static int fill_window(struct loader *ld, struct ld_target *s, const unsigned char **data, uint64_t lo,
                       uint64_t hi, unsigned char *dst, struct wd_error *err) {
  struct window_fill r = {.ld = ld, .set = s, .data = data, .lo = lo, .hi = hi, .dst = dst};
  r.task = task_bytes(ld, hi - lo);
  r.ntasks = (size_t)((hi - lo + r.task - 1) / r.task);
  pthread_mutex_init(&r.lock, NULL);
  fill_run(ld->fill, r.ntasks, fill_task, &r);
  pthread_mutex_destroy(&r.lock);
  if (r.rc != 0) *err = r.err;
  return r.rc;
}

static int check_cancel(struct ld_target *s, struct wd_error *err) {
  if (!atomic_load(&s->cancel)) return 0;
  return err_set(err, WEIGHTD_E_CANCELED, "load of %s canceled", s->ck->path);
}

/* ---- memcpy: the slab is host memory ------------------------------------------------ */

static int fill_memcpy(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  const uint64_t window = 256ull << 20; /* cancellation is checked between windows */
  const unsigned char **data = shard_data(s);
  if (data == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  int rc = 0;
  for (uint64_t lo = 0; lo < s->plan->slab_bytes && rc == 0; lo += window) {
    if ((rc = check_cancel(s, err)) != 0) break;
    uint64_t hi = lo + window < s->plan->slab_bytes ? lo + window : s->plan->slab_bytes;
    rc = fill_window(ld, s, data, lo, hi, (unsigned char *)s->slab->host_view + lo, err);
  }
  free(data);
  return rc;
}

/* ---- staged: pinned slots and a stream per slot -------------------------------------- */

/*
 * The staged pipeline without a barrier per window: the slab is cut into
 * windows of one slot each, and every window into fill tasks; the fill
 * threads take tasks in order. A task of window w first waits until the slot
 * it fills (w mod S) has finished the transfer of window w - S; the thread
 * that finishes a window's last task starts that window's transfer on the
 * slot's stream and records the slot's event. So threads that are done with
 * one window go on filling the next while stragglers finish, and the only
 * wait is for a slot's previous transfer.
 */
struct staged_run {
  struct loader *ld;
  struct ld_target *set;
  struct staging *st;
  const unsigned char **data; /* per shard: its data section in the mapping */
  uint64_t total;             /* slab bytes */
  size_t windows, per_window; /* tasks per window */
  uint64_t task;              /* bytes per task */
  atomic_size_t *left;        /* per window: tasks not finished */
  size_t *issued;             /* per slot: windows whose transfer has started */
  pthread_mutex_t lock;       /* guards issued, rc, err */
  pthread_cond_t moved;       /* a transfer started, or the run failed */
  int rc;
  struct wd_error err;
};

static void staged_fail(struct staged_run *r, int rc, const struct wd_error *err) {
  pthread_mutex_lock(&r->lock);
  if (r->rc == 0) {
    r->rc = rc;
    r->err = *err;
  }
  pthread_cond_broadcast(&r->moved);
  pthread_mutex_unlock(&r->lock);
}

static void staged_task(void *arg, size_t i) {
  struct staged_run *r = arg;
  struct staging *st = r->st;
  const struct wd_backend *b = r->ld->backend;
  size_t w = i / r->per_window, k = w % st->nslots;
  struct wd_error err = {0};
  /* Wait for the slot: window w - S must have started its transfer, then finished it. */
  pthread_mutex_lock(&r->lock);
  while (r->rc == 0 && w >= st->nslots && r->issued[k] <= (w - st->nslots) / st->nslots)
    pthread_cond_wait(&r->moved, &r->lock);
  int failed = r->rc != 0;
  pthread_mutex_unlock(&r->lock);
  if (failed) return;
  if (check_cancel(r->set, &err) != 0) {
    staged_fail(r, err.code, &err);
    return;
  }
  if (w >= st->nslots && b->ops->event_wait(b->ctx, st->events[k], &err) != 0) {
    staged_fail(r, err.code, &err);
    return;
  }
  uint64_t wlo = (uint64_t)w * st->slot_bytes;
  uint64_t whi = wlo + st->slot_bytes < r->total ? wlo + st->slot_bytes : r->total;
  uint64_t lo = wlo + (uint64_t)(i % r->per_window) * r->task;
  uint64_t hi = lo + r->task < whi ? lo + r->task : whi;
  if (lo < hi) {
    struct gather_args g = {r->set, r->data, lo, hi, (unsigned char *)st->slots[k] + (lo - wlo)};
    if (fault_call(gather_range, &g) != 0) {
      fault_error(r->set, lo, &err);
      staged_fail(r, err.code, &err);
      return;
    }
  }
  if (atomic_fetch_sub(&r->left[w], 1) != 1) return;
  /* The window's last task: start its transfer. */
  size_t n = (size_t)(whi - wlo);
  int rc = b->ops->copy_h2d(b->ctx, r->set->slab, wlo, n, st->slots[k], n, n, 1, st->streams[k], &err);
  if (rc == 0) rc = b->ops->event_record(b->ctx, st->events[k], st->streams[k], &err);
  if (rc != 0) {
    staged_fail(r, rc, &err);
    return;
  }
  atomic_fetch_add(&r->set->bytes_done, n);
  pthread_mutex_lock(&r->lock);
  r->issued[k]++;
  pthread_cond_broadcast(&r->moved);
  pthread_mutex_unlock(&r->lock);
}

static int fill_staged(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  const struct wd_backend *b = ld->backend;
  struct staging *st = &ld->stagings[s->device];
  struct staged_run r = {.ld = ld, .set = s, .st = st, .total = s->plan->slab_bytes};
  r.windows = (size_t)((r.total + st->slot_bytes - 1) / st->slot_bytes);
  r.task = task_bytes(ld, st->slot_bytes);
  r.per_window = (size_t)((st->slot_bytes + r.task - 1) / r.task);
  r.data = shard_data(s);
  r.left = malloc((r.windows ? r.windows : 1) * sizeof *r.left);
  r.issued = calloc(st->nslots, sizeof *r.issued);
  if (r.data == NULL || r.left == NULL || r.issued == NULL) {
    free(r.data);
    free(r.left);
    free(r.issued);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  for (size_t w = 0; w < r.windows; w++) atomic_init(&r.left[w], r.per_window);
  pthread_mutex_init(&r.lock, NULL);
  pthread_cond_init(&r.moved, NULL);
  pthread_mutex_lock(&st->lock);
  fill_run(ld->fill, r.windows * r.per_window, staged_task, &r);
  /* Drain every slot, also after an error: the slots must be idle for the next load. */
  for (size_t k = 0; k < st->nslots; k++) {
    if (r.issued[k] == 0) continue;
    struct wd_error e2 = {0};
    int r2 = b->ops->event_wait(b->ctx, st->events[k], &e2);
    if (r.rc == 0 && r2 != 0) {
      r.rc = r2;
      r.err = e2;
    }
  }
  pthread_mutex_unlock(&st->lock);
  pthread_cond_destroy(&r.moved);
  pthread_mutex_destroy(&r.lock);
  free(r.data);
  free(r.left);
  free(r.issued);
  if (r.rc != 0) {
    *err = r.err;
    return r.rc;
  }
  atomic_store(&s->bytes_done, s->plan->slab_bytes);
  return 0;
}

/* ---- direct: the copy engines read the registered mappings ---------------------------- */

static int fill_direct(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  struct staging *st = &ld->stagings[s->device];
  static const unsigned char zeros[1u << 16];
  pthread_mutex_lock(&st->lock);
  int rc = 0;
  size_t n = 0;
  const struct plan *p = s->plan;
  for (size_t o = 0; o < p->noutputs && rc == 0; o++) {
    uint64_t dst = p->outputs[o].offset;
    for (size_t k = 0; k < p->outputs[o].npieces && rc == 0; k++) {
      const struct plan_piece *pc = &p->outputs[o].pieces[k];
      uint64_t len = pc->width * pc->height;
      if ((rc = check_cancel(s, err)) != 0) break;
      struct wd_stream *stream = st->streams[n++ % st->nslots];
      if (pc->src == NULL) {
        for (uint64_t off = 0; off < len && rc == 0; off += sizeof zeros) {
          size_t m = len - off < sizeof zeros ? (size_t)(len - off) : sizeof zeros;
          rc = ops->copy_h2d(ctx, s->slab, dst + off, m, zeros, m, m, 1, NULL, err);
        }
      } else if (pc->height <= 1 || pc->src_pitch == pc->width) {
        for (uint64_t off = 0; off < len && rc == 0; off += LD_DIRECT_CHUNK) {
          size_t m = len - off < LD_DIRECT_CHUNK ? (size_t)(len - off) : (size_t)LD_DIRECT_CHUNK;
          rc = ops->copy_h2d(ctx, s->slab, dst + off, m, piece_src(s, pc) + off, m, m, 1, stream, err);
        }
      } else {
        rc = ops->copy_h2d(ctx, s->slab, dst, (size_t)pc->width, piece_src(s, pc),
                           (size_t)pc->src_pitch, (size_t)pc->width, (size_t)pc->height, stream, err);
      }
      dst += len;
      atomic_fetch_add(&s->bytes_done, len);
    }
  }
  for (size_t k = 0; k < st->nslots; k++) {
    struct wd_error e2 = {0};
    int r2 = ops->event_record(ctx, st->events[k], st->streams[k], &e2);
    if (r2 == 0) r2 = ops->event_wait(ctx, st->events[k], &e2);
    if (rc == 0 && r2 != 0) {
      rc = r2;
      *err = e2;
    }
  }
  pthread_mutex_unlock(&st->lock);
  return rc;
}

/* ---- entry points ------------------------------------------------------------------------ */

const unsigned char **ld_shard_data(const struct ld_target *t) { return shard_data(t); }

int ld_fault_error(const struct ld_target *t, uint64_t off, struct wd_error *err) { return fault_error(t, off, err); }

int ld_fill(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  double t0 = clock_s();
  s->slab = NULL;
  s->source_device = -1;
  s->nshares = 0;
  fill_set_home(ld->nodes != NULL ? ld->nodes[s->device] : -1); /* fill threads near the device first */
  int rc = ops->slab_alloc(ctx, s->device, s->plan->slab_bytes, &s->slab, err);
  s->alloc_seconds = clock_s() - t0;
  bool filled = false;
  if (rc == 0) rc = mg_fill(ld->mg, s, &filled, err); /* a replica from a peer, or striped over neighbours */
  if (rc != 0 || filled) {
    /* no slab, or mg_fill moved the bytes: nothing more to copy */
  } else if (ld->method == CFG_LOAD_STAGED) {
    s->method = "staged";
    rc = fill_staged(ld, s, err);
  } else if (s->slab->host_view != NULL) {
    s->method = "memcpy";
    rc = fill_memcpy(ld, s, err);
  } else if (atomic_load(&s->ck->pinned)) {
    s->method = "direct";
    rc = fill_direct(ld, s, err);
  } else {
    s->method = "staged";
    rc = fill_staged(ld, s, err);
  }
  /* A shard rewritten while we copied would have given a mix of old and new bytes. */
  if (rc == 0) rc = ckpt_check_unchanged(s->ck->ck, err);
  if (rc == 0) atomic_store(&s->bytes_done, s->plan->slab_bytes);
  if (rc == 0 && ops->slab_seal != NULL) rc = ops->slab_seal(ctx, s->slab, err);
  if (rc != 0) {
    if (s->slab != NULL) ops->slab_free(ctx, s->slab);
    s->slab = NULL;
  }
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
  const struct wd_backend_ops *ops = p->backend->ops;
  void *ctx = p->backend->ctx;
  struct loader *ld = calloc(1, sizeof *ld);
  if (ld == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  ld->backend = p->backend;
  ld->fill = p->fill;
  ld->mg = p->mg;
  ld->method = p->method;
  *out = ld;
  if (p->device_nodes != NULL && p->ndevices > 0) {
    if ((ld->nodes = malloc((size_t)p->ndevices * sizeof *ld->nodes)) == NULL)
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    memcpy(ld->nodes, p->device_nodes, (size_t)p->ndevices * sizeof *ld->nodes);
  }
  /* Host slabs are filled in place and need no staging, unless staging is forced. */
  if ((ops->caps & WD_CAP_HOST_SLABS) && p->method != CFG_LOAD_STAGED) return 0;
  ld->stagings = calloc((size_t)p->ndevices, sizeof *ld->stagings);
  if (ld->stagings == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (int d = 0; d < p->ndevices; d++) {
    struct staging *st = &ld->stagings[d];
    pthread_mutex_init(&st->lock, NULL);
    ld->nstagings = d + 1;
    st->nslots = p->staging_slots;
    st->slot_bytes = p->staging_slot_bytes;
    st->slots = calloc(st->nslots, sizeof *st->slots);
    st->streams = calloc(st->nslots, sizeof *st->streams);
    st->events = calloc(st->nslots, sizeof *st->events);
    if (st->slots == NULL || st->streams == NULL || st->events == NULL)
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    if (p->place != NULL) p->place(p->place_arg, d);
    for (size_t k = 0; k < st->nslots; k++) {
      int rc = ops->pinned_alloc(ctx, d, st->slot_bytes, &st->slots[k], err);
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
  free(ld->nodes);
  free(ld);
}
