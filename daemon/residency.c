/*
 * residency.c - resident sets, leases and eviction (see residency.h).
 *
 * DESIGN: sets, waiters and leases are loop-owned. A set is LOADING while its
 * load job owns its slab (the job reads only its ld_target and the loader),
 * then READY, or it fails and goes away. Waiters of a LOADING set sit in its
 * list; a second identical load joins the list instead of loading again.
 * Slabs are freed on the job pool (freeing a large slab takes tens of
 * milliseconds), by the load that needs the room before it allocates, or by
 * an eviction job that reports back once the memory is free.
 *
 * The load's threads touch two things of a set besides its ld_target: its
 * progress page (advanced through the loader's ready hook; the page is made
 * before the job starts and unmapped after it ended) and, once, the
 * `allocated` flag with an async wake-up of the loop (`notify`), which then
 * answers the set's early waiters.
 */
#include "residency.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"

struct free_job;

struct residency {
  uv_loop_t *loop;
  const struct wd_backend *backend;
  struct jobs *bulk;
  struct loader *ld;
  int ndevices;
  struct res_device *devices;
  uint64_t device_budget;
  uint64_t next_id;
  struct res_set *sets;
  struct res_set *orphans; /* failed or canceled while leased: freed with their last lease */
  struct lease *leases;
  struct res_stats stats;
  uv_async_t notify; /* a load allocated its slab: answer early waiters */
  bool replicas;
  void (*changed)(void *arg); /* sets or leases changed (res_on_change) */
  void *changed_arg;
};

static void changed(struct residency *r) {
  if (r->changed != NULL) r->changed(r->changed_arg);
}

void res_on_change(struct residency *r, void (*fn)(void *arg), void *arg) {
  r->changed = fn;
  r->changed_arg = arg;
}

const char *res_method_name(enum res_method m) {
  static const char *const names[] = {"memcpy", "staged", "direct", "peer", "striped"};
  return m < RES_METHOD_COUNT ? names[m] : "?";
}

const char *res_result_name(enum res_result r) {
  static const char *const names[] = {"ok", "failed", "canceled"};
  return r < RES_RESULT_COUNT ? names[r] : "?";
}

const char *res_evict_reason_name(enum res_evict_reason r) {
  static const char *const names[] = {"budget", "device_full", "request", "reload"};
  return r < RES_EVICT_COUNT ? names[r] : "?";
}

const struct res_stats *res_stats(const struct residency *r) { return &r->stats; }

/* Counts a finished load job (loop thread). */
static void count_load(struct residency *r, const struct res_set *s, int rc) {
  enum res_method m = RES_METHOD_MEMCPY;
  for (int i = 0; i < RES_METHOD_COUNT; i++)
    if (s->load.method != NULL && strcmp(s->load.method, res_method_name((enum res_method)i)) == 0) m = (enum res_method)i;
  enum res_result res = rc == 0 ? RES_RESULT_OK : rc == WEIGHTD_E_CANCELED ? RES_RESULT_CANCELED : RES_RESULT_FAILED;
  struct res_stats *st = &r->stats;
  st->loads[res][m]++;
  if (rc != 0) return;
  st->bytes_loaded += s->plan->payload_bytes;
  st->last_gib_per_s = s->seconds > 0 ? (double)s->plan->payload_bytes / (double)(1ull << 30) / s->seconds : 0;
  static const double bounds[RES_DURATION_BUCKETS] = RES_DURATION_BOUNDS;
  int b = 0;
  while (b < RES_DURATION_BUCKETS && s->seconds > bounds[b]) b++;
  if (b < RES_DURATION_BUCKETS) st->duration_le[b]++;
  else st->duration_over++;
  st->duration_sum += s->seconds;
}

/* Slabs taken from evicted sets, freed together off the loop. */
struct slab_list {
  struct wd_slab **v;
  size_t n, cap;
};

static void serve_early_waiters(struct res_set *s);

static void on_notify(uv_async_t *a) {
  struct residency *r = a->data;
  for (struct res_set *s = r->sets; s != NULL; s = s->next)
    if (res_set_early_ok(s)) serve_early_waiters(s);
}

