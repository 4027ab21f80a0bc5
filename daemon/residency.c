/*
 * residency.c - resident sets, leases and eviction.
 *
 * DESIGN: sets and leases are loop-owned. A set is LOADING while its load job
 * owns its slab, then READY (or it fails and goes away). Requests waiting for
 * a LOADING set sit in its waiter list; a second identical load joins that
 * list instead of loading again. A set with a lease is never freed; unleased
 * READY sets are evicted least recently used first when a device's budget
 * (or the device itself) has no room for a new set.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "jsonutil.h"
#include "msg.h"

/* ---- lookup and bookkeeping --------------------------------------------------- */

struct res_set *res_find_set(const char *id) {
  for (struct res_set *s = wd->sets; s != NULL; s = s->next)
    if (strcmp(s->id, id) == 0) return s;
  return NULL;
}

static struct res_set *find_by_key(const char *key) {
  for (struct res_set *s = wd->sets; s != NULL; s = s->next)
    if (strcmp(s->key, key) == 0 && s->state != SET_FAILED) return s;
  return NULL;
}

static void timer_closed(uv_handle_t *h) {
  struct res_set *s = h->data;
  free(s->table_json);
  free(s->key);
  free(s);
}

/* Unlinks and frees a set that no lease, waiter or job uses. */
void slab_list_push(struct slab_list *l, struct wd_slab *slab) {
  if (slab == NULL) return;
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 4;
    struct wd_slab **nv = realloc(l->v, cap * sizeof *nv);
    if (nv == NULL) { /* no memory to defer it: free it now */
      wd->backend.ops->slab_free(wd->backend.ctx, slab);
      return;
    }
    l->v = nv;
    l->cap = cap;
  }
  l->v[l->n++] = slab;
}

/* Freeing a large slab takes long (host: ~57 ms per GiB to unmap): a job does it. */
struct free_job {
  struct job job;
  struct wd_slab *slab;
};

static void free_work(struct job *j) {
  struct free_job *f = (struct free_job *)j;
  wd->backend.ops->slab_free(wd->backend.ctx, f->slab);
}

static void free_done(struct job *j) { free(j); }

static void slab_release(struct wd_slab *slab) {
  if (slab == NULL) return;
  struct free_job *f = calloc(1, sizeof *f);
  if (f == NULL || wd->job_pool == NULL) { /* no memory, or shutting down: free it here */
    free(f);
    wd->backend.ops->slab_free(wd->backend.ctx, slab);
    return;
  }
  f->job.work = free_work;
  f->job.done = free_done;
  f->slab = slab;
  jobs_submit(wd->job_pool, &f->job);
}

/* Unlinks and frees a set; its slab goes to `keep` when given, else to a free job. */
static void set_destroy(struct res_set *s, struct slab_list *keep) {
  struct res_set **pp = &wd->sets;
  while (*pp != NULL && *pp != s) pp = &(*pp)->next;
  if (*pp == s) *pp = s->next;
  if (keep != NULL) slab_list_push(keep, s->slab);
  else slab_release(s->slab);
  s->slab = NULL;
  if (s->device >= 0 && s->device < wd->ndevices) wd->devices[s->device].used -= s->plan->slab_bytes;
  plan_free(s->plan);
  reg_unref(s->ck);
  uv_timer_stop(&s->progress_timer);
  uv_close((uv_handle_t *)&s->progress_timer, timer_closed);
}

cJSON *res_set_json(const struct res_set *s) {
  static const char *const states[] = {"loading", "ready", "failed"};
  cJSON *o = cJSON_CreateObject();
  msg_add_string(o, "set", s->id);
  msg_add_string(o, "path", s->ck->path);
  msg_add_string(o, "device", wd->devices[s->device].info.uuid);
  cJSON_AddItemToObject(o, "plan", cJSON_Parse(s->plan->key));
  msg_add_string(o, "state", states[s->state]);
  json_u64_add(o, "bytes", s->plan->slab_bytes);
  json_u64_add(o, "tensors", s->plan->noutputs);
  json_u64_add(o, "leases", (uint64_t)s->leases);
  if (s->state == SET_LOADING) json_u64_add(o, "bytes_done", atomic_load(&s->bytes_done));
  if (s->state == SET_READY) {
    cJSON_AddNumberToObject(o, "seconds", s->seconds);
    msg_add_string(o, "method", s->method);
  }
  return o;
}

