/*
 * ops_sets.c - the handlers of checkpoints and resident sets: open, close,
 * prefetch, load, attach and evict. Each hands the work to the registry or
 * residency with a continuation that builds the reply.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ipc_handle.h"
#include "jsonutil.h"
#include "log.h"
#include "ops_common.h"

/* ---- open, close, prefetch ------------------------------------------------------------- */

static void open_ready(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct request *r = arg;
  if (ck == NULL) req_fail_err(r, err);
  else ops_reply_checkpoint(r, ck);
}

void op_open(struct request *r) {
  const char *path = ops_path_arg(r);
  if (path != NULL) reg_acquire(req_daemon(r)->reg, path, open_ready, r);
}

static void close_resolved(void *arg, const char *resolved, const struct wd_error *err) {
  struct request *r = arg;
  struct wd_error e = {0};
  if (resolved == NULL) {
    req_fail_err(r, err);
  } else if (reg_close(req_daemon(r)->reg, resolved, &e) != 0) {
    req_fail_err(r, &e);
  } else {
    cJSON *rep = msg_reply_ok(r->id);
    cJSON_AddBoolToObject(rep, "closed", 1);
    msg_add_string(rep, "path", resolved);
    req_reply(r, rep, NULL, 0);
  }
}

/* close: resolved and checked against the model roots on a job thread (realpath touches the file system). */
void op_close(struct request *r) {
  const char *path = ops_path_arg(r);
  if (path != NULL) reg_resolve(req_daemon(r)->reg, path, close_resolved, r);
}

static void prefetched(void *arg, struct reg_ckpt *ck, uint64_t resident, const struct wd_error *err) {
  struct request *r = arg;
  if (err != NULL) {
    req_fail_err(r, err);
    return;
  }
  cJSON *reply = msg_reply_ok(r->id);
  cJSON_AddItemToObject(reply, "checkpoint", ops_checkpoint_json(req_daemon(r), ck, resident));
  req_reply(r, reply, NULL, 0);
}

static void prefetch_ready(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct request *r = arg;
  struct daemon *d = req_daemon(r);
  if (ck == NULL) {
    req_fail_err(r, err);
    return;
  }
  struct msg_obj o;
  bool wait = false, pin = false;
  struct wd_error e = {0};
  msg_get_bool(ops_args(r, &o), "wait", false, false, &wait, &e);
  msg_get_bool(ops_args(r, &o), "pin", false, false, &pin, &e);
  if (pin && (d->backend.ops->caps & WD_CAP_HOST_SLABS))
    log_msg(LOG_DEBUG, "%s: the %s backend reads host memory directly; nothing to pin", ck->path, d->backend_name);
  if (ck->prefetching && !wait && !(pin && !atomic_load(&ck->pinned))) {
    ops_reply_checkpoint(r, ck);
    return;
  }
  if (reg_prefetch(d->reg, ck, pin, wait ? prefetched : NULL, r, &e) != 0) {
    reg_unref(ck);
    req_fail_err(r, &e);
    return;
  }
  if (wait) reg_unref(ck);
  else ops_reply_checkpoint(r, ck);
}

void op_prefetch(struct request *r) {
  struct msg_obj o;
  struct wd_error err = {0};
  bool b;
  if (msg_get_bool(ops_args(r, &o), "wait", false, false, &b, &err) < 0 ||
      msg_get_bool(ops_args(r, &o), "pin", false, false, &b, &err) < 0) {
    req_fail_err(r, &err);
    return;
  }
  const char *path = ops_path_arg(r);
  if (path != NULL) reg_acquire(req_daemon(r)->reg, path, prefetch_ready, r);
}

/* ---- load and attach --------------------------------------------------------------------- */

static void reply_loaded(struct request *r, struct res_set *s, bool shared) {
  struct daemon *d = req_daemon(r);
  cJSON *rep = msg_reply_ok(r->id);
  msg_add_string(rep, "set", s->id);
  msg_add_string(rep, "device", res_device(d->res, s->device)->info.uuid);
  json_u64_add(rep, "bytes", s->plan->slab_bytes);
  json_u64_add(rep, "payload_bytes", s->plan->payload_bytes);
  json_u64_add(rep, "tensors", s->plan->noutputs);
  cJSON_AddNumberToObject(rep, "seconds", s->seconds);
  cJSON_AddNumberToObject(rep, "alloc_seconds", s->load.alloc_seconds);
  cJSON_AddNumberToObject(rep, "gib_per_s",
                          s->seconds > 0 ? (double)s->plan->payload_bytes / (double)(1ull << 30) / s->seconds : 0);
  cJSON_AddBoolToObject(rep, "shared", shared);
  msg_add_string(rep, "method", s->load.method);
  req_reply(r, rep, NULL, 0);
}

