/*
 * ops_multi.c - several devices in the protocol: the load_group op (every
 * rank of a tensor/expert-parallel group, each onto its device, at once) and
 * the JSON views of the topology, of where a set's bytes came from and of
 * a striped load's links.
 *
 * A group is planned on a control job (every rank's plan, before any byte
 * moves: a plan that does not fit fails the whole group), then each rank is
 * a res_load with its own waiter, so ranks on different devices load
 * concurrently and share the fill threads fairly. The reply waits for every
 * rank; progress events sum the ranks and list each.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "jsonutil.h"
#include "base/log.h"
#include "load/loader.h"
#include "ops_common.h"
#include "base/topology.h"

/* The largest group: ranks of one load_group. */
#define GROUP_MAX_RANKS 256
/* Progress events of a group are sent at most this often. */
#define GROUP_PROGRESS_MS 100

/* ---- views ------------------------------------------------------------------------------- */

void ops_multi_device_fields(const struct daemon *d, int i, cJSON *o) {
  const struct topology *t = d->topo;
  if (t == NULL) return;
  cJSON_AddNumberToObject(o, "numa_node", t->dev[i].numa_node);
  if (t->dev[i].pci[0] != '\0') msg_add_string(o, "pci_bus_id", t->dev[i].pci);
  cJSON_AddNumberToObject(o, "link_rate", t->dev[i].link_rate);
  cJSON_AddBoolToObject(o, "link_rate_measured", t->rates_measured);
  cJSON *peers = cJSON_AddArrayToObject(o, "peers");
  for (int j = 0; j < t->ndev; j++) {
    if (j == i) continue;
    const struct wd_peer_info *p = topo_peer(t, i, j);
    cJSON *e = cJSON_CreateObject();
    json_u64_add(e, "index", (uint64_t)j);
    msg_add_string(e, "uuid", res_device(d->res, j)->info.uuid);
    cJSON_AddBoolToObject(e, "access", p->access);
    msg_add_string(e, "link", wd_link_name(p->link));
    cJSON_AddNumberToObject(e, "performance_rank", p->performance_rank);
    cJSON_AddItemToArray(peers, e);
  }
}

/* "host", or "peer:<uuid>" of the device whose copy was copied. */
static void source_text(const struct daemon *d, const struct ld_target *t, char *buf, size_t len) {
  if (t->source_device >= 0) snprintf(buf, len, "peer:%s", res_device(d->res, t->source_device)->info.uuid);
  else snprintf(buf, len, "host");
}

/*
 * Adds "source" (host memory or a peer's copy), what host bytes were read
 * through ("read_from", with "read_bytes" per leaf source) and, for a
 * striped load, "links": [{"device", "offset", "bytes"}], to o.
 */
static void add_origin(const struct daemon *d, const struct ld_target *t, cJSON *o) {
  char src[WD_UUID_MAX + 8];
  source_text(d, t, src, sizeof src);
  msg_add_string(o, "source", src);
  if (t->source[0] != '\0') {
    msg_add_string(o, "read_from", t->source);
    cJSON *rb = cJSON_AddObjectToObject(o, "read_bytes");
    for (int k = 0; k < LD_SOURCE_KINDS; k++) {
      uint64_t n = atomic_load(&t->source_bytes[k]);
      if (n > 0) json_u64_add(rb, ld_source_kind_name((enum ld_source_kind)k), n);
    }
  }
  if (t->nshares == 0) return;
  cJSON *links = cJSON_AddArrayToObject(o, "links");
  for (size_t i = 0; i < t->nshares; i++) {
    cJSON *e = cJSON_CreateObject();
    msg_add_string(e, "device", res_device(d->res, t->shares[i].device)->info.uuid);
    json_u64_add(e, "offset", t->shares[i].lo);
    json_u64_add(e, "bytes", t->shares[i].hi - t->shares[i].lo);
    cJSON_AddItemToArray(links, e);
  }
}

