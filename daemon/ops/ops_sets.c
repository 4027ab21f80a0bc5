/*
 * ops_sets.c - the handlers of checkpoints and resident sets: open, close,
 * prefetch, load, attach and evict. Each hands the work to the registry or
 * residency with a continuation that builds the reply.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clock.h"
#include "handles.h"
#include "jsonutil.h"
#include "base/log.h"
#include "ops_common.h"
#include "base/sealed_memfd.h"
#include "sha256.h"
#include "tensor_table.h"

/* ---- open, close, prefetch ------------------------------------------------------------- */

static void open_ready(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct request *r = arg;
  if (ck == NULL) req_fail_err(r, err);
  else ops_reply_checkpoint(r, ck);
}

void op_open(struct request *r) {
  struct acc_cred who;
  const char *path = ops_path_arg(r);
  if (path != NULL) reg_acquire_as(req_daemon(r)->reg, path, r->conn->uid, ops_reader(r->conn, &who), open_ready, r);
}

/*
 * The answer to a client that is no admin when the checkpoint is not open,
 * and when it is open but the client may not read its files: the same, so
 * that close never tells whether a checkpoint the client may not read is
 * open (status hides those from it too; admins see them there).
 */
static void fail_not_open(struct request *r) {
  char q[320];
  const char *path = ops_path_arg(r); /* op_close checked it */
  req_fail(r, WEIGHTD_E_NOT_FOUND, "%s is not open, or not readable by uid %u",
           path != NULL ? err_quote(path, strlen(path), q, sizeof q) : "the path", (unsigned)r->conn->uid);
}

static void close_checked(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct request *r = arg;
  struct wd_error e = {0};
  struct acc_cred who;
  if (ck == NULL && err->code != WEIGHTD_E_NOMEM && ops_reader(r->conn, &who) != NULL && !ops_is_admin(r->conn)) {
    fail_not_open(r);
    return;
  }
  if (ck == NULL) {
    req_fail_err(r, err);
    return;
  }
  char *path = strdup(ck->path);
  reg_unref(ck); /* before reg_close, which counts who else holds it */
  if (path == NULL) {
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
  } else if (reg_close(req_daemon(r)->reg, path, &e) != 0) {
    req_fail_err(r, &e);
  } else {
    cJSON *rep = msg_reply_ok(r->id);
    cJSON_AddBoolToObject(rep, "closed", 1);
    msg_add_string(rep, "path", path);
    req_reply(r, rep, NULL, 0);
  }
  free(path);
}

static void close_resolved(void *arg, const char *resolved, const struct wd_error *err) {
  struct request *r = arg;
  struct wd_error e = {0};
  struct reg_ckpt *ck = resolved != NULL ? reg_find(req_daemon(r)->reg, resolved) : NULL;
  struct acc_cred who;
  char label[320];
  if (resolved == NULL) {
    req_fail_err(r, err);
  } else if (ck == NULL && ops_reader(r->conn, &who) != NULL && !ops_is_admin(r->conn)) {
    fail_not_open(r);
  } else if (ck == NULL) {
    reg_close(req_daemon(r)->reg, resolved, &e); /* NOT_FOUND: it is not open */
    req_fail_err(r, &e);
  } else {
    /* Closing one that is open is for those who may read it, as opening it is. */
    reg_check(req_daemon(r)->reg, ck, ops_reader(r->conn, &who), err_quote(resolved, strlen(resolved), label, sizeof label),
              REG_CHECK_PATHS, close_checked, r);
  }
}

/* close: resolved and checked against the model roots on a job thread (realpath touches the file system). */
void op_close(struct request *r) {
  struct acc_cred who;
  const char *path = ops_path_arg(r);
  if (path != NULL) reg_resolve(req_daemon(r)->reg, path, ops_reader(r->conn, &who), close_resolved, r);
}

/*
 * Progress events of a prefetch that is waited for: a timer per request reads
 * the registry's count every 100 ms and sends it when it moved. The timer
 * outlives its request only until its close completes.
 */
struct ops_ticker {
  uv_timer_t timer;
  struct request *req; /* NULL once the request is answered */
  uint64_t last;
};

static void ticker_closed(uv_handle_t *h) { free(h->data); }

static void on_tick(uv_timer_t *t) {
  struct ops_ticker *k = t->data;
  struct request *r = k->req;
  if (r == NULL || r->prefetch == NULL) return;
  uint64_t done, total;
  reg_prefetch_progress(r->prefetch, &done, &total);
  if (done == k->last && done != 0) return;
  k->last = done;
  req_progress(r, done, total);
}

