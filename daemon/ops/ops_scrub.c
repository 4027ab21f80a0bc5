/*
 * ops_scrub.c - the scrub op, and the corrupt event a scrub's finding sends
 * to a set's holders (state/scrub.h does the hashing and keeps the marks).
 *
 * Who may scrub a set: whoever may see it in status and attach it. A named
 * set gets the attach's check of the caller's access to the set's files
 * (ops_sets.c's op_attach); a scrub of every set (no "set") covers what a
 * status would list: for root, the daemon's uid and admin_gids every ready
 * set, for anyone else the sets their uid loaded and those of checkpoints
 * whose files they may read (reg_readable, as ops_status.c decides).
 * Handlers run on the loop thread; the scrubber's continuations reply.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "jsonutil.h"
#include "manifest.h"
#include "ops_common.h"
#include "state/scrub.h"

/* One scrub request: the sets still being scrubbed and the reply's list so far. */
struct scrub_req {
  struct request *r;
  size_t pending;
  size_t mismatches;
  size_t skipped; /* sets that could not be scrubbed (no digests, one queued already) */
  bool digests; /* the request asked for every tensor's digest */
  cJSON *sets;
  int rc; /* the first error of a named set's scrub */
  struct wd_error err;
};

static void scrub_req_finish(struct scrub_req *q) {
  struct request *r = q->r;
  if (r->conn->closed) {
    req_finish(r);
  } else if (q->rc != 0) {
    req_fail_err(r, &q->err);
  } else {
    cJSON *rep = msg_reply_ok(r->id);
    /* Clean only when every set was hashed and matched: a set skipped was not shown to be right. */
    cJSON_AddBoolToObject(rep, "clean", q->mismatches == 0 && q->skipped == 0);
    json_u64_add(rep, "mismatches", q->mismatches);
    json_u64_add(rep, "skipped", q->skipped);
    cJSON_AddItemToObject(rep, "sets", q->sets);
    q->sets = NULL;
    req_reply(r, rep, NULL, 0);
  }
  cJSON_Delete(q->sets);
  free(q);
}

/* A set's result: {"set", "tensors", "bytes", "seconds", "mismatches": [{"tensor", "expected", "found"}]}. */
static void scrubbed(void *arg, struct res_set *s, const struct scrub_report *rep, const struct wd_error *err) {
  struct scrub_req *q = arg;
  if (rep == NULL) {
    if (q->rc == 0) {
      q->rc = err->code;
      q->err = *err;
    }
  } else {
    cJSON *o = cJSON_CreateObject();
    msg_add_string(o, "set", s->id);
    json_u64_add(o, "tensors", rep->tensors);
    json_u64_add(o, "bytes", rep->bytes);
    cJSON_AddNumberToObject(o, "seconds", rep->seconds);
    cJSON *list = cJSON_AddArrayToObject(o, "mismatches");
    for (size_t i = 0; i < rep->nmismatch; i++) {
      char w[2 * WD_DIGEST_BYTES + 1], g[2 * WD_DIGEST_BYTES + 1];
      mf_hex(rep->mismatch[i].want, WD_DIGEST_BYTES, w);
      mf_hex(rep->mismatch[i].got, WD_DIGEST_BYTES, g);
      cJSON *m = cJSON_CreateObject();
      msg_add_string(m, "tensor", s->plan->outputs[rep->mismatch[i].output].name);
      msg_add_string(m, "expected", w);
      msg_add_string(m, "found", g);
      cJSON_AddItemToArray(list, m);
    }
    if (q->digests) {
      cJSON *all = cJSON_AddArrayToObject(o, "digests");
      for (size_t i = 0; i < rep->tensors; i++) {
        char g[2 * WD_DIGEST_BYTES + 1];
        mf_hex(rep->found[i], WD_DIGEST_BYTES, g);
        cJSON *m = cJSON_CreateObject();
        msg_add_string(m, "tensor", s->plan->outputs[i].name);
        msg_add_string(m, "digest", g);
        cJSON_AddItemToArray(all, m);
      }
    }
    q->mismatches += rep->nmismatch;
    cJSON_AddItemToArray(q->sets, o);
  }
  if (--q->pending == 0) scrub_req_finish(q);
}

static struct scrub_req *scrub_req_new(struct request *r) {
  struct msg_obj o;
  struct wd_error err = {0};
  bool digests = false;
  if (msg_get_bool(ops_args(r, &o), "digests", false, false, &digests, &err) < 0) {
    req_fail_err(r, &err);
    return NULL;
  }
  struct scrub_req *q = calloc(1, sizeof *q);
  if (q != NULL && (q->sets = cJSON_CreateArray()) == NULL) {
    free(q);
    q = NULL;
  }
  if (q == NULL) req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
  else {
    q->r = r;
    q->digests = digests;
  }
  return q;
}

