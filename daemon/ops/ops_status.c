/*
 * ops_status.c - status, and the JSON views of checkpoints, devices and sets
 * that every reply describing them uses. Page-cache residency and free
 * device memory are measured on a job (mincore over large mappings takes a
 * while); the job reads only its own struct: the entries it was handed
 * (immutable once open) and the backend's const table.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "jsonutil.h"
#include "sha256.h"
#include "ops_common.h"
#include "telemetry.h"

/* ---- views ------------------------------------------------------------------------------- */

void ops_ids_add(const struct reg_ckpt *ck, cJSON *o) {
  char hex[SHA256_HEX_LEN + 1];
  sha256_hex(ck->ck->layout_id, hex);
  msg_add_string(o, "layout_id", hex);
  if (ck->content_known) {
    sha256_hex(ck->content_id, hex);
    msg_add_string(o, "content_id", hex);
  } else {
    cJSON_AddNullToObject(o, "content_id"); /* known once a whole prefetch has digested the files */
  }
}

cJSON *ops_checkpoint_json(const struct daemon *d, const struct reg_ckpt *ck, uint64_t resident) {
  cJSON *o = cJSON_CreateObject();
  msg_add_string(o, "path", ck->path);
  msg_add_string(o, "layout", ckpt_layout_name(ck->ck->layout));
  ops_ids_add(ck, o);
  json_u64_add(o, "shards", ck->ck->nshards);
  json_u64_add(o, "tensors", ck->ck->ntensors);
  json_u64_add(o, "bytes", ck->ck->total_bytes);
  json_u64_add(o, "resident_bytes", resident);
  cJSON_AddBoolToObject(o, "pinned", reg_pinned_whole(ck));
  json_u64_add(o, "pinned_bytes", reg_pins_bytes(ck));
  json_u64_add(o, "pinned_ranges", ck->npins);
  cJSON_AddBoolToObject(o, "pinning", ck->pinning);
  cJSON_AddBoolToObject(o, "prefetching", ck->prefetching);
  json_u64_add(o, "sets", res_count_sets_of(d->res, ck));
  return o;
}

cJSON *ops_device_json(const struct daemon *d, int i) {
  const struct res_device *dev = res_device(d->res, i);
  cJSON *o = cJSON_CreateObject();
  json_u64_add(o, "index", (uint64_t)i);
  msg_add_string(o, "uuid", dev->info.uuid);
  msg_add_string(o, "name", dev->info.name);
  json_u64_add(o, "memory_total", dev->info.memory_total);
  json_u64_add(o, "memory_free", dev->info.memory_free);
  json_u64_add(o, "budget", d->cfg.device_memory_budget);
  json_u64_add(o, "used", dev->used);
  msg_add_string(o, "handles", wd_handle_kind_name(dev->info.handles));
  ops_multi_device_fields(d, i, o);
  return o;
}

cJSON *ops_set_json(const struct daemon *d, const struct res_set *s) {
  static const char *const states[] = {"loading", "ready", "failed"};
  cJSON *o = cJSON_CreateObject();
  msg_add_string(o, "set", s->id);
  msg_add_string(o, "path", s->ck->path);
  ops_ids_add(s->ck, o);
  msg_add_string(o, "device", res_device(d->res, s->device)->info.uuid);
  cJSON_AddItemToObject(o, "plan", cJSON_Parse(s->plan->key));
  msg_add_string(o, "state", res_set_canceling(s) ? "canceling" : states[s->state]);
  json_u64_add(o, "bytes", s->plan->slab_bytes);
  json_u64_add(o, "tensors", s->plan->noutputs);
  json_u64_add(o, "leases", (uint64_t)s->leases);
  if (s->state == SET_LOADING) json_u64_add(o, "bytes_done", atomic_load(&s->load.bytes_done));
  if (s->state == SET_READY) {
    cJSON_AddNumberToObject(o, "seconds", s->seconds);
    msg_add_string(o, "method", res_set_method(s));
    if (s->load.slab != NULL) msg_add_string(o, "handles", wd_handle_kind_name(s->load.slab->kind));
  }
  ops_multi_set_fields(d, s, o);
  return o;
}

/* A lease: its holder's credentials (SO_PEERCRED), the client name its hello gave, its age. */
static cJSON *lease_json(const struct lease *l, uint64_t now) {
  cJSON *o = cJSON_CreateObject();
  msg_add_string(o, "lease", l->id);
  msg_add_string(o, "set", l->set->id);
  json_u64_add(o, "pid", (uint64_t)l->holder.pid);
  json_u64_add(o, "uid", (uint64_t)l->holder.uid);
  msg_add_string(o, "client_name", l->holder.client);
  cJSON_AddBoolToObject(o, "recovered", l->holder.owner == NULL); /* re-adopted after a restart, not reclaimed yet */
  cJSON_AddNumberToObject(o, "age_s", (double)(now - l->created_ms) / 1000.0);
  return o;
}

