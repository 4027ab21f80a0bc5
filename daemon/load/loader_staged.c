/*
 * loader_staged.c - the staging pipeline: fill threads gather each window of
 * a plan's staging schedule into a pinned slot, the slot's stream copies it
 * to the GPU (see loader.c for the three ways a load fills a slab, and the
 * ready watermark).
 *
 * DESIGN (threads): ld_fill_staged runs on the load's job thread, holding
 * its GPU's staging (`staging.lock`) for the whole load; its tasks run on the
 * fill pool (struct staged_run below says which field each lock guards).
 */
#include "loader_internal.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "base/fault.h"
#include "load_source.h"
#include "base/log.h"
#include "stream_copy.h"

/* ---- staged: pinned slots and a stream per slot -------------------------------------- */

/*
 * The staged pipeline without a barrier per window: the plan is cut into
 * windows of one slot each (plan_stage.h: the slab image, and strided pieces
 * as whole source rows where staged_strided says so), every window into fill
 * tasks (ld_task_bytes); the fill threads take tasks in order. A task of window
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
  uint64_t task;              /* bytes per task (ld_task_bytes of a slot) */
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
  if (moved) ld_publish_ready(r->set, upto);
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
 * Starts window w's transfers from slot k and records the slot's event.
 * When a transfer fails after others were queued, it records the event and
 * waits for those first, so that no copy reads the slot once the load has
 * returned. Best effort: when the event cannot be recorded either (the
 * device is failing), nothing here can wait for them.
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
  if (ld_check_cancel(r->set, &err) != 0) {
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

/* Frees a run's arrays (any of them may be NULL) and its schedule. */
static void staged_run_free(struct staged_run *r, struct plan_stage *sched) {
  free(r->data);
  free(r->task_base);
  free(r->left);
  free(r->issued);
  free(r->ends);
  free(r->landed);
  plan_stage_free(sched);
}

int ld_fill_staged(struct loader *ld, struct ld_target *s, struct wd_error *err) {
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
  r.task = ld_task_bytes(ld, st->slot_bytes);
  r.data = ld_shard_data(s);
  r.task_base = malloc((sched->nwindows + 1) * sizeof *r.task_base);
  r.left = malloc(nw * sizeof *r.left);
  r.issued = calloc(st->nslots, sizeof *r.issued);
  r.ends = malloc(nw * sizeof *r.ends);
  r.landed = calloc(nw, 1);
  if (r.data == NULL || r.task_base == NULL || r.left == NULL || r.issued == NULL || r.ends == NULL ||
      r.landed == NULL) {
    staged_run_free(&r, sched);
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
  int gate = ld_gate_open(ld);
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
      int grc = r.rc == 0 ? ld_gate_pass(&gate, s, &ge) : 0;
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
  staged_run_free(&r, sched);
  if (r.rc != 0) *err = r.err;
  return r.rc;
}
