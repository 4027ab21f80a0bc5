/*
 * ops.c - the request handlers: one function per op of the catalogue
 * (proto/msg.h), listed in one table. Handlers run on the loop thread; those
 * that need files or devices hand the work to jobs and reply from callbacks.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "jsonutil.h"
#include "msg.h"
#include "pathutil.h"

static const struct msg_obj *args_of(const struct request *r, struct msg_obj *o) {
  o->json = r->root;
  o->path[0] = '\0';
  return o;
}

/* ---- shared pieces ---------------------------------------------------------------- */

cJSON *ops_checkpoint_json(const struct reg_ckpt *ck, uint64_t resident) {
  cJSON *o = cJSON_CreateObject();
  msg_add_string(o, "path", ck->path);
  msg_add_string(o, "layout", ckpt_layout_name(ck->ck->layout));
  json_u64_add(o, "shards", ck->ck->nshards);
  json_u64_add(o, "tensors", ck->ck->ntensors);
  json_u64_add(o, "bytes", ck->ck->total_bytes);
  json_u64_add(o, "resident_bytes", resident);
  cJSON_AddBoolToObject(o, "pinned", atomic_load(&ck->pinned));
  json_u64_add(o, "pinned_bytes", ck->pinned_bytes);
  cJSON_AddBoolToObject(o, "prefetching", ck->prefetching);
  int sets = 0;
  for (struct res_set *s = wd->sets; s != NULL; s = s->next)
    if (s->ck == ck) sets++;
  json_u64_add(o, "sets", (uint64_t)sets);
  return o;
}

static cJSON *device_json(int i) {
  const struct device_state *d = &wd->devices[i];
  cJSON *o = cJSON_CreateObject();
  json_u64_add(o, "index", (uint64_t)i);
  msg_add_string(o, "uuid", d->info.uuid);
  msg_add_string(o, "name", d->info.name);
  json_u64_add(o, "memory_total", d->info.memory_total);
  json_u64_add(o, "memory_free", d->info.memory_free);
  json_u64_add(o, "budget", wd->cfg.device_memory_budget);
  json_u64_add(o, "used", d->used);
  return o;
}

int dev_resolve(const cJSON *v, int *device, struct wd_error *err) {
  if (v == NULL || cJSON_IsNull(v)) {
    *device = 0;
    return 0;
  }
  if (cJSON_IsNumber(v)) {
    double d = v->valuedouble;
    if (!(d >= 0 && d <= 9007199254740991.0) || d != floor(d)) /* range first: no out-of-range cast */
      return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'device' must be a non-negative integer index or a UUID");
    if (d >= wd->ndevices)
      return err_set(err, WEIGHTD_E_NOT_FOUND, "no device %g (this daemon has %d)", d, wd->ndevices);
    *device = (int)d;
    return 0;
  }
  if (!cJSON_IsString(v))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'device' must be a device index or UUID");
  const char *s = v->valuestring;
  if ((s[0] >= '0' && s[0] <= '9') || s[0] == '-' || s[0] == '+') {
    /* An index as text: digits only. */
    char *end;
    errno = 0;
    unsigned long n = strtoul(s, &end, 10);
    if (*end != '\0' || errno != 0 || s[0] == '-' || s[0] == '+')
      return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'device': '%.40s' is neither an index nor a UUID", s);
    if (n >= (unsigned long)wd->ndevices)
      return err_set(err, WEIGHTD_E_NOT_FOUND, "no device %lu (this daemon has %d)", n, wd->ndevices);
    *device = (int)n;
    return 0;
  }
  for (int i = 0; i < wd->ndevices; i++)
    if (strcmp(wd->devices[i].info.uuid, s) == 0) {
      *device = i;
      return 0;
    }
  return err_set(err, WEIGHTD_E_NOT_FOUND, "no device '%.80s' (give an index below %d or a UUID)", s,
                 wd->ndevices);
}

/* A job that measures page-cache residency off the loop, then replies. */
struct info_job {
  struct job job;
  struct request *req;
  struct reg_ckpt **cks;
  size_t n;
  uint64_t *resident;
  bool status; /* reply with the whole status, not one checkpoint */
  struct wd_device_info *devinfo;
};

