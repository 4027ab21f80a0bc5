/*
 * stripe.c - the striped data path (see stripe.h).
 *
 * DESIGN (threads): stripe_fill runs on the load's job thread, which owns
 * the target's slab and, through the kits' locks its caller holds, every
 * link's kit. Staged: fill tasks run on the fill pool and write disjoint
 * parts of the slots; `lock` guards issued, rc and err, and `moved` wakes
 * tasks waiting for a slot. Direct: the job thread alone issues the copies.
 * Progress is the target's atomic bytes_done, cancellation its cancel flag,
 * checked per task (staged) or per window (direct). Direct copies read only
 * the target's registered ranges (ld_target.pins), one registration at a
 * time.
 */
#include "stripe.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/fault.h"
#include "load_source.h"

/* ---- kits ---------------------------------------------------------------------------- */

int stripe_kit_init(struct stripe_kit *k, const struct wd_backend *b, int device, size_t bytes,
                    struct wd_error *err) {
  const struct wd_backend_ops *ops = b->ops;
  memset(k, 0, sizeof *k);
  pthread_mutex_init(&k->lock, NULL);
  k->device = device;
  k->bytes = bytes;
  for (int i = 0; i < STRIPE_SLOTS; i++) {
    int rc = ops->pinned_alloc(b->ctx, device, bytes, 0, &k->slots[i], err);
    if (rc == 0) rc = ops->scratch_alloc(b->ctx, device, bytes, &k->bounce[i], err);
    if (rc == 0) rc = ops->stream_create(b->ctx, device, &k->streams[i], err);
    if (rc == 0) rc = ops->event_create(b->ctx, device, &k->events[i], err);
    if (rc != 0) return rc;
  }
  return 0;
}

void stripe_kit_fini(struct stripe_kit *k, const struct wd_backend *b) {
  const struct wd_backend_ops *ops = b->ops;
  for (int i = 0; i < STRIPE_SLOTS; i++) {
    if (k->events[i] != NULL) ops->event_destroy(b->ctx, k->events[i]);
    if (k->streams[i] != NULL) ops->stream_destroy(b->ctx, k->streams[i]);
    if (k->bounce[i] != NULL) ops->slab_free(b->ctx, k->bounce[i]);
    if (k->slots[i] != NULL) ops->pinned_free(b->ctx, k->device, k->slots[i]);
  }
  pthread_mutex_destroy(&k->lock);
  memset(k, 0, sizeof *k);
}

/* ---- windows ------------------------------------------------------------------------ */

/* Window j of link `link`: slab bytes [lo, hi), moved through slot j % STRIPE_SLOTS. */
struct window {
  size_t link, j;
  uint64_t lo, hi;
};

/* How many windows a share of n bytes makes. */
static size_t windows_of(uint64_t n, size_t bytes) { return (size_t)((n + bytes - 1) / bytes); }

/*
 * Every link's windows in the order they are moved: repeatedly the next
 * window of the link that is the least far through its own (j / count
 * smallest, ties to the lower link), so that all links run in step.
 */
static struct window *windows_order(const struct stripe_job *jb, size_t *nw) {
  size_t total = 0, counts[LD_MAX_LINKS] = {0}, next[LD_MAX_LINKS] = {0};
  for (size_t i = 0; i < jb->nlinks; i++) {
    counts[i] = windows_of(jb->links[i].hi - jb->links[i].lo, jb->links[i].kit->bytes);
    total += counts[i];
  }
  struct window *w = malloc((total ? total : 1) * sizeof *w);
  if (w == NULL) return NULL;
  for (size_t g = 0; g < total; g++) {
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < jb->nlinks; i++) {
      if (next[i] == counts[i]) continue;
      if (best == SIZE_MAX || (uint64_t)next[i] * counts[best] < (uint64_t)next[best] * counts[i]) best = i;
    }
    const struct stripe_link *l = &jb->links[best];
    uint64_t lo = l->lo + (uint64_t)next[best] * l->kit->bytes;
    w[g] = (struct window){.link = best, .j = next[best], .lo = lo, .hi = lo + l->kit->bytes < l->hi ? lo + l->kit->bytes : l->hi};
    next[best]++;
  }
  *nw = total;
  return w;
}