/*
 * Adds what a load in flight reads from, as far as its load has told: "source"
 * (host memory, or "peer:<uuid>" while it copies a peer's copy) and "reading"
 * (the kind of host source it reads through) once it has chosen, and
 * "read_bytes" (file bytes read so far, per leaf source), to o.
 */
static void add_reading(const struct daemon *d, const struct ld_target *t, cJSON *o) {
  int kind = atomic_load(&t->reading_kind), peer = atomic_load(&t->reading_device);
  if (peer >= 0 && peer < d->ndevices) {
    char src[WD_UUID_MAX + 8];
    snprintf(src, sizeof src, "peer:%s", res_device(d->res, peer)->info.uuid);
    msg_add_string(o, "source", src);
  } else if (kind >= 0) {
    msg_add_string(o, "source", "host");
    msg_add_string(o, "reading", ld_source_kind_name((enum ld_source_kind)kind));
  }
  cJSON *rb = cJSON_AddObjectToObject(o, "read_bytes");
  for (int k = 0; k < LD_SOURCE_KINDS; k++) {
    uint64_t n = atomic_load(&t->source_bytes[k]);
    if (n > 0) json_u64_add(rb, ld_source_kind_name((enum ld_source_kind)k), n);
  }
}

void ops_multi_set_fields(const struct daemon *d, const struct res_set *s, cJSON *o) {
  if (s->state == SET_READY) add_origin(d, &s->load, o);
  else if (s->state == SET_LOADING) add_reading(d, &s->load, o);
}

cJSON *ops_multi_topology_json(const struct daemon *d) {
  cJSON *o = cJSON_CreateObject();
  const struct topology *t = d->topo;
  /* active: several devices and a backend with peer copies; else replicas and striping have nothing to do. */
  cJSON_AddBoolToObject(o, "active", ld_has_peers(d->ld));
  msg_add_string(o, "replicas", config_enum_name(&d->cfg, "replicas"));
  msg_add_string(o, "striping", config_enum_name(&d->cfg, "striping"));
  json_u64_add(o, "stripe_min_bytes", d->cfg.stripe_min_bytes);
  cJSON_AddBoolToObject(o, "link_rates_measured", t != NULL && t->rates_measured);
  msg_add_string(o, "numa", config_enum_name(&d->cfg, "numa"));
  cJSON *nodes = cJSON_AddArrayToObject(o, "numa_nodes");
  for (size_t k = 0; t != NULL && k < t->numa.n; k++) {
    const struct numa_node *n = &t->numa.nodes[k];
    unsigned threads = 0;
    for (unsigned i = 0; i + 1 < ld_pool_threads(d->fill); i++) threads += ld_pool_thread_node(d->fill, i) == n->id;
    cJSON *e = cJSON_CreateObject();
    json_u64_add(e, "node", (uint64_t)n->id);
    json_u64_add(e, "cpus", n->ncpus);
    json_u64_add(e, "fill_threads", threads);
    cJSON_AddItemToArray(nodes, e);
  }
  cJSON *busy = cJSON_AddArrayToObject(o, "busy");
  for (int i = 0; i < d->ndevices; i++) cJSON_AddItemToArray(busy, cJSON_CreateNumber(ld_busy(d->ld, i)));
  return o;
}

/* ---- load_group ------------------------------------------------------------------------------ */

struct ops_group;

/* One rank: its plan and waiter, then what its load gave (copied: the set may be evicted before the reply). */
struct group_rank {
  struct res_waiter wait;
  struct ops_group *g;
  unsigned tp_rank, ep_rank;
  int device;
  struct plan *plan; /* until res_load takes it */
  bool done;
  int rc;
  struct wd_error err;
  uint64_t bytes_done, bytes_total;
  cJSON *result; /* the rank's reply entry, built when it finished */
};

struct ops_group {
  struct job job; /* the planning job */
  struct request *req;
  struct reg_ckpt *ck;
  unsigned tp_size, ep_size, nranks;
  struct group_rank *ranks;
  cJSON *base;       /* the plan object without ranks (a copy) */
  bool source_given; /* the request named a source */
  enum ld_source_choice source;
  unsigned pending;  /* ranks not finished */
  bool starting;     /* res_load calls are being made (a rank may finish inside one) */
  bool planning;     /* the planning job holds the group */
  int plan_rc;
  struct wd_error plan_err;
  uint64_t started_ms, last_progress_ms;
};

