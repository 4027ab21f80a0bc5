/*
 * scrub.c - the scrubber (scrub.h): a worker thread that hashes resident
 * sets' tensors again, and the loop side that queues scrubs, schedules the
 * background ones and applies the results.
 *
 * DESIGN. Two threads share the scrubber. The loop thread queues tasks
 * (scrub_set, the background timer), and takes finished ones back in
 * on_done (uv_async_send from the worker; the done list coalesces several
 * sends) to compare digests, mark sets corrupt and call the continuations.
 * The worker thread takes tasks from the queue, those asked for before
 * background ones, and hashes one batch of outputs (up to batch_bytes) at a
 * time through the backend's slab_hash; after the last batch of a
 * background task it sleeps so that hashing takes `duty` percent of its
 * time (woken early by a new task or the stop). `lock` guards the queue, the done list and
 * `stop`; a task's fields are the worker's while it is queued and the
 * loop's once on the done list. The worker reads of a set only what is
 * immutable while it is READY and held (res_set.scrubbing): its plan, slab
 * and digests.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "clock.h"
#include "manifest.h"
#include "scrub.h"


struct scrub_task {
  struct res_set *set;
  bool background;
  size_t next; /* the next output to hash (worker) */
  uint64_t bytes;
  double spent; /* seconds of hashing so far (worker) */
  unsigned char (*got)[WD_DIGEST_BYTES];
  int rc;
  struct wd_error err;
  double queued_s;
  scrub_done_fn done;
  void *arg;
  struct scrub_task *next_task;
};

struct scrubber {
  uv_loop_t *loop;
  const struct wd_backend *backend;
  struct residency *res;
  bool off;
  unsigned duty;
  uint64_t interval_ms;
  uint64_t batch_bytes; /* per slab_hash call (scrub_params) */
  void (*on_corrupt)(void *arg, struct res_set *s, const size_t *outs, size_t n);
  void *on_corrupt_arg;
  pthread_t worker;
  bool started;
  pthread_mutex_t lock;
  pthread_cond_t cv;
  struct scrub_task *queue; /* asked-for tasks first, in order, then background ones */
  struct scrub_task *done;
  bool stop;
  uv_async_t async;
  uv_timer_t timer;
  int handles_open; /* the async and the timer, until their close callbacks ran */
  bool background_out; /* a background task is queued or its result not applied yet */
  uint64_t last_id;    /* the id number of the set last scrubbed in the background */
  struct scrub_stats stats;
};

/* ---- the worker ------------------------------------------------------------------- */

/* Sleeps up to s seconds, or until a task arrives or the stop (lock held). */
static void nap(struct scrubber *sc, double s) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* the condition variable's clock (scrub_create) */
  double end = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 + s;
  ts.tv_sec = (time_t)end;
  ts.tv_nsec = (long)((end - (double)ts.tv_sec) * 1e9);
  /* Only the stop or an asked-for task ends it early: the next background task, queued by the loop a short
   * interval after the last one ended, must wait for it (else the duty cycle holds only for long intervals). */
  while (!sc->stop && (sc->queue == NULL || sc->queue->background))
    if (pthread_cond_timedwait(&sc->cv, &sc->lock, &ts) == ETIMEDOUT) break;
}

/* Hashes the task's next batch of outputs; true when the task is complete (or failed). */
static bool hash_batch(struct scrubber *sc, struct scrub_task *t) {
  const struct plan *p = t->set->plan;
  size_t first = t->next, end = first;
  uint64_t bytes = 0;
  while (end < p->noutputs && (end == first || bytes + p->outputs[end].nbytes <= sc->batch_bytes))
    bytes += p->outputs[end++].nbytes;
  struct wd_hash_range *r = calloc(end - first ? end - first : 1, sizeof *r);
  if (r == NULL) {
    t->rc = err_set(&t->err, WEIGHTD_E_NOMEM, "scrub of set %s: out of memory", t->set->id);
    return true;
  }
  for (size_t i = first; i < end; i++)
    r[i - first] = (struct wd_hash_range){p->outputs[i].offset, p->outputs[i].nbytes};
  t->rc = end > first ? sc->backend->ops->slab_hash(sc->backend->ctx, t->set->load.slab, r, end - first,
                                                   t->got + first, &t->err)
                      : 0;
  free(r);
  t->bytes += bytes;
  t->next = end;
  return t->rc != 0 || end == p->noutputs;
}

