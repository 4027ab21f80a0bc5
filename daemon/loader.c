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
 *   staged  otherwise: fill threads fill each window of the plan's staging
 *           schedule (plan_stage.h: the slab image, or strided pieces as
 *           whole source rows) into a pinned staging slot, a stream copies
 *           the slot to the GPU (2D for whole rows) while the next slot
 *           fills; the only wait is for a slot's previous transfers.
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
#include "loader.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "fault.h"
#include "load_source.h"
#include "log.h"
#include "multigpu.h"
#include "stream_copy.h"

/* Bytes one fill task gathers: enough tasks per window to keep every fill thread busy. */
#define LD_TASK_MIN (256ull << 10)
#define LD_TASK_MAX (8ull << 20)
/* Bytes one direct copy moves at most (keeps progress and cancellation responsive). */
#define LD_DIRECT_CHUNK (256ull << 20)
/* Bytes a direct load issues between sync points, where the ready watermark moves (one drain each, ~10 ms of copies). */
#define LD_DIRECT_SYNC (512ull << 20)

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
  enum plan_strided strided;
  enum ld_writes writes;
  struct staging *stagings; /* one per device, for backends without host-visible slabs (ld_staging_start) */
  int ndevices;
  size_t staging_slots, staging_slot_bytes;
  void (*place)(void *arg, int device); /* NUMA placement before a device's staging slots (ld_params) */
  void *place_arg;
  int nstagings;
  char *gate; /* test_load_gate, or NULL */
  int *nodes; /* per device, its NUMA node (-1: none) */
};

/* Raises the target's ready watermark to v (never lowers it) and tells the hook. */
static void raise_ready(struct ld_target *t, uint64_t v) {
  uint_fast64_t cur = atomic_load(&t->ready_bytes);
  while (cur < v)
    if (atomic_compare_exchange_weak(&t->ready_bytes, &cur, v)) {
      if (t->ready != NULL) t->ready(t, v);
      return;
    }
}

/*
 * Raises the watermark while the fill runs, short of the end of the slab: a
 * wait for the whole slab succeeds only once the shards are known unchanged
 * (publish_final).
 */
static void publish_ready(struct ld_target *t, uint64_t v) {
  if (v < t->plan->slab_bytes) raise_ready(t, v);
}

/* The whole slab is ready: after the fill and the check that no shard changed under it. */
static void publish_final(struct ld_target *t) { raise_ready(t, t->plan->slab_bytes); }

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
  if (moved) publish_ready(r->set, upto < r->hi ? upto : r->hi);
}

/*
 * Bytes per fill task for a window: one task per fill thread, 256 KiB to 8
 * MiB each, in 64 KiB multiples. A staged load has its slots' windows in
 * flight at once, so every fill thread has a task while the slots are
 * free (16 threads and 16 MiB windows: 1 MiB tasks, as measured on the
 * H200 host; docs/benchmarks.md).
 */
static uint64_t task_bytes(const struct loader *ld, uint64_t window) {
  uint64_t task = window / (uint64_t)fill_threads(ld->fill);
  task = task < LD_TASK_MIN ? LD_TASK_MIN : task > LD_TASK_MAX ? LD_TASK_MAX : task;
  return (task + 65535) / 65536 * 65536;
}