static void group_free(struct ops_group *g) {
  for (unsigned i = 0; i < g->nranks; i++) {
    plan_free(g->ranks[i].plan);
    cJSON_Delete(g->ranks[i].result);
  }
  if (g->ck != NULL) reg_unref(g->ck);
  cJSON_Delete(g->base);
  free(g->ranks);
  free(g);
}

/* Detaches the group from its request and frees it. */
static void group_end(struct ops_group *g) {
  if (g->req != NULL) g->req->group = NULL;
  group_free(g);
}

static struct group_rank *rank_of(struct res_waiter *w) {
  return (struct group_rank *)((char *)w - offsetof(struct group_rank, wait));
}

static void rank_name(const struct ops_group *g, const struct group_rank *k, char *buf, size_t len) {
  snprintf(buf, len, "rank %u (tp_rank %u of %u, ep_rank %u of %u) on device %d", (unsigned)(k - g->ranks),
           k->tp_rank, g->tp_size, k->ep_rank, g->ep_size, k->device);
}

/* The reply once every rank finished: ok with each rank's set, or the first failure with every rank's result. */
static void group_reply(struct ops_group *g) {
  struct request *r = g->req;
  struct daemon *d = req_daemon(r);
  const struct group_rank *failed = NULL;
  uint64_t bytes = 0;
  for (unsigned i = 0; i < g->nranks; i++) {
    if (g->ranks[i].rc != 0 && failed == NULL) failed = &g->ranks[i];
    bytes += g->ranks[i].bytes_total;
  }
  cJSON *rep;
  if (failed != NULL) {
    char who[96], msg[WD_ERROR_MSG_MAX];
    rank_name(g, failed, who, sizeof who);
    snprintf(msg, sizeof msg, "%s: %s", who, failed->err.msg);
    daemon_count_error(d, failed->rc);
    rep = msg_reply_error(r->id, failed->rc, msg);
  } else {
    rep = msg_reply_ok(r->id);
    double secs = (double)(clock_ms() - g->started_ms) / 1000.0;
    json_u64_add(rep, "bytes", bytes);
    cJSON_AddNumberToObject(rep, "seconds", secs);
    cJSON_AddNumberToObject(rep, "gib_per_s", secs > 0 ? (double)bytes / (double)(1ull << 30) / secs : 0);
  }
  cJSON *grp = cJSON_AddObjectToObject(rep, "group");
  json_u64_add(grp, "tp_size", g->tp_size);
  json_u64_add(grp, "ep_size", g->ep_size);
  json_u64_add(grp, "ranks", g->nranks);
  cJSON *ranks = cJSON_AddArrayToObject(rep, "ranks");
  for (unsigned i = 0; i < g->nranks; i++) {
    cJSON_AddItemToArray(ranks, g->ranks[i].result);
    g->ranks[i].result = NULL;
  }
  g->req = NULL;
  r->group = NULL;
  req_reply(r, rep, NULL, 0);
  group_free(g);
}