/* The tensor table as attach replies carry it, serialised once per set. */
static const char *attach_table(struct res_set *s) {
  if (s->table_cache == NULL) {
    cJSON *tensors = plan_table(s->plan);
    s->table_cache = tensors ? cJSON_PrintUnformatted(tensors) : NULL;
    cJSON_Delete(tensors);
  }
  return s->table_cache;
}

/* Leases a ready set to the request's connection and replies with its handle and tensor table. */
static void reply_attached(struct request *r, struct res_set *s) {
  struct daemon *d = req_daemon(r);
  const struct wd_backend *b = &d->backend;
  struct wd_error err = {0};
  const char *table = attach_table(s);
  if (table == NULL) {
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  /* A descriptor for the reply must leave the daemon room to accept (root too) and to work. */
  if ((b->ops->caps & WD_CAP_HOST_SLABS) &&
      d->stats.connections + d->stats.fds_queued + d->cfg.reserved_connections >= daemon_fd_budget(d)) {
    req_fail(r, WEIGHTD_E_LIMIT,
             "the daemon is near its descriptor limit (%" PRIu64 ", %" PRIu64 " waiting in unread replies); retry",
             d->stats.fd_limit, d->stats.fds_queued);
    return;
  }
  struct wd_handle h;
  if (b->ops->slab_export(b->ctx, s->load.slab, &h, &err) != 0) {
    req_fail_err(r, &err);
    return;
  }
  struct lease_holder holder = {.owner = r->conn, .pid = r->conn->pid, .uid = r->conn->uid};
  snprintf(holder.client, sizeof holder.client, "%s", r->conn->client);
  struct lease *l;
  if (res_lease_add(d->res, s, &holder, &l, &err) != 0) {
    if (h.kind == WD_HANDLE_FD) close(h.fd);
    req_fail_err(r, &err);
    return;
  }
  cJSON *rep = msg_reply_ok(r->id);
  msg_add_string(rep, "set", s->id);
  msg_add_string(rep, "lease", l->id);
  msg_add_string(rep, "device", res_device(d->res, s->device)->info.uuid);
  json_u64_add(rep, "bytes", s->plan->slab_bytes);
  cJSON *handles = cJSON_AddArrayToObject(rep, "handles");
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
  cJSON_AddItemToObject(rep, "tensors", cJSON_CreateRaw(table));
  char lease_id[sizeof l->id];
  snprintf(lease_id, sizeof lease_id, "%s", l->id);
  pid_t pid = r->conn->pid;
  /* The lease stands only once its reply is on its way: a reply answered LIMIT instead leaves none. */
  if (req_reply(r, rep, fds, nfds) != 0) {
    res_lease_drop(d->res, l);
    log_msg(LOG_DEBUG, "lease %s of set %s to pid %d withdrawn: its reply was not queued", lease_id, s->id, (int)pid);
    return;
  }
  log_msg(LOG_DEBUG, "lease %s of set %s to pid %d", lease_id, s->id, (int)pid);
}

static struct request *waiter_request(struct res_waiter *w) {
  return (struct request *)((char *)w - offsetof(struct request, wait));
}

static void set_done(struct res_waiter *w, struct res_set *s, bool joined, const struct wd_error *err) {
  struct request *r = waiter_request(w);
  if (s == NULL) req_fail_err(r, err);
  else if (r->op == MSG_OP_ATTACH) reply_attached(r, s);
  else reply_loaded(r, s, joined);
}

static void set_progress(struct res_waiter *w, uint64_t done, uint64_t total) {
  req_progress(waiter_request(w), done, total);
}

static void wait_init(struct request *r) {
  r->wait.done = set_done;
  r->wait.progress = set_progress;
}

bool ops_sets_cancel(struct request *t) {
  if (t->op != MSG_OP_LOAD && t->op != MSG_OP_ATTACH) return false;
  struct res_set *s = t->wait.set;
  if (s == NULL) {
    t->canceled = true; /* still opening or planning: its continuation replies CANCELED */
    return true;
  }
  res_waiter_cancel(&t->wait);
  req_fail(t, WEIGHTD_E_CANCELED, "load of %s canceled", s->ck->path);
  return true;
}

/* The plan is built on a job thread (big checkpoints take a while), then the set is found or loaded. */
struct plan_job {
  struct job job;
  struct request *req;
  struct reg_ckpt *ck;
  const cJSON *spec; /* in the request, which does not change */
  int device;
  struct plan *plan;
  int rc;
  struct wd_error err;
};

static void plan_work(struct job *j) {
  struct plan_job *pj = (struct plan_job *)j;
  pj->rc = plan_build(pj->ck->ck, pj->spec, &pj->plan, &pj->err);
}

static void plan_done(struct job *j) {
  struct plan_job *pj = (struct plan_job *)j;
  struct request *r = pj->req;
  if (pj->rc != 0) {
    reg_unref(pj->ck);
    req_fail_err(r, &pj->err);
  } else if (r->canceled) {
    plan_free(pj->plan);
    reg_unref(pj->ck);
    req_fail(r, WEIGHTD_E_CANCELED, "canceled");
  } else if (r->conn->closed) { /* nobody to load for */
    plan_free(pj->plan);
    reg_unref(pj->ck);
    req_finish(r);
  } else if (req_daemon(r)->stopping) {
    plan_free(pj->plan);
    reg_unref(pj->ck);
    req_fail(r, WEIGHTD_E_SHUTDOWN, "the daemon is shutting down");
  } else {
    req_args_free(r); /* a waiting load keeps only its id: joiners of a slow load hold no request text */
    wait_init(r);
    res_load(req_daemon(r)->res, pj->ck, pj->device, pj->plan, &r->wait);
  }
  free(pj);
}

static void load_ready(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct request *r = arg;
  struct daemon *d = req_daemon(r);
  if (ck == NULL) {
    req_fail_err(r, err);
    return;
  }
  if (r->canceled) {
    reg_unref(ck);
    req_fail(r, WEIGHTD_E_CANCELED, "canceled");
    return;
  }
  if (r->conn->closed) { /* nobody to load for */
    reg_unref(ck);
    req_finish(r);
    return;
  }
  struct plan_job *pj = calloc(1, sizeof *pj);
  if (pj == NULL) {
    reg_unref(ck);
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  struct wd_error e = {0};
  ops_device_resolve(d, cJSON_GetObjectItemCaseSensitive(r->root, "device"), &pj->device, &e);
  pj->job.work = plan_work;
  pj->job.done = plan_done;
  pj->req = r;
  pj->ck = ck;
  pj->spec = cJSON_GetObjectItemCaseSensitive(r->root, "plan");
  jobs_submit(d->control_pool, &pj->job);
}

void op_load(struct request *r) {
  struct msg_obj o, plan;
  struct wd_error err = {0};
  int device;
  const char *path = ops_path_arg(r);
  if (path == NULL) return;
  if (ops_device_resolve(req_daemon(r), cJSON_GetObjectItemCaseSensitive(r->root, "device"), &device, &err) != 0 ||
      msg_get_object(ops_args(r, &o), "plan", false, &plan, &err) < 0) {
    req_fail_err(r, &err);
    return;
  }
  reg_acquire(req_daemon(r)->reg, path, load_ready, r);
}

void op_attach(struct request *r) {
  const char *set_id;
  if (!ops_str_arg(r, "set", false, &set_id)) return;
  if (set_id == NULL) { /* by path: load if needed, then attach */
    op_load(r);
    return;
  }
  struct daemon *d = req_daemon(r);
  struct res_set *s = res_find_set(d->res, set_id);
  if (s == NULL) {
    req_fail(r, WEIGHTD_E_NOT_FOUND, "no resident set '%.64s'", set_id);
    return;
  }
  wait_init(r);
  res_wait(d->res, s, &r->wait); /* a loading set: wait like an identical load would */
}

/* ---- evict ---------------------------------------------------------------------------------- */

static void evicted(void *arg, char *const *ids, size_t n) {
  struct request *r = arg;
  cJSON *rep = msg_reply_ok(r->id);
  cJSON *list = cJSON_AddArrayToObject(rep, "evicted");
  for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(list, cJSON_CreateString(ids[i]));
  req_reply(r, rep, NULL, 0);
}

/* evict answers once the memory is back: the slabs are freed on a job first. */
void op_evict(struct request *r) {
  struct daemon *d = req_daemon(r);
  struct wd_error err = {0};
  const char *set_id;
  if (!ops_str_arg(r, "set", false, &set_id)) return;
  int device = -1;
  if (set_id == NULL) {
    const cJSON *dv = cJSON_GetObjectItemCaseSensitive(r->root, "device");
    if (dv == NULL) {
      req_fail(r, WEIGHTD_E_BAD_REQUEST, "evict needs 'set' or 'device'");
      return;
    }
    if (ops_device_resolve(d, dv, &device, &err) != 0) {
      req_fail_err(r, &err);
      return;
    }
  }
  if (res_evict(d->res, set_id, device, evicted, r, &err) != 0) req_fail_err(r, &err);
}
