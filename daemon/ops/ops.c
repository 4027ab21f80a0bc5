/*
 * ops.c - the op table and the small handlers (hello, cancel, release,
 * shutdown). Checkpoints, loads and attaches are in ops_sets.c; status and
 * the JSON views of state in ops_status.c; replies and argument readers in
 * ops_common.c. Handlers run on the loop thread; those that need files or
 * devices go through the state modules, whose continuations reply.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "jsonutil.h"
#include "base/log.h"
#include "ops_common.h"
#include "telemetry.h"

/* ---- small handlers ----------------------------------------------------------------------- */

/*
 * Reads hello's optional "handles", the handle kinds the client can open,
 * into *accepts. Absent: what every client spoke before the field existed
 * (fd and cuda_ipc). Names this daemon does not know are skipped, so that a
 * newer client can list kinds an older daemon never makes.
 */
static int hello_handles(const cJSON *root, unsigned *accepts, struct wd_error *err) {
  const cJSON *list = cJSON_GetObjectItemCaseSensitive(root, "handles");
  if (list == NULL) {
    *accepts = WD_HANDLES_DEFAULT;
    return 0;
  }
  if (!cJSON_IsArray(list))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'handles' must be a list of handle kind names");
  unsigned mask = 0;
  int i = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, list) {
    if (!cJSON_IsString(e))
      return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'handles[%d]' must be a string", i);
    int k = wd_handle_kind_from_name(e->valuestring);
    if (k >= 0) mask |= WD_HANDLE_BIT(k);
    i++;
  }
  *accepts = mask;
  return 0;
}

/* Reads hello's optional "features" into *features; names this daemon does not know are skipped. */
static int hello_features(const cJSON *root, unsigned *features, struct wd_error *err) {
  const cJSON *list = cJSON_GetObjectItemCaseSensitive(root, "features");
  *features = 0;
  if (list == NULL) return 0;
  if (!cJSON_IsArray(list)) return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'features' must be a list of names");
  int i = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, list) {
    if (!cJSON_IsString(e)) return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'features[%d]' must be a string", i);
    int f = wd_feature_from_name(e->valuestring);
    if (f >= 0) *features |= WD_FEATURE_BIT(f);
    i++;
  }
  return 0;
}

static void op_hello(struct request *r) {
  struct daemon *d = req_daemon(r);
  struct msg_obj o;
  struct wd_error err = {0};
  uint64_t proto = 0;
  const char *client = NULL;
  unsigned accepts = 0, features = 0;
  if (msg_get_u64(ops_args(r, &o), "protocol", true, 0, UINT32_MAX, &proto, &err) < 0 ||
      msg_get_string(ops_args(r, &o), "client", false, &client, &err) < 0 ||
      hello_handles(r->root, &accepts, &err) != 0 || hello_features(r->root, &features, &err) != 0) {
    req_fail_err(r, &err);
    return;
  }
  if (proto != WEIGHTD_PROTOCOL_VERSION) {
    req_fail(r, WEIGHTD_E_VERSION, "this daemon speaks protocol %d, not %" PRIu64, WEIGHTD_PROTOCOL_VERSION, proto);
    return;
  }
  if (client != NULL && strlen(client) >= sizeof r->conn->client) {
    req_fail(r, WEIGHTD_E_BAD_REQUEST, "field 'client' is longer than %zu bytes", sizeof r->conn->client - 1);
    return;
  }
  snprintf(r->conn->client, sizeof r->conn->client, "%s", client ? client : "");
  r->conn->accepts = accepts;
  r->conn->accepts_listed = cJSON_GetObjectItemCaseSensitive(r->root, "handles") != NULL;
  r->conn->features = features;
  r->conn->hello_done = true;
  cJSON *rep = msg_reply_ok(r->id);
  json_u64_add(rep, "protocol", WEIGHTD_PROTOCOL_VERSION);
  msg_add_string(rep, "version", weightd_version_string());
  msg_add_string(rep, "backend", d->backend_name);
  json_u64_add(rep, "pid", (uint64_t)getpid());
  cJSON *devs = cJSON_AddArrayToObject(rep, "devices");
  for (int i = 0; i < d->ndevices; i++) cJSON_AddItemToArray(devs, ops_device_json(d, i));
  cJSON *feats = cJSON_AddArrayToObject(rep, "features");
  for (int f = 0; f < WD_FEATURE_COUNT; f++)
    cJSON_AddItemToArray(feats, cJSON_CreateString(wd_feature_name((enum wd_feature)f)));
  req_reply(r, rep, NULL, 0);
}