/* A named set, once the requester's access to its files is checked (as for an attach by set id). */
static void scrub_checked(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct request *r = arg;
  struct daemon *d = req_daemon(r);
  if (ck == NULL) {
    req_fail_err(r, err);
    return;
  }
  const cJSON *id = cJSON_GetObjectItemCaseSensitive(r->root, "set");
  struct res_set *s = res_find_set(d->res, id->valuestring); /* it may have gone while the check ran */
  bool checked = s != NULL && s->ck == ck;
  reg_unref(ck);
  if (r->conn->closed) {
    req_finish(r);
    return;
  }
  if (!checked) {
    req_fail(r, WEIGHTD_E_NOT_FOUND, "no resident set '%.64s'", id->valuestring);
    return;
  }
  struct scrub_req *q = scrub_req_new(r);
  if (q == NULL) return;
  struct wd_error e = {0};
  q->pending = 1;
  if (scrub_set(d->scrub, s, scrubbed, q, &e) != 0) {
    cJSON_Delete(q->sets);
    free(q);
    req_fail_err(r, &e);
  }
}

/*
 * Queues a scrub of every ready set that `shows` accepts (NULL: all), and
 * lists those that cannot be scrubbed as skipped; replies once all are done.
 */
static void scrub_sets(struct request *r, bool (*shows)(void *arg, const struct res_set *s), void *arg) {
  struct daemon *d = req_daemon(r);
  struct scrub_req *q = scrub_req_new(r);
  if (q == NULL) return;
  q->pending = 1; /* held until every set is queued */
  for (struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) {
    if (s->state != SET_READY || (shows != NULL && !shows(arg, s))) continue;
    struct wd_error e = {0};
    q->pending++;
    if (scrub_set(d->scrub, s, scrubbed, q, &e) == 0) continue;
    q->pending--;
    q->skipped++;
    cJSON *o = cJSON_CreateObject();
    msg_add_string(o, "set", s->id);
    msg_add_string(o, "skipped", e.msg);
    cJSON_AddItemToArray(q->sets, o);
  }
  if (--q->pending == 0) scrub_req_finish(q);
}

/* What a client that is no admin sees (as status decides it): the checkpoints of the ready sets, readable or not. */
struct scrub_view {
  struct request *r;
  struct reg_ckpt **cks; /* observed, each once */
  const bool *readable;
  size_t n;
};

static int by_ptr(const void *a, const void *b) {
  uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
  return x < y ? -1 : x > y;
}

static bool view_shows(void *arg, const struct res_set *s) {
  const struct scrub_view *v = arg;
  if (s->loader_uid == v->r->conn->uid) return true; /* its own, as status shows it */
  struct reg_ckpt *const *hit = bsearch(&s->ck, v->cks, v->n, sizeof *v->cks, by_ptr);
  return hit != NULL && v->readable[hit - v->cks]; /* one not asked about (a set loaded since): not shown */
}

static void view_free(struct scrub_view *v) {
  for (size_t i = 0; i < v->n; i++) reg_unobserve(v->cks[i]);
  free(v->cks);
  free(v);
}

static void scrub_readable(void *arg, const bool *readable) {
  struct scrub_view *v = arg;
  struct request *r = v->r;
  if (readable == NULL) req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
  else if (r->conn->closed) req_finish(r);
  else {
    v->readable = readable;
    scrub_sets(r, view_shows, v);
  }
  view_free(v);
}

