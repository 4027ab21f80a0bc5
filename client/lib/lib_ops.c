/* lib_ops.c - the daemon's ops as C calls: open, prefetch, load, evict, attach, release. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lib_internal.h"

/* Sends req (consumed) and discards the reply: for ops whose reply the C API does not return. */
static int simple_call(weightd_client *c, cJSON *req) {
  if (req == NULL) return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  int rc = lib_call(c, req, NULL, NULL, NULL, NULL, NULL);
  cJSON_Delete(req);
  return rc;
}

int weightd_open(weightd_client *c, const char *path) {
  int rc = lib_usable(c);
  if (rc != 0) return rc;
  cJSON *req = lib_request_new("open");
  if (req != NULL && (rc = lib_add_path(c, req, path)) != 0) {
    cJSON_Delete(req);
    return rc;
  }
  return simple_call(c, req);
}

int weightd_prefetch(weightd_client *c, const char *path, int pin, int wait) {
  int rc = lib_usable(c);
  if (rc != 0) return rc;
  cJSON *req = lib_request_new("prefetch");
  if (req != NULL && (rc = lib_add_path(c, req, path)) != 0) {
    cJSON_Delete(req);
    return rc;
  }
  if (req != NULL && (cJSON_AddBoolToObject(req, "pin", pin != 0) == NULL ||
                      cJSON_AddBoolToObject(req, "wait", wait != 0) == NULL)) {
    cJSON_Delete(req);
    req = NULL;
  }
  return simple_call(c, req);
}

int weightd_evict(weightd_client *c, const char *set_id) {
  int rc = lib_usable(c);
  if (rc != 0) return rc;
  if (set_id == NULL || set_id[0] == '\0') return lib_fail(c, WEIGHTD_E_INVALID, "no set id given");
  cJSON *req = lib_request_new("evict");
  if (req != NULL && cJSON_AddStringToObject(req, "set", set_id) == NULL) {
    cJSON_Delete(req);
    req = NULL;
  }
  return simple_call(c, req);
}

/* ---- load ---------------------------------------------------------------------- */

/* True when opts (of the caller's struct_size) contains field. */
#define OPT_HAS(opts, field) \
  ((opts) != NULL && (opts)->struct_size >= offsetof(struct weightd_load_options, field) + sizeof((opts)->field))