/* Gathers slab bytes [lo, hi) into dst on the fill threads, counting progress. */
static int fill_window(struct loader *ld, struct ld_target *s, const unsigned char **data, uint64_t lo,
                       uint64_t hi, unsigned char *dst, struct wd_error *err) {
  struct window_fill r = {.ld = ld, .set = s, .data = data, .lo = lo, .hi = hi, .dst = dst};
  r.task = task_bytes(ld, hi - lo);
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

static int check_cancel(struct ld_target *s, struct wd_error *err) {
  if (!atomic_load(&s->cancel)) return 0;
  return err_set(err, WEIGHTD_E_CANCELED, "load of %s canceled", s->ck->path);
}

/* ---- the test gate ------------------------------------------------------------------ */

/* Opens the test gate for one load: its descriptor, or -1 when there is none (the gate is open). */
static int gate_open(const struct loader *ld) {
  if (ld->gate == NULL) return -1;
  int gate = open(ld->gate, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (gate < 0) log_msg(LOG_WARN, "test_load_gate %s: %s (the gate stays open)", ld->gate, strerror(errno));
  return gate;
}

/*
 * Waits for one byte from the test gate (a FIFO) before a window: 0 to go
 * on, CANCELED when the load is canceled meanwhile. End of file (every writer
 * gone) or a failed read closes *gate: from then on the gate is open.
 */
static int gate_pass(int *gate, struct ld_target *s, struct wd_error *err) {
  while (*gate >= 0) {
    char byte;
    ssize_t n = read(*gate, &byte, 1);
    if (n == 1) return 0;
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      int rc = check_cancel(s, err);
      if (rc != 0) return rc;
      struct pollfd p = {.fd = *gate, .events = POLLIN};
      poll(&p, 1, 20);
      continue;
    }
    close(*gate);
    *gate = -1;
  }
  return 0;
}

/* ---- memcpy: the slab is host memory ------------------------------------------------ */

static int fill_memcpy(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  const uint64_t window = 256ull << 20; /* cancellation is checked between windows */
  const unsigned char **data = ld_shard_data(s);
  if (data == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  int gate = gate_open(ld);
  int rc = 0;
  for (uint64_t lo = 0; lo < s->plan->slab_bytes && rc == 0; lo += window) {
    if ((rc = gate_pass(&gate, s, err)) != 0 || (rc = check_cancel(s, err)) != 0) break;
    uint64_t hi = lo + window < s->plan->slab_bytes ? lo + window : s->plan->slab_bytes;
    rc = fill_window(ld, s, data, lo, hi, (unsigned char *)s->slab->host_view + lo, err);
  }
  if (gate >= 0) close(gate);
  free(data);
  return rc;
}

/* ---- staged: pinned slots and a stream per slot -------------------------------------- */

/*
 * The staged pipeline without a barrier per window: the plan is cut into
 * windows of one slot each (plan_stage.h: the slab image, and strided pieces
 * as whole source rows where staged_strided says so), every window into fill
 * tasks of slot bytes; the fill threads take tasks in order. A task of window
 * w first waits until the slot it fills (w mod S) has finished the transfers
 * of window w - S; the thread that finishes a window's last task starts that
 * window's transfers (a plain copy per image run, a 2D copy per run of whole
 * rows) on the slot's stream and records the slot's event. So threads that
 * are done with one window go on filling the next while stragglers finish,
 * and the only wait is for a slot's previous transfers.
 *
 * The ready watermark: the schedule's windows are consecutive slab ranges
 * (window w delivers [end of w - 1, end of w), image runs and whole rows
 * alike), and a window has landed once its slot's event, recorded after all
 * of its transfers, has been waited for. That happens when window w + S
 * reuses the slot, at a test-gate stop, and in the final drain; the
 * watermark is the end of the longest prefix of windows that have landed
 * (a window on one slot may land before an earlier one on another).
 */
struct staged_run {
  struct loader *ld;
  struct ld_target *set;
  struct staging *st;
  const struct plan_stage *sched;
  const unsigned char **data; /* per shard: its data section in the mapping */
  uint64_t task;              /* slot bytes per task */
  size_t *task_base;          /* per window + 1: its first task's number */
  atomic_size_t *left;        /* per window: tasks not finished */
  size_t *issued;             /* per slot: windows whose transfers have started */
  uint64_t *ends;             /* per window: the end of the slab range it delivers */
  unsigned char *landed;      /* per window: its transfers are known to have completed */
  size_t next_landed;         /* windows [0, next_landed) have all landed */
  size_t first_task;          /* added to fill_run's task numbers (a gated run goes window by window) */
  plan_copy_fn copy;          /* memcpy, or stream_copy (staging_writes) */
  /*
   * The slots' stores are weakly ordered (streaming stores, write-combined
   * memory): every task fences its own stores (stream_copy_fence) before it
   * counts itself finished in left[w], so the thread that sends the window
   * sends only bytes every filling thread has made visible. A fence in the
   * sender alone would order only the sender's stores.
   */
  bool fence;
  atomic_uint_fast64_t fill_ns, wait_ns; /* thread time filling, and waiting for slots (the debug log) */
  pthread_mutex_t lock;       /* guards issued, landed, next_landed, rc, err */
  pthread_cond_t moved;       /* a transfer started, or the run failed */
  int rc;
  struct wd_error err;
};

struct stage_fill_args {
  const struct staged_run *r;
  size_t w;
  uint64_t lo, hi;
  unsigned char *dst;
};

static int stage_fill_range(void *arg) {
  struct stage_fill_args *a = arg;
  plan_stage_fill(a->r->sched, a->r->set->plan, a->r->data, a->w, a->lo, a->hi, a->dst, a->r->copy);
  return 0;
}

static void staged_fail(struct staged_run *r, int rc, const struct wd_error *err) {
  pthread_mutex_lock(&r->lock);
  if (r->rc == 0) {
    r->rc = rc;
    r->err = *err;
  }
  pthread_cond_broadcast(&r->moved);
  pthread_mutex_unlock(&r->lock);
}

/*
 * Marks window w landed (w == SIZE_MAX: none) and then every window after
 * the landed prefix that has been issued when all_issued is set (the caller
 * drained every slot); raises the watermark over the landed prefix.
 */
static void staged_landed(struct staged_run *r, size_t w, bool all_issued) {
  size_t nslots = r->st->nslots;
  pthread_mutex_lock(&r->lock);
  if (w != SIZE_MAX) r->landed[w] = 1;
  size_t before = r->next_landed;
  for (size_t v = r->next_landed; v < r->sched->nwindows; v++, r->next_landed++) {
    if (all_issued && v / nslots < r->issued[v % nslots]) r->landed[v] = 1;
    if (!r->landed[v]) break;
  }
  uint64_t upto = r->next_landed > 0 ? r->ends[r->next_landed - 1] : 0;
  int moved = r->next_landed != before;
  pthread_mutex_unlock(&r->lock);
  if (moved) publish_ready(r->set, upto);
}

/*
 * Waits for every slot's last transfers while no task runs: every window
 * issued so far has landed. A failed wait fails the run (and moves nothing).
 */
static void staged_drain(struct staged_run *r) {
  const struct wd_backend *b = r->ld->backend;
  bool ok = true;
  for (size_t k = 0; k < r->st->nslots; k++) {
    if (r->issued[k] == 0) continue;
    struct wd_error e2 = {0};
    int r2 = b->ops->event_wait(b->ctx, r->st->events[k], &e2);
    if (r2 != 0) {
      staged_fail(r, r2, &e2);
      ok = false;
    }
  }
  if (ok) staged_landed(r, SIZE_MAX, true);
}

/* The window task i belongs to. */
static size_t task_window(const struct staged_run *r, size_t i) {
  size_t a = 0, b = r->sched->nwindows;
  while (b - a > 1) {
    size_t m = a + (b - a) / 2;
    if (r->task_base[m] <= i) a = m;
    else b = m;
  }
  return a;
}

/*
 * Starts window w's transfers from slot k and records the slot's event. On
 * failure after some transfers were queued it waits for those first (best
 * effort), so that no copy reads the slot once the load has returned.
 */
static int window_send(struct staged_run *r, size_t w, size_t k, struct wd_error *err) {
  const struct wd_backend *b = r->ld->backend;
  const struct plan_window *win = &r->sched->windows[w];
  const unsigned char *slot = r->st->slots[k];
  int rc = 0;
  size_t i = win->first;
  for (; i < win->first + win->count && rc == 0; i++) {
    const struct plan_xfer *x = &r->sched->xfers[i];
    if (x->pc == NULL)
      rc = b->ops->copy_h2d(b->ctx, r->set->slab, x->dst, (size_t)x->len, slot + x->at, (size_t)x->len,
                            (size_t)x->len, 1, r->st->streams[k], err);
    else
      rc = b->ops->copy_h2d(b->ctx, r->set->slab, x->dst, (size_t)x->pc->width, slot + x->at,
                            (size_t)x->pc->src_pitch, (size_t)x->pc->width, (size_t)x->rows, r->st->streams[k], err);
  }
  if (rc == 0) return b->ops->event_record(b->ctx, r->st->events[k], r->st->streams[k], err);
  if (i - 1 > win->first) { /* copies before the failed one were queued */
    struct wd_error e2 = {0};
    if (b->ops->event_record(b->ctx, r->st->events[k], r->st->streams[k], &e2) == 0)
      b->ops->event_wait(b->ctx, r->st->events[k], &e2);
  }
  return rc;
}

static void staged_task(void *arg, size_t i) {
  struct staged_run *r = arg;
  struct staging *st = r->st;
  const struct wd_backend *b = r->ld->backend;
  i += r->first_task;
  size_t w = task_window(r, i), k = w % st->nslots;
  struct wd_error err = {0};
  /* Wait for the slot: window w - S must have started its transfers, then finished them. */
  uint64_t t0 = clock_ns();
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
  if (w >= st->nslots) {
    if (b->ops->event_wait(b->ctx, st->events[k], &err) != 0) {
      staged_fail(r, err.code, &err);
      return;
    }
    /* The slot's last event is window w - S's (w itself records only after this task): it has landed. */
    staged_landed(r, w - st->nslots, false);
  }
  uint64_t t1 = clock_ns();
  atomic_fetch_add(&r->wait_ns, t1 - t0);
  const struct plan_window *win = &r->sched->windows[w];
  uint64_t lo = (uint64_t)(i - r->task_base[w]) * r->task;
  uint64_t hi = lo + r->task < win->used ? lo + r->task : win->used;
  if (lo < hi) {
    struct stage_fill_args a = {r, w, lo, hi, (unsigned char *)st->slots[k] + lo};
    if (fault_call(stage_fill_range, &a) != 0) {
      /* The first transfer of the window that overlaps the range names the tensor. */
      uint64_t off = r->sched->xfers[win->first].dst;
      for (size_t x = win->first; x < win->first + win->count; x++)
        if (r->sched->xfers[x].at + r->sched->xfers[x].len > lo) {
          off = r->sched->xfers[x].dst;
          break;
        }
      ld_fault_error(r->set, off, &err);
      staged_fail(r, err.code, &err);
      return;
    }
    if (r->fence) stream_copy_fence();
  }
  atomic_fetch_add(&r->fill_ns, clock_ns() - t1);
  if (atomic_fetch_sub(&r->left[w], 1) != 1) return;
  /* The window's last task: start its transfers. */
  if (window_send(r, w, k, &err) != 0) {
    staged_fail(r, err.code, &err);
    return;
  }
  atomic_fetch_add(&r->set->bytes_done, win->slab_bytes);
  pthread_mutex_lock(&r->lock);
  r->issued[k]++;
  pthread_cond_broadcast(&r->moved);
  pthread_mutex_unlock(&r->lock);
}

static int fill_staged(struct loader *ld, struct ld_target *s, struct wd_error *err) {
  struct staging *st = &ld->stagings[s->device];
  struct plan_stage *sched = NULL;
  int rc = plan_stage_build(s->plan, st->slot_bytes, ld->strided, &sched, err);
  if (rc != 0) return rc;
  struct staged_run r = {.ld = ld, .set = s, .st = st, .sched = sched};
  r.copy = ld->writes == LD_WRITES_STREAMING ? stream_copy : memcpy;
  r.fence = ld->writes != LD_WRITES_CACHED;
  atomic_init(&r.fill_ns, 0);
  atomic_init(&r.wait_ns, 0);
  size_t nw = sched->nwindows ? sched->nwindows : 1;
  r.task = task_bytes(ld, st->slot_bytes);
  r.data = ld_shard_data(s);
  r.task_base = malloc((sched->nwindows + 1) * sizeof *r.task_base);
  r.left = malloc(nw * sizeof *r.left);
  r.issued = calloc(st->nslots, sizeof *r.issued);
  r.ends = malloc(nw * sizeof *r.ends);
  r.landed = calloc(nw, 1);
  if (r.data == NULL || r.task_base == NULL || r.left == NULL || r.issued == NULL || r.ends == NULL ||
      r.landed == NULL) {
    free(r.data);
    free(r.task_base);
    free(r.left);
    free(r.issued);
    free(r.ends);
    free(r.landed);
    plan_stage_free(sched);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  size_t ntasks = 0;
  for (size_t w = 0; w < sched->nwindows; w++) {
    const struct plan_window *win = &sched->windows[w];
    size_t n = (size_t)((win->used + r.task - 1) / r.task);
    r.task_base[w] = ntasks;
    atomic_init(&r.left[w], n);
    ntasks += n;
    /* Windows deliver consecutive slab ranges (plan_stage.h): this one ends where its last transfer does. */
    const struct plan_xfer *x = &sched->xfers[win->first + win->count - 1];
    r.ends[w] = x->dst + (x->pc == NULL ? x->len : x->rows * x->pc->width);
  }
  r.task_base[sched->nwindows] = ntasks;
  if (sched->rows_pieces > 0)
    log_msg(LOG_DEBUG, "staging %zu strided piece(s) as whole rows: %llu slot bytes for %llu slab bytes",
            sched->rows_pieces, (unsigned long long)sched->staged_bytes, (unsigned long long)s->plan->slab_bytes);
  pthread_mutex_init(&r.lock, NULL);
  pthread_cond_init(&r.moved, NULL);
  int gate = gate_open(ld);
  pthread_mutex_lock(&st->lock);
  uint64_t started = clock_ns();
  if (gate < 0) {
    fill_run(ld->fill, ntasks, staged_task, &r);
  } else {
    /*
     * The test gate: window by window, each once every window before it has
     * landed (the watermark stops exactly at its start) and a byte came
     * through; once the gate opens, the rest in one run. No task runs
     * between two fill_run calls, so r.rc and r.first_task need no lock here.
     */
    for (size_t w = 0; w < sched->nwindows && r.rc == 0; w++) {
      staged_drain(&r);
      struct wd_error ge = {0};
      int grc = r.rc == 0 ? gate_pass(&gate, s, &ge) : 0;
      if (grc != 0) {
        staged_fail(&r, grc, &ge);
        break;
      }
      if (r.rc != 0) break;
      r.first_task = r.task_base[w];
      size_t upto = gate >= 0 ? r.task_base[w + 1] : ntasks;
      fill_run(ld->fill, upto - r.task_base[w], staged_task, &r);
      if (gate < 0) break;
    }
    if (gate >= 0) close(gate);
  }
  /* Drain every slot, also after an error: the slots must be idle for the next load. */
  staged_drain(&r);
  pthread_mutex_unlock(&st->lock);
  double ms = (double)(clock_ns() - started) / 1e6;
  if (r.rc == 0)
    log_msg(LOG_DEBUG,
            "staged %llu slab bytes in %.1f ms (%.1f GiB/s): %zu windows over %zu slots of %.2f MiB; fill threads "
            "filled %.1f ms and waited for slots %.1f ms (thread time)",
            (unsigned long long)s->plan->slab_bytes, ms,
            (double)s->plan->slab_bytes / (ms / 1e3) / (double)(1ull << 30), sched->nwindows, st->nslots,
            (double)st->slot_bytes / (double)(1ull << 20), (double)atomic_load(&r.fill_ns) / 1e6,
            (double)atomic_load(&r.wait_ns) / 1e6);
  pthread_cond_destroy(&r.moved);
  pthread_mutex_destroy(&r.lock);
  free(r.data);
  free(r.task_base);
  free(r.left);
  free(r.issued);
  free(r.ends);
  free(r.landed);
  plan_stage_free(sched);
  if (r.rc != 0) {
    *err = r.err;
    return r.rc;
  }
  atomic_store(&s->bytes_done, s->plan->slab_bytes);
  return 0;
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
      if ((rc = check_cancel(s, err)) != 0) break;
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
      publish_ready(s, end);
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
    rc = fill_staged(ld, s, err);
  } else if (ld->stagings != NULL && ld_plan_pinned(s)) {
    s->method = "direct";
    rc = fill_direct(ld, s, err);
  } else if (s->slab->host_view != NULL) {
    s->method = "memcpy";
    rc = fill_memcpy(ld, s, err);
  } else {
    s->method = "staged";
    rc = fill_staged(ld, s, err);
  }
  if (rc == 0) atomic_store(&s->bytes_done, s->plan->slab_bytes);
  /* A shard rewritten while we copied would have given a mix of old and new bytes. */
  if (rc == 0) rc = ckpt_check_unchanged(s->ck->ck, err);
  if (rc == 0) publish_final(s);
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