/* Every ready set the connection may see in status: all for admins; else after the check of its access. */
static void scrub_all(struct request *r) {
  struct daemon *d = req_daemon(r);
  if (ops_is_admin(r->conn)) {
    scrub_sets(r, NULL, NULL);
    return;
  }
  size_t cap = 0;
  for (const struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) cap++;
  struct scrub_view *v = calloc(1, sizeof *v);
  if (v != NULL) v->cks = calloc(cap ? cap : 1, sizeof *v->cks);
  if (v == NULL || v->cks == NULL) {
    free(v);
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  v->r = r;
  size_t n = 0;
  for (struct res_set *s = res_first_set(d->res); s != NULL; s = s->next)
    if (s->state == SET_READY) v->cks[n++] = s->ck;
  qsort(v->cks, n, sizeof *v->cks, by_ptr);
  for (size_t i = 0; i < n; i++)
    if (v->n == 0 || v->cks[v->n - 1] != v->cks[i]) v->cks[v->n++] = v->cks[i];
  for (size_t i = 0; i < v->n; i++) reg_observe(v->cks[i]);
  struct acc_cred who;
  reg_readable(d->reg, v->cks, v->n, ops_reader(r->conn, &who), scrub_readable, v);
}

void op_scrub(struct request *r) {
  const char *set_id;
  if (!ops_str_arg(r, "set", false, &set_id)) return;
  if (set_id == NULL) {
    scrub_all(r);
    return;
  }
  struct daemon *d = req_daemon(r);
  struct res_set *s = res_find_set(d->res, set_id);
  if (s == NULL) {
    req_fail(r, WEIGHTD_E_NOT_FOUND, "no resident set '%.64s'", set_id);
    return;
  }
  ops_set_check(r, s, scrub_checked);
}

/* ---- the corrupt event, and the reload -------------------------------------------------- */

/* A corrupt set's reload: its plan and checkpoint loaded again as a new set, whoever waits or not. */
struct reload {
  struct res_waiter w;
  char old_id[24];
};

static void reloaded(struct res_waiter *w, struct res_set *s, bool joined, const struct wd_error *err) {
  struct reload *rl = (struct reload *)w;
  (void)joined;
  if (s != NULL)
    log_msg(LOG_INFO, "set %s (corrupt) loaded again as set %s (%s)", rl->old_id, s->id, s->ck->path);
  else
    log_msg(LOG_ERROR, "set %s (corrupt): loading it again failed: %s", rl->old_id, err->msg);
  free(rl);
}

/*
 * A reload of s prepared (its waiter and a copy of its plan), or NULL when
 * s is not to be reloaded: scrub_reload off, the daemon stopping, s retired
 * already or not ready, its checkpoint replaced since (a load of the new
 * files is a load of its own, by path), no room on its device for a second
 * copy while its holders keep the first, or no memory.
 */
static struct reload *reload_prepare(struct daemon *d, struct res_set *s, struct plan **copy) {
  *copy = NULL;
  if (d->cfg.scrub_reload != CFG_ON || d->stopping || s->orphan || s->state != SET_READY || s->ck->detached)
    return NULL;
  if (!res_set_reload_fits(d->res, s)) {
    log_msg(LOG_WARN, "set %s (corrupt): no room on device %d for a second copy while it is held: not loaded "
                      "again; it refuses new leases until it is released and evicted", s->id, s->device);
    return NULL;
  }
  struct reload *rl = calloc(1, sizeof *rl);
  if (rl == NULL || plan_copy(s->plan, copy) != 0) {
    free(rl);
    log_msg(LOG_ERROR, "set %s (corrupt): out of memory to load it again; evict it and load it again", s->id);
    return NULL;
  }
  snprintf(rl->old_id, sizeof rl->old_id, "%s", s->id);
  rl->w.done = reloaded;
  rl->w.uid = s->loader_uid;
  return rl;
}

/*
 * Retires s and loads its plan again on its device, through the source its
 * own load was given: the new set is an ordinary one (evictable once
 * ready, found by the next load or attach by path); the old one's holders
 * keep its memory until they release it. s may be freed when this returns.
 */
static void reload_start(struct daemon *d, struct res_set *s, struct reload *rl, struct plan *copy) {
  struct reg_ckpt *ck = s->ck;
  int device = s->device;
  enum ld_source_choice source = s->load.choice;
  reg_ref(ck); /* res_load takes this reference; retiring s may drop its own */
  res_set_retire(d->res, s);
  log_msg(LOG_INFO, "set %s (corrupt): retired, loading %s again", rl->old_id, ck->path);
  res_load(d->res, ck, device, copy, source, &rl->w);
}

void ops_scrub_corrupt(void *arg, struct res_set *s, const size_t *outs, size_t n) {
  struct daemon *d = arg;
  bool retired = s->orphan;
  struct plan *copy = NULL;
  struct reload *rl = reload_prepare(d, s, &copy);
  if (s->page != NULL) ppage_flag_set(s->page, WD_PAGE_FLAG_CORRUPT); /* holders that poll their page see it */
  for (struct lease *l = res_first_lease(d->res); l != NULL; l = l->next) {
    if (l->set != s || l->holder.owner == NULL) continue;
    bool told = false; /* one event per connection, however many leases it holds on the set */
    for (struct lease *e = res_first_lease(d->res); e != l && !told; e = e->next)
      told = e->set == s && e->holder.owner == l->holder.owner;
    if (told) continue;
    struct conn *c = (struct conn *)l->holder.owner;
    cJSON *ev = msg_event(NULL, "corrupt");
    if (ev == NULL) continue;
    msg_add_string(ev, "set", s->id);
    cJSON *names = cJSON_AddArrayToObject(ev, "tensors");
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(names, cJSON_CreateString(s->plan->outputs[outs[i]].name));
    cJSON_AddBoolToObject(ev, "reload", rl != NULL);
    msg_add_string(ev, "message",
                   rl != NULL ? "a scrub found these tensors changed since the set was loaded; the daemon is loading "
                                "it again as a new set: release this one and attach again by path"
                   : retired  ? "a scrub found these tensors changed since the set was loaded; it was retired "
                                "already: release it and attach again by path"
                              : "a scrub found these tensors changed since the set was loaded; the set refuses new "
                                "leases: release it and load it again");
    conn_send(c, ev, NULL, 0);
    log_msg(LOG_INFO, "set %s: told pid %d (lease %s) it is corrupt", s->id, (int)l->holder.pid, l->id);
  }
  if (rl != NULL) reload_start(d, s, rl, copy);
  else if (!res_set_release_if_orphan(s) && !retired) res_set_marked(d->res); /* listed, corrupt: never adopted */
}
