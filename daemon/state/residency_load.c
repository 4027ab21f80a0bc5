/*
 * residency_load.c - loading a set and waiting for it: the load job, its
 * waiters and their progress, replicas offered as sources (see residency.h).
 * It calls into residency.c (residency_internal.h); residency.c never calls
 * in here.
 *
 * DESIGN: like all of residency, loop-owned, except the load job's work
 * (load_work), which a job thread runs. The load's threads touch two things
 * of a set besides its ld_target: its progress page (advanced through the
 * loader's ready hook; the page is made before the job starts and unmapped
 * after it ended) and, once, the `allocated` flag with an async wake-up of
 * the loop (`notify`), which then answers the set's early waiters
 * (residency.c).
 */
#include "residency_internal.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "base/log.h"

/* Counts a finished load job (loop thread). */
static void count_load(struct residency *r, const struct res_set *s, int rc) {
  enum ld_method m = s->load.method < LD_METHOD_COUNT ? s->load.method : LD_METHOD_MEMCPY;
  enum res_result res = rc == 0 ? RES_RESULT_OK : rc == WEIGHTD_E_CANCELED ? RES_RESULT_CANCELED : RES_RESULT_FAILED;
  struct res_stats *st = &r->stats;
  st->loads[res][m]++;
  st->verified_chunks += s->load.verified_chunks;
  st->verify_mismatches += s->load.verify_mismatches;
  if (rc != 0) return;
  st->bytes_loaded += s->plan->payload_bytes;
  for (int k = 0; k < LD_SOURCE_KINDS; k++) st->source_bytes[k] += atomic_load(&s->load.source_bytes[k]);
  st->last_gib_per_s = s->seconds > 0 ? (double)s->plan->payload_bytes / (double)(1ull << 30) / s->seconds : 0;
  static const double bounds[RES_DURATION_BUCKETS] = RES_DURATION_BOUNDS;
  int b = 0;
  while (b < RES_DURATION_BUCKETS && s->seconds > bounds[b]) b++;
  if (b < RES_DURATION_BUCKETS) st->duration_le[b]++;
  else st->duration_over++;
  st->duration_sum += s->seconds;
}

/* ---- waiters ------------------------------------------------------------------------ */

static void on_progress_timer(uv_timer_t *t) {
  struct res_set *s = t->data;
  uint64_t done = atomic_load(&s->load.bytes_done);
  for (struct res_waiter *w = s->waiters; w != NULL; w = w->next)
    if (w->progress != NULL) w->progress(w, done, s->plan->slab_bytes);
}

static void add_waiter(struct res_set *s, struct res_waiter *w, bool joined) {
  w->joined = joined;
  w->set = s;
  w->next = s->waiters;
  s->waiters = w;
  atomic_store(&s->load.cancel, false); /* a canceled load someone wants again goes on */
  s->cancel_asked = false;
  if (w->progress != NULL) w->progress(w, atomic_load(&s->load.bytes_done), s->plan->slab_bytes);
}

/* Takes w out of the waiter list of the set it waits for; true if it was there. */
bool res_waiter_leave(struct res_waiter *w) {
  struct res_set *s = w->set;
  if (s == NULL) return false;
  struct res_waiter **pp = &s->waiters;
  while (*pp != NULL && *pp != w) pp = &(*pp)->next;
  if (*pp == w) *pp = w->next;
  w->set = NULL;
  w->next = NULL;
  return true;
}

bool res_waiter_cancel(struct res_waiter *w) {
  struct res_set *s = w->set;
  if (!res_waiter_leave(w)) return false;
  /* Early attachers are not waiters: their leases keep the load going too. */
  if (s->waiters == NULL && s->leases == 0) {
    atomic_store(&s->load.cancel, true);
    s->cancel_asked = true; /* and if it completes anyway, nothing is kept: the cancel's reply said so */
  }
  return true;
}

static void fail_waiter(struct res_waiter *w, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void fail_waiter(struct res_waiter *w, int code, const char *fmt, ...) {
  struct wd_error err = {.code = code};
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err.msg, sizeof err.msg, fmt, ap);
  va_end(ap);
  w->done(w, NULL, false, &err);
}

/* ---- the load job -------------------------------------------------------------------- */

struct load_job {
  struct job job;
  struct res_set *set;
  struct loader *ld;
  const struct wd_backend *backend;
  struct slab_list to_free; /* evicted for this load: freed before it allocates */
  bool budgeted;            /* the device has a budget: the job asks the loop for room before it allocates */
  bool room_refused;        /* the budget could not hold the set: evicting more would not help */
  bool retried;
  bool want_ranges; /* the pin policy wants the byte ranges a finished load read */
  struct plan_range *ranges;
  size_t nranges;
  int rc;
  struct wd_error err;
};