int res_create(const struct res_params *p, struct residency **out, struct wd_error *err) {
  struct residency *r = calloc(1, sizeof *r);
  if (r == NULL || (r->devices = calloc((size_t)(p->ndevices > 0 ? p->ndevices : 1), sizeof *r->devices)) == NULL) {
    free(r);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  r->loop = p->loop;
  r->backend = p->backend;
  r->bulk = p->bulk;
  r->ld = p->ld;
  r->ndevices = p->ndevices;
  r->device_budget = p->device_budget;
  r->replicas = p->replicas;
  for (int i = 0; i < p->ndevices; i++) r->devices[i].info = p->devices[i];
  if (uv_async_init(r->loop, &r->notify, on_notify) != 0) {
    free(r->devices);
    free(r);
    return err_set(err, WEIGHTD_E_INTERNAL, "uv_async_init failed");
  }
  r->notify.data = r;
  *out = r;
  return 0;
}

struct res_set *res_first_set(const struct residency *r) { return r->sets; }
struct lease *res_first_lease(const struct residency *r) { return r->leases; }
int res_device_count(const struct residency *r) { return r->ndevices; }
struct res_device *res_device(struct residency *r, int device) { return &r->devices[device]; }
static int evict_one(struct res_set *s, struct slab_list *keep, enum res_evict_reason why, struct wd_error *err);
static bool evictable(const struct res_set *s, int device);
static void free_later(struct residency *r, struct free_job *f, struct slab_list *l);

size_t res_device_budget_set(struct residency *r, uint64_t budget) {
  r->device_budget = budget;
  struct slab_list keep = {0};
  size_t n = 0;
  for (int d = 0; d < r->ndevices; d++) {
    uint64_t b = res_device_budget(r, d);
    while (b > 0 && r->devices[d].used > b) {
      struct res_set *victim = NULL;
      for (struct res_set *s = r->sets; s != NULL; s = s->next)
        if (evictable(s, d) && (victim == NULL || s->last_used_ms < victim->last_used_ms)) victim = s;
      if (victim == NULL) break; /* leased and loading sets stay: the device is over budget until they go */
      evict_one(victim, &keep, RES_EVICT_RELOAD, NULL);
      n++;
    }
  }
  free_later(r, NULL, &keep);
  return n;
}

size_t res_set_fds(const struct residency *r) {
  size_t n = 0;
  for (const struct res_set *s = r->sets; s != NULL; s = s->next) n++;
  for (const struct res_set *s = r->orphans; s != NULL; s = s->next) n++;
  return 3 * n;
}

size_t res_count_sets_of(const struct residency *r, const struct reg_ckpt *ck) {
  size_t n = 0;
  for (const struct res_set *s = r->sets; s != NULL; s = s->next) n += s->ck == ck;
  return n;
}

struct res_set *res_find_set(const struct residency *r, const char *id) {
  for (struct res_set *s = r->sets; s != NULL; s = s->next)
    if (strcmp(s->id, id) == 0) return s;
  return NULL;
}

static struct res_set *find_by_key(const struct residency *r, const char *key) {
  for (struct res_set *s = r->sets; s != NULL; s = s->next)
    if (strcmp(s->key, key) == 0 && s->state != SET_FAILED) return s;
  return NULL;
}

bool res_set_canceling(const struct res_set *s) {
  return s->state == SET_LOADING && s->waiters == NULL && atomic_load(&s->load.cancel);
}

bool res_set_early_ok(const struct res_set *s) {
  return s->state == SET_LOADING && s->page != NULL && atomic_load(&s->allocated) &&
         s->load.slab->export_while_filling;
}

/* ---- freeing slabs ------------------------------------------------------------------ */

static void slab_list_push(struct residency *r, struct slab_list *l, struct wd_slab *slab) {
  if (slab == NULL) return;
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 4;
    struct wd_slab **nv = realloc(l->v, cap * sizeof *nv);
    if (nv == NULL) { /* no memory to defer it: free it now */
      r->backend->ops->slab_free(r->backend->ctx, slab);
      return;
    }
    l->v = nv;
    l->cap = cap;
  }
  l->v[l->n++] = slab;
}

/* Frees every slab of the list (on a job thread) and empties it. */
static void slab_list_free_now(const struct wd_backend *b, struct slab_list *l) {
  for (size_t i = 0; i < l->n; i++) b->ops->slab_free(b->ctx, l->v[i]);
  free(l->v);
  memset(l, 0, sizeof *l);
}

