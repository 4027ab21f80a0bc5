/*
 * pipeline.c - the one staging pipeline: a plan's staging schedule moved
 * window by window over one host link or several (see internal.h,
 * ld_pipe_run).
 *
 * The plan is cut into windows of one slot each (plan_stage.h: the slab
 * image, strided pieces as whole rows where staged_strided says so, or the
 * aligned schedule for sources that read best into aligned slots). Each
 * window belongs to one link: the target's own, or a neighbour's lending
 * link when the load is striped (its share of the slab), and uses slot
 * j mod S of it, j being its place among that link's windows. A window's
 * bytes reach the slab in one of two ways:
 *
 *   staged  fill tasks (ld_task_bytes each) read the window from the source
 *           into its slot; the task that finishes the window's last part
 *           starts its transfers on the slot's stream (a plain copy per
 *           image run or span, a 2D copy per run of whole rows) and records
 *           the slot's event. A task first waits until the slot has
 *           finished the transfers of the window S before it on that link.
 *   direct  every byte the plan reads is registered (the pinned-resident
 *           tier): the job thread has the copy engines read the mappings,
 *           segment by segment (plan_segments: 2D copies for strided rows,
 *           split where a registration ends; zeros from a pinned buffer),
 *           on the slot's stream, and waits for the slot's event of the
 *           window S before it first.
 *
 * On a neighbour's link the transfers land in the slot's bounce buffer on
 * the neighbour and a peer copy on the same stream forwards them to the
 * slab, so forwarding starts as soon as the window has landed. Windows are
 * taken in step across links (each link's next window when its share of the
 * way through is the smallest), so every link is busy at once.
 *
 * The ready watermark: windows deliver consecutive slab ranges, and a window
 * has landed once its slot's event, recorded after all of its transfers, has
 * been waited for: when the slot is reused, at a test-gate stop, and in the
 * final drain. The watermark is the end of the longest prefix of windows
 * that have landed (a window on one slot or link may land before an earlier
 * one on another).
 *
 * DESIGN (threads): ld_pipe_run runs on the load's job thread, which holds
 * every link of the run (their locks taken by the caller) until it returns;
 * fill tasks run on the fill pool. struct run says which field `lock`
 * guards; the rest is written before the tasks start. Reads from mappings
 * run under the SIGBUS guard.
 */
#include "internal.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/fault.h"
#include "base/log.h"
#include "clock.h"
#include "stream_copy.h"

/* ---- registered ranges ---------------------------------------------------------------- */

uint64_t ld_pinned_run(const struct ld_target *t, uint32_t shard, uint64_t off) {
  size_t a = 0, b = t->npins;
  while (a < b) { /* the first registration after (shard, off) */
    size_t m = a + (b - a) / 2;
    const struct plan_range *p = &t->pins[m];
    if (p->shard < shard || (p->shard == shard && p->off <= off)) a = m + 1;
    else b = m;
  }
  if (a == 0) return 0;
  const struct plan_range *p = &t->pins[a - 1];
  return p->shard == shard && off < p->off + p->len ? p->off + p->len - off : 0;
}

bool ld_plan_pinned(const struct ld_target *t) {
  if (t->npins == 0 || t->mmap == NULL) return false;
  const struct plan *p = t->plan;
  for (size_t o = 0; o < p->noutputs; o++)
    for (size_t k = 0; k < p->outputs[o].npieces; k++) {
      const struct plan_piece *pc = &p->outputs[o].pieces[k];
      if (pc->src == NULL || pc->width == 0 || pc->height == 0) continue;
      uint64_t a = ld_piece_file_off(t->ck, pc), b = a + (pc->height - 1) * pc->src_pitch + pc->width;
      while (a < b) {
        uint64_t n = ld_pinned_run(t, pc->src->shard, a);
        if (n == 0) return false;
        a += n;
      }
    }
  return true;
}

/* ---- a run ------------------------------------------------------------------------------ */

struct run_link {
  struct ld_link *link;
  bool own;      /* the target's link: straight into the slab */
  size_t w0, w1; /* its windows [w0, w1), in slab order */
  size_t *issued; /* per slot: windows whose transfers have started */
};