/* ---- eviction -------------------------------------------------------------------- */

static int evict(struct res_set *s, struct slab_list *keep, struct wd_error *err) {
  if (s->state == SET_LOADING) return err_set(err, WEIGHTD_E_BUSY, "set %s is still loading", s->id);
  if (s->leases > 0)
    return err_set(err, WEIGHTD_E_BUSY, "set %s has %d lease(s)", s->id, s->leases);
  log_msg(LOG_INFO, "evicted set %s (%s, %" PRIu64 " bytes)", s->id, s->ck->path, s->plan->slab_bytes);
  set_destroy(s, keep);
  return 0;
}

int res_evict_set(struct res_set *s, struct slab_list *keep, struct wd_error *err) { return evict(s, keep, err); }

/* Evicts every unleased READY set of device; ids to evicted (may be NULL), slabs to keep (may be NULL). */
static size_t evict_device(int device, cJSON *evicted, struct slab_list *keep) {
  size_t n = 0;
  struct res_set *s = wd->sets;
  while (s != NULL) {
    struct res_set *next = s->next;
    if (s->device == device && s->state == SET_READY && s->leases == 0) {
      if (evicted) cJSON_AddItemToArray(evicted, cJSON_CreateString(s->id));
      evict(s, keep, NULL);
      n++;
    }
    s = next;
  }
  return n;
}

size_t res_evict_device(int device, cJSON *evicted, struct slab_list *keep) {
  return evict_device(device, evicted, keep);
}

void slab_list_free_now(struct slab_list *l) {
  for (size_t i = 0; i < l->n; i++) wd->backend.ops->slab_free(wd->backend.ctx, l->v[i]);
  free(l->v);
  memset(l, 0, sizeof *l);
}

/* Evicts unleased sets of device, least recently used first, until `need` more bytes fit. */
/*
 * The budget of resident sets on a device: the configured one; else, for the
 * host backend, half of physical memory (host memory also holds the page
 * cache the weights come from, and the engines); else none (the GPU decides).
 */
static uint64_t device_budget(int device) {
  if (wd->cfg.device_memory_budget > 0) return wd->cfg.device_memory_budget;
  if (wd->backend.ops->caps & WD_CAP_HOST_SLABS) return wd->devices[device].info.memory_total / 2;
  return 0;
}

static bool make_room(int device, uint64_t need, struct slab_list *keep) {
  uint64_t budget = device_budget(device);
  if (budget == 0) return true; /* the device itself decides, at allocation */
  /* What eviction cannot free (leased or loading sets) must leave room, or nothing is evicted. */
  uint64_t pinned = 0;
  for (struct res_set *s = wd->sets; s != NULL; s = s->next)
    if (s->device == device && (s->state != SET_READY || s->leases > 0)) pinned += s->plan->slab_bytes;
  if (need > budget || pinned > budget - need) return false;
  for (;;) {
    if (wd->devices[device].used + need <= budget) return true;
    struct res_set *victim = NULL;
    for (struct res_set *s = wd->sets; s != NULL; s = s->next)
      if (s->device == device && s->state == SET_READY && s->leases == 0 &&
          (victim == NULL || s->last_used_ms < victim->last_used_ms))
        victim = s;
    if (victim == NULL) return false;
    evict(victim, keep, NULL);
  }
}

/* ---- replies ----------------------------------------------------------------------- */

static void reply_loaded(struct request *req, struct res_set *s, bool shared) {
  cJSON *r = msg_reply_ok(req->id);
  msg_add_string(r, "set", s->id);
  msg_add_string(r, "device", wd->devices[s->device].info.uuid);
  json_u64_add(r, "bytes", s->plan->slab_bytes);
  json_u64_add(r, "payload_bytes", s->plan->payload_bytes);
  json_u64_add(r, "tensors", s->plan->noutputs);
  cJSON_AddNumberToObject(r, "seconds", s->seconds);
  cJSON_AddNumberToObject(r, "alloc_seconds", s->alloc_seconds);
  cJSON_AddNumberToObject(r, "gib_per_s",
                          s->seconds > 0 ? (double)s->plan->payload_bytes / (double)(1ull << 30) / s->seconds : 0);
  cJSON_AddBoolToObject(r, "shared", shared);
  msg_add_string(r, "method", s->method);
  req_reply(req, r, NULL, 0);
}

