/* lib_group.c - tensor- and expert-parallel groups: weightd_load_group and its results. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib_internal.h"

struct group_rank {
  unsigned rank, tp_rank, ep_rank;
  char *device, *set_id, *message, *method, *source;
  int error;
  uint64_t bytes;
  double seconds;
};

struct weightd_group {
  size_t n;
  struct group_rank *ranks;
};

/* A copy of o's string member (or "" when absent); NULL when memory ran out. */
static char *str_of(const cJSON *o, const char *key) {
  const char *v = lib_get_str(o, key);
  return strdup(v != NULL ? v : "");
}

static unsigned uint_of(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble < 4294967296.0 ? (unsigned)v->valuedouble : 0;
}

void weightd_group_free(weightd_group *g) {
  if (g == NULL) return;
  for (size_t i = 0; i < g->n; i++) {
    struct group_rank *r = &g->ranks[i];
    free(r->device);
    free(r->set_id);
    free(r->message);
    free(r->method);
    free(r->source);
  }
  free(g->ranks);
  free(g);
}

/* The group of a reply's "ranks" (an ok reply or an error reply carrying them); NULL without them. */
static weightd_group *group_from_reply(const cJSON *reply) {
  const cJSON *ranks = cJSON_GetObjectItemCaseSensitive(reply, "ranks");
  if (!cJSON_IsArray(ranks)) return NULL;
  weightd_group *g = calloc(1, sizeof *g);
  size_t n = (size_t)cJSON_GetArraySize(ranks);
  if (g == NULL || (g->ranks = calloc(n ? n : 1, sizeof *g->ranks)) == NULL) {
    free(g);
    return NULL;
  }
  const cJSON *e;
  cJSON_ArrayForEach(e, ranks) {
    struct group_rank *r = &g->ranks[g->n++];
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(e, "error");
    const cJSON *secs = cJSON_GetObjectItemCaseSensitive(e, "seconds");
    const cJSON *bytes = cJSON_GetObjectItemCaseSensitive(e, "bytes");
    r->rank = uint_of(e, "rank");
    r->tp_rank = uint_of(e, "tp_rank");
    r->ep_rank = uint_of(e, "ep_rank");
    r->device = str_of(e, "device");
    r->set_id = str_of(e, "set");
    r->method = str_of(e, "method");
    r->source = str_of(e, "source");
    r->message = str_of(err, "message");
    if (err != NULL) {
      r->error = err_from_name(lib_get_str(err, "code"));
      if (r->error == 0) r->error = WEIGHTD_E_INTERNAL;
    }
    r->seconds = cJSON_IsNumber(secs) ? secs->valuedouble : 0;
    r->bytes = cJSON_IsNumber(bytes) && bytes->valuedouble > 0 ? (uint64_t)bytes->valuedouble : 0;
    if (r->device == NULL || r->set_id == NULL || r->method == NULL || r->source == NULL || r->message == NULL) {
      weightd_group_free(g);
      return NULL;
    }
  }
  return g;
}

/* True when opts (of the caller's struct_size) contains field. */
#define GOPT_HAS(opts, field) \
  ((opts) != NULL && (opts)->struct_size >= offsetof(struct weightd_group_options, field) + sizeof((opts)->field))

