/*
 * ops_status.c - status, and the JSON views of checkpoints, devices and sets
 * that every reply describing them uses. Page-cache residency and free
 * device memory are measured on a job (mincore over large mappings takes a
 * while); the job reads only its own struct: the entries it was handed
 * (immutable once open) and the backend's const table.
 *
 * A status reply is bounded: each of its four lists (checkpoints, sets,
 * leases, requests) is a page of at most `limit` items, newest first, cut
 * short where the list's estimated text would pass STATUS_LIST_BYTES, with
 * the totals, how many were left out and the cursors of the next page
 * ("next", which a client passes back as "after"). Choosing a page costs one
 * walk of each list and a heap of `limit` items; only the page's
 * checkpoints are measured.
 *
 * Who sees what. Root, the daemon's uid and members of admin_gids see
 * everything. Any other client sees only the checkpoints it may read (its
 * access to the very files each was opened from, checked as for an open, on
 * a job first: reg_readable), the sets and leases of those and of the sets
 * its uid loaded, its own
 * requests' paths and set ids (others' requests without them), and the
 * metrics without their path-labelled samples; the reply counts what was
 * left out ("checkpoints_hidden", "sets_hidden", "leases_hidden"). The check
 * is one per distinct checkpoint, whatever the number of its sets, so a
 * status stays linear in what is open.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "jsonutil.h"
#include "sha256.h"
#include "ops_common.h"
#include "telemetry.h"
#include "remote/fetch.h"
#include "remote/rroots.h"

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

/* A checkpoint's view, with the number of its sets given. */
static cJSON *checkpoint_json(const struct reg_ckpt *ck, uint64_t resident, size_t nsets) {
  cJSON *o = cJSON_CreateObject();
  msg_add_string(o, "path", ck->path);
  msg_add_string(o, "layout", ckpt_layout_name(ck->ck->layout));
  msg_add_string(o, "origin", ck->remote ? "remote" : "files");
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
  json_u64_add(o, "sets", nsets);
  return o;
}

cJSON *ops_checkpoint_json(const struct daemon *d, const struct reg_ckpt *ck, uint64_t resident) {
  return checkpoint_json(ck, resident, res_count_sets_of(d->res, ck));
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
  /* Of used: sets off the list that leases (or scrubs, copies) still hold: failed while leased, or retired corrupt. */
  uint64_t held = 0, nheld = 0;
  for (const struct res_set *s = res_first_orphan(d->res); s != NULL; s = s->next)
    if (s->device == i) {
      held += s->plan->slab_bytes;
      nheld++;
    }
  json_u64_add(o, "unlisted_sets", nheld);
  json_u64_add(o, "unlisted_bytes", held);
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
    cJSON_AddBoolToObject(o, "digests", s->load.digests != NULL); /* a scrub can check it */
    if (s->ncorrupt > 0) { /* tensors a scrub found changed since the load */
      cJSON *c = cJSON_AddArrayToObject(o, "corrupt");
      for (size_t i = 0; i < s->plan->noutputs; i++)
        if (s->corrupt[i]) cJSON_AddItemToArray(c, cJSON_CreateString(s->plan->outputs[i].name));
    }
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

/* ---- who sees what ---------------------------------------------------------------------------- */

enum status_list { SL_CHECKPOINTS, SL_SETS, SL_LEASES, SL_REQUESTS, SL_COUNT };

/* What a status shows a client that is no admin (NULL for admins: everything). */
struct status_view {
  struct reg_ckpt **cand; /* observed, sorted by address: every open checkpoint and every set's, once */
  bool *readable;         /* of each candidate */
  size_t n;
  uid_t uid;              /* requests of other uids show no path or set id */
  uint64_t hidden[SL_COUNT];
};

static int by_ptr(const void *a, const void *b) {
  uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
  return x < y ? -1 : x > y;
}

/* Whether v shows ck: one the check was not asked about (opened since) is not shown. */
static bool view_shows(const struct status_view *v, const struct reg_ckpt *ck) {
  if (v == NULL) return true;
  const struct reg_ckpt **hit = bsearch(&ck, v->cand, v->n, sizeof *v->cand, by_ptr);
  return hit != NULL && v->readable[(struct reg_ckpt *const *)hit - v->cand];
}

/* Whether v shows set s: its loader sees it (the set is its own to attach), anyone else as its checkpoint. */
static bool view_shows_set(const struct status_view *v, const struct res_set *s) {
  return v == NULL || s->loader_uid == v->uid || view_shows(v, s->ck);
}

static void view_free(struct status_view *v) {
  if (v == NULL) return;
  for (size_t i = 0; i < v->n; i++) reg_unobserve(v->cand[i]);
  free(v->cand);
  free(v->readable);
  free(v);
}

/* The most bytes of a request's path or set that status shows (a longer one names nothing). */
#define STATUS_PATH_MAX 4096u

/* s, clipped to STATUS_PATH_MAX bytes at a UTF-8 character's start, into a new string (NULL: no memory). */
static char *clip_path(const char *s) {
  size_t n = strlen(s);
  if (n > STATUS_PATH_MAX) {
    n = STATUS_PATH_MAX;
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80) n--;
  }
  char *c = malloc(n + 1);
  if (c != NULL) {
    memcpy(c, s, n);
    c[n] = '\0';
  }
  return c;
}