struct run {
  struct loader *ld;
  struct ld_target *t;
  const struct ld_source *src;
  const struct plan_stage *sched;
  bool direct;
  size_t nlinks;
  struct run_link links[LD_MAX_LINKS];
  size_t *order;       /* per position: the window run there (links in step) */
  size_t *link_of;     /* per window: its link */
  uint64_t *starts, *ends; /* per window: the slab range it delivers */
  /* Staged. */
  uint64_t task;       /* bytes per task (ld_task_bytes of a slot) */
  size_t *task_base;   /* per position + 1: its first task's number */
  atomic_size_t *left; /* per window: tasks not finished */
  size_t first_task;   /* added to ld_pool_run's task numbers (a gated run goes position by position) */
  plan_copy_fn copy;   /* memcpy, or stream_copy (staging_writes) */
  /*
   * The slots' stores are weakly ordered (streaming stores, write-combined
   * memory): every task fences its own stores (stream_copy_fence) before it
   * counts itself finished in left[w], so the thread that sends the window
   * sends only bytes every filling thread has made visible. A fence in the
   * sender alone would order only the sender's stores.
   */
  bool fence;
  atomic_uint_fast64_t fill_ns, wait_ns; /* thread time filling, and waiting for slots (the debug log) */
  pthread_mutex_t lock; /* guards every link's issued, landed, next_landed, rc, err */
  pthread_cond_t moved; /* a transfer started, or the run failed */
  unsigned char *landed; /* per window: its transfers are known to have completed */
  size_t next_landed;    /* windows [0, next_landed) have all landed */
  int rc;
  struct wd_error err;
  bool read_failed; /* the failure recorded first was a read of the source */
};

/* Window w's link, its place j on it, and its slot. */
static inline const struct run_link *link_of(const struct run *r, size_t w, size_t *j, size_t *k) {
  const struct run_link *l = &r->links[r->link_of[w]];
  *j = w - l->w0;
  *k = *j % l->link->nslots;
  return l;
}

/* Records the run's first failure (read: a failed read of the source, not of the link) and wakes every waiter. */
static void run_fail_as(struct run *r, int rc, const struct wd_error *err, bool read) {
  pthread_mutex_lock(&r->lock);
  if (r->rc == 0) {
    r->rc = rc ? rc : WEIGHTD_E_INTERNAL;
    r->err = *err;
    r->read_failed = read;
  }
  pthread_cond_broadcast(&r->moved);
  pthread_mutex_unlock(&r->lock);
}

static void run_fail(struct run *r, int rc, const struct wd_error *err) { run_fail_as(r, rc, err, false); }

/*
 * Marks window w landed (w == SIZE_MAX: none) and then, when all_issued is
 * set (the caller drained every slot), every window that has been issued;
 * raises the watermark over the landed prefix.
 */
static void run_landed(struct run *r, size_t w, bool all_issued) {
  pthread_mutex_lock(&r->lock);
  if (w != SIZE_MAX) r->landed[w] = 1;
  size_t before = r->next_landed;
  for (size_t v = r->next_landed; v < r->sched->nwindows; v++, r->next_landed++) {
    size_t j, k;
    const struct run_link *l = link_of(r, v, &j, &k);
    if (all_issued && j / l->link->nslots < l->issued[k]) r->landed[v] = 1;
    if (!r->landed[v]) break;
  }
  uint64_t upto = r->next_landed > 0 ? r->ends[r->next_landed - 1] : 0;
  bool moved = r->next_landed != before;
  pthread_mutex_unlock(&r->lock);
  if (moved) ld_publish_ready(r->t, upto);
}

/* Waits for every slot's last transfers while nothing else runs: every window issued so far has landed. */
static void run_drain(struct run *r) {
  const struct wd_backend *b = r->ld->backend;
  bool ok = true;
  for (size_t i = 0; i < r->nlinks; i++) {
    const struct run_link *l = &r->links[i];
    for (size_t k = 0; k < l->link->nslots; k++) {
      if (l->issued[k] == 0) continue;
      struct wd_error e2 = {0};
      int r2 = b->ops->event_wait(b->ctx, l->link->events[k], &e2);
      if (r2 != 0) {
        run_fail(r, r2, &e2);
        ok = false;
      }
    }
  }
  if (ok) run_landed(r, SIZE_MAX, true);
}