/* A request in progress or queued, by its daemon-wide id: what it works on, who sent it, how far it got. */
static cJSON *request_json(const struct daemon *d, const struct request *t, uint64_t now) {
  char id[24];
  snprintf(id, sizeof id, "r%llu", (unsigned long long)t->serial);
  cJSON *o = cJSON_CreateObject();
  msg_add_string(o, "request", id);
  msg_add_string(o, "op", msg_op_name(t->op) ? msg_op_name(t->op) : "?");
  msg_add_string(o, "state", t->started ? "running" : "queued");
  const cJSON *path = t->root ? cJSON_GetObjectItemCaseSensitive(t->root, "path") : NULL;
  const cJSON *set = t->root ? cJSON_GetObjectItemCaseSensitive(t->root, "set") : NULL;
  const struct res_set *s = t->wait.set;
  if (cJSON_IsString(path)) msg_add_string(o, "path", path->valuestring);
  else if (s != NULL) msg_add_string(o, "path", s->ck->path);
  if (s != NULL) {
    msg_add_string(o, "set", s->id);
    msg_add_string(o, "device", res_device(d->res, s->device)->info.uuid);
    if (s->state == SET_LOADING) {
      json_u64_add(o, "bytes_done", atomic_load(&s->load.bytes_done));
      json_u64_add(o, "bytes_total", s->plan->slab_bytes);
    }
  } else if (cJSON_IsString(set)) {
    msg_add_string(o, "set", set->valuestring);
  }
  if (t->prefetch != NULL) {
    uint64_t done, total;
    reg_prefetch_progress(t->prefetch, &done, &total);
    json_u64_add(o, "bytes_done", done);
    json_u64_add(o, "bytes_total", total);
  }
  json_u64_add(o, "pid", (uint64_t)t->conn->pid);
  json_u64_add(o, "uid", (uint64_t)t->conn->uid);
  msg_add_string(o, "client_name", t->conn->client);
  cJSON_AddNumberToObject(o, "age_s", (double)(now - t->created_ms) / 1000.0);
  return o;
}

/* ---- the measuring job ---------------------------------------------------------------------- */

struct info_job {
  struct job job;
  struct request *req;
  const struct wd_backend *backend;
  struct reg_ckpt **cks;
  size_t n;
  uint64_t *resident;
  bool status; /* reply with the whole status, not one checkpoint */
  int ndevices;
  struct wd_device_info *devinfo;
};

static void info_work(struct job *j) {
  struct info_job *ij = (struct info_job *)j;
  const struct wd_backend *b = ij->backend;
  for (size_t i = 0; i < ij->n; i++) ij->resident[i] = reg_resident_bytes(ij->cks[i]);
  for (int i = 0; ij->devinfo != NULL && i < ij->ndevices; i++)
    if (b->ops->device_info(b->ctx, i, &ij->devinfo[i], NULL) != 0) ij->devinfo[i].index = -1;
}

static void status_body(struct daemon *d, cJSON *r, const struct info_job *ij) {
  cJSON *o = cJSON_AddObjectToObject(r, "daemon");
  msg_add_string(o, "version", weightd_version_string());
  json_u64_add(o, "pid", (uint64_t)getpid());
  msg_add_string(o, "backend", d->backend_name);
  cJSON_AddNumberToObject(o, "uptime_s", (double)(clock_ms() - d->started_ms) / 1000.0);
  json_u64_add(o, "connections", d->stats.connections);
  msg_add_string(o, "socket", d->socket_path);
  json_u64_add(o, "jobs", jobs_outstanding(d->control_pool) + jobs_outstanding(d->job_pool));
  json_u64_add(o, "fill_threads", ld_pool_threads(d->fill));
  msg_add_string(o, "load_method", config_enum_name(&d->cfg, "load_method"));
  msg_add_string(o, "staged_strided", config_enum_name(&d->cfg, "staged_strided"));
  json_u64_add(o, "staging_slots", d->cfg.staging_slots);
  json_u64_add(o, "staging_slot_bytes", d->cfg.staging_slot_bytes);
  msg_add_string(o, "staging_writes", config_enum_name(&d->cfg, "staging_writes"));
  msg_add_string(o, "pin", config_enum_name(&d->cfg, "pin"));
  json_u64_add(o, "host_pin_budget", reg_pin_budget(d->reg));
  msg_add_string(o, "host_pin_budget_from", reg_pin_budget_source(d->reg));
  json_u64_add(o, "pinned_bytes", reg_pinned_bytes(d->reg));
  const struct res_stats *st = res_stats(d->res);
  uint64_t loads = 0;
  for (int rr = 0; rr < RES_RESULT_COUNT; rr++)
    for (int m = 0; m < LD_METHOD_COUNT; m++) loads += st->loads[rr][m];
  json_u64_add(o, "loads", loads); /* load jobs finished since start, whatever their result */
  json_u64_add(o, "sets_readopted", st->adopted);
  cJSON *devs = cJSON_AddArrayToObject(r, "devices");
  for (int i = 0; i < d->ndevices; i++) cJSON_AddItemToArray(devs, ops_device_json(d, i));
  cJSON *cks = cJSON_AddArrayToObject(r, "checkpoints");
  for (size_t i = 0; i < ij->n; i++)
    if (!ij->cks[i]->detached) cJSON_AddItemToArray(cks, ops_checkpoint_json(d, ij->cks[i], ij->resident[i]));
  cJSON *sets = cJSON_AddArrayToObject(r, "sets");
  for (struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) cJSON_AddItemToArray(sets, ops_set_json(d, s));
  uint64_t nleases = 0, now = clock_ms();
  cJSON *leases = cJSON_AddArrayToObject(r, "leases");
  for (struct lease *l = res_first_lease(d->res); l != NULL; l = l->next) {
    nleases++;
    cJSON_AddItemToArray(leases, lease_json(l, now));
  }
  json_u64_add(o, "leases", nleases);
  cJSON *reqs = cJSON_AddArrayToObject(r, "requests");
  const struct conn *self = ij->req->conn;
  for (struct conn *c = self->ops->first(self); c != NULL; c = c->next) {
    for (const struct request *t = c->requests; t != NULL; t = t->next_in_conn)
      if (t != ij->req) cJSON_AddItemToArray(reqs, request_json(d, t, now));
    for (const struct request *t = c->queued; t != NULL; t = t->next_in_conn)
      cJSON_AddItemToArray(reqs, request_json(d, t, now));
  }
  cJSON_AddItemToObject(r, "metrics", telemetry_json(d));
  cJSON_AddItemToObject(r, "topology", ops_multi_topology_json(d));
}