/*
 * A request in progress or queued, by its daemon-wide id: what it works on,
 * who sent it, how far it got; what it works on only when the view shows
 * the requests of its uid.
 */
static cJSON *request_json(const struct daemon *d, const struct request *t, uint64_t now,
                           const struct status_view *view) {
  char id[24];
  snprintf(id, sizeof id, "r%llu", (unsigned long long)t->serial);
  cJSON *o = cJSON_CreateObject();
  msg_add_string(o, "request", id);
  msg_add_string(o, "op", msg_op_name(t->op) ? msg_op_name(t->op) : "?");
  msg_add_string(o, "state", t->started ? "running" : "queued");
  bool named = view == NULL || t->conn->uid == view->uid;
  const cJSON *path = t->root && named ? cJSON_GetObjectItemCaseSensitive(t->root, "path") : NULL;
  const cJSON *set = t->root && named ? cJSON_GetObjectItemCaseSensitive(t->root, "set") : NULL;
  const struct res_set *s = named ? t->wait.set : NULL;
  char *clipped = cJSON_IsString(path) ? clip_path(path->valuestring) : NULL;
  if (clipped != NULL) msg_add_string(o, "path", clipped);
  else if (s != NULL) msg_add_string(o, "path", s->ck->path);
  free(clipped);
  if (s != NULL) {
    msg_add_string(o, "set", s->id);
    msg_add_string(o, "device", res_device(d->res, s->device)->info.uuid);
    if (s->state == SET_LOADING) {
      json_u64_add(o, "bytes_done", atomic_load(&s->load.bytes_done));
      json_u64_add(o, "bytes_total", s->plan->slab_bytes);
    }
  } else if (cJSON_IsString(set) && (clipped = clip_path(set->valuestring)) != NULL) {
    msg_add_string(o, "set", clipped);
    free(clipped);
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

/* ---- pages ---------------------------------------------------------------------------------- */

#define STATUS_LIMIT_DEFAULT 256u
#define STATUS_LIMIT_MAX 1024u
/* A list's share of a reply, as estimated below: four lists stay well under the 16 MiB reply limit. */
#define STATUS_LIST_BYTES (2u << 20)

static const char *const list_names[SL_COUNT] = {"checkpoints", "sets", "leases", "requests"};

/* What a status asks for: each list's cursor (items numbered below it; UINT64_MAX: from the newest). */
struct status_ask {
  uint64_t limit;
  bool listed[SL_COUNT]; /* with "after", only the lists it names */
  uint64_t after[SL_COUNT];
};

/* An item of a list: its number (generation, set, lease or request id), itself, its text's estimated bytes. */
struct item {
  uint64_t num;
  const void *p;
  size_t bytes;
};

/* A list's page: its items, newest first, and what was left out. */
struct page {
  struct item *v;
  size_t n;
  uint64_t total;  /* the list's items, whatever the cursor */
  uint64_t left;   /* items after the cursor not on this page */
  uint64_t next;   /* the cursor of the next page, when left > 0 */
};

/* Keeps the `limit` largest numbers offered in a min-heap, in O(log limit) per item. */
struct picker {
  struct item *heap;
  size_t n, limit;
  uint64_t offered; /* items after the cursor */
};

static void sift_down(struct item *h, size_t n, size_t i) {
  for (;;) {
    size_t l = 2 * i + 1, m = i;
    if (l < n && h[l].num < h[m].num) m = l;
    if (l + 1 < n && h[l + 1].num < h[m].num) m = l + 1;
    if (m == i) return;
    struct item t = h[i];
    h[i] = h[m];
    h[m] = t;
    i = m;
  }
}

static void offer(struct picker *k, uint64_t num, const void *p, size_t bytes) {
  k->offered++;
  struct item it = {num, p, bytes};
  if (k->n < k->limit) {
    size_t i = k->n++;
    k->heap[i] = it;
    while (i > 0 && k->heap[(i - 1) / 2].num > k->heap[i].num) {
      struct item t = k->heap[i];
      k->heap[i] = k->heap[(i - 1) / 2];
      k->heap[(i - 1) / 2] = t;
      i = (i - 1) / 2;
    }
  } else if (k->limit > 0 && num > k->heap[0].num) {
    k->heap[0] = it;
    sift_down(k->heap, k->n, 0);
  }
}

static int by_num_desc(const void *a, const void *b) {
  uint64_t x = ((const struct item *)a)->num, y = ((const struct item *)b)->num;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* Turns what the picker kept into a page: newest first, cut where the estimated bytes pass the list's share. */
static void page_close(struct picker *k, uint64_t total, struct page *pg) {
  qsort(k->heap, k->n, sizeof *k->heap, by_num_desc);
  size_t n = 0, bytes = 0;
  while (n < k->n && (n == 0 || bytes + k->heap[n].bytes <= STATUS_LIST_BYTES)) bytes += k->heap[n++].bytes;
  *pg = (struct page){.v = k->heap, .n = n, .total = total, .left = k->offered - n};
  if (pg->left > 0 && n > 0) pg->next = k->heap[n - 1].num;
}

static bool picker_init(struct picker *k, uint64_t limit) {
  *k = (struct picker){.limit = (size_t)limit};
  return (k->heap = calloc((size_t)limit, sizeof *k->heap)) != NULL;
}

/* The number in an id such as "s12" or "l7" (0 when it has none). */
static uint64_t id_number(const char *id) {
  char *end;
  unsigned long long n = strtoull(id + 1, &end, 10);
  return *end == '\0' ? n : 0;
}

/* The estimated bytes of a string in JSON: every byte escaped at worst. */
static size_t text_cost(const char *s) { return s != NULL ? 6 * strlen(s) : 0; }

/* The estimated bytes of a request's entry: the path or set it names (as clipped), its client's name. */
static size_t request_cost(const struct request *t) {
  size_t n = 640 + text_cost(t->conn->client);
  for (int f = 0; f < 2 && t->root != NULL; f++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(t->root, f ? "set" : "path");
    if (cJSON_IsString(v)) n += 6 * strnlen(v->valuestring, STATUS_PATH_MAX);
  }
  return n;
}

/* Reads "limit" and "after"; 0 or BAD_REQUEST naming the field. */
static int status_ask_read(const struct request *r, struct status_ask *a, struct wd_error *err) {
  struct msg_obj o, after;
  int rc = msg_get_u64(ops_args(r, &o), "limit", false, STATUS_LIMIT_DEFAULT, STATUS_LIMIT_MAX, &a->limit, err);
  if (rc < 0) return rc;
  if (a->limit == 0) return err_set(err, WEIGHTD_E_BAD_REQUEST, "'limit' must be at least 1");
  int given = msg_get_object(ops_args(r, &o), "after", false, &after, err);
  if (given < 0) return given;
  for (int l = 0; l < SL_COUNT; l++) {
    a->listed[l] = given == 0;
    a->after[l] = UINT64_MAX;
    if (given == 0) continue;
    rc = msg_get_u64(&after, list_names[l], false, UINT64_MAX, MSG_INT_MAX, &a->after[l], err);
    if (rc < 0) return rc;
    a->listed[l] = rc == 1;
  }
  return 0;
}

/* ---- the measuring job ---------------------------------------------------------------------- */

struct info_job {
  struct job job;
  struct request *req;
  const struct wd_backend *backend;
  struct reg_ckpt **cks; /* referenced: the page's checkpoints, or the one a reply describes */
  size_t n;
  uint64_t *resident;
  bool status; /* reply with the whole status, not one checkpoint */
  struct status_ask ask;
  struct page ckpage; /* the checkpoints' page (its items are cks, in order) */
  struct status_view *view; /* owned; NULL: an admin's, which shows everything */
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

/* The number of sets of each of the page's checkpoints, in one walk of the sets. */
static size_t *sets_per_checkpoint(const struct daemon *d, const struct info_job *ij) {
  size_t *count = calloc(ij->n ? ij->n : 1, sizeof *count);
  const struct reg_ckpt **sorted = malloc((ij->n ? ij->n : 1) * sizeof *sorted);
  if (count == NULL || sorted == NULL) {
    free(count);
    free(sorted);
    return NULL;
  }
  memcpy(sorted, ij->cks, ij->n * sizeof *sorted);
  qsort(sorted, ij->n, sizeof *sorted, by_ptr);
  size_t *by_sorted = calloc(ij->n ? ij->n : 1, sizeof *by_sorted);
  if (by_sorted == NULL) {
    free(count);
    free(sorted);
    return NULL;
  }
  for (const struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) {
    const struct reg_ckpt *key = s->ck;
    const struct reg_ckpt **hit = bsearch(&key, sorted, ij->n, sizeof *sorted, by_ptr);
    if (hit != NULL) by_sorted[hit - sorted]++;
  }
  for (size_t i = 0; i < ij->n; i++) {
    const struct reg_ckpt *key = ij->cks[i];
    const struct reg_ckpt **hit = bsearch(&key, sorted, ij->n, sizeof *sorted, by_ptr);
    count[i] = hit != NULL ? by_sorted[hit - sorted] : 0;
  }
  free(sorted);
  free(by_sorted);
  return count;
}

/* The page of sets, leases or requests (the checkpoints' was chosen before the job); false: out of memory. */
static bool pick_list(struct daemon *d, const struct info_job *ij, enum status_list l, struct page *pg) {
  struct picker k;
  if (!picker_init(&k, ij->ask.limit)) return false;
  uint64_t after = ij->ask.after[l], total = 0;
  struct status_view *v = ij->view;
  if (l == SL_SETS) {
    for (const struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) {
      if (!view_shows_set(v, s)) {
        v->hidden[l]++;
        continue;
      }
      total++;
      if (id_number(s->id) < after) offer(&k, id_number(s->id), s, 1024 + text_cost(s->ck->path));
    }
  } else if (l == SL_LEASES) {
    for (const struct lease *x = res_first_lease(d->res); x != NULL; x = x->next) {
      if (!view_shows_set(v, x->set)) {
        v->hidden[l]++;
        continue;
      }
      total++;
      if (id_number(x->id) < after) offer(&k, id_number(x->id), x, 320 + text_cost(x->holder.client));
    }
  } else {
    const struct conn *self = ij->req->conn;
    for (const struct conn *c = self->ops->first(self); c != NULL; c = c->next)
      for (int q = 0; q < 2; q++)
        for (const struct request *t = q ? c->queued : c->requests; t != NULL; t = t->next_in_conn)
          if (t != ij->req) {
            total++;
            if (t->serial < after) offer(&k, t->serial, t, request_cost(t));
          }
  }
  page_close(&k, total, pg);
  return true;
}

/* Adds "name": [...] for a page, with "totals", "left_out" and "next" entries. */
static void add_page(cJSON *r, enum status_list l, const struct page *pg, cJSON *items) {
  cJSON_AddItemToObject(r, list_names[l], items);
  json_u64_add(cJSON_GetObjectItemCaseSensitive(r, "totals"), list_names[l], pg->total);
  if (pg->left == 0) return;
  json_u64_add(cJSON_GetObjectItemCaseSensitive(r, "left_out"), list_names[l], pg->left);
  json_u64_add(cJSON_GetObjectItemCaseSensitive(r, "next"), list_names[l], pg->next);
}

/* The remote roots and the range-GET engine's counters since start (null: no remote roots). */
static void status_remote(const struct daemon *d, cJSON *o) {
  if (d->remote == NULL) {
    cJSON_AddNullToObject(o, "remote");
    return;
  }
  cJSON *m = cJSON_AddObjectToObject(o, "remote");
  cJSON *roots = cJSON_AddArrayToObject(m, "roots");
  for (size_t i = 0; i < rroots_count(d->remote); i++)
    cJSON_AddItemToArray(roots, cJSON_CreateString(rroots_text(d->remote, i)));
  msg_add_string(m, "credentials", rroots_creds_source(d->remote));
  struct rf_stats st;
  rf_client_stats(rroots_client(d->remote), &st);
  json_u64_add(m, "bytes", st.bytes);
  json_u64_add(m, "in_flight", st.in_flight);
  json_u64_add(m, "retries", st.retries);
  json_u64_add(m, "stalls", st.stalls);
  json_u64_add(m, "redirects", st.redirects);
  json_u64_add(m, "connections", st.connects);
  json_u64_add(m, "http2_responses", st.http2);
  cJSON *resp = cJSON_AddObjectToObject(m, "responses");
  static const char *const classes[6] = {"none", "1xx", "2xx", "3xx", "4xx", "5xx"};
  for (int i = 0; i < 6; i++) json_u64_add(resp, classes[i], st.requests[i]);
}

static void status_daemon(struct daemon *d, cJSON *r) {
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
  msg_add_string(o, "scrub", config_enum_name(&d->cfg, "scrub"));
  if (d->cfg.test_writable_slabs == CFG_ON) cJSON_AddTrueToObject(o, "test_writable_slabs"); /* never in production */
  json_u64_add(o, "host_pin_budget", reg_pin_budget(d->reg));
  msg_add_string(o, "host_pin_budget_from", reg_pin_budget_source(d->reg));
  json_u64_add(o, "pinned_bytes", reg_pinned_bytes(d->reg));
  const struct res_stats *st = res_stats(d->res);
  uint64_t loads = 0;
  for (int rr = 0; rr < RES_RESULT_COUNT; rr++)
    for (int m = 0; m < LD_METHOD_COUNT; m++) loads += st->loads[rr][m];
  json_u64_add(o, "loads", loads); /* load jobs finished since start, whatever their result */
  json_u64_add(o, "sets_readopted", st->adopted);
  uint64_t nleases = 0;
  for (struct lease *l = res_first_lease(d->res); l != NULL; l = l->next) nleases++;
  json_u64_add(o, "leases", nleases);
  struct reg_counts rc;
  reg_counts(d->reg, &rc);
  const struct reg_limits *lim = reg_limits(d->reg);
  cJSON *c = cJSON_AddObjectToObject(o, "checkpoints");
  json_u64_add(c, "open", rc.open);
  json_u64_add(c, "max_open", lim->max_open);
  json_u64_add(c, "max_open_per_uid", lim->max_open_per_uid);
  json_u64_add(c, "charged_bytes", rc.charged);
  json_u64_add(c, "memory", lim->memory);
  json_u64_add(c, "memory_per_uid", lim->memory_per_uid);
  json_u64_add(c, "mappings", rc.maps);
  json_u64_add(c, "max_mappings", lim->max_maps);
  json_u64_add(c, "idle_ms", lim->idle_ms);
  json_u64_add(c, "closed_idle", rc.closed_idle);
  json_u64_add(c, "closed_for_room", rc.closed_room);
  json_u64_add(c, "refused", rc.refused);
  json_u64_add(c, "plans_reused", rc.plans_reused);
  status_remote(d, o);
}

/* The status reply's body; false when memory ran out. */
static bool status_body(struct daemon *d, cJSON *r, const struct info_job *ij) {
  status_daemon(d, r);
  cJSON *devs = cJSON_AddArrayToObject(r, "devices");
  for (int i = 0; i < d->ndevices; i++) cJSON_AddItemToArray(devs, ops_device_json(d, i));
  cJSON_AddObjectToObject(r, "totals");
  cJSON_AddObjectToObject(r, "left_out");
  cJSON_AddObjectToObject(r, "next");
  if (ij->ask.listed[SL_CHECKPOINTS]) {
    size_t *nsets = sets_per_checkpoint(d, ij);
    if (nsets == NULL) return false;
    cJSON *cks = cJSON_CreateArray();
    for (size_t i = 0; i < ij->n; i++)
      if (!ij->cks[i]->detached) cJSON_AddItemToArray(cks, checkpoint_json(ij->cks[i], ij->resident[i], nsets[i]));
    free(nsets);
    add_page(r, SL_CHECKPOINTS, &ij->ckpage, cks);
  }
  uint64_t now = clock_ms();
  for (int l = SL_SETS; l < SL_COUNT; l++) {
    if (!ij->ask.listed[l]) continue;
    struct page pg;
    if (!pick_list(d, ij, (enum status_list)l, &pg)) return false;
    cJSON *items = cJSON_CreateArray();
    for (size_t i = 0; i < pg.n; i++)
      cJSON_AddItemToArray(items, l == SL_SETS     ? ops_set_json(d, pg.v[i].p)
                                  : l == SL_LEASES ? lease_json(pg.v[i].p, now)
                                                   : request_json(d, pg.v[i].p, now, ij->view));
    free(pg.v);
    add_page(r, (enum status_list)l, &pg, items);
  }
  /* What this reader was not shown, counted over the whole lists (0 for an admin). */
  static const char *const hidden_names[SL_COUNT] = {"checkpoints_hidden", "sets_hidden", "leases_hidden", NULL};
  for (int l = SL_CHECKPOINTS; l < SL_REQUESTS; l++)
    if (ij->ask.listed[l]) json_u64_add(r, hidden_names[l], ij->view != NULL ? ij->view->hidden[l] : 0);
  if (cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(r, "next")) == 0) {
    cJSON_DeleteItemFromObject(r, "next");
    cJSON_DeleteItemFromObject(r, "left_out");
  }
  cJSON_AddItemToObject(r, "metrics", telemetry_json(d, ij->view == NULL));
  cJSON_AddItemToObject(r, "topology", ops_multi_topology_json(d));
  return true;
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
  if (!ij->status) {
    cJSON_AddItemToObject(r, "checkpoint", ops_checkpoint_json(d, ij->cks[0], ij->resident[0]));
    req_reply(ij->req, r, NULL, 0);
  } else if (status_body(d, r, ij)) {
    req_reply(ij->req, r, NULL, 0);
  } else {
    cJSON_Delete(r);
    req_fail(ij->req, WEIGHTD_E_NOMEM, "out of memory");
  }
  release_cks(ij->cks, ij->n, ij->status);
  view_free(ij->view);
  free(ij->resident);
  free(ij->devinfo);
  free(ij);
}

/*
 * Measures cks (references taken over) on a job, then replies: with the
 * status ask gives (NULL: one checkpoint), as view shows it (taken over).
 */
static void reply_info(struct request *req, struct reg_ckpt **cks, size_t n, const struct status_ask *ask,
                       const struct page *ckpage, struct status_view *view) {
  struct daemon *d = req_daemon(req);
  struct info_job *ij = calloc(1, sizeof *ij);
  if (ij == NULL || (ij->resident = calloc(n ? n : 1, sizeof *ij->resident)) == NULL ||
      (ask != NULL && (ij->devinfo = calloc((size_t)d->ndevices, sizeof *ij->devinfo)) == NULL)) {
    if (ij) free(ij->resident);
    free(ij);
    release_cks(cks, n, ask != NULL);
    view_free(view);
    req_fail(req, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  ij->view = view;
  ij->job.work = info_work;
  ij->job.done = info_done;
  ij->req = req;
  ij->backend = &d->backend;
  ij->cks = cks;
  ij->n = n;
  ij->status = ask != NULL;
  if (ask != NULL) {
    ij->ask = *ask;
    ij->ckpage = *ckpage;
  }
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
  reply_info(r, cks, 1, NULL, NULL, NULL);
}

/*
 * The page of open checkpoints view shows, chosen now so that only they are
 * measured; their references go to *out.
 */
static int pick_checkpoints(struct daemon *d, const struct status_ask *ask, struct status_view *view,
                            struct reg_ckpt ***out, struct page *pg) {
  struct picker k;
  *out = NULL;
  memset(pg, 0, sizeof *pg);
  if (!ask->listed[SL_CHECKPOINTS]) return 0;
  if (!picker_init(&k, ask->limit)) return WEIGHTD_E_NOMEM;
  uint64_t total = 0;
  for (struct reg_ckpt *c = reg_first(d->reg); c != NULL; c = c->next) {
    if (c->state != REG_OPEN) continue;
    if (!view_shows(view, c)) {
      view->hidden[SL_CHECKPOINTS]++;
      continue;
    }
    total++;
    if (c->generation < ask->after[SL_CHECKPOINTS]) offer(&k, c->generation, c, 600 + text_cost(c->path));
  }
  page_close(&k, total, pg);
  struct reg_ckpt **cks = calloc(pg->n ? pg->n : 1, sizeof *cks);
  if (cks == NULL) {
    free(k.heap);
    return WEIGHTD_E_NOMEM;
  }
  for (size_t i = 0; i < pg->n; i++) {
    cks[i] = (struct reg_ckpt *)pg->v[i].p;
    reg_observe(cks[i]); /* a measurement: close does not wait for it */
  }
  free(k.heap);
  pg->v = NULL;
  *out = cks;
  return 0;
}

/* Picks the checkpoints' page as view shows it and measures it (view taken over; NULL: everything). */
static void status_pick(struct request *r, const struct status_ask *ask, struct status_view *view) {
  struct reg_ckpt **cks;
  struct page pg;
  if (pick_checkpoints(req_daemon(r), ask, view, &cks, &pg) != 0) {
    view_free(view);
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  reply_info(r, cks, pg.n, ask, &pg, view);
}

/* A status for a client that is no admin, while reg_readable decides what it may see. */
struct status_wait {
  struct request *req;
  struct status_ask ask;
  struct status_view *view;
};

static void status_readable(void *arg, const bool *readable) {
  struct status_wait *w = arg;
  struct request *r = w->req;
  struct status_view *v = w->view;
  struct status_ask ask = w->ask;
  free(w);
  if (readable == NULL) {
    view_free(v);
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
  } else if (r->conn->closed) { /* nobody to answer */
    view_free(v);
    req_finish(r);
  } else {
    memcpy(v->readable, readable, v->n * sizeof *readable);
    status_pick(r, &ask, v);
  }
}

/* Every open checkpoint and every set's, once each, observed and sorted by address; false: out of memory. */
static bool view_gather(struct daemon *d, struct status_view *v) {
  size_t n = 0, cap = 0;
  for (struct reg_ckpt *c = reg_first(d->reg); c != NULL; c = c->next) cap += c->state == REG_OPEN;
  for (const struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) cap++;
  v->cand = malloc((cap ? cap : 1) * sizeof *v->cand);
  v->readable = calloc(cap ? cap : 1, sizeof *v->readable);
  if (v->cand == NULL || v->readable == NULL) return false;
  for (struct reg_ckpt *c = reg_first(d->reg); c != NULL; c = c->next)
    if (c->state == REG_OPEN) v->cand[n++] = c;
  for (const struct res_set *s = res_first_set(d->res); s != NULL; s = s->next) v->cand[n++] = s->ck;
  qsort(v->cand, n, sizeof *v->cand, by_ptr);
  size_t u = 0;
  for (size_t i = 0; i < n; i++)
    if (u == 0 || v->cand[u - 1] != v->cand[i]) v->cand[u++] = v->cand[i];
  for (size_t i = 0; i < u; i++) reg_observe(v->cand[i]);
  v->n = u;
  return true;
}

void op_status(struct request *r) {
  struct daemon *d = req_daemon(r);
  struct status_ask ask;
  struct wd_error err = {0};
  if (status_ask_read(r, &ask, &err) != 0) {
    req_fail_err(r, &err);
    return;
  }
  if (ops_is_admin(r->conn)) {
    status_pick(r, &ask, NULL);
    return;
  }
  struct status_view *v = calloc(1, sizeof *v);
  struct status_wait *w = v != NULL && view_gather(d, v) ? calloc(1, sizeof *w) : NULL;
  if (w == NULL) {
    view_free(v);
    req_fail(r, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  v->uid = r->conn->uid;
  w->req = r;
  w->ask = ask;
  w->view = v;
  struct acc_cred who;
  reg_readable(d->reg, v->cand, v->n, ops_reader(r->conn, &who), status_readable, w);
}