/* A rank finished (or failed): keep its result; the last one replies. */
static void rank_done(struct res_waiter *w, struct res_set *s, bool joined, const struct wd_error *err) {
  struct group_rank *k = rank_of(w);
  struct ops_group *g = k->g;
  struct daemon *d = req_daemon(g->req);
  k->done = true;
  struct wd_error corrupt = {0};
  if (s != NULL && s->ncorrupt > 0) { /* resident, but a scrub found it changed: this rank fails as a load would */
    res_set_corrupt_error(s, &corrupt);
    s = NULL;
    err = &corrupt;
  }
  cJSON *e = cJSON_CreateObject();
  json_u64_add(e, "rank", (uint64_t)(k - g->ranks));
  json_u64_add(e, "tp_rank", k->tp_rank);
  json_u64_add(e, "ep_rank", k->ep_rank);
  msg_add_string(e, "device", res_device(d->res, k->device)->info.uuid);
  if (s == NULL) {
    k->rc = err->code ? err->code : WEIGHTD_E_INTERNAL;
    k->err = *err;
    cJSON *eo = cJSON_AddObjectToObject(e, "error");
    msg_add_string(eo, "code", weightd_err_name(k->rc));
    msg_add_string(eo, "message", err->msg);
  } else {
    k->bytes_done = k->bytes_total = s->plan->slab_bytes;
    msg_add_string(e, "set", s->id);
    json_u64_add(e, "bytes", s->plan->slab_bytes);
    json_u64_add(e, "payload_bytes", s->plan->payload_bytes);
    json_u64_add(e, "tensors", s->plan->noutputs);
    cJSON_AddNumberToObject(e, "seconds", s->seconds);
    cJSON_AddNumberToObject(e, "gib_per_s",
                            s->seconds > 0 ? (double)s->plan->payload_bytes / (double)(1ull << 30) / s->seconds : 0);
    cJSON_AddBoolToObject(e, "shared", joined);
    msg_add_string(e, "method", res_set_method(s));
    add_origin(d, &s->load, e);
  }
  k->result = e;
  if (--g->pending == 0 && !g->starting) group_reply(g);
}

/* Progress: the ranks' sum, and each rank's, at most every GROUP_PROGRESS_MS. */
static void rank_progress(struct res_waiter *w, uint64_t done, uint64_t total) {
  struct group_rank *k = rank_of(w);
  struct ops_group *g = k->g;
  k->bytes_done = done;
  k->bytes_total = total;
  uint64_t now = clock_ms();
  if (g->req == NULL || g->req->conn->closed || now - g->last_progress_ms < GROUP_PROGRESS_MS) return;
  g->last_progress_ms = now;
  uint64_t sum_done = 0, sum_total = 0;
  cJSON *ranks = cJSON_CreateArray();
  for (unsigned i = 0; i < g->nranks; i++) {
    sum_done += g->ranks[i].bytes_done;
    sum_total += g->ranks[i].bytes_total;
    cJSON *e = cJSON_CreateObject();
    json_u64_add(e, "bytes_done", g->ranks[i].bytes_done);
    json_u64_add(e, "bytes_total", g->ranks[i].bytes_total);
    cJSON_AddItemToArray(ranks, e);
  }
  cJSON *ev = msg_event_progress(g->req->id, sum_done, sum_total);
  if (ev == NULL) {
    cJSON_Delete(ranks);
    return;
  }
  cJSON_AddItemToObject(ev, "ranks", ranks);
  conn_send(g->req->conn, ev, NULL, 0);
}

/* Every rank's plan: the base plan object with the rank's sizes and ranks added. */
static void group_plan_work(struct job *j) {
  struct ops_group *g = (struct ops_group *)j;
  for (unsigned i = 0; i < g->nranks && g->plan_rc == 0; i++) {
    struct group_rank *k = &g->ranks[i];
    cJSON *spec = cJSON_Duplicate(g->base, 1);
    if (spec == NULL) {
      g->plan_rc = err_set(&g->plan_err, WEIGHTD_E_NOMEM, "out of memory");
      break;
    }
    if (g->tp_size > 1) {
      cJSON_AddNumberToObject(spec, "tp_size", g->tp_size);
      cJSON_AddNumberToObject(spec, "tp_rank", k->tp_rank);
    }
    if (g->ep_size > 1) {
      cJSON_AddNumberToObject(spec, "ep_size", g->ep_size);
      cJSON_AddNumberToObject(spec, "ep_rank", k->ep_rank);
    }
    g->plan_rc = plan_build(g->ck->ck, spec, &k->plan, &g->plan_err);
    cJSON_Delete(spec);
    if (g->plan_rc != 0) {
      char who[96];
      rank_name(g, k, who, sizeof who);
      err_prefix(&g->plan_err, "%s", who);
    }
  }
}