static int canceled(const struct ld_target *t, struct wd_error *err) {
  if (!atomic_load(&t->cancel)) return 0;
  return err_set(err, WEIGHTD_E_CANCELED, "load of %s canceled", t->ck->path);
}

/*
 * Sends window w, whose bytes sit in its link's slot (staged) or bounce
 * buffer (direct, already copied there): a neighbour forwards the bounce
 * buffer over the peer link; a staged window first goes to the slab (the
 * target's link) or the bounce buffer. Records the slot's event.
 */
static int window_send(const struct stripe_job *jb, const struct window *w, bool staged, struct wd_error *err) {
  const struct wd_backend_ops *ops = jb->backend->ops;
  void *ctx = jb->backend->ctx;
  struct stripe_kit *k = jb->links[w->link].kit;
  size_t s = w->j % STRIPE_SLOTS, n = (size_t)(w->hi - w->lo);
  bool own = w->link == 0;
  int rc = 0;
  if (staged)
    rc = ops->copy_h2d(ctx, own ? jb->t->slab : k->bounce[s], own ? w->lo : 0, n, k->slots[s], n, n, 1, k->streams[s],
                       err);
  if (rc == 0 && !own) rc = ops->copy_peer(ctx, jb->t->slab, w->lo, k->bounce[s], 0, n, k->streams[s], err);
  if (rc == 0) rc = ops->event_record(ctx, k->events[s], k->streams[s], err);
  return rc;
}

/* Waits for every slot that moved something; keeps the first error. */
static int drain(const struct stripe_job *jb, const size_t *issued, int rc, struct wd_error *err) {
  const struct wd_backend_ops *ops = jb->backend->ops;
  for (size_t i = 0; i < jb->nlinks; i++)
    for (size_t s = 0; s < STRIPE_SLOTS; s++) {
      if (issued[i * STRIPE_SLOTS + s] == 0) continue;
      struct wd_error e2 = {0};
      int r2 = ops->event_wait(jb->backend->ctx, jb->links[i].kit->events[s], &e2);
      if (rc == 0 && r2 != 0) {
        rc = r2;
        *err = e2;
      }
    }
  return rc;
}

/* ---- staged: fill tasks gather into the links' slots ------------------------------------ */

struct staged {
  const struct stripe_job *jb;
  const unsigned char **data;
  const struct window *w;
  size_t per_window;   /* tasks per window */
  uint64_t task;       /* bytes per task */
  atomic_size_t *left; /* per window: tasks not finished */
  size_t *issued;      /* per link and slot: windows sent */
  pthread_mutex_t lock;
  pthread_cond_t moved;
  int rc;
  struct wd_error err;
};

/* The first failure stops the run: every waiting task wakes and returns. */
static void staged_fail(struct staged *r, const struct wd_error *err) {
  pthread_mutex_lock(&r->lock);
  if (r->rc == 0) r->err = *err, r->rc = err->code ? err->code : WEIGHTD_E_INTERNAL;
  pthread_cond_broadcast(&r->moved);
  pthread_mutex_unlock(&r->lock);
}

struct gather_part {
  const struct plan *plan;
  const unsigned char *const *data;
  uint64_t lo, hi;
  unsigned char *dst;
};

static int gather_part(void *arg) {
  struct gather_part *g = arg;
  plan_gather(g->plan, g->data, g->lo, g->hi, g->dst);
  return 0;
}