/* The request called text ("r42") in status, started or queued, on any connection; NULL if none. */
static struct request *request_by_serial(const struct conn *self, const char *text) {
  uint64_t serial = 0;
  if (text[0] != 'r' || text[1] < '1' || text[1] > '9' || strlen(text) > 20) return NULL;
  for (const char *p = text + 1; *p != '\0'; p++) {
    if (*p < '0' || *p > '9') return NULL;
    serial = serial * 10 + (uint64_t)(*p - '0');
  }
  for (struct conn *c = self->ops->first(self); c != NULL; c = c->next) {
    for (struct request *t = c->requests; t != NULL; t = t->next_in_conn)
      if (t->serial == serial) return t;
    for (struct request *t = c->queued; t != NULL; t = t->next_in_conn)
      if (t->serial == serial) return t;
  }
  return NULL;
}

/* cancel {"request": "r42"}: any connection's request, for the same uid, root, the daemon's uid or admin_gids. */
static void cancel_by_serial(struct request *r, const char *rid) {
  struct request *t = request_by_serial(r->conn, rid);
  if (t == NULL || t == r || t->done) {
    req_fail(r, WEIGHTD_E_NOT_FOUND, "no request '%.40s' in progress (status lists them under 'requests')", rid);
    return;
  }
  if (t->conn->uid != r->conn->uid && !ops_is_admin(r->conn)) {
    req_fail(r, WEIGHTD_E_PERMISSION,
             "request %s belongs to uid %d: only that uid, root, the daemon's uid or a member of admin_gids may cancel it",
             rid, (int)t->conn->uid);
    return;
  }
  int op = t->op;
  pid_t pid = t->conn->pid;
  bool canceled;
  if (!t->started && t->conn->ops->dequeue(t->conn, t)) {
    req_fail(t, WEIGHTD_E_CANCELED, "canceled before it started (by pid %d)", (int)r->conn->pid);
    canceled = true;
  } else {
    canceled = ops_sets_cancel(t);
  }
  if (canceled)
    log_msg(LOG_INFO, "request %s (%s of pid %d) canceled by pid %d", rid, msg_op_name(op), (int)pid,
            (int)r->conn->pid);
  cJSON *rep = msg_reply_ok(r->id);
  cJSON_AddBoolToObject(rep, "canceled", canceled);
  msg_add_string(rep, "request", rid);
  msg_add_string(rep, "op", msg_op_name(op));
  req_reply(r, rep, NULL, 0);
}

static void op_cancel(struct request *r) {
  const cJSON *target = cJSON_GetObjectItemCaseSensitive(r->root, "target");
  const char *rid;
  if (!ops_str_arg(r, "request", false, &rid)) return;
  if (rid != NULL && target != NULL) {
    req_fail(r, WEIGHTD_E_BAD_REQUEST,
             "give 'target' (the id of a request on this connection) or 'request' (a daemon-wide id), not both");
    return;
  }
  if (rid != NULL) {
    cancel_by_serial(r, rid);
    return;
  }
  if (target == NULL || !(cJSON_IsString(target) || cJSON_IsNumber(target))) {
    req_fail(r, WEIGHTD_E_BAD_REQUEST,
             "field 'target' must be the id of a request on this connection (or give 'request', a daemon-wide id "
             "from status)");
    return;
  }
  bool canceled = false;
  struct request *q = conn_unqueue(r->conn, target);
  if (q != NULL) { /* read but not started: it never runs */
    req_fail(q, WEIGHTD_E_CANCELED, "canceled before it started");
    canceled = true;
  }
  for (struct request *t = r->conn->requests; !canceled && t != NULL; t = t->next_in_conn) {
    if (t == r || t->id == NULL || !msg_id_equal(t->id, target)) continue;
    canceled = ops_sets_cancel(t);
    break;
  }
  cJSON *rep = msg_reply_ok(r->id);
  cJSON_AddBoolToObject(rep, "canceled", canceled);
  req_reply(r, rep, NULL, 0);
}

static void op_release(struct request *r) {
  struct daemon *d = req_daemon(r);
  const char *id;
  if (!ops_str_arg(r, "lease", true, &id)) return;
  struct lease *l = res_find_lease(d->res, id);
  if (l == NULL) {
    req_fail(r, WEIGHTD_E_NOT_FOUND, "no lease %.64s", id);
    return;
  }
  if (l->holder.owner != r->conn) {
    if (!ops_is_admin(r->conn)) {
      req_fail(r, WEIGHTD_E_PERMISSION,
               "lease %s belongs to another connection: only root, the daemon's user or a member of admin_gids may "
               "release it",
               l->id);
      return;
    }
    log_msg(LOG_WARN, "lease %s of pid %d released by pid %d", l->id, (int)l->holder.pid, (int)r->conn->pid);
  }
  res_lease_drop(d->res, l);
  cJSON *rep = msg_reply_ok(r->id);
  cJSON_AddBoolToObject(rep, "released", 1);
  req_reply(r, rep, NULL, 0);
}