static void group_plan_done(struct job *j) {
  struct ops_group *g = (struct ops_group *)j;
  g->planning = false;
  struct request *r = g->req;
  struct daemon *d = req_daemon(r);
  if (r->conn->closed) { /* nobody to load for */
    group_end(g);
    req_finish(r);
    return;
  }
  if (g->plan_rc != 0 || r->canceled || d->stopping) {
    struct wd_error e = g->plan_err;
    if (g->plan_rc == 0)
      err_set(&e, r->canceled ? WEIGHTD_E_CANCELED : WEIGHTD_E_SHUTDOWN,
              r->canceled ? "canceled" : "the daemon is shutting down");
    group_end(g);
    req_fail_err(r, &e);
    return;
  }
  req_args_free(r); /* the ranks keep what they need */
  g->pending = g->nranks;
  g->starting = true;
  g->started_ms = clock_ms();
  /* Every rank's device is busy before the first rank's job can start: no rank borrows another's link. */
  for (unsigned i = 0; i < g->nranks; i++) ld_reserve(d->ld, g->ranks[i].device);
  for (unsigned i = 0; i < g->nranks; i++) {
    struct group_rank *k = &g->ranks[i];
    struct plan *p = k->plan;
    k->plan = NULL;
    reg_ref(g->ck);
    res_load(d->res, g->ck, k->device, p, ops_load_source(d, g->ck, g->source_given, g->source), &k->wait);
  }
  for (unsigned i = 0; i < g->nranks; i++) ld_unreserve(d->ld, g->ranks[i].device);
  g->starting = false;
  if (g->pending == 0) group_reply(g);
}

static void group_ready(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct ops_group *g = arg;
  struct request *r = g->req;
  if (r->conn->closed) { /* nobody to load for */
    if (ck != NULL) reg_unref(ck);
    group_end(g);
    req_finish(r);
    return;
  }
  if (ck == NULL || r->canceled) {
    struct wd_error e = {0};
    if (ck == NULL) e = *err;
    else err_set(&e, WEIGHTD_E_CANCELED, "canceled");
    if (ck != NULL) reg_unref(ck);
    group_end(g);
    req_fail_err(r, &e);
    return;
  }
  g->ck = ck;
  g->planning = true;
  jobs_submit(req_daemon(r)->control_pool, &g->job);
}

/* Reads one of the group's sizes (1 when absent). */
static int group_size(const struct msg_obj *grp, const char *name, unsigned *out, struct wd_error *err) {
  uint64_t v = 1;
  if (msg_get_u64(grp, name, false, 1, GROUP_MAX_RANKS, &v, err) < 0) return err->code;
  if (v == 0) return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'group.%s' must be at least 1", name);
  *out = (unsigned)v;
  return 0;
}

/*
 * Checks the request and builds the group: its sizes and ranks (rank r gets
 * tp_rank r mod tp_size and ep_rank r mod ep_size, over max(tp_size,
 * ep_size) ranks: vLLM's layout, where expert parallelism spans the data-
 * and tensor-parallel ranks), each rank's device, and the base plan.
 */