/*
 * Window w is about to use slot k of its link, where the window j - S before
 * it on the link ran: waits for that window's transfers (the slot's event)
 * and marks it landed. The caller made sure its transfers were started.
 */
static int slot_reuse(struct run *r, size_t w, struct wd_error *err) {
  size_t j, k;
  const struct run_link *l = link_of(r, w, &j, &k);
  size_t ns = l->link->nslots;
  if (j < ns) return 0;
  const struct wd_backend *b = r->ld->backend;
  int rc = b->ops->event_wait(b->ctx, l->link->events[k], err);
  if (rc == 0) run_landed(r, l->w0 + j - ns, false); /* the slot's last event is that window's */
  return rc;
}

/* Forwards window w from its bounce buffer to the slab (a neighbour's link), then records the slot's event. */
static int window_finish(struct run *r, size_t w, struct wd_error *err) {
  const struct wd_backend *b = r->ld->backend;
  size_t j, k;
  const struct run_link *l = link_of(r, w, &j, &k);
  int rc = 0;
  if (!l->own)
    rc = b->ops->copy_peer(b->ctx, r->t->slab, r->starts[w], l->link->bounce[k], 0, r->ends[w] - r->starts[w],
                           l->link->streams[k], err);
  if (rc == 0) rc = b->ops->event_record(b->ctx, l->link->events[k], l->link->streams[k], err);
  return rc;
}

/*
 * When a transfer of window w failed after others were queued on its slot's
 * stream, records the event and waits for those first, so that no copy reads
 * the slot once the load has returned. Best effort: when the event cannot be
 * recorded either (the device is failing), nothing here can wait for them.
 */
static void window_abandon(struct run *r, size_t w) {
  const struct wd_backend *b = r->ld->backend;
  size_t j, k;
  const struct run_link *l = link_of(r, w, &j, &k);
  struct wd_error e2 = {0};
  if (b->ops->event_record(b->ctx, l->link->events[k], l->link->streams[k], &e2) == 0)
    b->ops->event_wait(b->ctx, l->link->events[k], &e2);
}

/* Counts window w's transfers started (its slot is in use until its event is waited for). */
static void window_issued(struct run *r, size_t w) {
  size_t j, k;
  const struct run_link *l = link_of(r, w, &j, &k);
  atomic_fetch_add(&r->t->bytes_done, r->ends[w] - r->starts[w]);
  pthread_mutex_lock(&r->lock);
  l->issued[k]++;
  pthread_cond_broadcast(&r->moved);
  pthread_mutex_unlock(&r->lock);
}

/* ---- staged windows: the fill threads read each window into its slot ---------------------- */

/* Starts window w's transfers from its slot: to the slab, or to the bounce buffer and on. */
static int staged_send(struct run *r, size_t w, struct wd_error *err) {
  const struct wd_backend *b = r->ld->backend;
  size_t j, k;
  const struct run_link *l = link_of(r, w, &j, &k);
  const struct plan_window *win = &r->sched->windows[w];
  const unsigned char *slot = l->link->slots[k];
  struct wd_slab *to = l->own ? r->t->slab : l->link->bounce[k];
  uint64_t base = l->own ? 0 : r->starts[w];
  int rc = 0;
  size_t queued = 0;
  for (size_t i = win->first; i < win->first + win->count && rc == 0; i++) {
    const struct plan_xfer *x = &r->sched->xfers[i];
    if (x->kind == PLAN_XFER_ROWS)
      rc = b->ops->copy_h2d(b->ctx, to, x->dst - base, (size_t)x->pc->width, slot + x->at, (size_t)x->pc->src_pitch,
                            (size_t)x->pc->width, (size_t)x->rows, l->link->streams[k], err);
    else
      rc = b->ops->copy_h2d(b->ctx, to, x->dst - base, (size_t)x->len, slot + x->at, (size_t)x->len, (size_t)x->len,
                            1, l->link->streams[k], err);
    if (rc == 0) queued++;
  }
  if (rc == 0) rc = window_finish(r, w, err);
  if (rc != 0 && queued > 0) window_abandon(r, w);
  return rc;
}