static struct res_set *target_set(struct ld_target *t) {
  return (struct res_set *)((char *)t - offsetof(struct res_set, load));
}

/* The load's hooks (its threads): the slab exists; the watermark moved. */
static void load_allocated(struct ld_target *t) {
  struct res_set *s = target_set(t);
  atomic_store(&s->allocated, true);
  uv_async_send(&s->res->notify);
}

static void load_ready(struct ld_target *t, uint64_t ready) {
  struct res_set *s = target_set(t);
  if (s->page != NULL) ppage_advance(s->page, ready);
}

static void load_work(struct job *j) {
  struct load_job *lj = (struct load_job *)j;
  res_slab_list_free_now(lj->backend, &lj->to_free);
  /* Room on the device now, as it is about to allocate (a slab it has already, from a run before, needs none). */
  if (lj->budgeted && lj->set->load.slab == NULL) {
    struct room_req room;
    lj->rc = res_room_ask(lj->set->res, lj->set, &room);
    res_slab_list_free_now(lj->backend, &room.freed);
    if (lj->rc != 0) {
      lj->err = room.err;
      lj->room_refused = true;
      return;
    }
  }
  double t0 = clock_s();
  lj->rc = ld_fill(lj->ld, &lj->set->load, &lj->err);
  lj->set->seconds = clock_s() - t0;
  /*
   * Listed here, off the loop; a load that went direct read only registered
   * bytes already, a replica read no host memory at all, and one that read
   * with O_DIRECT must not bring its bytes into the page cache after all.
   */
  struct wd_error e2 = {0};
  const struct ld_target *t = &lj->set->load;
  if (lj->rc == 0 && lj->want_ranges && (t->method == LD_METHOD_MEMCPY || t->method == LD_METHOD_STAGED ||
                                          t->method == LD_METHOD_STRIPED) && t->source_kind == LD_SOURCE_MMAP)
    reg_plan_ranges(lj->set->ck, lj->set->plan, &lj->ranges, &lj->nranges, &e2);
}