/* Starts r's progress events (none when memory is short: the reply still comes). */
static void ticker_start(struct request *r) {
  struct ops_ticker *k = calloc(1, sizeof *k);
  if (k == NULL) return;
  uv_timer_init(req_daemon(r)->loop, &k->timer);
  k->timer.data = k;
  k->req = r;
  r->ticker = k;
  uv_timer_start(&k->timer, on_tick, 100, 100);
}

static void ticker_stop(struct request *r) {
  struct ops_ticker *k = r->ticker;
  if (k == NULL) return;
  r->ticker = NULL;
  k->req = NULL;
  uv_timer_stop(&k->timer);
  uv_close((uv_handle_t *)&k->timer, ticker_closed);
}

static void prefetched(void *arg, struct reg_ckpt *ck, const struct reg_prefetched *res, const struct wd_error *err) {
  struct request *r = arg;
  r->prefetch = NULL;
  ticker_stop(r);
  if (err != NULL) {
    req_fail_err(r, err);
    return;
  }
  cJSON *reply = msg_reply_ok(r->id);
  cJSON_AddItemToObject(reply, "checkpoint", ops_checkpoint_json(req_daemon(r), ck, res->resident));
  json_u64_add(reply, "registered_bytes", res->registered);
  cJSON_AddNumberToObject(reply, "read_seconds", res->read_seconds);
  cJSON_AddNumberToObject(reply, "pin_seconds", res->pin_seconds);
  req_reply(r, reply, NULL, 0);
}

/* Starts the prefetch of ranges (NULL: the whole checkpoint) and replies now or, with wait, when it is done. */
static void prefetch_start(struct request *r, struct reg_ckpt *ck, const struct plan_range *ranges, size_t n) {
  struct daemon *d = req_daemon(r);
  struct msg_obj o;
  bool wait = false, pin = false;
  struct wd_error e = {0};
  msg_get_bool(ops_args(r, &o), "wait", false, false, &wait, &e);
  msg_get_bool(ops_args(r, &o), "pin", false, false, &pin, &e);
  if (pin && (d->backend.ops->caps & WD_CAP_HOST_SLABS))
    log_msg(LOG_DEBUG, "%s: the %s backend reads host memory directly; nothing to pin", ck->path, d->backend_name);
  if (ck->prefetching && !wait && !pin && ranges == NULL) { /* a read of it is under way already */
    ops_reply_checkpoint(r, ck);
    return;
  }
  if (reg_prefetch_start(d->reg, ck, ranges, n, pin, wait ? prefetched : NULL, r, wait ? &r->prefetch : NULL, &e) !=
      0) {
    reg_unref(ck);
    req_fail_err(r, &e);
    return;
  }
  if (wait) {
    reg_unref(ck);
    req_args_free(r); /* a waiting prefetch keeps only its id */
    ticker_start(r);
  } else {
    ops_reply_checkpoint(r, ck);
  }
}

/* A prefetch with a plan: the plan is built and its byte ranges listed on a job (big checkpoints take a while). */
struct ranges_job {
  struct job job;
  struct request *req;
  struct reg_ckpt *ck;
  const cJSON *spec; /* in the request, which does not change */
  struct plan_range *ranges;
  size_t n;
  int rc;
  struct wd_error err;
};

static void ranges_work(struct job *j) {
  struct ranges_job *rj = (struct ranges_job *)j;
  struct plan *p = NULL;
  rj->rc = plan_build(rj->ck->ck, rj->spec, &p, &rj->err);
  if (rj->rc == 0) rj->rc = reg_plan_ranges(rj->ck, p, &rj->ranges, &rj->n, &rj->err);
  plan_free(p);
}

static void ranges_done(struct job *j) {
  struct ranges_job *rj = (struct ranges_job *)j;
  if (rj->rc == 0 && rj->req->canceled) {
    reg_unref(rj->ck);
    req_fail(rj->req, WEIGHTD_E_CANCELED, "prefetch canceled");
  } else if (rj->rc != 0) {
    reg_unref(rj->ck);
    req_fail_err(rj->req, &rj->err);
  } else if (rj->n == 0) { /* the plan reads nothing */
    ops_reply_checkpoint(rj->req, rj->ck);
  } else {
    prefetch_start(rj->req, rj->ck, rj->ranges, rj->n);
  }
  free(rj->ranges);
  free(rj);
}