struct fill_args {
  const struct run *r;
  size_t w;
  uint64_t lo, hi;
  unsigned char *dst;
  struct ld_reader *rd;
};

static int fill_range(void *arg) {
  struct fill_args *a = arg;
  int rc = plan_stage_read(a->r->sched, a->r->t->plan, a->w, a->lo, a->hi, a->dst, ld_reader_read, a->rd);
  return rc == 0 ? ld_reader_flush(a->rd) : rc;
}

/* The window task i belongs to (by position), and that position's window. */
static size_t task_position(const struct run *r, size_t i) {
  size_t a = 0, b = r->sched->nwindows;
  while (b - a > 1) {
    size_t m = a + (b - a) / 2;
    if (r->task_base[m] <= i) a = m;
    else b = m;
  }
  return a;
}

static void staged_task(void *arg, size_t i) {
  struct run *r = arg;
  i += r->first_task;
  size_t pos = task_position(r, i), w = r->order[pos], j, k;
  const struct run_link *l = link_of(r, w, &j, &k);
  size_t ns = l->link->nslots;
  struct wd_error err = {0};
  /* Wait for the slot: the window S before this one on the link must have started its transfers. */
  uint64_t t0 = clock_ns();
  pthread_mutex_lock(&r->lock);
  while (r->rc == 0 && j >= ns && l->issued[k] <= (j - ns) / ns) pthread_cond_wait(&r->moved, &r->lock);
  int failed = r->rc != 0;
  pthread_mutex_unlock(&r->lock);
  if (failed) return;
  if (ld_check_cancel(r->t, &err) != 0 || slot_reuse(r, w, &err) != 0) {
    run_fail(r, err.code, &err);
    return;
  }
  uint64_t t1 = clock_ns();
  atomic_fetch_add(&r->wait_ns, t1 - t0);
  const struct plan_window *win = &r->sched->windows[w];
  uint64_t lo = (uint64_t)(i - r->task_base[pos]) * r->task;
  uint64_t hi = lo + r->task < win->used ? lo + r->task : win->used;
  if (lo < hi) {
    struct ld_reader rd = {.src = r->src, .copy = r->copy, .cancel = &r->t->cancel};
    struct fill_args a = {r, w, lo, hi, (unsigned char *)l->link->slots[k] + lo, &rd};
    int rc = fault_call(fill_range, &a);
    ld_reader_clear(&rd);
    ld_count_reads(r->t, &rd);
    if (rc != 0) {
      /* The first transfer of the window that overlaps the range names the tensor. */
      uint64_t off = r->sched->xfers[win->first].dst;
      for (size_t x = win->first; x < win->first + win->count; x++)
        if (r->sched->xfers[x].at + r->sched->xfers[x].len > lo) {
          off = r->sched->xfers[x].dst;
          break;
        }
      if (rc == WEIGHTD_E_FAULT) {
        ld_fault_error(r->t, off, &err);
      } else {
        const struct plan_output *o = plan_output_at(r->t->plan, off);
        err = rd.err;
        err_prefix(&err, "tensor '%s'", o != NULL ? o->name : "?");
      }
      run_fail_as(r, err.code, &err, true);
      return;
    }
    if (r->fence) stream_copy_fence();
  }
  atomic_fetch_add(&r->fill_ns, clock_ns() - t1);
  if (atomic_fetch_sub(&r->left[w], 1) != 1) return;
  /* The window's last task: start its transfers. */
  if (staged_send(r, w, &err) != 0) {
    run_fail(r, err.code, &err);
    return;
  }
  window_issued(r, w);
}

/* ---- direct windows: the copy engines read the registered mappings -------------------------- */