static void info_work(struct job *j) {
  struct info_job *ij = (struct info_job *)j;
  for (size_t i = 0; i < ij->n; i++) ij->resident[i] = reg_resident_bytes(ij->cks[i]);
  if (ij->devinfo != NULL)
    for (int i = 0; i < wd->ndevices; i++)
      if (wd->backend.ops->device_info(wd->backend.ctx, i, &ij->devinfo[i], NULL) != 0) ij->devinfo[i].index = -1;
}

static void info_done(struct job *j) {
  struct info_job *ij = (struct info_job *)j;
  cJSON *r = msg_reply_ok(ij->req->id);
  if (ij->devinfo != NULL)
    for (int i = 0; i < wd->ndevices; i++)
      if (ij->devinfo[i].index >= 0) wd->devices[i].info.memory_free = ij->devinfo[i].memory_free;
  if (!ij->status) {
    cJSON_AddItemToObject(r, "checkpoint", ops_checkpoint_json(ij->cks[0], ij->resident[0]));
  } else {
    cJSON *d = cJSON_AddObjectToObject(r, "daemon");
    msg_add_string(d, "version", weightd_version_string());
    json_u64_add(d, "pid", (uint64_t)getpid());
    msg_add_string(d, "backend", wd->backend_name);
    cJSON_AddNumberToObject(d, "uptime_s", (double)(clock_ms() - wd->started_ms) / 1000.0);
    json_u64_add(d, "connections", wd->nconns);
    msg_add_string(d, "socket", wd->socket_path);
    json_u64_add(d, "jobs", jobs_outstanding(wd->control_pool) + jobs_outstanding(wd->job_pool));
    json_u64_add(d, "fill_threads", fill_threads(wd->fill));
    cJSON *devs = cJSON_AddArrayToObject(r, "devices");
    for (int i = 0; i < wd->ndevices; i++) cJSON_AddItemToArray(devs, device_json(i));
    cJSON *cks = cJSON_AddArrayToObject(r, "checkpoints");
    for (size_t i = 0; i < ij->n; i++)
      if (!ij->cks[i]->detached) cJSON_AddItemToArray(cks, ops_checkpoint_json(ij->cks[i], ij->resident[i]));
    cJSON *sets = cJSON_AddArrayToObject(r, "sets");
    for (struct res_set *s = wd->sets; s != NULL; s = s->next) cJSON_AddItemToArray(sets, res_set_json(s));
    uint64_t nleases = 0;
    for (struct lease *l = wd->leases; l != NULL; l = l->next) nleases++;
    json_u64_add(d, "leases", nleases);
  }
  req_reply(ij->req, r, NULL, 0);
  for (size_t i = 0; i < ij->n; i++) reg_unref(ij->cks[i]);
  free(ij->cks);
  free(ij->resident);
  free(ij->devinfo);
  free(ij);
}