static void load_done(struct job *j) {
  struct load_job *lj = (struct load_job *)j;
  struct res_set *s = lj->set;
  struct residency *r = s->res;
  if (lj->rc == 0 && s->cancel_asked && atomic_load(&s->load.cancel) && s->waiters == NULL && s->leases == 0) {
    /* Its last window was moving when the cancel came: its requester was told CANCELED, so nothing is kept. */
    log_msg(LOG_INFO, "set %s: its load was canceled as it completed: not kept", s->id);
    lj->rc = err_set(&lj->err, WEIGHTD_E_CANCELED, "load of %s canceled", s->ck->path);
  }
  if (lj->rc == WEIGHTD_E_CANCELED && (s->waiters != NULL || s->leases > 0) && !atomic_load(&s->load.cancel)) {
    /* Canceled, but someone asked for the same set since: load it for them (into the same slab). */
    log_msg(LOG_INFO, "set %s: canceled load restarted for a request that joined it", s->id);
    atomic_store(&s->load.bytes_done, 0);
    jobs_submit(r->bulk, &lj->job);
    return;
  }
  /* A remote checkpoint found changed by its load: the next request asks the store again (and reopens it). */
  if (lj->rc == WEIGHTD_E_STALE && s->ck->remote) atomic_store(&s->ck->remote_checked_ms, 0);
  if (lj->rc == WEIGHTD_E_DEVICE_NOMEM && !lj->retried && !lj->room_refused && !atomic_load(&s->load.cancel)) {
    size_t n = 0;
    struct res_set *e = r->sets;
    while (e != NULL) {
      struct res_set *next = e->next;
      if (res_evictable(e, s->device)) {
        res_evict_one(e, &lj->to_free, RES_EVICT_DEVICE_FULL, NULL);
        n++;
      }
      e = next;
    }
    if (n > 0) {
      log_msg(LOG_INFO, "device %d full: evicted %zu unleased set(s), retrying set %s", s->device, n, s->id);
      lj->retried = true;
      atomic_store(&s->load.bytes_done, 0);
      jobs_submit(r->bulk, &lj->job);
      return;
    }
  }
  reg_load_end(s->ck);
  ld_unreserve(r->ld, s->device);
  for (size_t i = 0; i < s->ncopy_from; i++) {
    s->copy_from[i]->copying--;
    res_set_release_if_orphan(s->copy_from[i]); /* retired meanwhile (a scrub found it corrupt): it goes now */
  }
  s->ncopy_from = 0;
  s->load.ncopies = 0;
  count_load(r, s, lj->rc);
  free((void *)s->load.pins); /* the registrations it could use: no longer needed */
  s->load.pins = NULL;
  s->load.npins = 0;
  uv_timer_stop(&s->progress_timer);
  struct res_waiter *w = s->waiters;
  s->waiters = NULL;
  if (lj->rc == 0) {
    s->state = SET_READY;
    s->last_used_ms = clock_ms();
    res_changed(r, true);
    double gibs = s->seconds > 0 ? (double)s->plan->payload_bytes / (double)(1ull << 30) / s->seconds : 0;
    log_msg(LOG_INFO,
            "loaded set %s: %s on %s, %zu tensors, %" PRIu64 " bytes in %.3f s (%.2f GiB/s, %s%s%s; slab allocation "
            "%.1f ms)",
            s->id, s->ck->path, r->devices[s->device].info.uuid, s->plan->noutputs, s->plan->payload_bytes,
            s->seconds, gibs, ld_method_name(s->load.method), s->load.source[0] ? " from " : "", s->load.source,
            s->load.alloc_seconds * 1e3);
  } else {
    s->state = SET_FAILED;
    log_msg(LOG_WARN, "load of set %s (%s) failed: %s", s->id, s->ck->path, lj->err.msg);
  }
  if (s->page != NULL)
    ppage_finish(s->page,
                 lj->rc == 0                    ? WD_PAGE_READY
                 : lj->rc == WEIGHTD_E_CANCELED ? WD_PAGE_CANCELED
                                                : WD_PAGE_FAILED,
                 lj->rc, lj->rc != 0 ? lj->err.msg : "");
  while (w != NULL) {
    struct res_waiter *next = w->next;
    w->set = NULL;
    w->next = NULL;
    if (lj->rc == 0) w->done(w, s, w->joined, NULL);
    else w->done(w, NULL, false, &lj->err);
    w = next;
  }
  /* The pin policy after the waiters have their answer: registering runs in the background. */
  if (lj->rc == 0 && lj->ranges != NULL) reg_pin_after_load(s->ck, lj->ranges, lj->nranges);
  else free(lj->ranges);
  if (lj->rc != 0 && s->leases > 0) {
    /* Early attachers still map the slab: off the list now, freed with the last lease. */
    res_set_unlink(s);
    s->orphan = true;
    s->next = r->orphans;
    r->orphans = s;
    log_msg(LOG_INFO, "set %s: %d early lease(s) keep its slab until they end", s->id, s->leases);
  } else if (lj->rc != 0) {
    res_set_destroy(s, NULL);
  }
  free(lj->to_free.v);
  free(lj);
}

/*
 * Offers a new set's load the ready copies of the same checkpoint and plan
 * on other devices (a replica may be copied from one of them), and keeps
 * them from eviction until the load is done. Without memory it offers none.
 */
/* Whether c is a ready copy of s on another device that s may be copied from (never one a scrub found corrupt). */
static bool copyable(const struct res_set *c, const struct res_set *s) {
  return c->ck == s->ck && c->device != s->device && c->state == SET_READY && c->ncorrupt == 0 &&
         strcmp(c->plan->key, s->plan->key) == 0;
}

static void offer_copies(struct residency *r, struct res_set *s) {
  if (!r->replicas) return;
  size_t n = 0;
  for (struct res_set *c = r->sets; c != NULL; c = c->next)
    n += copyable(c, s);
  if (n == 0) return;
  struct ld_copy *src = calloc(n, sizeof *src);
  struct res_set **from = calloc(n, sizeof *from);
  if (src == NULL || from == NULL) {
    free(src);
    free(from);
    return;
  }
  size_t k = 0;
  for (struct res_set *c = r->sets; c != NULL && k < n; c = c->next) {
    if (!copyable(c, s)) continue;
    src[k] = (struct ld_copy){.slab = c->load.slab, .device = c->device,
                              .digests = (const unsigned char (*)[WD_DIGEST_BYTES])c->load.digests};
    from[k++] = c;
    c->copying++;
  }
  s->load.copies = src;
  s->load.ncopies = k;
  s->copy_from = from;
  s->ncopy_from = k;
}