static void prefetch_ready(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct request *r = arg;
  struct daemon *d = req_daemon(r);
  if (ck == NULL) {
    req_fail_err(r, err);
    return;
  }
  if (r->canceled) {
    reg_unref(ck);
    req_fail(r, WEIGHTD_E_CANCELED, "prefetch canceled");
    return;
  }
  const cJSON *spec = cJSON_GetObjectItemCaseSensitive(r->root, "plan");
  if (spec == NULL) {
    prefetch_start(r, ck, NULL, 0);
    return;
  }
  struct ranges_job *rj = calloc(1, sizeof *rj);
  if (rj == NULL) {
    reg_unref(ck);
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  rj->job.work = ranges_work;
  rj->job.done = ranges_done;
  rj->req = r;
  rj->ck = ck;
  rj->spec = spec;
  jobs_submit(d->control_pool, &rj->job);
}

void op_prefetch(struct request *r) {
  struct msg_obj o, plan;
  struct wd_error err = {0};
  bool b;
  if (msg_get_bool(ops_args(r, &o), "wait", false, false, &b, &err) < 0 ||
      msg_get_bool(ops_args(r, &o), "pin", false, false, &b, &err) < 0 ||
      msg_get_object(ops_args(r, &o), "plan", false, &plan, &err) < 0) {
    req_fail_err(r, &err);
    return;
  }
  struct acc_cred who;
  const char *path = ops_path_arg(r);
  if (path != NULL) reg_acquire_as(req_daemon(r)->reg, path, r->conn->uid, ops_reader(r->conn, &who), prefetch_ready, r);
}

/* ---- load and attach --------------------------------------------------------------------- */

static void reply_loaded(struct request *r, struct res_set *s, bool shared) {
  struct daemon *d = req_daemon(r);
  struct wd_error err = {0};
  if (s->ncorrupt > 0) { /* resident, but a scrub found it changed: not what the caller asked for */
    res_set_corrupt_error(s, &err);
    req_fail_err(r, &err);
    return;
  }
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
  msg_add_string(rep, "method", res_set_method(s));
  ops_multi_set_fields(d, s, rep);
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

/* Writes the names of the kinds in mask into buf: "fd, cuda_ipc" ("none" when empty). */
static void kinds_text(unsigned mask, char *buf, size_t len) {
  size_t n = 0;
  buf[0] = '\0';
  for (int k = 0; k < WD_HANDLE_KIND_COUNT; k++) {
    if (!(mask & WD_HANDLE_BIT(k))) continue;
    int w = snprintf(buf + n, len - n, "%s%s", n ? ", " : "", wd_handle_kind_name((enum wd_handle_kind)k));
    if (w < 0 || (size_t)w >= len - n) break;
    n += (size_t)w;
  }
  if (n == 0) snprintf(buf, len, "none");
}

/*
 * Refuses an attach whose set's handle kind the client did not accept in
 * hello, before any descriptor or lease is made: UNSUPPORTED, naming both
 * sides and, for GPU sets, the daemon setting that decides the kind.
 */
static bool handle_accepted(struct request *r, const struct res_set *s) {
  enum wd_handle_kind kind = s->load.slab->kind;
  if (r->conn->accepts & WD_HANDLE_BIT(kind)) return true;
  char accepted[96];
  kinds_text(r->conn->accepts, accepted, sizeof accepted);
  const char *hint = "";
  if (kind == WD_HANDLE_CUDA_VMM && (r->conn->accepts & WD_HANDLE_BIT(WD_HANDLE_CUDA_IPC)))
    hint = "; update the client library (libweightd opens cuda_vmm handles), or run the daemon with "
           "\"cuda_handles\": \"legacy\" (a restart; a set keeps the kind it was loaded with until it is evicted)";
  else if (kind == WD_HANDLE_CUDA_IPC && (r->conn->accepts & WD_HANDLE_BIT(WD_HANDLE_CUDA_VMM)))
    hint = "; run the daemon with \"cuda_handles\": \"vmm\" (a restart; a set keeps the kind it was loaded with "
           "until it is evicted)";
  req_fail(r, WEIGHTD_E_UNSUPPORTED, "set %s is shared through %s handles, which this client does not accept (%s: %s)%s",
           s->id, wd_handle_kind_name(kind),
           r->conn->accepts_listed ? "its hello accepts" : "its hello lists no \"handles\", which means", accepted,
           hint);
  return false;
}

/* A duplicate of fd for a reply, or -1 with err set. */
static int dup_for_reply(int fd, const char *what, struct wd_error *err) {
  int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) err_set(err, WEIGHTD_E_LIMIT, "duplicating the %s descriptor: %s", what, strerror(errno));
  return d;
}

/* {"fd_index": i, "bytes": n, "version": v}, the descriptor of a reply's table or page. */
static cJSON *fd_object(size_t index, uint64_t bytes, unsigned version) {
  cJSON *o = cJSON_CreateObject();
  json_u64_add(o, "fd_index", index);
  json_u64_add(o, "bytes", bytes);
  json_u64_add(o, "version", version);
  return o;
}

/*
 * Leases a ready set (or, for an early attach, a loading one whose memory
 * may be shared) to the request's connection and replies with its handle,
 * its tensor table (binary for clients that asked for "tensor_table" in
 * hello, else JSON) and, for an early attach, its progress page. The
 * reply's descriptors, in fd_index order: the slab's (when its kind has
 * one), the table's, the page's.
 */
static void reply_attached(struct request *r, struct res_set *s) {
  struct daemon *d = req_daemon(r);
  const struct wd_backend *b = &d->backend;
  struct wd_error err = {0};
  if (!handle_accepted(r, s)) return;
  bool binary = (r->conn->features & WD_FEATURE_BIT(WD_FEATURE_TENSOR_TABLE)) != 0;
  /* Early attachers follow the load on it; others that asked for it see a scrub's corrupt flag there. */
  bool page = s->page_fd >= 0 && (r->early || (r->conn->features & WD_FEATURE_BIT(WD_FEATURE_PROGRESS_PAGE)) != 0);
  const char *table = NULL;
  int rc = binary ? res_set_table_fd(s, &err) : (table = attach_table(s)) == NULL ? err_set(&err, WEIGHTD_E_NOMEM, "out of memory") : 0;
  if (rc != 0) {
    req_fail_err(r, &err);
    return;
  }
  /*
   * The reply's descriptors must stay within what connections and replies may
   * hold (daemon_fd_budget: room to accept, root too), and leave the daemon
   * room to work beside the descriptors its sets hold.
   */
  size_t want = (size_t)wd_handle_kind_has_fd(s->load.slab->kind) + binary + page;
  uint64_t held = d->stats.connections + d->stats.fds_queued + d->cfg.reserved_connections + want;
  if (want > 0 && (held > daemon_fd_budget(d) ||
                   (d->stats.fd_limit > 0 && held + 64 + res_set_fds(d->res) >= d->stats.fd_limit))) {
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
  int fds[3];
  size_t nfds = 0;
  if (wd_handle_kind_has_fd(h.kind)) fds[nfds++] = h.fd;
  size_t table_index = nfds, page_index = nfds + binary;
  if (binary && (fds[nfds] = dup_for_reply(s->table_fd, "tensor table", &err)) >= 0) nfds++;
  if (page && err.code == 0 && (fds[nfds] = dup_for_reply(s->page_fd, "progress page", &err)) >= 0) nfds++;
  struct lease_holder holder = {.owner = r->conn, .pid = r->conn->pid, .uid = r->conn->uid};
  snprintf(holder.client, sizeof holder.client, "%s", r->conn->client);
  struct lease *l;
  if (err.code != 0 || res_lease_add(d->res, s, &holder, &l, &err) != 0) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    req_fail_err(r, &err);
    return;
  }
  cJSON *rep = msg_reply_ok(r->id);
  msg_add_string(rep, "set", s->id);
  msg_add_string(rep, "lease", l->id);
  msg_add_string(rep, "device", res_device(d->res, s->device)->info.uuid);
  json_u64_add(rep, "bytes", s->plan->slab_bytes);
  if (r->early) msg_add_string(rep, "state", s->state == SET_READY ? "ready" : "loading");
  cJSON *handles = cJSON_AddArrayToObject(rep, "handles");
  cJSON *ho = cJSON_CreateObject();
  msg_add_string(ho, "kind", wd_handle_kind_name(h.kind));
  if (wd_handle_kind_has_fd(h.kind)) json_u64_add(ho, "fd_index", 0);
  if (h.kind == WD_HANDLE_CUDA_IPC) {
    char hex[2 * WD_IPC_HANDLE_BYTES + 1];
    msg_hex_encode(h.ipc, WD_IPC_HANDLE_BYTES, hex);
    msg_add_string(ho, "handle", hex);
  } else if (h.kind == WD_HANDLE_CUDA_VMM) {
    char hex[2 * WD_ALLOC_ID_BYTES + 1];
    msg_hex_encode(h.alloc_id, WD_ALLOC_ID_BYTES, hex);
    msg_add_string(ho, "alloc_id", hex);
  }
  json_u64_add(ho, "bytes", h.bytes);
  cJSON_AddItemToArray(handles, ho);
  json_u64_add(rep, "tensor_count", s->plan->noutputs);
  if (binary) cJSON_AddItemToObject(rep, "tensor_table", fd_object(table_index, s->table_bytes, TTAB_VERSION));
  else cJSON_AddItemToObject(rep, "tensors", cJSON_CreateRaw(table));
  if (page) cJSON_AddItemToObject(rep, "progress", fd_object(page_index, WD_PAGE_BYTES, WD_PAGE_VERSION));
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
  r->wait.early = r->op == MSG_OP_ATTACH && r->early;
  r->wait.uid = r->conn->uid;
}

bool ops_sets_cancel(struct request *t) {
  if (t->op == MSG_OP_PREFETCH) {
    /* A running read stops between chunks and answers CANCELED; one still opening answers when opened. */
    if (t->prefetch != NULL) reg_prefetch_cancel(t->prefetch);
    else t->canceled = true;
    return true;
  }
  if (t->op == MSG_OP_LOAD_GROUP) return ops_group_cancel(t);
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

/*
 * A load's plan, on job threads: first the spec's digest, which the loop
 * looks up in the checkpoint's plan memo (a resident set of the same spec is
 * then joined without building the plan: plan_reuse); else the plan is built
 * (big checkpoints take a while), its key remembered under the digest, and
 * the set found or loaded.
 */
enum plan_step { PLAN_DIGEST, PLAN_BUILD };

struct plan_job {
  struct job job;
  struct request *req;
  struct reg_ckpt *ck;
  const cJSON *spec; /* in the request, which does not change */
  enum plan_step stage;
  unsigned char digest[REG_SPEC_DIGEST]; /* of spec (spec_digest) */
  bool digested;
  int device;
  enum ld_source_choice source;
  struct plan *plan;
  int rc;
  struct wd_error err;
};

/* SHA-256 of the plan object as printed compactly ("null" when there is none); false when memory runs out. */
static bool spec_digest(const cJSON *spec, unsigned char out[REG_SPEC_DIGEST]) {
  char *text = spec != NULL ? cJSON_PrintUnformatted(spec) : NULL;
  if (spec != NULL && text == NULL) return false;
  struct sha256 h;
  sha256_init(&h);
  sha256_update(&h, text != NULL ? text : "null", text != NULL ? strlen(text) : 4);
  sha256_final(&h, out);
  free(text);
  return true;
}

static void plan_work(struct job *j) {
  struct plan_job *pj = (struct plan_job *)j;
  if (pj->stage == PLAN_DIGEST) pj->digested = spec_digest(pj->spec, pj->digest);
  else pj->rc = plan_build(pj->ck->ck, pj->spec, &pj->plan, &pj->err);
}

static bool plan_reuse(struct request *r, struct plan_job *pj);

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
  } else if (pj->stage == PLAN_DIGEST) {
    pj->stage = PLAN_BUILD;
    if (!plan_reuse(r, pj)) jobs_submit(req_daemon(r)->control_pool, &pj->job);
    return;
  } else {
    if (pj->digested) reg_plan_key_remember(pj->ck, pj->digest, pj->plan->key);
    req_args_free(r); /* a waiting load keeps only its id: joiners of a slow load hold no request text */
    wait_init(r);
    res_load(req_daemon(r)->res, pj->ck, pj->device, pj->plan, pj->source, &r->wait);
  }
  free(pj);
}