static void reply_info(struct request *req, struct reg_ckpt **cks, size_t n, bool status) {
  struct info_job *ij = calloc(1, sizeof *ij);
  if (ij == NULL || (ij->resident = calloc(n ? n : 1, sizeof *ij->resident)) == NULL ||
      (status && (ij->devinfo = calloc((size_t)wd->ndevices, sizeof *ij->devinfo)) == NULL)) {
    if (ij) free(ij->resident);
    free(ij);
    for (size_t i = 0; i < n; i++) reg_unref(cks[i]);
    free(cks);
    req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  ij->job.work = info_work;
  ij->job.done = info_done;
  ij->req = req;
  ij->cks = cks;
  ij->n = n;
  ij->status = status;
  jobs_submit(wd->control_pool, &ij->job);
}

static void reply_checkpoint(struct request *req, struct reg_ckpt *ck) {
  struct reg_ckpt **cks = malloc(sizeof *cks);
  if (cks == NULL) {
    reg_unref(ck);
    req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  cks[0] = ck; /* the caller's reference moves to the job */
  reply_info(req, cks, 1, false);
}

/* Reads a string field; on a malformed one, replies with the error and returns false. */
static bool str_arg(struct request *r, const char *name, bool required, const char **out) {
  struct msg_obj o;
  struct wd_error err = {0};
  *out = NULL;
  if (msg_get_string(args_of(r, &o), name, required, out, &err) < 0) {
    req_fail_err(r, &err);
    return false;
  }
  return true;
}

/* The required path field, or NULL after replying with the error. */
static const char *path_arg(struct request *r) {
  const char *path;
  return str_arg(r, "path", true, &path) ? path : NULL;
}

/* ---- handlers ----------------------------------------------------------------------- */

static void op_hello(struct request *r) {
  struct msg_obj o;
  struct wd_error err = {0};
  uint64_t proto = 0;
  if (msg_get_u64(args_of(r, &o), "protocol", true, 0, UINT32_MAX, &proto, &err) < 0) {
    req_fail_err(r, &err);
    return;
  }
  if (proto != WEIGHTD_PROTOCOL_VERSION) {
    req_fail(r, WEIGHTD_E_VERSION, "this daemon speaks protocol %d, not %" PRIu64, WEIGHTD_PROTOCOL_VERSION, proto);
    return;
  }
  r->conn->hello_done = true;
  cJSON *rep = msg_reply_ok(r->id);
  json_u64_add(rep, "protocol", WEIGHTD_PROTOCOL_VERSION);
  msg_add_string(rep, "version", weightd_version_string());
  msg_add_string(rep, "backend", wd->backend_name);
  json_u64_add(rep, "pid", (uint64_t)getpid());
  cJSON *devs = cJSON_AddArrayToObject(rep, "devices");
  for (int i = 0; i < wd->ndevices; i++) cJSON_AddItemToArray(devs, device_json(i));
  req_reply(r, rep, NULL, 0);
}

static void open_ready(struct request *r, struct reg_ckpt *ck, const struct wd_error *err) {
  if (ck == NULL) {
    req_fail_err(r, err);
    return;
  }
  reply_checkpoint(r, ck);
}

static void op_open(struct request *r) {
  const char *path = path_arg(r);
  if (path != NULL) reg_acquire(r, path, open_ready);
}

/* close: resolve on a job thread (realpath touches the file system), then drop. */
struct resolve_job {
  struct job job;
  struct request *req;
  char *resolved;
  int err_no;
};

static void resolve_work(struct job *j) {
  struct resolve_job *rj = (struct resolve_job *)j;
  const char *path = cJSON_GetObjectItemCaseSensitive(rj->req->root, "path")->valuestring;
  rj->resolved = realpath(path, NULL);
  rj->err_no = rj->resolved ? 0 : errno;
}

static void close_done(struct job *j) {
  struct resolve_job *rj = (struct resolve_job *)j;
  struct wd_error err = {0};
  if (rj->resolved == NULL) {
    req_fail(rj->req, WEIGHTD_E_NOT_FOUND, "%s", strerror(rj->err_no));
  } else if (wd->nroots > 0 && !path_under_roots(rj->resolved, (const char *const *)wd->roots, wd->nroots)) {
    req_fail(rj->req, WEIGHTD_E_PATH_DENIED, "%s is outside the model roots", rj->resolved);
  } else if (reg_close(rj->resolved, &err) != 0) {
    req_fail_err(rj->req, &err);
  } else {
    cJSON *rep = msg_reply_ok(rj->req->id);
    cJSON_AddBoolToObject(rep, "closed", 1);
    msg_add_string(rep, "path", rj->resolved);
    req_reply(rj->req, rep, NULL, 0);
  }
  free(rj->resolved);
  free(rj);
}

static void op_close(struct request *r) {
  if (path_arg(r) == NULL) return;
  struct resolve_job *rj = calloc(1, sizeof *rj);
  if (rj == NULL) {
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  rj->job.work = resolve_work;
  rj->job.done = close_done;
  rj->req = r;
  jobs_submit(wd->control_pool, &rj->job);
}

static void prefetch_ready(struct request *r, struct reg_ckpt *ck, const struct wd_error *err) {
  if (ck == NULL) {
    req_fail_err(r, err);
    return;
  }
  struct msg_obj o;
  bool wait = false, pin = false;
  struct wd_error e = {0};
  msg_get_bool(args_of(r, &o), "wait", false, false, &wait, &e);
  msg_get_bool(args_of(r, &o), "pin", false, false, &pin, &e);
  if (pin && (wd->backend.ops->caps & WD_CAP_HOST_SLABS))
    log_msg(LOG_DEBUG, "%s: the %s backend reads host memory directly; nothing to pin", ck->path,
            wd->backend_name);
  if (ck->prefetching && !wait && !(pin && !atomic_load(&ck->pinned))) {
    reply_checkpoint(r, ck);
    return;
  }
  if (reg_prefetch(ck, pin, wait ? r : NULL, &e) != 0) {
    reg_unref(ck);
    req_fail_err(r, &e);
    return;
  }
  if (wait) reg_unref(ck);
  else reply_checkpoint(r, ck);
}

static void op_prefetch(struct request *r) {
  struct msg_obj o;
  struct wd_error err = {0};
  bool b;
  if (msg_get_bool(args_of(r, &o), "wait", false, false, &b, &err) < 0 ||
      msg_get_bool(args_of(r, &o), "pin", false, false, &b, &err) < 0) {
    req_fail_err(r, &err);
    return;
  }
  const char *path = path_arg(r);
  if (path != NULL) reg_acquire(r, path, prefetch_ready);
}

/* load and attach-by-path: the checkpoint, then the plan (on a job thread: big checkpoints), then the set. */
struct plan_job {
  struct job job;
  struct request *req;
  struct reg_ckpt *ck;
  int device;
  struct plan *plan;
  int rc;
  struct wd_error err;
};

static void plan_work(struct job *j) {
  struct plan_job *pj = (struct plan_job *)j;
  /* The request object and the open checkpoint do not change once made. */
  pj->rc = plan_build(pj->ck->ck, cJSON_GetObjectItemCaseSensitive(pj->req->root, "plan"), &pj->plan, &pj->err);
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
  } else {
    res_load(r, pj->ck, pj->device, pj->plan);
  }
  free(pj);
}

static void load_ready(struct request *r, struct reg_ckpt *ck, const struct wd_error *err) {
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
  dev_resolve(cJSON_GetObjectItemCaseSensitive(r->root, "device"), &pj->device, &e);
  pj->job.work = plan_work;
  pj->job.done = plan_done;
  pj->req = r;
  pj->ck = ck;
  jobs_submit(wd->control_pool, &pj->job);
}

static int check_load_args(struct request *r) {
  struct msg_obj o, plan;
  struct wd_error err = {0};
  int device;
  if (dev_resolve(cJSON_GetObjectItemCaseSensitive(r->root, "device"), &device, &err) != 0 ||
      msg_get_object(args_of(r, &o), "plan", false, &plan, &err) < 0) {
    req_fail_err(r, &err);
    return -1;
  }
  return 0;
}

static void op_load(struct request *r) {
  const char *path = path_arg(r);
  if (path == NULL || check_load_args(r) != 0) return;
  reg_acquire(r, path, load_ready);
}

static void op_attach(struct request *r) {
  const char *set_id;
  if (!str_arg(r, "set", false, &set_id)) return;
  if (set_id == NULL) {
    op_load(r);
    return;
  }
  struct res_set *s = res_find_set(set_id);
  if (s == NULL) {
    req_fail(r, WEIGHTD_E_NOT_FOUND, "no resident set '%.64s'", set_id);
    return;
  }
  if (s->state == SET_READY) {
    res_attach_ready(r, s);
    return;
  }
  /* Still loading: wait like an identical load would. */
  res_wait_set(r, s);
}

static void op_cancel(struct request *r) {
  const cJSON *target = cJSON_GetObjectItemCaseSensitive(r->root, "target");
  if (target == NULL || !(cJSON_IsString(target) || cJSON_IsNumber(target))) {
    req_fail(r, WEIGHTD_E_BAD_REQUEST, "field 'target' must be the id of a request on this connection");
    return;
  }
  bool canceled = false;
  struct request *q = conn_unqueue(r->conn, target);
  if (q != NULL) { /* read but not started: it never runs */
    req_fail(q, WEIGHTD_E_CANCELED, "canceled before it started");
    canceled = true;
  }
  for (struct request *t = r->conn->requests; !canceled && t != NULL; t = t->next_in_conn) {
    if (t == r || t->id == NULL || !cJSON_Compare(t->id, target, true)) continue;
    if (t->op == MSG_OP_LOAD || t->op == MSG_OP_ATTACH) {
      res_cancel_request(t);
      canceled = true;
    }
    break;
  }
  cJSON *rep = msg_reply_ok(r->id);
  cJSON_AddBoolToObject(rep, "canceled", canceled);
  req_reply(r, rep, NULL, 0);
}

static void op_release(struct request *r) {
  struct wd_error err = {0};
  const char *lease;
  if (!str_arg(r, "lease", true, &lease)) return;
  if (res_release(r->conn, lease, conn_privileged(r->conn), &err) != 0) {
    req_fail_err(r, &err);
    return;
  }
  cJSON *rep = msg_reply_ok(r->id);
  cJSON_AddBoolToObject(rep, "released", 1);
  req_reply(r, rep, NULL, 0);
}

/* evict answers once the memory is back: the slabs are freed on a job first. */
struct evict_job {
  struct job job;
  struct request *req;
  cJSON *evicted;
  struct slab_list slabs;
};

static void evict_work(struct job *j) { slab_list_free_now(&((struct evict_job *)j)->slabs); }

static void evict_done(struct job *j) {
  struct evict_job *ej = (struct evict_job *)j;
  cJSON *rep = msg_reply_ok(ej->req->id);
  cJSON_AddItemToObject(rep, "evicted", ej->evicted);
  req_reply(ej->req, rep, NULL, 0);
  free(ej);
}

static void op_evict(struct request *r) {
  struct wd_error err = {0};
  const char *set_id;
  if (!str_arg(r, "set", false, &set_id)) return;
  struct evict_job *ej = calloc(1, sizeof *ej);
  if (ej == NULL || (ej->evicted = cJSON_CreateArray()) == NULL) {
    free(ej);
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  if (set_id != NULL) {
    struct res_set *s = res_find_set(set_id);
    if (s == NULL) err_set(&err, WEIGHTD_E_NOT_FOUND, "no resident set '%.64s'", set_id);
    else if (res_evict_set(s, &ej->slabs, &err) == 0) cJSON_AddItemToArray(ej->evicted, cJSON_CreateString(set_id));
  } else {
    const cJSON *dv = cJSON_GetObjectItemCaseSensitive(r->root, "device");
    int device;
    if (dv == NULL) err_set(&err, WEIGHTD_E_BAD_REQUEST, "evict needs 'set' or 'device'");
    else if (dev_resolve(dv, &device, &err) == 0) res_evict_device(device, ej->evicted, &ej->slabs);
  }
  if (err.code != 0) {
    cJSON_Delete(ej->evicted);
    free(ej);
    req_fail_err(r, &err);
    return;
  }
  ej->job.work = evict_work;
  ej->job.done = evict_done;
  ej->req = r;
  jobs_submit(wd->job_pool, &ej->job);
}

static void op_status(struct request *r) {
  size_t n = 0;
  for (struct reg_ckpt *c = wd->ckpts; c != NULL; c = c->next)
    if (c->state == REG_OPEN) n++;
  struct reg_ckpt **cks = calloc(n ? n : 1, sizeof *cks);
  if (cks == NULL) {
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  size_t i = 0;
  for (struct reg_ckpt *c = wd->ckpts; c != NULL; c = c->next)
    if (c->state == REG_OPEN) {
      reg_ref(c);
      cks[i++] = c;
    }
  reply_info(r, cks, n, true);
}

static void op_shutdown(struct request *r) {
  if (!conn_privileged(r->conn)) {
    req_fail(r, WEIGHTD_E_PERMISSION, "only root or the daemon's uid may stop it");
    return;
  }
  log_msg(LOG_INFO, "shutdown requested by pid %d", (int)r->conn->pid);
  cJSON *rep = msg_reply_ok(r->id);
  cJSON_AddBoolToObject(rep, "stopping", 1);
  req_reply(r, rep, NULL, 0);
  daemon_request_stop();
}

/* ---- the table -------------------------------------------------------------------------- */

static void (*const handlers[MSG_OP_COUNT])(struct request *r) = {
    [MSG_OP_HELLO] = op_hello,       [MSG_OP_OPEN] = op_open,       [MSG_OP_CLOSE] = op_close,
    [MSG_OP_PREFETCH] = op_prefetch, [MSG_OP_LOAD] = op_load,       [MSG_OP_CANCEL] = op_cancel,
    [MSG_OP_ATTACH] = op_attach,     [MSG_OP_RELEASE] = op_release, [MSG_OP_EVICT] = op_evict,
    [MSG_OP_STATUS] = op_status,     [MSG_OP_SHUTDOWN] = op_shutdown,
};

void ops_dispatch(struct request *r) {
  if (r->op < 0 || r->op >= MSG_OP_COUNT || handlers[r->op] == NULL) {
    req_fail(r, WEIGHTD_E_BAD_REQUEST, "unsupported op");
    return;
  }
  handlers[r->op](r);
}