/* Builds {"op": op, "path", "device", "plan", "source"} from the options. */
static int load_request(weightd_client *c, const char *op, const char *path,
                        const struct weightd_load_options *opts, cJSON **out) {
  *out = NULL;
  if (opts != NULL && opts->struct_size == 0)
    return lib_fail(c, WEIGHTD_E_INVALID, "weightd_load_options.struct_size is 0: set it to sizeof the struct");
  cJSON *req = lib_request_new(op);
  if (req == NULL) return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  int rc = lib_add_path(c, req, path);
  if (rc != 0) goto fail;
  const char *device = OPT_HAS(opts, device) ? opts->device : NULL;
  cJSON *dev = device != NULL ? cJSON_CreateString(device) : cJSON_CreateNumber(0);
  if (dev == NULL || !cJSON_AddItemToObject(req, "device", dev)) {
    cJSON_Delete(dev);
    rc = lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  const char *plan_json = OPT_HAS(opts, plan_json) ? opts->plan_json : NULL;
  if (plan_json != NULL) {
    cJSON *plan = cJSON_Parse(plan_json);
    if (!cJSON_IsObject(plan)) {
      cJSON_Delete(plan);
      rc = lib_fail(c, WEIGHTD_E_INVALID, "the plan is not a JSON object: %.200s", plan_json);
      goto fail;
    }
    cJSON_AddItemToObject(req, "plan", plan);
  }
  const char *source = OPT_HAS(opts, source) ? opts->source : NULL;
  if (source != NULL && cJSON_AddStringToObject(req, "source", source) == NULL) {
    rc = lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  *out = req;
  return 0;
fail:
  cJSON_Delete(req);
  return rc;
}

int weightd_load(weightd_client *c, const char *path, const struct weightd_load_options *opts,
                 char *set_id, size_t set_id_len) {
  int rc = lib_usable(c);
  if (rc != 0) return rc;
  cJSON *req;
  if ((rc = load_request(c, "load", path, opts, &req)) != 0) return rc;
  weightd_progress_fn progress = OPT_HAS(opts, progress) ? opts->progress : NULL;
  void *arg = OPT_HAS(opts, progress_arg) ? opts->progress_arg : NULL;
  cJSON *reply = NULL;
  rc = lib_call(c, req, progress, arg, &reply, NULL, NULL);
  cJSON_Delete(req);
  if (rc != 0) return rc;
  const char *set = lib_get_str(reply, "set");
  if (set == NULL) rc = lib_fail(c, WEIGHTD_E_PROTOCOL, "load: the reply has no \"set\"");
  else if (set_id != NULL && strlen(set) >= set_id_len)
    rc = lib_fail(c, WEIGHTD_E_INVALID, "load: set id '%s' does not fit in %zu bytes", set, set_id_len);
  else if (set_id != NULL)
    memcpy(set_id, set, strlen(set) + 1);
  cJSON_Delete(reply);
  return rc;
}

/* ---- attach and release --------------------------------------------------------- */

static int attach_call(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *arg,
                       weightd_set **out) {
  struct sj_doc reply;
  struct wire_frame frame;
  int rc = lib_call_doc(c, req, progress, arg, &reply, &frame);
  cJSON_Delete(req);
  if (rc != 0) return rc;
  rc = lib_set_from_reply(c, reply.root, &frame, out);
  const char *lease = lib_sj_str(reply.root, "lease");
  if (rc != 0 && lease != NULL) {
    /* The daemon granted a lease we cannot use: hand it back, keeping the first error. */
    struct wd_error saved = c->err;
    cJSON *rel = lib_request_new("release");
    if (rel != NULL && cJSON_AddStringToObject(rel, "lease", lease) != NULL)
      lib_call(c, rel, NULL, NULL, NULL, NULL, NULL);
    cJSON_Delete(rel);
    c->err = saved;
  }
  wire_frame_clear(&frame);
  sj_doc_free(&reply);
  return rc;
}

static int attach_id(weightd_client *c, const char *set_id, int early, weightd_set **out) {
  if (out != NULL) *out = NULL;
  int rc = lib_usable(c);
  if (rc != 0) return rc;
  if (out == NULL) return lib_fail(c, WEIGHTD_E_INVALID, "attach: out is NULL");
  if (set_id == NULL || set_id[0] == '\0') return lib_fail(c, WEIGHTD_E_INVALID, "no set id given");
  cJSON *req = lib_request_new("attach");
  if (req == NULL || cJSON_AddStringToObject(req, "set", set_id) == NULL ||
      (early && cJSON_AddBoolToObject(req, "early", 1) == NULL)) {
    cJSON_Delete(req);
    return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  }
  return attach_call(c, req, NULL, NULL, out);
}

int weightd_attach(weightd_client *c, const char *set_id, weightd_set **out) { return attach_id(c, set_id, 0, out); }

int weightd_attach_early(weightd_client *c, const char *set_id, weightd_set **out) {
  return attach_id(c, set_id, 1, out);
}

int weightd_attach_path(weightd_client *c, const char *path, const struct weightd_load_options *opts,
                        weightd_set **out) {
  if (out != NULL) *out = NULL;
  int rc = lib_usable(c);
  if (rc != 0) return rc;
  if (out == NULL) return lib_fail(c, WEIGHTD_E_INVALID, "attach: out is NULL");
  cJSON *req;
  if ((rc = load_request(c, "attach", path, opts, &req)) != 0) return rc;
  unsigned flags = OPT_HAS(opts, flags) ? opts->flags : 0;
  if ((flags & WEIGHTD_ATTACH_EARLY) && cJSON_AddBoolToObject(req, "early", 1) == NULL) {
    cJSON_Delete(req);
    return lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
  }
  weightd_progress_fn progress = OPT_HAS(opts, progress) ? opts->progress : NULL;
  void *arg = OPT_HAS(opts, progress_arg) ? opts->progress_arg : NULL;
  return attach_call(c, req, progress, arg, out);
}

int weightd_release(weightd_set *s) {
  if (s == NULL) return 0;
  weightd_client *c = s->client;
  int in_child = s->pid != getpid();
  int rc = 0;
  if (c != NULL) {
    /* Unlink from the handle's list. */
    if (s->prev) s->prev->next = s->next;
    else c->sets = s->next;
    if (s->next) s->next->prev = s->prev;
    /* A child must not end the parent's lease; a dead connection has no lease left. */
    if (!in_child && c->sock >= 0 && !c->broken) {
      cJSON *req = lib_request_new("release");
      if (req == NULL || cJSON_AddStringToObject(req, "lease", s->lease) == NULL) {
        cJSON_Delete(req);
        rc = lib_fail(c, WEIGHTD_E_NOMEM, "out of memory");
      } else {
        /*
         * No per-frame timeout: a release given up on would report an error
         * for a lease the daemon still ends, and leave its reply to be
         * skipped later. The daemon answers release without I/O.
         */
        int saved = c->timeout_ms;
        c->timeout_ms = -1;
        rc = simple_call(c, req);
        c->timeout_ms = saved;
        /* A connection that died meanwhile took the lease with it. */
        if (c->broken && (rc == WEIGHTD_E_CLOSED || rc == WEIGHTD_E_SHUTDOWN)) rc = 0;
      }
    }
  }
  struct wd_error e;
  err_clear(&e);
  int mrc = lib_map_put(s->map, in_child, &e);
  if (mrc != 0 && rc == 0) rc = c != NULL ? lib_fail(c, mrc, "%s", e.msg) : mrc;
  lib_set_free(s);
  return rc;
}