struct direct_copy {
  const struct run *r;
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
  const struct wd_backend *b = c->r->ld->backend;
  const struct ld_target *t = c->r->t;
  const unsigned char *map = ld_source_map(t->mmap, shard);
  int rc = 0;
  for (uint64_t done = 0; done < len && rc == 0;) {
    uint64_t m = ld_pinned_run(t, shard, off + done);
    if (m > len - done) m = len - done;
    if (m == 0 || map == NULL) return err_set(c->err, WEIGHTD_E_INTERNAL, "a direct copy reached unregistered bytes");
    rc = b->ops->copy_h2d(b->ctx, c->dst, at + done, (size_t)m, map + off + done, (size_t)m, (size_t)m, 1, c->stream,
                          c->err);
    done += m;
  }
  return rc;
}

static int copy_segment(void *arg, const struct plan_segment *sg) {
  const struct direct_copy *c = arg;
  const struct loader *ld = c->r->ld;
  const struct wd_backend *b = ld->backend;
  uint64_t at = sg->dst - c->base;
  if (sg->pc == NULL) {
    int rc = 0;
    for (uint64_t off = 0, n = sg->width * sg->height; off < n && rc == 0; off += LD_ZEROS) {
      size_t m = n - off < LD_ZEROS ? (size_t)(n - off) : LD_ZEROS;
      rc = b->ops->copy_h2d(b->ctx, c->dst, at + off, m, ld->zeros, m, m, 1, c->stream, c->err);
    }
    return rc;
  }
  const struct ld_target *t = c->r->t;
  const struct plan_piece *pc = sg->pc;
  uint32_t shard = pc->src->shard;
  uint64_t base = ld_piece_file_off(t->ck, pc) + sg->src;
  if (sg->height <= 1 || sg->src_pitch == sg->width) return copy_span(c, shard, base, sg->width * sg->height, at);
  /* Rows in one registration go as one 2D copy; a row that straddles two is split. */
  const unsigned char *map = ld_source_map(t->mmap, shard);
  int rc = 0;
  for (uint64_t row = 0; row < sg->height && rc == 0;) {
    uint64_t a = base + row * sg->src_pitch, run = ld_pinned_run(t, shard, a);
    if (run < sg->width) {
      rc = copy_span(c, shard, a, sg->width, at + row * sg->width);
      row++;
      continue;
    }
    uint64_t n = (run - sg->width) / sg->src_pitch + 1;
    if (n > sg->height - row) n = sg->height - row;
    rc = b->ops->copy_h2d(b->ctx, c->dst, at + row * sg->width, (size_t)sg->width, map + a, (size_t)sg->src_pitch,
                          (size_t)sg->width, (size_t)n, c->stream, c->err);
    row += n;
  }
  return rc;
}

/* Issues window w's copies (the job thread), after its slot is free. */
static int direct_window(struct run *r, size_t w, struct wd_error *err) {
  size_t j, k;
  const struct run_link *l = link_of(r, w, &j, &k);
  int rc = ld_check_cancel(r->t, err);
  if (rc == 0) rc = slot_reuse(r, w, err);
  if (rc != 0) return rc;
  struct direct_copy c = {r, l->own ? r->t->slab : l->link->bounce[k], l->own ? 0 : r->starts[w], l->link->streams[k],
                          err};
  rc = plan_segments(r->t->plan, r->starts[w], r->ends[w], copy_segment, &c);
  if (rc == 0) rc = window_finish(r, w, err);
  if (rc != 0) {
    window_abandon(r, w);
    return rc;
  }
  window_issued(r, w);
  return 0;
}

/* ---- the run ------------------------------------------------------------------------------ */

/* Frees a run's arrays (any of them may be NULL). */
static void run_free(struct run *r) {
  free(r->order);
  free(r->link_of);
  free(r->starts);
  free(r->ends);
  free(r->task_base);
  free(r->left);
  free(r->landed);
  for (size_t i = 0; i < r->nlinks; i++) free(r->links[i].issued);
}

/*
 * Assigns the windows to links by cuts and orders them so that the links run
 * in step: repeatedly the next window of the link the least far through its
 * own (ties to the lower link). 0 or NOMEM / INTERNAL.
 */