/*
 * A set of ck on device whose plan key the memo gave for this spec, resident
 * or loading: r waits for it as an identical load would, without the plan
 * being built again (ck's files were checked unchanged by the acquire).
 * False when there is none (then the plan is built).
 */
static bool plan_reuse(struct request *r, struct plan_job *pj) {
  struct daemon *d = req_daemon(r);
  const char *key = pj->digested ? reg_plan_key_find(pj->ck, pj->digest) : NULL;
  struct res_set *s = key != NULL ? res_find_plan(d->res, pj->ck, pj->device, key) : NULL;
  if (s == NULL) return false;
  reg_plan_reused(pj->ck);
  reg_unref(pj->ck); /* the set holds its own */
  free(pj);
  req_args_free(r);
  wait_init(r);
  res_wait(d->res, s, &r->wait);
  return true;
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
  bool given;
  enum ld_source_choice asked = LD_CHOOSE_AUTO;
  ops_source_arg(r, &given, &asked, &e); /* op_load checked it */
  pj->source = ops_load_source(d, ck, given, asked);
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
  bool given;
  enum ld_source_choice source;
  if (ops_source_arg(r, &given, &source, &err) != 0) {
    req_fail_err(r, &err);
    return;
  }
  struct acc_cred who;
  reg_acquire_as(req_daemon(r)->reg, path, r->conn->uid, ops_reader(r->conn, &who), load_ready, r);
}