/* The tensor table as attach replies carry it, serialised once per set. */
static char *table_json(const struct plan *p) {
  cJSON *tensors = plan_table(p);
  char *text = tensors ? cJSON_PrintUnformatted(tensors) : NULL;
  cJSON_Delete(tensors);
  return text;
}

static void lease_drop(struct lease **pp);

void res_attach_ready(struct request *req, struct res_set *s) {
  struct wd_error err = {0};
  struct wd_handle h;
  if (wd->backend.ops->slab_export(wd->backend.ctx, s->slab, &h, &err) != 0) {
    req_fail_err(req, &err);
    return;
  }
  struct lease *l = calloc(1, sizeof *l);
  if (l == NULL) {
    if (h.kind == WD_HANDLE_FD) close(h.fd);
    req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  snprintf(l->id, sizeof l->id, "l%" PRIu64, ++wd->next_id);
  l->set = s;
  l->owner = req->conn;
  l->next = wd->leases;
  wd->leases = l;
  s->leases++;
  s->last_used_ms = clock_ms();

  cJSON *r = msg_reply_ok(req->id);
  msg_add_string(r, "set", s->id);
  msg_add_string(r, "lease", l->id);
  msg_add_string(r, "device", wd->devices[s->device].info.uuid);
  json_u64_add(r, "bytes", s->plan->slab_bytes);
  cJSON *handles = cJSON_AddArrayToObject(r, "handles");
  cJSON *ho = cJSON_CreateObject();
  int fds[1];
  size_t nfds = 0;
  if (h.kind == WD_HANDLE_FD) {
    msg_add_string(ho, "kind", "fd");
    json_u64_add(ho, "fd_index", 0);
    fds[nfds++] = h.fd;
  } else {
    char hex[2 * WD_IPC_HANDLE_BYTES + 1];
    msg_hex_encode(h.ipc, WD_IPC_HANDLE_BYTES, hex);
    msg_add_string(ho, "kind", "cuda_ipc");
    msg_add_string(ho, "handle", hex);
  }
  json_u64_add(ho, "bytes", h.bytes);
  cJSON_AddItemToArray(handles, ho);
  if (s->table_json == NULL) s->table_json = table_json(s->plan);
  if (s->table_json == NULL) {
    cJSON_Delete(r);
    lease_drop(&wd->leases);
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  cJSON_AddItemToObject(r, "tensors", cJSON_CreateRaw(s->table_json));
  log_msg(LOG_DEBUG, "lease %s of set %s to pid %d", l->id, s->id, (int)req->conn->pid);
  req_reply(req, r, fds, nfds);
}

static void reply_ready(struct request *req, struct res_set *s, bool shared) {
  if (req->op == MSG_OP_ATTACH) res_attach_ready(req, s);
  else reply_loaded(req, s, shared);
}

/* ---- the load job -------------------------------------------------------------------- */

struct load_job {
  struct job job;
  struct res_set *set;
  struct slab_list to_free; /* evicted for this load: freed before it allocates */
  bool retried;
  int rc;
  struct wd_error err;
};

static void load_work(struct job *j) {
  struct load_job *lj = (struct load_job *)j;
  for (size_t i = 0; i < lj->to_free.n; i++) wd->backend.ops->slab_free(wd->backend.ctx, lj->to_free.v[i]);
  lj->to_free.n = 0;
  double t0 = clock_s();
  lj->rc = ld_fill(lj->set, &lj->err);
  lj->set->seconds = clock_s() - t0;
}

static void load_done(struct job *j) {
  struct load_job *lj = (struct load_job *)j;
  struct res_set *s = lj->set;
  if (lj->rc == WEIGHTD_E_CANCELED && s->waiters != NULL && !wd->stopping) {
    /* Canceled, but someone asked for the same set since: load it for them. */
    log_msg(LOG_INFO, "set %s: canceled load restarted for a request that joined it", s->id);
    atomic_store(&s->cancel, false);
    atomic_store(&s->bytes_done, 0);
    jobs_submit(wd->job_pool, &lj->job);
    return;
  }
  if (lj->rc == WEIGHTD_E_DEVICE_NOMEM && !lj->retried && !atomic_load(&s->cancel)) {
    size_t n = evict_device(s->device, NULL, &lj->to_free);
    if (n > 0) {
      log_msg(LOG_INFO, "device %d full: evicted %zu unleased set(s), retrying set %s", s->device, n, s->id);
      lj->retried = true;
      atomic_store(&s->bytes_done, 0);
      jobs_submit(wd->job_pool, &lj->job);
      return;
    }
  }
  uv_timer_stop(&s->progress_timer);
  struct set_waiter *w = s->waiters;
  s->waiters = NULL;
  if (lj->rc == 0) {
    s->state = SET_READY;
    s->last_used_ms = clock_ms();
    double gibs = s->seconds > 0 ? (double)s->plan->payload_bytes / (double)(1ull << 30) / s->seconds : 0;
    log_msg(LOG_INFO,
            "loaded set %s: %s on %s, %zu tensors, %" PRIu64 " bytes in %.3f s (%.2f GiB/s, %s; slab allocation %.1f ms)",
            s->id, s->ck->path, wd->devices[s->device].info.uuid, s->plan->noutputs, s->plan->payload_bytes,
            s->seconds, gibs, s->method, s->alloc_seconds * 1e3);
    while (w != NULL) {
      struct set_waiter *next = w->next;
      w->req->waiting_on = NULL;
      reply_ready(w->req, s, w->joined);
      free(w);
      w = next;
    }
  } else {
    s->state = SET_FAILED;
    log_msg(LOG_WARN, "load of set %s (%s) failed: %s", s->id, s->ck->path, lj->err.msg);
    while (w != NULL) {
      struct set_waiter *next = w->next;
      w->req->waiting_on = NULL;
      req_fail_err(w->req, &lj->err);
      free(w);
      w = next;
    }
    set_destroy(s, NULL);
  }
  free(lj->to_free.v);
  free(lj);
}

static void on_progress_timer(uv_timer_t *t) {
  struct res_set *s = t->data;
  uint64_t done = atomic_load(&s->bytes_done);
  for (struct set_waiter *w = s->waiters; w != NULL; w = w->next)
    req_progress(w->req, done, s->plan->slab_bytes);
}

static int add_set_waiter(struct res_set *s, struct request *req, bool joined) {
  struct set_waiter *w = calloc(1, sizeof *w);
  if (w == NULL) return -1;
  w->joined = joined;
  atomic_store(&s->cancel, false); /* a canceled load someone wants again goes on */
  w->req = req;
  w->next = s->waiters;
  s->waiters = w;
  req->waiting_on = s;
  req_progress(req, atomic_load(&s->bytes_done), s->plan->slab_bytes);
  return 0;
}

void res_load(struct request *req, struct reg_ckpt *ck, int device, struct plan *plan) {
  if (wd->stopping) {
    plan_free(plan);
    reg_unref(ck);
    req_fail(req, WEIGHTD_E_SHUTDOWN, "the daemon is shutting down");
    return;
  }
  char *key = NULL;
  if (asprintf(&key, "%s#%" PRIu64 "|%d|%s", ck->path, ck->generation, device, plan->key) < 0) {
    plan_free(plan);
    reg_unref(ck);
    req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  struct res_set *s = find_by_key(key);
  if (s != NULL) {
    free(key);
    plan_free(plan);
    reg_unref(ck);
    s->last_used_ms = clock_ms();
    if (s->state == SET_READY) {
      reply_ready(req, s, true);
    } else if (add_set_waiter(s, req, true) != 0) {
      req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    }
    return;
  }
  struct slab_list evicted = {0};
  if (!make_room(device, plan->slab_bytes, &evicted)) {
    req_fail(req, WEIGHTD_E_DEVICE_NOMEM,
             "set of %" PRIu64 " bytes does not fit device %d's budget of %" PRIu64
             " bytes (%" PRIu64 " in use; leased and loading sets are never evicted)",
             plan->slab_bytes, device, device_budget(device), wd->devices[device].used);
    for (size_t i = 0; i < evicted.n; i++) slab_release(evicted.v[i]);
    free(evicted.v);
    free(key);
    plan_free(plan);
    reg_unref(ck);
    return;
  }
  s = calloc(1, sizeof *s);
  struct load_job *lj = calloc(1, sizeof *lj);
  if (s == NULL || lj == NULL) {
    for (size_t i = 0; i < evicted.n; i++) slab_release(evicted.v[i]);
    free(evicted.v);
    free(s);
    free(lj);
    free(key);
    plan_free(plan);
    reg_unref(ck);
    req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  snprintf(s->id, sizeof s->id, "s%" PRIu64, ++wd->next_id);
  s->key = key;
  s->ck = ck; /* takes the caller's reference */
  s->device = device;
  s->plan = plan;
  s->state = SET_LOADING;
  s->method = "memcpy";
  s->last_used_ms = clock_ms();
  atomic_init(&s->bytes_done, 0);
  atomic_init(&s->cancel, false);
  uv_timer_init(wd->loop, &s->progress_timer);
  s->progress_timer.data = s;
  s->next = wd->sets;
  wd->sets = s;
  wd->devices[device].used += plan->slab_bytes;
  if (add_set_waiter(s, req, false) != 0) req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
  uv_timer_start(&s->progress_timer, on_progress_timer, 100, 100);
  lj->job.work = load_work;
  lj->job.done = load_done;
  lj->set = s;
  lj->to_free = evicted;
  log_msg(LOG_DEBUG, "loading set %s: %s, %zu tensors, %" PRIu64 " bytes", s->id, ck->path,
          plan->noutputs, plan->slab_bytes);
  jobs_submit(wd->job_pool, &lj->job);
}

void res_wait_set(struct request *req, struct res_set *s) {
  s->last_used_ms = clock_ms();
  if (add_set_waiter(s, req, true) != 0) req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
}

/* ---- waiters that leave -------------------------------------------------------------- */

/* Takes req out of the waiter list of the set it waits for; true if it was there. */
static bool unwait(struct request *req) {
  struct res_set *s = req->waiting_on;
  if (s == NULL) return false;
  struct set_waiter **pp = &s->waiters;
  while (*pp != NULL && (*pp)->req != req) pp = &(*pp)->next;
  if (*pp != NULL) {
    struct set_waiter *w = *pp;
    *pp = w->next;
    free(w);
  }
  req->waiting_on = NULL;
  return true;
}

/*
 * The request's connection closed: stop waiting. The load itself goes on (the
 * next engine to ask will find the set resident); its connection is gone, so
 * nothing is replied.
 */
void res_request_gone(struct request *req) {
  if (unwait(req)) req_finish(req);
}

/* `cancel`: the request gets CANCELED; the load stops when nobody else waits for it. */
int res_cancel_request(struct request *target) {
  struct res_set *s = target->waiting_on;
  if (s == NULL) {
    target->canceled = true; /* still opening: its callback replies CANCELED */
    return 0;
  }
  unwait(target);
  if (s->waiters == NULL) atomic_store(&s->cancel, true);
  req_fail(target, WEIGHTD_E_CANCELED, "load of %s canceled", s->ck->path);
  return 0;
}

/* ---- leases ------------------------------------------------------------------------------ */

static void lease_drop(struct lease **pp) {
  struct lease *l = *pp;
  *pp = l->next;
  l->set->leases--;
  l->set->last_used_ms = clock_ms();
  free(l);
}

int res_release(struct conn *c, const char *lease_id, bool privileged, struct wd_error *err) {
  for (struct lease **pp = &wd->leases; *pp != NULL; pp = &(*pp)->next) {
    if (strcmp((*pp)->id, lease_id) != 0) continue;
    if ((*pp)->owner != c && !privileged)
      return err_set(err, WEIGHTD_E_PERMISSION, "lease %s belongs to another connection", lease_id);
    if ((*pp)->owner != c)
      log_msg(LOG_WARN, "lease %s of pid %d released by pid %d", lease_id, (int)(*pp)->owner->pid, (int)c->pid);
    lease_drop(pp);
    return 0;
  }
  return err_set(err, WEIGHTD_E_NOT_FOUND, "no lease %s", lease_id);
}

void res_release_conn(struct conn *c) {
  struct lease **pp = &wd->leases;
  while (*pp != NULL) {
    if ((*pp)->owner == c) lease_drop(pp);
    else pp = &(*pp)->next;
  }
}

/* ---- shutdown ----------------------------------------------------------------------------- */

void res_cancel_all(void) {
  for (struct res_set *s = wd->sets; s != NULL; s = s->next)
    if (s->state == SET_LOADING) atomic_store(&s->cancel, true);
}

void res_shutdown(void) {
  while (wd->leases != NULL) lease_drop(&wd->leases);
  while (wd->sets != NULL) set_destroy(wd->sets, NULL);
}