static int run_plan(struct run *r, struct ld_link *const *links, const uint64_t *cuts, size_t n,
                    struct wd_error *err) {
  const struct plan_stage *s = r->sched;
  size_t nw = s->nwindows ? s->nwindows : 1;
  r->order = malloc(nw * sizeof *r->order);
  r->link_of = malloc(nw * sizeof *r->link_of);
  r->starts = malloc(nw * sizeof *r->starts);
  r->ends = malloc(nw * sizeof *r->ends);
  r->landed = calloc(nw, 1);
  if (r->order == NULL || r->link_of == NULL || r->starts == NULL || r->ends == NULL || r->landed == NULL)
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  r->nlinks = n;
  for (size_t i = 0; i < n; i++) {
    r->links[i] = (struct run_link){.link = links[i], .own = i == 0};
    if ((r->links[i].issued = calloc(links[i]->nslots, sizeof *r->links[i].issued)) == NULL)
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  size_t l = 0;
  for (size_t w = 0; w < s->nwindows; w++) {
    const struct plan_window *win = &s->windows[w];
    /* Windows deliver consecutive slab ranges (plan_stage.h): this one ends where its last transfer does. */
    const struct plan_xfer *x = &s->xfers[win->first + win->count - 1];
    r->starts[w] = w > 0 ? r->ends[w - 1] : 0;
    r->ends[w] = x->dst + (x->kind == PLAN_XFER_ROWS ? x->rows * x->pc->width : x->len);
    while (cuts != NULL && l + 1 < n && r->starts[w] >= cuts[l + 1]) l++;
    r->link_of[w] = l;
    if (r->links[l].w0 == r->links[l].w1) r->links[l].w0 = w;
    r->links[l].w1 = w + 1;
    if (!r->links[l].own && r->ends[w] - r->starts[w] > links[l]->slot_bytes)
      return err_set(err, WEIGHTD_E_INTERNAL, "a window of %llu slab bytes exceeds a bounce buffer",
                     (unsigned long long)(r->ends[w] - r->starts[w]));
  }
  size_t next[LD_MAX_LINKS] = {0}, count[LD_MAX_LINKS] = {0};
  for (size_t i = 0; i < n; i++) count[i] = r->links[i].w1 - r->links[i].w0;
  for (size_t p = 0; p < s->nwindows; p++) {
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
      if (next[i] == count[i]) continue;
      if (best == SIZE_MAX || (uint64_t)next[i] * count[best] < (uint64_t)next[best] * count[i]) best = i;
    }
    r->order[p] = r->links[best].w0 + next[best]++;
  }
  return 0;
}