static void staged_task(void *arg, size_t i) {
  struct staged *r = arg;
  const struct stripe_job *jb = r->jb;
  const struct window *w = &r->w[i / r->per_window];
  struct stripe_kit *k = jb->links[w->link].kit;
  size_t s = w->j % STRIPE_SLOTS, *issued = &r->issued[w->link * STRIPE_SLOTS + s];
  struct wd_error err = {0};
  /* The slot is free once this link's window j - STRIPE_SLOTS was sent and its copies are done. */
  pthread_mutex_lock(&r->lock);
  while (r->rc == 0 && w->j >= STRIPE_SLOTS && *issued <= (w->j - STRIPE_SLOTS) / STRIPE_SLOTS)
    pthread_cond_wait(&r->moved, &r->lock);
  int failed = r->rc != 0;
  pthread_mutex_unlock(&r->lock);
  if (failed) return;
  if (canceled(jb->t, &err) != 0 ||
      (w->j >= STRIPE_SLOTS && jb->backend->ops->event_wait(jb->backend->ctx, k->events[s], &err) != 0)) {
    staged_fail(r, &err);
    return;
  }
  uint64_t a = w->lo + (uint64_t)(i % r->per_window) * r->task;
  uint64_t b = a + r->task < w->hi ? a + r->task : w->hi;
  if (a < b) {
    struct gather_part g = {jb->t->plan, r->data, a, b, (unsigned char *)k->slots[s] + (a - w->lo)};
    if (fault_call(gather_part, &g) != 0) {
      ld_fault_error(jb->t, a, &err);
      staged_fail(r, &err);
      return;
    }
  }
  if (atomic_fetch_sub(&r->left[i / r->per_window], 1) != 1) return;
  if (window_send(jb, w, true, &err) != 0) {
    staged_fail(r, &err);
    return;
  }
  atomic_fetch_add(&jb->t->bytes_done, w->hi - w->lo);
  pthread_mutex_lock(&r->lock);
  (*issued)++;
  pthread_cond_broadcast(&r->moved);
  pthread_mutex_unlock(&r->lock);
}