/* Drops the references a reply held: status's are a measurement's (reg_observe), an open's the caller's. */
static void release_cks(struct reg_ckpt **cks, size_t n, bool status) {
  for (size_t i = 0; i < n; i++) {
    if (status) reg_unobserve(cks[i]);
    else reg_unref(cks[i]);
  }
  free(cks);
}

static void info_done(struct job *j) {
  struct info_job *ij = (struct info_job *)j;
  struct daemon *d = req_daemon(ij->req);
  for (int i = 0; ij->devinfo != NULL && i < ij->ndevices; i++)
    if (ij->devinfo[i].index >= 0) res_device(d->res, i)->info.memory_free = ij->devinfo[i].memory_free;
  cJSON *r = msg_reply_ok(ij->req->id);
  if (ij->status) status_body(d, r, ij);
  else cJSON_AddItemToObject(r, "checkpoint", ops_checkpoint_json(d, ij->cks[0], ij->resident[0]));
  req_reply(ij->req, r, NULL, 0);
  release_cks(ij->cks, ij->n, ij->status);
  free(ij->resident);
  free(ij->devinfo);
  free(ij);
}

/* Measures cks (references taken over) on a job, then replies. */
static void reply_info(struct request *req, struct reg_ckpt **cks, size_t n, bool status) {
  struct daemon *d = req_daemon(req);
  struct info_job *ij = calloc(1, sizeof *ij);
  if (ij == NULL || (ij->resident = calloc(n ? n : 1, sizeof *ij->resident)) == NULL ||
      (status && (ij->devinfo = calloc((size_t)d->ndevices, sizeof *ij->devinfo)) == NULL)) {
    if (ij) free(ij->resident);
    free(ij);
    release_cks(cks, n, status);
    req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  ij->job.work = info_work;
  ij->job.done = info_done;
  ij->req = req;
  ij->backend = &d->backend;
  ij->cks = cks;
  ij->n = n;
  ij->status = status;
  ij->ndevices = d->ndevices;
  jobs_submit(d->control_pool, &ij->job);
}

void ops_reply_checkpoint(struct request *r, struct reg_ckpt *ck) {
  struct reg_ckpt **cks = malloc(sizeof *cks);
  if (cks == NULL) {
    reg_unref(ck);
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  cks[0] = ck; /* the caller's reference moves to the job */
  reply_info(r, cks, 1, false);
}

void op_status(struct request *r) {
  struct daemon *d = req_daemon(r);
  size_t n = 0;
  for (struct reg_ckpt *c = reg_first(d->reg); c != NULL; c = c->next) n += c->state == REG_OPEN;
  struct reg_ckpt **cks = calloc(n ? n : 1, sizeof *cks);
  if (cks == NULL) {
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  size_t i = 0;
  for (struct reg_ckpt *c = reg_first(d->reg); c != NULL; c = c->next)
    if (c->state == REG_OPEN) {
      reg_observe(c); /* a measurement: close does not wait for it */
      cks[i++] = c;
    }
  reply_info(r, cks, n, true);
}
