/*
 * residency.c - resident sets: their list, freeing and eviction, leases,
 * re-adoption after a restart and shutdown (see residency.h). Loading a set
 * and waiting for it is residency_load.c, which calls in here (never the
 * reverse); what the two share is residency_internal.h.
 *
 * DESIGN: sets, waiters and leases are loop-owned. A set is LOADING while its
 * load job owns its slab (the job reads only its ld_target and the loader),
 * then READY, or it fails and goes away. Waiters of a LOADING set sit in its
 * list; a second identical load joins the list instead of loading again.
 * Slabs are freed on the job pool (freeing a large slab takes tens of
 * milliseconds), by the load that needs the room before it allocates, or by
 * an eviction job that reports back once the memory is free. A load's
 * `notify` wake-up (residency_load.c) lands here and answers the set's early
 * waiters.
 */
#include "residency_internal.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "tensor_table.h"
#include "base/log.h"
#include "base/sealed_memfd.h"

void res_on_change(struct residency *r, void (*fn)(void *arg, bool now), void *arg) {
  r->changed = fn;
  r->changed_arg = arg;
}

const char *res_set_method(const struct res_set *s) { return s->adopted ? "adopted" : ld_method_name(s->load.method); }

const char *res_result_name(enum res_result r) {
  static const char *const names[] = {"ok", "failed", "canceled"};
  return r < RES_RESULT_COUNT ? names[r] : "?";
}

const char *res_evict_reason_name(enum res_evict_reason r) {
  static const char *const names[] = {"budget", "device_full", "request", "reload"};
  return r < RES_EVICT_COUNT ? names[r] : "?";
}

const struct res_stats *res_stats(const struct residency *r) { return &r->stats; }

static void serve_early_waiters(struct res_set *s);

static void answer_rooms(struct residency *r);

static void on_notify(uv_async_t *a) {
  struct residency *r = a->data;
  answer_rooms(r);
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
  pthread_mutex_init(&r->room_lock, NULL);
  pthread_cond_init(&r->room_cv, NULL);
  *out = r;
  return 0;
}

struct res_set *res_first_set(const struct residency *r) { return r->sets; }
struct lease *res_first_lease(const struct residency *r) { return r->leases; }
int res_device_count(const struct residency *r) { return r->ndevices; }
struct res_device *res_device(struct residency *r, int device) { return &r->devices[device]; }