/* Freeing a large slab takes long (host: ~57 ms per GiB to unmap): a job does it. */
struct free_job {
  struct job job;
  const struct wd_backend *backend;
  struct slab_list slabs;
  res_evicted_fn cb; /* evictions report back once the memory is free */
  void *arg;
  char **ids;
  size_t nids;
};

static void free_work(struct job *j) {
  struct free_job *f = (struct free_job *)j;
  slab_list_free_now(f->backend, &f->slabs);
}

static void free_done(struct job *j) {
  struct free_job *f = (struct free_job *)j;
  if (f->cb != NULL) f->cb(f->arg, f->ids, f->nids);
  for (size_t i = 0; i < f->nids; i++) free(f->ids[i]);
  free(f->ids);
  free(f);
}

/* Frees the slabs of l on a job (f may carry a continuation), or here when no job can be made. */
static void free_later(struct residency *r, struct free_job *f, struct slab_list *l) {
  if (f == NULL && l->n == 0) {
    free(l->v);
    memset(l, 0, sizeof *l);
    return;
  }
  if (f == NULL && (f = calloc(1, sizeof *f)) == NULL) {
    slab_list_free_now(r->backend, l);
    return;
  }
  f->job.work = free_work;
  f->job.done = free_done;
  f->backend = r->backend;
  f->slabs = *l;
  memset(l, 0, sizeof *l);
  jobs_submit(r->bulk, &f->job);
}

static void timer_closed(uv_handle_t *h) {
  struct res_set *s = h->data;
  ppage_destroy(s->page, s->page_fd);
  if (s->table_fd >= 0) close(s->table_fd);
  free(s->copy_from);
  free((void *)s->load.sources);
  free(s->table_cache);
  free(s->key);
  free(s);
}

/* Takes s out of the list it is on (the sets, or the orphans). */
static void set_unlink(struct res_set *s) {
  struct res_set **pp = s->orphan ? &s->res->orphans : &s->res->sets;
  while (*pp != NULL && *pp != s) pp = &(*pp)->next;
  if (*pp == s) *pp = s->next;
  s->next = NULL;
}

/* Unlinks and frees a set; its slab goes to `keep` when given, else to a free job. */
static void set_destroy(struct res_set *s, struct slab_list *keep) {
  struct residency *r = s->res;
  set_unlink(s);
  if (s->state == SET_READY) changed(r);
  if (s->load.slab != NULL) {
    struct slab_list one = {0};
    slab_list_push(r, keep != NULL ? keep : &one, s->load.slab);
    if (keep == NULL) free_later(r, NULL, &one);
    s->load.slab = NULL;
  }
  if (s->device >= 0 && s->device < r->ndevices) r->devices[s->device].used -= s->plan->slab_bytes;
  free((void *)s->load.pins);
  s->load.pins = NULL;
  plan_free(s->plan);
  reg_unref(s->ck);
  uv_timer_stop(&s->progress_timer);
  uv_close((uv_handle_t *)&s->progress_timer, timer_closed);
}

/* ---- eviction -------------------------------------------------------------------- */

static int evict_one(struct res_set *s, struct slab_list *keep, enum res_evict_reason why, struct wd_error *err) {
  if (s->state == SET_LOADING) return err_set(err, WEIGHTD_E_BUSY, "set %s is still loading", s->id);
  if (s->leases > 0) return err_set(err, WEIGHTD_E_BUSY, "set %s has %d lease(s)", s->id, s->leases);
  if (s->copying > 0)
    return err_set(err, WEIGHTD_E_BUSY, "set %s is being copied to another device by %u load(s)", s->id, s->copying);
  log_msg(LOG_INFO, "evicted set %s (%s, %" PRIu64 " bytes; %s)", s->id, s->ck->path, s->plan->slab_bytes,
          res_evict_reason_name(why));
  s->res->stats.evictions[why]++;
  set_destroy(s, keep);
  return 0;
}

static bool evictable(const struct res_set *s, int device) {
  return s->device == device && s->state == SET_READY && s->leases == 0 && s->copying == 0;
}

uint64_t res_device_budget(const struct residency *r, int device) {
  if (r->device_budget > 0) return r->device_budget;
  if (r->backend->ops->caps & WD_CAP_HOST_SLABS) return r->devices[device].info.memory_total / 2;
  return 0;
}