static int group_parse(struct request *r, struct ops_group *g, struct wd_error *err) {
  struct daemon *d = req_daemon(r);
  struct msg_obj o, grp, plan;
  int rc;
  if (msg_get_object(ops_args(r, &o), "group", true, &grp, err) < 0 ||
      msg_get_object(ops_args(r, &o), "plan", false, &plan, err) < 0)
    return err->code;
  if ((rc = group_size(&grp, "tp_size", &g->tp_size, err)) != 0 || (rc = group_size(&grp, "ep_size", &g->ep_size, err)) != 0 ||
      (rc = ops_source_arg(r, &g->source_given, &g->source, err)) != 0)
    return rc;
  unsigned world = g->tp_size > g->ep_size ? g->tp_size : g->ep_size;
  if (world % g->tp_size != 0 || world % g->ep_size != 0)
    return err_set(err, WEIGHTD_E_BAD_REQUEST,
                   "group: tp_size %u and ep_size %u: the larger must be a multiple of the smaller (rank r has "
                   "tp_rank r mod tp_size and ep_rank r mod ep_size)",
                   g->tp_size, g->ep_size);
  static const char *const set_by_group[] = {"tp_size", "tp_rank", "ep_size", "ep_rank", "experts", "outputs"};
  for (size_t i = 0; plan.json != NULL && i < sizeof set_by_group / sizeof set_by_group[0]; i++)
    if (cJSON_GetObjectItemCaseSensitive(plan.json, set_by_group[i]) != NULL)
      return err_set(err, WEIGHTD_E_BAD_REQUEST,
                     "field 'plan.%s': a group plan is a preset whose ranks the group sets (give tp_size and ep_size "
                     "in 'group')",
                     set_by_group[i]);
  const cJSON *devs = cJSON_GetObjectItemCaseSensitive(grp.json, "devices");
  if (devs != NULL && !cJSON_IsArray(devs))
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'group.devices' must be a list of device indexes or UUIDs");
  if (devs != NULL && cJSON_GetArraySize(devs) != (int)world)
    return err_set(err, WEIGHTD_E_BAD_REQUEST, "field 'group.devices' lists %d device(s) for %u rank(s): give one per rank",
                   cJSON_GetArraySize(devs), world);
  g->nranks = world;
  g->ranks = calloc(world, sizeof *g->ranks);
  g->base = plan.json != NULL ? cJSON_Duplicate(plan.json, 1) : cJSON_CreateObject();
  if (g->ranks == NULL || g->base == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  if (cJSON_GetObjectItemCaseSensitive(g->base, "preset") == NULL) cJSON_AddStringToObject(g->base, "preset", "auto");
  for (unsigned i = 0; i < world; i++) {
    struct group_rank *k = &g->ranks[i];
    k->g = g;
    k->tp_rank = i % g->tp_size;
    k->ep_rank = i % g->ep_size;
    k->wait.done = rank_done;
    k->wait.progress = rank_progress;
    k->wait.uid = r->conn->uid;
    k->device = (int)(i % (unsigned)d->ndevices);
    if (devs != NULL && ops_device_resolve(d, cJSON_GetArrayItem(devs, (int)i), &k->device, err) != 0)
      return err_prefix(err, "group.devices[%u]", i);
  }
  return 0;
}

void op_load_group(struct request *r) {
  const char *path = ops_path_arg(r);
  if (path == NULL) return;
  struct ops_group *g = calloc(1, sizeof *g);
  struct wd_error err = {0};
  if (g == NULL) {
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  if (group_parse(r, g, &err) != 0) {
    group_free(g);
    req_fail_err(r, &err);
    return;
  }
  g->req = r;
  g->job.work = group_plan_work;
  g->job.done = group_plan_done;
  r->group = g;
  struct acc_cred who;
  reg_acquire_as(req_daemon(r)->reg, path, r->conn->uid, ops_reader(r->conn, &who), group_ready, g);
}

bool ops_group_cancel(struct request *t) {
  struct ops_group *g = t->group;
  if (g == NULL) return false;
  if (g->ck == NULL || g->planning) { /* still opening or planning: its continuation replies CANCELED */
    t->canceled = true;
    return true;
  }
  unsigned left = 0;
  for (unsigned i = 0; i < g->nranks; i++)
    if (!g->ranks[i].done && res_waiter_cancel(&g->ranks[i].wait)) left++;
  group_end(g);
  req_fail(t, WEIGHTD_E_CANCELED, "load of %u rank(s) canceled", left);
  return true;
}

bool ops_group_gone(struct request *r) {
  struct ops_group *g = r->group;
  if (g == NULL) return false;
  if (g->ck == NULL || g->planning) return true; /* the acquire's or the planning job's continuation finishes it */
  for (unsigned i = 0; i < g->nranks; i++)
    if (!g->ranks[i].done) res_waiter_leave(&g->ranks[i].wait);
  group_end(g);
  req_finish(r);
  return true;
}