size_t res_device_budget_set(struct residency *r, uint64_t budget) {
  r->device_budget = budget;
  struct slab_list keep = {0};
  size_t n = 0;
  for (int d = 0; d < r->ndevices; d++) {
    uint64_t b = res_device_budget(r, d);
    while (b > 0 && r->devices[d].used > b) {
      struct res_set *victim = NULL;
      for (struct res_set *s = r->sets; s != NULL; s = s->next)
        if (res_evictable(s, d) && (victim == NULL || s->last_used_ms < victim->last_used_ms)) victim = s;
      if (victim == NULL) break; /* leased and loading sets stay: the device is over budget until they go */
      res_evict_one(victim, &keep, RES_EVICT_RELOAD, NULL);
      n++;
    }
  }
  res_free_later(r, NULL, &keep);
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

struct res_set *res_find_plan(const struct residency *r, const struct reg_ckpt *ck, int device, const char *plan_key) {
  for (struct res_set *s = r->sets; s != NULL; s = s->next)
    if (s->ck == ck && s->device == device && s->state != SET_FAILED && strcmp(s->plan->key, plan_key) == 0) return s;
  return NULL;
}

struct res_set *res_find_by_key(const struct residency *r, const char *key) {
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
void res_slab_list_free_now(const struct wd_backend *b, struct slab_list *l) {
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
  res_slab_list_free_now(f->backend, &f->slabs);
}

static void free_done(struct job *j) {
  struct free_job *f = (struct free_job *)j;
  if (f->cb != NULL) f->cb(f->arg, f->ids, f->nids);
  for (size_t i = 0; i < f->nids; i++) free(f->ids[i]);
  free(f->ids);
  free(f);
}

/* Frees the slabs of l on a job (f may carry a continuation), or here when no job can be made. */
void res_free_later(struct residency *r, struct free_job *f, struct slab_list *l) {
  if (f == NULL && l->n == 0) {
    free(l->v);
    memset(l, 0, sizeof *l);
    return;
  }
  if (f == NULL && (f = calloc(1, sizeof *f)) == NULL) {
    res_slab_list_free_now(r->backend, l);
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
  free((void *)s->load.copies);
  free(s->table_cache);
  free(s->key);
  free(s);
}

/* Takes s out of the list it is on (the sets, or the orphans). */
void res_set_unlink(struct res_set *s) {
  struct res_set **pp = s->orphan ? &s->res->orphans : &s->res->sets;
  while (*pp != NULL && *pp != s) pp = &(*pp)->next;
  if (*pp == s) *pp = s->next;
  s->next = NULL;
}

/* Unlinks and frees a set; its slab goes to `keep` when given, else to a free job. */
void res_set_destroy(struct res_set *s, struct slab_list *keep) {
  struct residency *r = s->res;
  res_set_unlink(s);
  if (s->state == SET_READY) res_changed(r, false);
  if (s->load.slab != NULL) {
    struct slab_list one = {0};
    slab_list_push(r, keep != NULL ? keep : &one, s->load.slab);
    if (keep == NULL) res_free_later(r, NULL, &one);
    s->load.slab = NULL;
  }
  if (s->device >= 0 && s->device < r->ndevices) r->devices[s->device].used -= s->plan->slab_bytes;
  free((void *)s->load.pins);
  s->load.pins = NULL;
  free(s->load.digests);
  s->load.digests = NULL;
  free(s->corrupt);
  s->corrupt = NULL;
  plan_free(s->plan);
  reg_touch(s->ck); /* its checkpoint's idle time starts when its last set goes */
  reg_unref(s->ck);
  uv_timer_stop(&s->progress_timer);
  uv_close((uv_handle_t *)&s->progress_timer, timer_closed);
}

/* ---- eviction -------------------------------------------------------------------- */

int res_evict_one(struct res_set *s, struct slab_list *keep, enum res_evict_reason why, struct wd_error *err) {
  if (s->state == SET_LOADING) return err_set(err, WEIGHTD_E_BUSY, "set %s is still loading", s->id);
  if (s->leases > 0) return err_set(err, WEIGHTD_E_BUSY, "set %s has %d lease(s)", s->id, s->leases);
  if (s->copying > 0)
    return err_set(err, WEIGHTD_E_BUSY, "set %s is being copied to another device by %u load(s)", s->id, s->copying);
  if (s->scrubbing > 0) return err_set(err, WEIGHTD_E_BUSY, "set %s is being scrubbed; retry when it is done", s->id);
  log_msg(LOG_INFO, "evicted set %s (%s, %" PRIu64 " bytes; %s)", s->id, s->ck->path, s->plan->slab_bytes,
          res_evict_reason_name(why));
  s->res->stats.evictions[why]++;
  res_set_destroy(s, keep);
  return 0;
}

bool res_evictable(const struct res_set *s, int device) {
  return s->device == device && s->state == SET_READY && s->leases == 0 && s->copying == 0 && s->scrubbing == 0;
}

uint64_t res_device_budget(const struct residency *r, int device) {
  if (r->device_budget > 0) return r->device_budget;
  if (r->backend->ops->caps & WD_CAP_HOST_SLABS) return r->devices[device].info.memory_total / 2;
  return 0;
}

/* Whether something still reads s's memory: a lease, a scrub, a load copying from it. */
static bool held(const struct res_set *s) { return s->leases > 0 || s->scrubbing > 0 || s->copying > 0; }

/* Bytes of device's sets that eviction cannot free: loading, leased, scrubbed or being copied, and orphans. */
static uint64_t unevictable(const struct residency *r, int device) {
  uint64_t pinned = 0;
  for (const struct res_set *s = r->sets; s != NULL; s = s->next)
    if (s->device == device && (s->state != SET_READY || held(s)))
      pinned += s->plan->slab_bytes;
  for (const struct res_set *s = r->orphans; s != NULL; s = s->next)
    if (s->device == device) pinned += s->plan->slab_bytes;
  return pinned;
}

bool res_room_possible(const struct residency *r, int device, uint64_t need) {
  uint64_t budget = res_device_budget(r, device), pinned = unevictable(r, device);
  return budget == 0 || (need <= budget && pinned <= budget - need);
}

/*
 * Evicts unleased sets of loading set s's device, least recently used
 * first, until the device's sets (s among them) fit its budget; 0, or
 * DEVICE_NOMEM without evicting anything when they cannot.
 */
static int make_room(struct residency *r, struct res_set *s, struct slab_list *keep, struct wd_error *err) {
  int device = s->device;
  uint64_t budget = res_device_budget(r, device), pinned = unevictable(r, device);
  if (budget == 0) return 0; /* the device itself decides, at allocation */
  if (pinned > budget)
    return err_set(err, WEIGHTD_E_DEVICE_NOMEM,
                   "set %s of %" PRIu64 " bytes does not fit device %d's budget of %" PRIu64 " bytes (%" PRIu64
                   " held by leased and loading sets, this one included, which are never evicted)",
                   s->id, s->plan->slab_bytes, device, budget, pinned);
  size_t n = 0;
  while (r->devices[device].used > budget) {
    struct res_set *victim = NULL;
    for (struct res_set *v = r->sets; v != NULL; v = v->next)
      if (res_evictable(v, device) && (victim == NULL || v->last_used_ms < victim->last_used_ms)) victim = v;
    if (victim == NULL) break; /* cannot happen: pinned <= budget */
    res_evict_one(victim, keep, RES_EVICT_BUDGET, NULL);
    n++;
  }
  if (n > 0) log_msg(LOG_INFO, "made room on device %d for set %s (%" PRIu64 " bytes): %zu set(s) evicted", device,
                     s->id, s->plan->slab_bytes, n);
  return 0;
}

/* Whether set s's load was canceled by its requesters and nobody wants it any more. */
static bool nobody_wants(const struct res_set *s) {
  return s->cancel_asked && atomic_load(&s->load.cancel) && s->waiters == NULL && s->leases == 0;
}

/* Answers the loads waiting for room (loop thread). */
static void answer_rooms(struct residency *r) {
  pthread_mutex_lock(&r->room_lock);
  struct room_req *q = r->room_queue;
  r->room_queue = NULL;
  pthread_mutex_unlock(&r->room_lock);
  while (q != NULL) {
    struct room_req *next = q->next;
    int rc;
    struct wd_error err = {0};
    if (r->stopping || r->destroying) /* evicting for a load that is about to be stopped helps nobody */
      rc = err_set(&err, WEIGHTD_E_CANCELED, "load of %s canceled: the daemon is stopping", q->set->ck->path);
    else if (nobody_wants(q->set))
      rc = err_set(&err, WEIGHTD_E_CANCELED, "load of %s canceled before it started", q->set->ck->path);
    else
      rc = make_room(r, q->set, &q->freed, &err);
    pthread_mutex_lock(&r->room_lock);
    q->rc = rc;
    q->err = err;
    q->answered = true;
    pthread_cond_broadcast(&r->room_cv);
    pthread_mutex_unlock(&r->room_lock);
    q = next;
  }
}

int res_room_ask(struct residency *r, struct res_set *s, struct room_req *req) {
  memset(req, 0, sizeof *req);
  req->set = s;
  pthread_mutex_lock(&r->room_lock);
  req->next = r->room_queue;
  r->room_queue = req;
  pthread_mutex_unlock(&r->room_lock);
  uv_async_send(&r->notify);
  pthread_mutex_lock(&r->room_lock);
  while (!req->answered) pthread_cond_wait(&r->room_cv, &r->room_lock);
  pthread_mutex_unlock(&r->room_lock);
  return req->rc;
}

int res_evict(struct residency *r, const char *set_id, int device, bool (*may)(void *arg, const struct res_set *s),
              void *may_arg, res_evicted_fn cb, void *arg, struct wd_error *err) {
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
                          : res_evict_one(s, &keep, RES_EVICT_REQUEST, err);
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
      if (res_evictable(s, device) && (may == NULL || may(may_arg, s))) {
        char *id = strdup(s->id);
        if (id != NULL) f->ids[f->nids++] = id;
        res_evict_one(s, &keep, RES_EVICT_REQUEST, NULL);
      }
      s = next;
    }
  }
  res_free_later(r, f, &keep);
  return 0;
}

/* ---- waiters ------------------------------------------------------------------------ */

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

/* Puts a new set s (device and plan set) among the resident ones: its timer, its bytes on the device. */
void res_set_link(struct residency *r, struct res_set *s) {
  s->last_used_ms = clock_ms();
  uv_timer_init(r->loop, &s->progress_timer);
  s->progress_timer.data = s;
  s->next = r->sets;
  r->sets = s;
  r->devices[s->device].used += s->plan->slab_bytes;
}

/* ---- leases ------------------------------------------------------------------------------ */

int res_set_table_fd(struct res_set *s, struct wd_error *err) {
  if (s->table_fd >= 0) return 0;
  unsigned char *buf;
  size_t len;
  int rc = ttab_write(s->plan->noutputs, plan_ttab_get, s->plan, s->plan->slab_bytes, &buf, &len, err);
  if (rc != 0) return err_prefix(err, "set %s: its tensor table", s->id);
  int fd = -1;
  rc = sealed_memfd_create("weightd-table", buf, len, &fd, err);
  uint64_t sum = ttab_xxh64(buf, len);
  free(buf);
  if (rc != 0) return rc;
  s->table_fd = fd;
  s->table_bytes = len;
  s->table_sum = sum;
  return 0;
}

int res_set_corrupt_error(const struct res_set *s, struct wd_error *err) {
  size_t first = 0;
  while (first < s->plan->noutputs && !s->corrupt[first]) first++;
  return err_set(err, WEIGHTD_E_BAD_CHECKSUM,
                 "set %s is corrupt: a scrub found tensor '%s'%s changed since it was loaded; evict it and load it "
                 "again", s->id, first < s->plan->noutputs ? s->plan->outputs[first].name : "?",
                 s->ncorrupt > 1 ? " and others" : "");
}

int res_lease_add(struct residency *r, struct res_set *s, const struct lease_holder *holder, struct lease **out,
                  struct wd_error *err) {
  if (s->state != SET_READY && !res_set_early_ok(s)) return err_set(err, WEIGHTD_E_BUSY, "set %s is not ready", s->id);
  if (s->ncorrupt > 0) return res_set_corrupt_error(s, err);
  uint64_t n = res_next_id(r);
  if (n == 0) return err_set(err, WEIGHTD_E_LIMIT, "no lease id is left (the last, l%llu, was given)", RES_ID_MAX);
  struct lease *l = calloc(1, sizeof *l);
  if (l == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  snprintf(l->id, sizeof l->id, "l%" PRIu64, n);
  l->set = s;
  l->holder = *holder;
  l->created_ms = clock_ms();
  l->next = r->leases;
  r->leases = l;
  s->leases++;
  s->last_used_ms = l->created_ms;
  if (s->state == SET_LOADING) atomic_store(&s->load.cancel, false); /* a leased load goes on */
  *out = l;
  res_changed(r, true);
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
  res_changed(r, false);
  if (s->orphan && !held(s)) {
    log_msg(LOG_DEBUG, "set %s: its last lease ended; freeing it", s->id);
    res_set_destroy(s, NULL);
  }
}

bool res_set_reload_fits(const struct residency *r, const struct res_set *s) {
  return !held(s) || res_room_possible(r, s->device, s->plan->slab_bytes);
}

void res_set_retire(struct residency *r, struct res_set *s) {
  if (s->orphan) return;
  res_set_unlink(s);
  if (s->state == SET_READY) res_changed(r, false); /* gone from the list: a restart does not adopt it */
  if (!held(s)) {
    /* Its slab is freed by the next load's job before that one allocates (res_load): the reload that follows
     * must not race a free job for the device's memory. */
    res_set_destroy(s, &r->retired);
    return;
  }
  s->orphan = true;
  s->next = r->orphans;
  r->orphans = s;
  log_msg(LOG_INFO, "set %s: retired; its %d lease(s), %u scrub(s) and %u copy(ies) keep its memory until they end",
          s->id, s->leases, s->scrubbing, s->copying);
}

bool res_set_release_if_orphan(struct res_set *s) {
  if (!s->orphan || held(s)) return false;
  res_set_destroy(s, NULL);
  return true;
}

struct res_set *res_first_orphan(const struct residency *r) { return r->orphans; }

void res_set_marked(struct residency *r) { res_changed(r, true); }

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
  if (res_find_by_key(r, key) != NULL) {
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
  s->load.ck = ck->ck;
  s->load.name = ck->path;
  s->load.mmap = ck->src;
  s->load.device = device;
  s->load.slab = slab;
  s->adopted = true;
  s->loader_uid = (uid_t)-1;
  atomic_init(&s->load.bytes_done, plan->slab_bytes);
  atomic_init(&s->load.ready_bytes, plan->slab_bytes);
  atomic_init(&s->load.cancel, false);
  atomic_init(&s->load.reading_kind, -1);
  atomic_init(&s->load.reading_device, -1);
  atomic_init(&s->allocated, true);
  s->table_fd = -1;
  s->page_fd = -1;
  res_set_link(r, s);
  r->stats.adopted++;
  *out = s;
  res_changed(r, true);
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
  res_changed(r, true);
  return 0;
}

/* ---- shutdown ----------------------------------------------------------------------------- */

void res_cancel_all(struct residency *r) {
  r->stopping = true;
  for (struct res_set *s = r->sets; s != NULL; s = s->next)
    if (s->state == SET_LOADING) atomic_store(&s->load.cancel, true);
}

static void residency_closed(uv_handle_t *h) {
  struct residency *r = h->data;
  pthread_cond_destroy(&r->room_cv);
  pthread_mutex_destroy(&r->room_lock);
  free(r->devices);
  free(r);
}

void res_destroy(struct residency *r) {
  if (r == NULL) return;
  r->destroying = true;
  answer_rooms(r); /* a load job that still waits for room is told to stop */
  while (r->leases != NULL) res_lease_drop(r, r->leases); /* orphans go with their last lease */
  while (r->orphans != NULL) res_set_destroy(r->orphans, NULL); /* one a scrub still counted (none runs now) */
  res_free_later(r, NULL, &r->retired);
  while (r->sets != NULL) res_set_destroy(r->sets, NULL);
  uv_close((uv_handle_t *)&r->notify, residency_closed);
}