/* Evicts unleased sets of device, least recently used first, until `need` more bytes fit. */
static bool make_room(struct residency *r, int device, uint64_t need, struct slab_list *keep) {
  uint64_t budget = res_device_budget(r, device);
  if (budget == 0) return true; /* the device itself decides, at allocation */
  /* What eviction cannot free (leased or loading sets) must leave room, or nothing is evicted. */
  uint64_t pinned = 0;
  for (struct res_set *s = r->sets; s != NULL; s = s->next)
    if (s->device == device && (s->state != SET_READY || s->leases > 0 || s->copying > 0))
      pinned += s->plan->slab_bytes;
  for (struct res_set *s = r->orphans; s != NULL; s = s->next)
    if (s->device == device) pinned += s->plan->slab_bytes;
  if (need > budget || pinned > budget - need) return false;
  for (;;) {
    if (r->devices[device].used + need <= budget) return true;
    struct res_set *victim = NULL;
    for (struct res_set *s = r->sets; s != NULL; s = s->next)
      if (evictable(s, device) && (victim == NULL || s->last_used_ms < victim->last_used_ms)) victim = s;
    if (victim == NULL) return false;
    evict_one(victim, keep, RES_EVICT_BUDGET, NULL);
  }
}

int res_evict(struct residency *r, const char *set_id, int device, res_evicted_fn cb, void *arg,
              struct wd_error *err) {
  struct free_job *f = calloc(1, sizeof *f);
  if (f == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  f->cb = cb;
  f->arg = arg;
  size_t cap = 0;
  for (struct res_set *s = r->sets; s != NULL; s = s->next) cap++;
  f->ids = calloc(cap ? cap : 1, sizeof *f->ids);
  if (f->ids == NULL) {
    free(f);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  struct slab_list keep = {0};
  if (set_id != NULL) {
    struct res_set *s = res_find_set(r, set_id);
    char *id = s != NULL ? strdup(s->id) : NULL;
    int rc = s == NULL    ? err_set(err, WEIGHTD_E_NOT_FOUND, "no resident set '%.64s'", set_id)
             : id == NULL ? err_set(err, WEIGHTD_E_NOMEM, "out of memory")
                          : evict_one(s, &keep, RES_EVICT_REQUEST, err);
    if (rc != 0) {
      free(id);
      free(f->ids);
      free(f);
      return rc;
    }
    f->ids[f->nids++] = id;
  } else {
    struct res_set *s = r->sets;
    while (s != NULL) {
      struct res_set *next = s->next;
      if (evictable(s, device)) {
        char *id = strdup(s->id);
        if (id != NULL) f->ids[f->nids++] = id;
        evict_one(s, &keep, RES_EVICT_REQUEST, NULL);
      }
      s = next;
    }
  }
  free_later(r, f, &keep);
  return 0;
}

/* ---- waiters ------------------------------------------------------------------------ */

static void on_progress_timer(uv_timer_t *t) {
  struct res_set *s = t->data;
  uint64_t done = atomic_load(&s->load.bytes_done);
  for (struct res_waiter *w = s->waiters; w != NULL; w = w->next)
    if (w->progress != NULL) w->progress(w, done, s->plan->slab_bytes);
}

/* Answers the set's early waiters (the slab may be shared now); they stop waiting. */
static void serve_early_waiters(struct res_set *s) {
  struct res_waiter *early = NULL, **pp = &s->waiters;
  while (*pp != NULL) {
    struct res_waiter *w = *pp;
    if (!w->early) {
      pp = &w->next;
      continue;
    }
    *pp = w->next;
    w->next = early;
    early = w;
  }
  while (early != NULL) {
    struct res_waiter *w = early;
    early = w->next;
    w->set = NULL;
    w->next = NULL;
    w->done(w, s, w->joined, NULL);
  }
}

static void add_waiter(struct res_set *s, struct res_waiter *w, bool joined) {
  w->joined = joined;
  w->set = s;
  w->next = s->waiters;
  s->waiters = w;
  atomic_store(&s->load.cancel, false); /* a canceled load someone wants again goes on */
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
  if (s->waiters == NULL && s->leases == 0) atomic_store(&s->load.cancel, true);
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
  slab_list_free_now(lj->backend, &lj->to_free);
  double t0 = clock_s();
  lj->rc = ld_fill(lj->ld, &lj->set->load, &lj->err);
  lj->set->seconds = clock_s() - t0;
  /*
   * Listed here, off the loop; a load that went direct read only registered
   * bytes already, and a replica read no host memory at all.
   */
  struct wd_error e2 = {0};
  const char *m = lj->set->load.method;
  if (lj->rc == 0 && lj->want_ranges && strcmp(m, "direct") != 0 && strcmp(m, "peer") != 0)
    reg_plan_ranges(lj->set->ck, lj->set->plan, &lj->ranges, &lj->nranges, &e2);
}

static void load_done(struct job *j) {
  struct load_job *lj = (struct load_job *)j;
  struct res_set *s = lj->set;
  struct residency *r = s->res;
  if (lj->rc == WEIGHTD_E_CANCELED && (s->waiters != NULL || s->leases > 0) && !atomic_load(&s->load.cancel)) {
    /* Canceled, but someone asked for the same set since: load it for them (into the same slab). */
    log_msg(LOG_INFO, "set %s: canceled load restarted for a request that joined it", s->id);
    atomic_store(&s->load.bytes_done, 0);
    jobs_submit(r->bulk, &lj->job);
    return;
  }
  if (lj->rc == WEIGHTD_E_DEVICE_NOMEM && !lj->retried && !atomic_load(&s->load.cancel)) {
    size_t n = 0;
    struct res_set *e = r->sets;
    while (e != NULL) {
      struct res_set *next = e->next;
      if (evictable(e, s->device)) {
        evict_one(e, &lj->to_free, RES_EVICT_DEVICE_FULL, NULL);
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
  for (size_t i = 0; i < s->ncopy_from; i++) s->copy_from[i]->copying--;
  s->ncopy_from = 0;
  s->load.nsources = 0;
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
    changed(r);
    double gibs = s->seconds > 0 ? (double)s->plan->payload_bytes / (double)(1ull << 30) / s->seconds : 0;
    log_msg(LOG_INFO,
            "loaded set %s: %s on %s, %zu tensors, %" PRIu64 " bytes in %.3f s (%.2f GiB/s, %s; slab allocation %.1f ms)",
            s->id, s->ck->path, r->devices[s->device].info.uuid, s->plan->noutputs, s->plan->payload_bytes,
            s->seconds, gibs, s->load.method, s->load.alloc_seconds * 1e3);
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
    set_unlink(s);
    s->orphan = true;
    s->next = r->orphans;
    r->orphans = s;
    log_msg(LOG_INFO, "set %s: %d early lease(s) keep its slab until they end", s->id, s->leases);
  } else if (lj->rc != 0) {
    set_destroy(s, NULL);
  }
  free(lj->to_free.v);
  free(lj);
}

/*
 * Offers a new set's load the ready copies of the same checkpoint and plan
 * on other devices (a replica may be copied from one of them), and keeps
 * them from eviction until the load is done. Without memory it offers none.
 */
static void offer_copies(struct residency *r, struct res_set *s) {
  if (!r->replicas) return;
  size_t n = 0;
  for (struct res_set *c = r->sets; c != NULL; c = c->next)
    n += c->ck == s->ck && c->device != s->device && c->state == SET_READY && strcmp(c->plan->key, s->plan->key) == 0;
  if (n == 0) return;
  struct ld_source *src = calloc(n, sizeof *src);
  struct res_set **from = calloc(n, sizeof *from);
  if (src == NULL || from == NULL) {
    free(src);
    free(from);
    return;
  }
  size_t k = 0;
  for (struct res_set *c = r->sets; c != NULL && k < n; c = c->next) {
    if (c->ck != s->ck || c->device == s->device || c->state != SET_READY || strcmp(c->plan->key, s->plan->key) != 0)
      continue;
    src[k] = (struct ld_source){.slab = c->load.slab, .device = c->device};
    from[k++] = c;
    c->copying++;
  }
  s->load.sources = src;
  s->load.nsources = k;
  s->copy_from = from;
  s->ncopy_from = k;
}

/* Puts a new set s (device and plan set) among the resident ones: its timer, its bytes on the device. */
static void set_link(struct residency *r, struct res_set *s) {
  s->last_used_ms = clock_ms();
  uv_timer_init(r->loop, &s->progress_timer);
  s->progress_timer.data = s;
  s->next = r->sets;
  r->sets = s;
  r->devices[s->device].used += s->plan->slab_bytes;
}

void res_load(struct residency *r, struct reg_ckpt *ck, int device, struct plan *plan, struct res_waiter *w) {
  w->set = NULL;
  char *key = NULL;
  if (asprintf(&key, "%s#%" PRIu64 "|%d|%s", ck->path, ck->generation, device, plan->key) < 0) {
    plan_free(plan);
    reg_unref(ck);
    fail_waiter(w, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  struct res_set *s = find_by_key(r, key);
  if (s != NULL) {
    free(key);
    plan_free(plan);
    reg_unref(ck);
    res_wait(r, s, w);
    return;
  }
  struct slab_list evicted = {0};
  s = calloc(1, sizeof *s);
  struct load_job *lj = calloc(1, sizeof *lj);
  if (s == NULL || lj == NULL || !make_room(r, device, plan->slab_bytes, &evicted)) {
    bool nomem = s == NULL || lj == NULL;
    free_later(r, NULL, &evicted);
    free(s);
    free(lj);
    free(key);
    if (nomem)
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
  snprintf(s->id, sizeof s->id, "s%" PRIu64, ++r->next_id);
  s->key = key;
  s->ck = ck; /* takes the caller's reference */
  s->device = device;
  s->plan = plan;
  s->state = SET_LOADING;
  offer_copies(r, s);
  s->load.plan = plan;
  s->load.ck = ck;
  s->load.device = device;
  s->load.method = "memcpy";
  struct plan_range *pins = NULL;
  if (reg_pins_copy(ck, &pins, &s->load.npins) != 0) s->load.npins = 0; /* no memory: it stages instead */
  s->load.pins = pins;
  s->load.allocated = load_allocated;
  s->load.ready = load_ready;
  atomic_init(&s->load.bytes_done, 0);
  atomic_init(&s->load.ready_bytes, 0);
  atomic_init(&s->load.cancel, false);
  atomic_init(&s->allocated, false);
  s->table_fd = -1;
  struct wd_error perr = {0};
  if (ppage_create(plan->slab_bytes, &s->page, &s->page_fd, &perr) != 0)
    log_msg(LOG_DEBUG, "set %s: no progress page, so no early attach: %s", s->id, perr.msg);
  set_link(r, s);
  reg_load_begin(ck);
  add_waiter(s, w, false);
  uv_timer_start(&s->progress_timer, on_progress_timer, 100, 100);
  lj->job.work = load_work;
  lj->job.done = load_done;
  lj->set = s;
  lj->ld = r->ld;
  lj->backend = r->backend;
  lj->to_free = evicted;
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

/* ---- leases ------------------------------------------------------------------------------ */

int res_lease_add(struct residency *r, struct res_set *s, const struct lease_holder *holder, struct lease **out,
                  struct wd_error *err) {
  if (s->state != SET_READY && !res_set_early_ok(s)) return err_set(err, WEIGHTD_E_BUSY, "set %s is not ready", s->id);
  struct lease *l = calloc(1, sizeof *l);
  if (l == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  snprintf(l->id, sizeof l->id, "l%" PRIu64, ++r->next_id);
  l->set = s;
  l->holder = *holder;
  l->created_ms = clock_ms();
  l->next = r->leases;
  r->leases = l;
  s->leases++;
  s->last_used_ms = l->created_ms;
  if (s->state == SET_LOADING) atomic_store(&s->load.cancel, false); /* a leased load goes on */
  *out = l;
  changed(r);
  return 0;
}

void res_lease_drop(struct residency *r, struct lease *l) {
  struct lease **pp = &r->leases;
  while (*pp != NULL && *pp != l) pp = &(*pp)->next;
  if (*pp == NULL) return;
  *pp = l->next;
  struct res_set *s = l->set;
  s->leases--;
  s->last_used_ms = clock_ms();
  free(l);
  changed(r);
  if (s->orphan && s->leases == 0) {
    log_msg(LOG_DEBUG, "set %s: its last early lease ended; freeing it", s->id);
    set_destroy(s, NULL);
  }
}

struct lease *res_find_lease(const struct residency *r, const char *id) {
  for (struct lease *l = r->leases; l != NULL; l = l->next)
    if (strcmp(l->id, id) == 0) return l;
  return NULL;
}

bool res_owner_has_leases(const struct residency *r, const void *owner) {
  for (const struct lease *l = r->leases; l != NULL; l = l->next)
    if (l->holder.owner == owner) return true;
  return false;
}

void res_leases_drop_owner(struct residency *r, const void *owner) {
  struct lease *l = r->leases;
  while (l != NULL) {
    struct lease *next = l->next;
    if (l->holder.owner == owner) res_lease_drop(r, l);
    l = next;
  }
}

/* ---- sets and leases re-adopted after a restart --------------------------------------- */

/* Keeps new ids past one taken over ("s12", "l13"), so that none is given twice. */
static void id_taken(struct residency *r, const char *id) {
  char *end;
  unsigned long long n = strtoull(id + 1, &end, 10);
  if (*end == '\0' && n >= r->next_id) r->next_id = n;
}

int res_set_adopt(struct residency *r, struct reg_ckpt *ck, int device, struct plan *plan, struct wd_slab *slab,
                  const char *id, struct res_set **out, struct wd_error *err) {
  *out = NULL;
  char *key = NULL;
  struct res_set *s = NULL;
  if (device < 0 || device >= r->ndevices || strlen(id) >= sizeof s->id || res_find_set(r, id) != NULL)
    return err_set(err, WEIGHTD_E_INVALID, "set %s cannot be adopted on device %d", id, device);
  if (asprintf(&key, "%s#%" PRIu64 "|%d|%s", ck->path, ck->generation, device, plan->key) < 0)
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  if (find_by_key(r, key) != NULL) {
    free(key);
    return err_set(err, WEIGHTD_E_INVALID, "set %s is described twice (%s)", id, ck->path);
  }
  if ((s = calloc(1, sizeof *s)) == NULL) {
    free(key);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  s->res = r;
  snprintf(s->id, sizeof s->id, "%s", id);
  id_taken(r, id);
  s->key = key;
  s->ck = ck;
  s->device = device;
  s->plan = plan;
  s->state = SET_READY;
  s->load.plan = plan;
  s->load.ck = ck;
  s->load.device = device;
  s->load.slab = slab;
  s->load.method = "adopted";
  atomic_init(&s->load.bytes_done, plan->slab_bytes);
  atomic_init(&s->load.ready_bytes, plan->slab_bytes);
  atomic_init(&s->load.cancel, false);
  atomic_init(&s->allocated, true);
  s->table_fd = -1;
  s->page_fd = -1;
  set_link(r, s);
  r->stats.adopted++;
  *out = s;
  changed(r);
  return 0;
}

int res_lease_restore(struct residency *r, struct res_set *s, const char *id, const struct lease_holder *holder,
                      struct wd_error *err) {
  struct lease *l = NULL;
  if (strlen(id) >= sizeof l->id || res_find_lease(r, id) != NULL)
    return err_set(err, WEIGHTD_E_INVALID, "lease %s cannot be restored", id);
  if ((l = calloc(1, sizeof *l)) == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  snprintf(l->id, sizeof l->id, "%s", id);
  id_taken(r, id);
  l->set = s;
  l->holder = *holder;
  l->holder.owner = NULL;
  l->created_ms = clock_ms();
  l->next = r->leases;
  r->leases = l;
  s->leases++;
  changed(r);
  return 0;
}

/* ---- shutdown ----------------------------------------------------------------------------- */

void res_cancel_all(struct residency *r) {
  for (struct res_set *s = r->sets; s != NULL; s = s->next)
    if (s->state == SET_LOADING) atomic_store(&s->load.cancel, true);
}

static void residency_closed(uv_handle_t *h) {
  struct residency *r = h->data;
  free(r->devices);
  free(r);
}

void res_destroy(struct residency *r) {
  if (r == NULL) return;
  while (r->leases != NULL) res_lease_drop(r, r->leases); /* orphans go with their last lease */
  while (r->sets != NULL) set_destroy(r->sets, NULL);
  uv_close((uv_handle_t *)&r->notify, residency_closed);
}