static void op_shutdown(struct request *r) {
  struct daemon *d = req_daemon(r);
  log_msg(LOG_INFO, "shutdown requested by pid %d", (int)r->conn->pid);
  cJSON *rep = msg_reply_ok(r->id);
  cJSON_AddBoolToObject(rep, "stopping", 1);
  req_reply(r, rep, NULL, 0);
  d->request_stop(d);
}

static void op_health(struct request *r) {
  char why[300];
  telemetry_refresh(req_daemon(r)); /* as GET /readyz does: else a client polling only here never sees a change */
  bool ready = telemetry_ready(req_daemon(r), why, sizeof why);
  cJSON *rep = msg_reply_ok(r->id);
  cJSON_AddBoolToObject(rep, "ready", ready);
  if (!ready) msg_add_string(rep, "reason", why);
  req_reply(r, rep, NULL, 0);
}

/*
 * A lease granted before a restart and re-adopted with its set comes back to
 * the process that held it: the peer's uid and pid (SO_PEERCRED) must be the
 * recorded holder's. Reclaiming one's own lease again is a no-op.
 */
static void op_reclaim(struct request *r) {
  struct daemon *d = req_daemon(r);
  const char *id;
  if (!ops_str_arg(r, "lease", true, &id)) return;
  struct lease *l = res_find_lease(d->res, id);
  if (l == NULL) {
    req_fail(r, WEIGHTD_E_NOT_FOUND, "no lease %.64s (it ended, was not re-adopted after the restart, or its grace "
                                     "period of restart_grace_ms passed)", id);
    return;
  }
  if (l->holder.owner != NULL && l->holder.owner != r->conn) {
    req_fail(r, WEIGHTD_E_PERMISSION, "lease %s is held by a live connection (pid %d); only leases re-adopted after "
                                      "a restart can be reclaimed", l->id, (int)l->holder.pid);
    return;
  }
  if (l->holder.uid != r->conn->uid || l->holder.pid != r->conn->pid) {
    req_fail(r, WEIGHTD_E_PERMISSION, "lease %s was granted to uid %u pid %d; this connection is uid %u pid %d",
             l->id, (unsigned)l->holder.uid, (int)l->holder.pid, (unsigned)r->conn->uid, (int)r->conn->pid);
    return;
  }
  if (l->holder.owner == NULL) log_msg(LOG_INFO, "lease %s of set %s reclaimed by pid %d", l->id, l->set->id, (int)r->conn->pid);
  l->holder.owner = r->conn;
  if (r->conn->client[0] != '\0') snprintf(l->holder.client, sizeof l->holder.client, "%s", r->conn->client);
  cJSON *rep = msg_reply_ok(r->id);
  msg_add_string(rep, "lease", l->id);
  msg_add_string(rep, "set", l->set->id);
  cJSON_AddBoolToObject(rep, "reclaimed", 1);
  req_reply(r, rep, NULL, 0);
}

/* ---- the table -------------------------------------------------------------------------- */

static void (*const handlers[MSG_OP_COUNT])(struct request *r) = {
    [MSG_OP_HELLO] = op_hello,       [MSG_OP_OPEN] = op_open,       [MSG_OP_CLOSE] = op_close,
    [MSG_OP_PREFETCH] = op_prefetch, [MSG_OP_LOAD] = op_load,       [MSG_OP_CANCEL] = op_cancel,
    [MSG_OP_ATTACH] = op_attach,     [MSG_OP_RELEASE] = op_release, [MSG_OP_EVICT] = op_evict,
    [MSG_OP_STATUS] = op_status,     [MSG_OP_SHUTDOWN] = op_shutdown, [MSG_OP_HEALTH] = op_health,
    [MSG_OP_LOAD_GROUP] = op_load_group,
    [MSG_OP_RECLAIM] = op_reclaim,   [MSG_OP_SCRUB] = op_scrub,
};

void ops_dispatch(struct request *r) {
  if (r->op < 0 || r->op >= MSG_OP_COUNT || handlers[r->op] == NULL) {
    req_fail(r, WEIGHTD_E_BAD_REQUEST, "unsupported op");
    return;
  }
  if ((msg_op_flags(r->op) & MSG_OPF_PRIVILEGED) && !conn_is_privileged(r->conn)) {
    req_fail(r, WEIGHTD_E_PERMISSION, "only root or the daemon's uid may %s", msg_op_name(r->op));
    return;
  }
  handlers[r->op](r);
}

void ops_request_gone(struct request *r) {
  if (ops_group_gone(r)) return;
  if (res_waiter_leave(&r->wait)) req_finish(r);
}

void ops_conn_gone(struct conn *c) { res_leases_drop_owner(c->d->res, c); }

bool ops_conn_holds_leases(const struct conn *c) { return res_owner_has_leases(c->d->res, c); }