/* An attach by set id once the requester's access to the set's files is checked. */
static void attach_checked(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
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
  if (r->canceled) {
    req_fail(r, WEIGHTD_E_CANCELED, "canceled");
  } else if (r->conn->closed) { /* nobody to attach for */
    req_finish(r);
  } else if (!checked) {
    req_fail(r, WEIGHTD_E_NOT_FOUND, "no resident set '%.64s'", id->valuestring);
  } else {
    req_args_free(r); /* the set id is in the request: not used past here; a waiting attach keeps only its id */
    wait_init(r);
    res_wait(d->res, s, &r->wait); /* a loading set: wait like an identical load would */
  }
}

void op_attach(struct request *r) {
  const char *set_id;
  struct msg_obj o;
  struct wd_error err = {0};
  if (msg_get_bool(ops_args(r, &o), "early", false, false, &r->early, &err) < 0) {
    req_fail_err(r, &err);
    return;
  }
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
  ops_set_check(r, s, attach_checked);
}

/* ---- evict ---------------------------------------------------------------------------------- */

static void evicted(void *arg, char *const *ids, size_t n) {
  struct request *r = arg;
  cJSON *rep = msg_reply_ok(r->id);
  cJSON *list = cJSON_AddArrayToObject(rep, "evicted");
  for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(list, cJSON_CreateString(ids[i]));
  req_reply(r, rep, NULL, 0);
}