void res_load(struct residency *r, struct reg_ckpt *ck, int device, struct plan *plan, enum ld_source_choice source,
              struct res_waiter *w) {
  w->set = NULL;
  /* Slabs of sets retired just before (a corrupt set's reload): this load's job frees them before it allocates. */
  struct slab_list retired = r->retired;
  r->retired = (struct slab_list){0};
  char *key = NULL;
  if (asprintf(&key, "%s#%" PRIu64 "|%d|%s", ck->path, ck->generation, device, plan->key) < 0) {
    res_free_later(r, NULL, &retired);
    plan_free(plan);
    reg_unref(ck);
    fail_waiter(w, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  struct res_set *s = res_find_by_key(r, key);
  if (s != NULL) {
    res_free_later(r, NULL, &retired);
    free(key);
    plan_free(plan);
    reg_unref(ck);
    res_wait(r, s, w);
    return;
  }
  uint64_t id = r->next_id < RES_ID_MAX ? r->next_id + 1 : 0; /* taken below, once the set is made */
  s = calloc(1, sizeof *s);
  struct load_job *lj = calloc(1, sizeof *lj);
  if (s == NULL || lj == NULL || id == 0 || !res_room_possible(r, device, plan->slab_bytes)) {
    bool nomem = s == NULL || lj == NULL;
    res_free_later(r, NULL, &retired);
    free(s);
    free(lj);
    free(key);
    if (id == 0)
      fail_waiter(w, WEIGHTD_E_LIMIT, "no set id is left (the last, s%llu, was given)", RES_ID_MAX);
    else if (nomem)
      fail_waiter(w, WEIGHTD_E_NOMEM, "out of memory");
    else
      fail_waiter(w, WEIGHTD_E_DEVICE_NOMEM,
                  "set of %" PRIu64 " bytes does not fit device %d's budget of %" PRIu64 " bytes (%" PRIu64
                  " in use; leased and loading sets are never evicted)",
                  plan->slab_bytes, device, res_device_budget(r, device), r->devices[device].used);
    plan_free(plan);
    reg_unref(ck);
    return;
  }
  s->res = r;
  r->next_id = id;
  snprintf(s->id, sizeof s->id, "s%" PRIu64, id);
  s->key = key;
  s->ck = ck; /* takes the caller's reference */
  s->device = device;
  s->loader_uid = w->uid;
  s->plan = plan;
  s->state = SET_LOADING;
  offer_copies(r, s);
  s->load.plan = plan;
  s->load.ck = ck->ck;
  s->load.name = ck->path;
  s->load.mmap = ck->src;
  s->load.choice = source;
  s->load.device = device;
  s->load.method = LD_METHOD_MEMCPY;
  struct plan_range *pins = NULL;
  if (reg_pins_copy(ck, &pins, &s->load.npins) != 0) s->load.npins = 0; /* no memory: it stages instead */
  s->load.pins = pins;
  s->load.allocated = load_allocated;
  s->load.ready = load_ready;
  atomic_init(&s->load.bytes_done, 0);
  atomic_init(&s->load.ready_bytes, 0);
  atomic_init(&s->load.cancel, false);
  atomic_init(&s->load.reading_kind, -1);
  atomic_init(&s->load.reading_device, -1);
  atomic_init(&s->allocated, false);
  s->table_fd = -1;
  struct wd_error perr = {0};
  if (ppage_create(plan->slab_bytes, &s->page, &s->page_fd, &perr) != 0)
    log_msg(LOG_DEBUG, "set %s: no progress page, so no early attach: %s", s->id, perr.msg);
  res_set_link(r, s);
  reg_load_begin(ck);
  add_waiter(s, w, false);
  uv_timer_start(&s->progress_timer, on_progress_timer, 100, 100);
  lj->job.work = load_work;
  lj->job.done = load_done;
  lj->to_free = retired;
  lj->set = s;
  lj->ld = r->ld;
  lj->backend = r->backend;
  lj->budgeted = res_device_budget(r, device) > 0;
  lj->want_ranges = reg_pin_wants_ranges(ck->reg) && ld_can_direct(r->ld);
  log_msg(LOG_DEBUG, "loading set %s: %s, %zu tensors, %" PRIu64 " bytes", s->id, ck->path, plan->noutputs,
          plan->slab_bytes);
  ld_reserve(r->ld, device);
  jobs_submit(r->bulk, &lj->job);
}

void res_wait(struct residency *r, struct res_set *s, struct res_waiter *w) {
  (void)r;
  w->set = NULL;
  s->last_used_ms = clock_ms();
  if (s->state == SET_READY) {
    w->done(w, s, true, NULL);
  } else if (w->early && res_set_early_ok(s)) {
    atomic_store(&s->load.cancel, false); /* a canceled load someone wants again goes on */
    w->done(w, s, true, NULL);
  } else {
    add_waiter(s, w, true);
  }
}