/* The staged windows' tasks, per position. */
static int run_tasks(struct run *r, struct wd_error *err) {
  const struct plan_stage *s = r->sched;
  size_t nw = s->nwindows ? s->nwindows : 1;
  r->task = ld_task_bytes(r->ld, s->slot_bytes, r->src);
  r->task_base = malloc((s->nwindows + 1) * sizeof *r->task_base);
  r->left = malloc(nw * sizeof *r->left);
  if (r->task_base == NULL || r->left == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  size_t ntasks = 0;
  for (size_t p = 0; p < s->nwindows; p++) {
    size_t w = r->order[p], n = (size_t)((s->windows[w].used + r->task - 1) / r->task);
    r->task_base[p] = ntasks;
    atomic_init(&r->left[w], n);
    ntasks += n;
  }
  r->task_base[s->nwindows] = ntasks;
  return 0;
}

/* Runs positions [p, q) of the run: their tasks on the fill pool (staged), or their copies here (direct). */
static void run_positions(struct run *r, size_t p, size_t q) {
  if (r->direct) {
    for (; p < q && r->rc == 0; p++) {
      struct wd_error err = {0};
      int rc = direct_window(r, r->order[p], &err);
      if (rc != 0) run_fail(r, rc, &err);
    }
    return;
  }
  r->first_task = r->task_base[p];
  ld_pool_run(r->ld->pool, r->task_base[q] - r->task_base[p], staged_task, r);
}

int ld_pipe_run(struct loader *ld, struct ld_target *t, const struct ld_source *src, struct ld_link *const *links,
                const uint64_t *cuts, size_t nlinks, bool direct, struct wd_error *err) {
  const uint64_t slot = links[0]->slot_bytes;
  /* An aligned schedule where the source reads best into aligned slots, within the fill tasks' 64 KiB grain. */
  uint64_t align = !direct && src->align > 1 && src->align <= (64u << 10) ? src->align : 1;
  struct plan_stage *sched = NULL;
  int rc = plan_stage_build(t->plan, t->ck, slot, direct ? PLAN_STRIDED_GATHER : ld->strided, align, &sched, err);
  if (rc != 0) return rc;
  struct run r = {.ld = ld, .t = t, .src = src, .sched = sched, .direct = direct};
  r.copy = ld->writes == LD_WRITES_STREAMING ? stream_copy : memcpy;
  r.fence = ld->writes != LD_WRITES_CACHED;
  atomic_init(&r.fill_ns, 0);
  atomic_init(&r.wait_ns, 0);
  rc = run_plan(&r, links, cuts, nlinks, err);
  if (rc == 0 && !direct) rc = run_tasks(&r, err);
  if (rc != 0) {
    run_free(&r);
    plan_stage_free(sched);
    return rc;
  }
  if (sched->rows_pieces > 0 || sched->align > 1)
    log_msg(LOG_DEBUG, "staging %zu strided piece(s) as whole rows%s: %llu slot bytes for %llu slab bytes",
            sched->rows_pieces, sched->align > 1 ? ", aligned for the source" : "",
            (unsigned long long)sched->staged_bytes, (unsigned long long)t->plan->slab_bytes);
  pthread_mutex_init(&r.lock, NULL);
  pthread_cond_init(&r.moved, NULL);
  uint64_t started = clock_ns();
  int gate = ld_gate_open(ld);
  if (gate < 0) {
    run_positions(&r, 0, sched->nwindows);
  } else {
    /*
     * The test gate: position by position, each once every window before it
     * has landed (with one link the watermark stops exactly at its start)
     * and a byte came through; once the gate opens, the rest in one go. No
     * task runs between two runs of positions, so r.rc needs no lock here.
     */
    for (size_t p = 0; p < sched->nwindows && r.rc == 0; p++) {
      run_drain(&r);
      struct wd_error ge = {0};
      int grc = r.rc == 0 ? ld_gate_pass(&gate, t, &ge) : 0;
      if (grc != 0) {
        run_fail(&r, grc, &ge);
        break;
      }
      if (r.rc != 0) break;
      run_positions(&r, p, gate >= 0 ? p + 1 : sched->nwindows);
      if (gate < 0) break;
    }
    if (gate >= 0) close(gate);
  }
  /* Drain every slot, also after an error: the links must be idle for the next load. */
  run_drain(&r);
  if (nlinks > 1) {
    t->nshares = 0;
    for (size_t i = 0; i < nlinks; i++)
      if (r.links[i].w1 > r.links[i].w0)
        t->shares[t->nshares++] = (struct ld_share){.device = links[i]->device,
                                                   .lo = r.starts[r.links[i].w0],
                                                   .hi = r.ends[r.links[i].w1 - 1]};
  }
  double ms = (double)(clock_ns() - started) / 1e6;
  if (r.rc == 0)
    log_msg(LOG_DEBUG,
            "%s %llu slab bytes in %.1f ms (%.1f GiB/s): %zu windows over %zu link(s) of %zu slots of %.2f MiB; fill "
            "threads filled %.1f ms and waited for slots %.1f ms (thread time)",
            direct ? "direct" : "staged", (unsigned long long)t->plan->slab_bytes, ms,
            (double)t->plan->slab_bytes / (ms / 1e3) / (double)(1ull << 30), sched->nwindows, nlinks,
            links[0]->nslots, (double)slot / (double)(1ull << 20), (double)atomic_load(&r.fill_ns) / 1e6,
            (double)atomic_load(&r.wait_ns) / 1e6);
  pthread_cond_destroy(&r.moved);
  pthread_mutex_destroy(&r.lock);
  run_free(&r);
  plan_stage_free(sched);
  if (r.rc != 0) *err = r.err;
  t->read_failed = r.rc != 0 && r.read_failed;
  return r.rc;
}