static void *worker_main(void *arg) {
  struct scrubber *sc = arg;
  pthread_mutex_lock(&sc->lock);
  while (!sc->stop) {
    struct scrub_task *t = sc->queue;
    if (t == NULL) {
      pthread_cond_wait(&sc->cv, &sc->lock);
      continue;
    }
    pthread_mutex_unlock(&sc->lock);
    double t0 = clock_s();
    bool complete = hash_batch(sc, t);
    t->spent += clock_s() - t0;
    double spent = t->spent;
    bool background = t->background;
    pthread_mutex_lock(&sc->lock);
    if (complete) {
      /* Only this thread takes tasks off the queue, but the loop may have put asked-for ones before t meanwhile. */
      struct scrub_task **pp = &sc->queue;
      while (*pp != t) pp = &(*pp)->next_task;
      *pp = t->next_task;
      t->next_task = sc->done;
      sc->done = t;
      uv_async_send(&sc->async);
    }
    /*
     * The duty cycle's nap comes after a background task is complete (t is the loop's now), never between its
     * batches: a set is held only while it is hashed, so a scrub never keeps it from an eviction for long. A
     * task queued meanwhile wakes the nap (the condition variable).
     */
    if (complete && background && sc->duty > 0 && sc->duty < 100 && !sc->stop)
      nap(sc, spent * (double)(100 - sc->duty) / (double)sc->duty);
  }
  pthread_mutex_unlock(&sc->lock);
  return NULL;
}

/* ---- the loop side ---------------------------------------------------------------- */

static uint64_t id_number(const char *id) { return strtoull(id + 1, NULL, 10); }

static void arm_background(struct scrubber *sc);

/* Compares a finished task's digests with the set's, marks what differs, and tells its caller. */
static void apply(struct scrubber *sc, struct scrub_task *t) {
  struct res_set *s = t->set;
  const struct plan *p = s->plan;
  struct scrub_mismatch *mm = NULL;
  size_t nm = 0, *fresh = NULL, nfresh = 0;
  if (t->rc == 0) {
    for (size_t i = 0; i < p->noutputs; i++) nm += memcmp(t->got[i], s->load.digests[i], WD_DIGEST_BYTES) != 0;
    mm = calloc(nm ? nm : 1, sizeof *mm);
    fresh = calloc(nm ? nm : 1, sizeof *fresh);
    if (nm > 0 && s->corrupt == NULL) s->corrupt = calloc(p->noutputs, sizeof *s->corrupt);
    if (mm == NULL || fresh == NULL || (nm > 0 && s->corrupt == NULL))
      t->rc = err_set(&t->err, WEIGHTD_E_NOMEM, "scrub of set %s: out of memory", s->id);
  }
  if (t->rc == 0) {
    size_t k = 0;
    for (size_t i = 0; i < p->noutputs; i++) {
      if (memcmp(t->got[i], s->load.digests[i], WD_DIGEST_BYTES) == 0) continue;
      mm[k].output = i;
      memcpy(mm[k].want, s->load.digests[i], WD_DIGEST_BYTES);
      memcpy(mm[k].got, t->got[i], WD_DIGEST_BYTES);
      k++;
      if (!s->corrupt[i]) {
        s->corrupt[i] = true;
        s->ncorrupt++;
        fresh[nfresh++] = i;
        char w[2 * WD_DIGEST_BYTES + 1], g[2 * WD_DIGEST_BYTES + 1];
        mf_hex(s->load.digests[i], WD_DIGEST_BYTES, w);
        mf_hex(t->got[i], WD_DIGEST_BYTES, g);
        log_msg(LOG_ERROR, "set %s (%s): tensor '%s' changed since it was loaded (xxh3-128 %s, loaded as %s; %s "
                           "scrub): the set is marked corrupt",
                s->id, s->ck->path, p->outputs[i].name, g, w, t->background ? "background" : "requested");
      }
    }
    sc->stats.scrubbed_bytes += t->bytes;
    sc->stats.mismatches += nm;
    sc->stats.scrubs++;
    sc->stats.background += t->background;
    log_msg(nm ? LOG_WARN : LOG_DEBUG, "scrubbed set %s: %zu tensors, %" PRIu64 " bytes, %zu differ", s->id,
            p->noutputs, t->bytes, nm);
  } else {
    log_msg(t->rc == WEIGHTD_E_CANCELED ? LOG_DEBUG : LOG_WARN, "scrub of set %s failed: %s", s->id, t->err.msg);
  }
  if (t->done != NULL) {
    struct scrub_report rep = {.bytes = t->bytes,
                               .tensors = p->noutputs,
                               .seconds = clock_s() - t->queued_s,
                               .nmismatch = nm,
                               .mismatch = mm,
                               .found = (const unsigned char (*)[WD_DIGEST_BYTES])t->got};
    if (t->rc == 0) t->done(t->arg, s, &rep, NULL);
    else t->done(t->arg, s, NULL, &t->err);
  }
  if (t->background) {
    sc->background_out = false;
    sc->last_id = id_number(s->id);
  }
  /* The set is no longer read; on_corrupt may retire it (and free it), and a retired one goes with its last scrub. */
  s->scrubbing--;
  if (nfresh > 0 && sc->on_corrupt != NULL) sc->on_corrupt(sc->on_corrupt_arg, s, fresh, nfresh);
  else res_set_release_if_orphan(s);
  if (t->background) arm_background(sc);
  free(mm);
  free(fresh);
  free(t->got);
  free(t);
}