/* Builds {"op": "load_group", "path", "plan", "group": {"tp_size", "ep_size", "devices"}}. */
static int group_request(weightd_client *c, const char *path, const struct weightd_group_options *o, cJSON **out) {
  *out = NULL;
  if (o != NULL && o->struct_size == 0)
    return lib_fail(c, WEIGHTD_E_INVALID, "weightd_group_options.struct_size is 0: set it to sizeof the struct");
  cJSON *req = lib_request_new("load_group");
  if (req == NULL) return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  int rc = lib_add_path(c, req, path);
  cJSON *grp = rc == 0 ? cJSON_AddObjectToObject(req, "group") : NULL;
  if (rc == 0 && grp == NULL) rc = lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  unsigned tp = GOPT_HAS(o, tp_size) && o->tp_size > 1 ? o->tp_size : 1;
  unsigned ep = GOPT_HAS(o, ep_size) && o->ep_size > 1 ? o->ep_size : 1;
  if (rc == 0 && (cJSON_AddNumberToObject(grp, "tp_size", tp) == NULL || cJSON_AddNumberToObject(grp, "ep_size", ep) == NULL))
    rc = lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  const char *const *devs = GOPT_HAS(o, devices) ? o->devices : NULL;
  size_t ndevs = GOPT_HAS(o, ndevices) ? o->ndevices : 0;
  if (rc == 0 && devs != NULL) {
    cJSON *list = cJSON_AddArrayToObject(grp, "devices");
    for (size_t i = 0; list != NULL && i < ndevs; i++) {
      if (devs[i] == NULL) {
        rc = lib_fail(c, WEIGHTD_E_INVALID, "weightd_group_options.devices[%zu] is NULL", i);
        break;
      }
      cJSON_AddItemToArray(list, cJSON_CreateString(devs[i]));
    }
    if (rc == 0 && (list == NULL || (size_t)cJSON_GetArraySize(list) != ndevs))
      rc = lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  }
  const char *plan_json = GOPT_HAS(o, plan_json) ? o->plan_json : NULL;
  if (rc == 0 && plan_json != NULL) {
    cJSON *plan = cJSON_Parse(plan_json);
    if (!cJSON_IsObject(plan)) {
      cJSON_Delete(plan);
      rc = lib_fail(c, WEIGHTD_E_INVALID, "the plan is not a JSON object: %.200s", plan_json);
    } else {
      cJSON_AddItemToObject(req, "plan", plan);
    }
  }
  if (rc != 0) {
    cJSON_Delete(req);
    return rc;
  }
  *out = req;
  return 0;
}

int weightd_load_group(weightd_client *c, const char *path, const struct weightd_group_options *opts,
                       weightd_group **out) {
  if (out != NULL) *out = NULL;
  int rc = lib_usable(c);
  if (rc != 0) return rc;
  if (out == NULL) return lib_fail(c, WEIGHTD_E_INVALID, "load_group: out is NULL");
  cJSON *req;
  if ((rc = group_request(c, path, opts, &req)) != 0) return rc;
  weightd_progress_fn progress = GOPT_HAS(opts, progress) ? opts->progress : NULL;
  void *arg = GOPT_HAS(opts, progress_arg) ? opts->progress_arg : NULL;
  char *text = NULL;
  rc = lib_call(c, req, progress, arg, NULL, NULL, &text);
  cJSON_Delete(req);
  cJSON *reply = text != NULL ? cJSON_Parse(text) : NULL;
  free(text);
  if (reply != NULL) *out = group_from_reply(reply);
  if (rc == 0 && *out == NULL)
    rc = lib_fail(c, reply == NULL ? WEIGHTD_E_NOMEM : WEIGHTD_E_PROTOCOL, "load_group: the reply has no \"ranks\"");
  cJSON_Delete(reply);
  return rc;
}

size_t weightd_group_size(const weightd_group *g) { return g != NULL ? g->n : 0; }

int weightd_group_rank(const weightd_group *g, size_t i, struct weightd_group_rank *out) {
  if (g == NULL || out == NULL || out->struct_size == 0) return WEIGHTD_E_INVALID;
  if (i >= g->n) return WEIGHTD_E_NOT_FOUND;
  const struct group_rank *r = &g->ranks[i];
  struct weightd_group_rank v = {.struct_size = out->struct_size,
                                 .rank = r->rank,
                                 .tp_rank = r->tp_rank,
                                 .ep_rank = r->ep_rank,
                                 .device = r->device,
                                 .set_id = r->set_id,
                                 .error = r->error,
                                 .message = r->message,
                                 .method = r->method,
                                 .source = r->source,
                                 .bytes = r->bytes,
                                 .seconds = r->seconds};
  /* Fields past the caller's struct_size are left alone: an older caller's struct is smaller. */
  size_t n = out->struct_size < sizeof v ? out->struct_size : sizeof v;
  memcpy(out, &v, n);
  return 0;
}