/*
 * Appends who holds a leased set's leases to a BUSY message: each lease's
 * id, the holder's pid and uid (from SO_PEERCRED), the client name its hello
 * gave (self-reported) and its age, and how to end it.
 */
static void busy_holders(struct daemon *d, const char *set_id, struct wd_error *err) {
  struct res_set *s = res_find_set(d->res, set_id);
  if (s == NULL || s->leases == 0) return;
  size_t len = strlen(err->msg);
  const char *sep = ": ";
  unsigned shown = 0;
  uint64_t now = clock_ms();
  for (struct lease *l = res_first_lease(d->res); l != NULL && len < sizeof err->msg - 1; l = l->next) {
    if (l->set != s) continue;
    if (shown++ == 4) {
      snprintf(err->msg + len, sizeof err->msg - len, "; and %d more", s->leases - 4);
      len = strlen(err->msg);
      break;
    }
    char client[96] = "";
    if (l->holder.client[0] != '\0') snprintf(client, sizeof client, ", client '%s' (self-reported)", l->holder.client);
    snprintf(err->msg + len, sizeof err->msg - len, "%slease %s held by pid %d uid %u%s for %.0f s", sep, l->id,
             (int)l->holder.pid, (unsigned)l->holder.uid, client, (double)(now - l->created_ms) / 1000.0);
    len = strlen(err->msg);
    sep = "; ";
  }
  snprintf(err->msg + len, sizeof err->msg - len,
           " (the holder releases it, or root or the daemon's user: weightctl release LEASE)");
}

/* Whether the requester may evict set s: its loader, root, the daemon's user or a member of admin_gids. */
static bool may_evict(void *arg, const struct res_set *s) {
  const struct request *r = arg;
  return s->loader_uid == r->conn->uid || ops_is_admin(r->conn);
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
  const struct res_set *s = set_id != NULL ? res_find_set(d->res, set_id) : NULL;
  if (s != NULL && !may_evict(r, s)) {
    req_fail(r, WEIGHTD_E_PERMISSION,
             "set %s was loaded by %s: only that user, root, the daemon's user or a member of admin_gids may evict it",
             s->id, s->loader_uid == (uid_t)-1 ? "an earlier daemon (re-adopted)" : "another user");
    return;
  }
  if (res_evict(d->res, set_id, device, may_evict, r, evicted, r, &err) != 0) {
    if (err.code == WEIGHTD_E_BUSY && set_id != NULL) busy_holders(d, set_id, &err);
    req_fail_err(r, &err);
  }
}