static void on_done(uv_async_t *a) {
  struct scrubber *sc = a->data;
  pthread_mutex_lock(&sc->lock);
  struct scrub_task *t = sc->done;
  sc->done = NULL;
  pthread_mutex_unlock(&sc->lock);
  while (t != NULL) {
    struct scrub_task *next = t->next_task;
    apply(sc, t);
    t = next;
  }
}

static int queue_task(struct scrubber *sc, struct res_set *s, bool background, scrub_done_fn done, void *arg,
                      struct wd_error *err) {
  if (s->state != SET_READY) return err_set(err, WEIGHTD_E_BUSY, "set %s is not ready: nothing to scrub yet", s->id);
  if (s->load.digests == NULL)
    return err_set(err, WEIGHTD_E_UNSUPPORTED, "set %s has no digests to scrub against (%s)", s->id,
                   sc->off                             ? "scrubbing is off: the scrub setting"
                   : sc->backend->ops->slab_hash == NULL ? "this backend cannot hash its memory"
                   : s->adopted ? "it was re-adopted after a restart, not loaded"
                                : "hashing it after its load failed: see the daemon's log");
  if (sc->stop) return err_set(err, WEIGHTD_E_CANCELED, "the daemon is stopping");
  struct scrub_task *t = calloc(1, sizeof *t);
  if (t != NULL) t->got = calloc(s->plan->noutputs ? s->plan->noutputs : 1, sizeof *t->got);
  if (t == NULL || t->got == NULL) {
    if (t != NULL) free(t->got);
    free(t);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  if (!background) { /* one asked-for scrub of a set waits at a time: more would only hold it from eviction */
    pthread_mutex_lock(&sc->lock);
    bool queued = false;
    for (struct scrub_task *q = sc->queue; q != NULL && !queued; q = q->next_task) queued = q->set == s && !q->background;
    pthread_mutex_unlock(&sc->lock);
    if (queued) {
      free(t->got);
      free(t);
      return err_set(err, WEIGHTD_E_BUSY, "a scrub of set %s is already queued: ask again when it is done", s->id);
    }
  }
  t->set = s;
  t->background = background;
  t->done = done;
  t->arg = arg;
  t->queued_s = clock_s();
  s->scrubbing++;
  pthread_mutex_lock(&sc->lock);
  /* Asked-for tasks go after the other asked-for ones, before every background one (which may have begun). */
  struct scrub_task **pp = &sc->queue;
  if (background)
    while (*pp != NULL) pp = &(*pp)->next_task;
  else
    while (*pp != NULL && !(*pp)->background) pp = &(*pp)->next_task;
  t->next_task = *pp;
  *pp = t;
  pthread_cond_signal(&sc->cv);
  pthread_mutex_unlock(&sc->lock);
  return 0;
}

int scrub_set(struct scrubber *sc, struct res_set *s, scrub_done_fn done, void *arg, struct wd_error *err) {
  return queue_task(sc, s, false, done, arg, err);
}

/* The next ready set with digests, not already corrupt, after the last one by id (wrapping around); NULL: none. */
static struct res_set *next_background(struct scrubber *sc) {
  struct res_set *after = NULL, *first = NULL;
  for (struct res_set *s = res_first_set(sc->res); s != NULL; s = s->next) {
    if (s->state != SET_READY || s->load.digests == NULL || s->ncorrupt > 0) continue;
    uint64_t n = id_number(s->id);
    if (n > sc->last_id && (after == NULL || n < id_number(after->id))) after = s;
    if (first == NULL || n < id_number(first->id)) first = s;
  }
  return after != NULL ? after : first;
}

static void on_timer(uv_timer_t *tm) {
  struct scrubber *sc = tm->data;
  if (sc->background_out || sc->stop) return;
  struct res_set *s = next_background(sc);
  struct wd_error err = {0};
  if (s != NULL && queue_task(sc, s, true, NULL, NULL, &err) == 0) sc->background_out = true;
  else arm_background(sc); /* nothing to scrub now: look again after the interval */
}

static void arm_background(struct scrubber *sc) {
  if (sc->duty == 0 || sc->stop) return;
  uv_timer_start(&sc->timer, on_timer, sc->interval_ms, 0);
}

int scrub_create(const struct scrub_params *p, struct scrubber **out, struct wd_error *err) {
  *out = NULL;
  struct scrubber *sc = calloc(1, sizeof *sc);
  if (sc == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  sc->loop = p->loop;
  sc->backend = p->backend;
  sc->res = p->res;
  sc->duty = p->duty > 100 ? 100 : p->duty;
  sc->off = p->off;
  sc->interval_ms = p->interval_ms;
  sc->batch_bytes = p->batch_bytes ? p->batch_bytes : SCRUB_BATCH_BYTES;
  sc->on_corrupt = p->on_corrupt;
  sc->on_corrupt_arg = p->on_corrupt_arg;
  pthread_mutex_init(&sc->lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* a nap's deadline does not move with the wall clock */
  pthread_cond_init(&sc->cv, &ca);
  pthread_condattr_destroy(&ca);
  uv_async_init(p->loop, &sc->async, on_done);
  sc->async.data = sc;
  uv_timer_init(p->loop, &sc->timer);
  sc->timer.data = sc;
  sc->handles_open = 2;
  int e = pthread_create(&sc->worker, NULL, worker_main, sc);
  if (e != 0) {
    scrub_destroy(sc);
    return err_set(err, WEIGHTD_E_NOMEM, "starting the scrub thread: %s", strerror(e));
  }
  sc->started = true;
  arm_background(sc);
  *out = sc;
  return 0;
}

void scrub_stop(struct scrubber *sc) {
  if (sc == NULL || sc->stop) return;
  pthread_mutex_lock(&sc->lock);
  sc->stop = true;
  pthread_cond_signal(&sc->cv);
  pthread_mutex_unlock(&sc->lock);
  if (sc->started) pthread_join(sc->worker, NULL);
  sc->started = false;
  uv_timer_stop(&sc->timer);
  on_done(&sc->async); /* finished ones are reported */
  struct scrub_task *t = sc->queue;
  sc->queue = NULL;
  while (t != NULL) {
    struct scrub_task *next = t->next_task;
    t->rc = err_set(&t->err, WEIGHTD_E_CANCELED, "the daemon is stopping");
    apply(sc, t);
    t = next;
  }
}

static void scrubber_closed(uv_handle_t *h) {
  struct scrubber *sc = h->data;
  if (--sc->handles_open > 0) return;
  pthread_mutex_destroy(&sc->lock);
  pthread_cond_destroy(&sc->cv);
  free(sc);
}

void scrub_destroy(struct scrubber *sc) {
  if (sc == NULL) return;
  scrub_stop(sc);
  uv_close((uv_handle_t *)&sc->async, scrubber_closed);
  uv_close((uv_handle_t *)&sc->timer, scrubber_closed);
}

const struct scrub_stats *scrub_stats(const struct scrubber *sc) { return &sc->stats; }
unsigned scrub_duty(const struct scrubber *sc) { return sc->duty; }