static int fill_staged(const struct stripe_job *jb, const struct window *w, size_t nw, size_t *issued,
                       struct wd_error *err) {
  size_t bytes = jb->links[0].kit->bytes;
  struct staged r = {.jb = jb, .w = w, .issued = issued};
  /* Two tasks per fill thread and window, 1 to 8 MiB each, in 64 KiB multiples. */
  uint64_t task = bytes / (2 * (uint64_t)fill_threads(jb->fill));
  task = task < (1u << 20) ? (1u << 20) : task > (8u << 20) ? (8u << 20) : task;
  r.task = (task + 65535) / 65536 * 65536;
  r.per_window = (size_t)((bytes + r.task - 1) / r.task);
  r.data = ld_shard_data(jb->t);
  r.left = malloc((nw ? nw : 1) * sizeof *r.left);
  if (r.data == NULL || r.left == NULL) {
    free(r.data);
    free(r.left);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  for (size_t g = 0; g < nw; g++) atomic_init(&r.left[g], r.per_window);
  pthread_mutex_init(&r.lock, NULL);
  pthread_cond_init(&r.moved, NULL);
  fill_run(jb->fill, nw * r.per_window, staged_task, &r);
  pthread_cond_destroy(&r.moved);
  pthread_mutex_destroy(&r.lock);
  free(r.data);
  free(r.left);
  if (r.rc != 0) *err = r.err;
  return r.rc;
}

/* ---- direct: the copy engines read the registered mappings --------------------------------- */

struct direct_copy {
  const struct stripe_job *jb;
  struct wd_slab *dst;
  uint64_t base; /* the slab offset that lands at dst offset 0 */
  struct wd_stream *stream;
  struct wd_error *err;
};

/*
 * Copies len contiguous bytes at file offset off of shard `shard` to dst
 * offset at, one registration at a time (a copy never crosses from one
 * registration into the next).
 */
static int copy_span(const struct direct_copy *c, uint32_t shard, uint64_t off, uint64_t len, uint64_t at) {
  const struct wd_backend_ops *ops = c->jb->backend->ops;
  const struct ld_target *t = c->jb->t;
  const unsigned char *map = t->ck->maps[shard];
  int rc = 0;
  for (uint64_t done = 0; done < len && rc == 0;) {
    uint64_t m = ld_pinned_run(t, shard, off + done);
    if (m > len - done) m = len - done;
    if (m == 0) return err_set(c->err, WEIGHTD_E_INTERNAL, "a striped direct copy reached unregistered bytes");
    rc = ops->copy_h2d(c->jb->backend->ctx, c->dst, at + done, (size_t)m, map + off + done, (size_t)m, (size_t)m, 1,
                       c->stream, c->err);
    done += m;
  }
  return rc;
}

static int copy_segment(void *arg, const struct plan_segment *sg) {
  const struct direct_copy *c = arg;
  const struct wd_backend_ops *ops = c->jb->backend->ops;
  void *ctx = c->jb->backend->ctx;
  uint64_t at = sg->dst - c->base;
  if (sg->pc == NULL) {
    int rc = 0;
    for (uint64_t off = 0, n = sg->width * sg->height; off < n && rc == 0; off += c->jb->zeros_bytes) {
      size_t m = n - off < c->jb->zeros_bytes ? (size_t)(n - off) : c->jb->zeros_bytes;
      rc = ops->copy_h2d(ctx, c->dst, at + off, m, c->jb->zeros, m, m, 1, c->stream, c->err);
    }
    return rc;
  }
  const struct ld_target *t = c->jb->t;
  const struct plan_piece *pc = sg->pc;
  uint32_t shard = pc->src->shard;
  uint64_t base = t->ck->ck->shards[shard].hdr->data_start + pc->src->t->begin + pc->src_offset + sg->src;
  if (sg->height <= 1 || sg->src_pitch == sg->width) return copy_span(c, shard, base, sg->width * sg->height, at);
  /* Rows in one registration go as one 2D copy; a row that straddles two is split. */
  const unsigned char *map = t->ck->maps[shard];
  int rc = 0;
  for (uint64_t r = 0; r < sg->height && rc == 0;) {
    uint64_t a = base + r * sg->src_pitch, run = ld_pinned_run(t, shard, a);
    if (run < sg->width) {
      rc = copy_span(c, shard, a, sg->width, at + r * sg->width);
      r++;
      continue;
    }
    uint64_t n = (run - sg->width) / sg->src_pitch + 1;
    if (n > sg->height - r) n = sg->height - r;
    rc = ops->copy_h2d(ctx, c->dst, at + r * sg->width, (size_t)sg->width, map + a, (size_t)sg->src_pitch,
                       (size_t)sg->width, (size_t)n, c->stream, c->err);
    r += n;
  }
  return rc;
}

static int fill_direct(const struct stripe_job *jb, const struct window *w, size_t nw, size_t *issued,
                       struct wd_error *err) {
  const struct wd_backend_ops *ops = jb->backend->ops;
  int rc = 0;
  for (size_t g = 0; g < nw && rc == 0; g++) {
    struct stripe_kit *k = jb->links[w[g].link].kit;
    size_t s = w[g].j % STRIPE_SLOTS;
    bool own = w[g].link == 0;
    if ((rc = canceled(jb->t, err)) != 0) break;
    /* A neighbour's bounce buffer is free once its window j - STRIPE_SLOTS has been forwarded. */
    if (!own && w[g].j >= STRIPE_SLOTS && (rc = ops->event_wait(jb->backend->ctx, k->events[s], err)) != 0) break;
    struct direct_copy c = {jb, own ? jb->t->slab : k->bounce[s], own ? 0 : w[g].lo, k->streams[s], err};
    rc = plan_segments(jb->t->plan, w[g].lo, w[g].hi, copy_segment, &c);
    if (rc == 0) rc = window_send(jb, &w[g], false, err);
    if (rc == 0) {
      issued[w[g].link * STRIPE_SLOTS + s]++;
      atomic_fetch_add(&jb->t->bytes_done, w[g].hi - w[g].lo);
    }
  }
  return rc;
}

/* ---- the entry point ------------------------------------------------------------------------ */

int stripe_fill(const struct stripe_job *jb, struct wd_error *err) {
  size_t nw = 0;
  struct window *w = windows_order(jb, &nw);
  size_t *issued = calloc(jb->nlinks * STRIPE_SLOTS, sizeof *issued);
  if (w == NULL || issued == NULL) {
    free(w);
    free(issued);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  int rc = jb->direct ? fill_direct(jb, w, nw, issued, err) : fill_staged(jb, w, nw, issued, err);
  /* Drain every slot, also after an error: the kits must be idle for the next load. */
  rc = drain(jb, issued, rc, err);
  free(w);
  free(issued);
  return rc;
}
