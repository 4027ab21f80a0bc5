/*
 * cmd_release.c - `weightctl cancel REQUEST...`, `weightctl release LEASE...`,
 * `weightctl evict (SET | --device D)` and `weightctl shutdown`: the short
 * requests that end something.
 */
#include <stdio.h>
#include <string.h>

#include "ctl.h"

/*
 * Sends one request per id (field: the id), prints a line per answer with
 * say(), collects the replies for --json under `key`. Returns the exit code
 * of the first failure (the others are still tried).
 */
static int per_id(const struct ctl_args *a, const char *op, const char *field, const char *key,
                  void (*say)(const char *id, const cJSON *reply)) {
  weightd_client *c;
  int exit_code = ctl_connect(&c);
  if (exit_code != 0) return exit_code;
  cJSON *all = cJSON_CreateArray();
  for (int i = 0; i < a->npos; i++) {
    cJSON *req = ctl_request_new(op), *reply;
    cJSON_AddStringToObject(req, field, a->pos[i]);
    int rc = ctl_request(c, req, NULL, NULL, &reply);
    if (rc != 0) {
      if (exit_code == 0) exit_code = ctl_exit_for(rc);
      if (rc == WEIGHTD_E_CLOSED || rc == WEIGHTD_E_SHUTDOWN || rc == WEIGHTD_E_TIMEOUT) break;
      continue;
    }
    if (!ctl_opts.json) say(a->pos[i], reply);
    cJSON_DeleteItemFromObjectCaseSensitive(reply, "id");
    cJSON_DeleteItemFromObjectCaseSensitive(reply, "ok");
    cJSON_AddStringToObject(reply, field, a->pos[i]);
    cJSON_AddItemToArray(all, reply);
  }
  if (ctl_opts.json && exit_code == 0) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddTrueToObject(o, "ok");
    cJSON_AddItemToObject(o, key, all);
    ctl_json_print(o);
  } else {
    cJSON_Delete(all);
  }
  ctl_disconnect(c);
  return exit_code;
}

/* ---- cancel ---------------------------------------------------------------------------- */

static void say_canceled(const char *id, const cJSON *r) {
  if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "canceled")))
    printf("canceled %s (%s)\n", id, ctl_str(r, "op"));
  else
    printf("%s (%s) cannot be canceled; it finishes on its own\n", id, ctl_str(r, "op"));
}

static int run_cancel(const struct ctl_args *a) { return per_id(a, "cancel", "request", "canceled", say_canceled); }

const struct ctl_cmd ctl_cmd_cancel = {
    .name = "cancel",
    .args = "REQUEST...",
    .min_args = 1,
    .max_args = CTL_MAX_ARGS,
    .summary = "cancel requests by the daemon-wide ids status lists (rN): loads, attaches, prefetches, pins",
    .description =
        "Cancels requests of any connection by their daemon-wide ids, which status lists under requests (r42): "
        "a load or an attach that waits for its set (the load stops unless another request waits for the same "
        "set), a prefetch or pin that is waited for, or any request still queued. Allowed for requests of your "
        "own uid, and to root and the daemon's uid for any. The canceled request is answered CANCELED. Exits 1 "
        "when an id is not in progress (NOT_FOUND) or belongs to another uid (PERMISSION).",
    .flags = CTL_CMD_DAEMON,
    .run = run_cancel,
};

/* ---- release --------------------------------------------------------------------------- */

static void say_released(const char *id, const cJSON *r) {
  printf(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "released")) ? "released lease %s\n"
                                                                      : "lease %s was not held\n",
         id);
}

static int run_release(const struct ctl_args *a) { return per_id(a, "release", "lease", "released", say_released); }

const struct ctl_cmd ctl_cmd_release = {
    .name = "release",
    .args = "LEASE...",
    .min_args = 1,
    .max_args = CTL_MAX_ARGS,
    .summary = "end leases by the ids status lists (another connection's: root or the daemon's user only)",
    .description =
        "Ends leases by their ids (l7), which status lists with the holder's pid, uid and client name, and which "
        "evict's BUSY error names. A lease of another connection may be ended only by root or the daemon's uid "
        "(for a client that is gone or stuck: its owner is not told).",
    .flags = CTL_CMD_DAEMON,
    .run = run_release,
};

/* ---- evict ------------------------------------------------------------------------------ */

static const struct optab_opt evict_opts[] = {
    {CTL_OPT_DEVICE, "device", 0, OPTAB_VALUE, "D",
     "Evict every unleased set of device D (an index or a UUID) instead of one set.", 0, NULL},
};

static int run_evict(const struct ctl_args *a) {
  const char *set = a->npos > 0 ? a->pos[0] : NULL, *device = ctl_val(a, CTL_OPT_DEVICE);
  if ((set == NULL) == (device == NULL))
    return ctl_usage_error("give a SET or --device D (%s)", set ? "not both" : "neither was given");
  weightd_client *c;
  int rc = ctl_connect(&c);
  if (rc != 0) return rc;
  cJSON *req = ctl_request_new("evict"), *reply;
  if (set != NULL) cJSON_AddStringToObject(req, "set", set);
  ctl_add_device(req, device);
  rc = ctl_request(c, req, NULL, NULL, &reply);
  if (rc == 0 && ctl_opts.json) {
    ctl_json_print(reply);
  } else if (rc == 0) {
    const cJSON *ev = cJSON_GetObjectItemCaseSensitive(reply, "evicted"), *x;
    if (cJSON_GetArraySize(ev) == 0) printf("nothing evicted\n");
    else {
      printf("evicted");
      cJSON_ArrayForEach(x, ev) printf(" %s", cJSON_IsString(x) ? x->valuestring : "?");
      printf("\n");
    }
    cJSON_Delete(reply);
  }
  ctl_disconnect(c);
  return ctl_exit_for(rc);
}

const struct ctl_cmd ctl_cmd_evict = {
    .name = "evict",
    .args = "[SET]",
    .max_args = 1,
    .summary = "free a resident set, or every unleased set of a device",
    .description =
        "Frees the resident set SET, or with --device every unleased set of that device, and answers once the "
        "memory is back. A leased set is never freed: the BUSY error names each lease, its holder's pid, uid "
        "and client name, and how long it has been held (weightctl release LEASE ends one).",
    .opts = CTL_OPTS(evict_opts),
    .flags = CTL_CMD_DAEMON,
    .run = run_evict,
};

/* ---- shutdown --------------------------------------------------------------------------- */

static int run_shutdown(const struct ctl_args *a) {
  (void)a;
  weightd_client *c;
  int rc = ctl_connect(&c);
  if (rc != 0) return rc;
  char *text = NULL;
  ctl_guard_call_begin();
  rc = weightd_request(c, "{\"op\":\"shutdown\"}", &text, NULL, NULL);
  ctl_guard_call_end();
  /* A daemon that closed the connection after announcing its shutdown did what was asked. */
  if (rc == WEIGHTD_E_SHUTDOWN) rc = 0;
  if (rc != 0) {
    ctl_fail(c, rc, "shutdown");
  } else if (ctl_opts.json) {
    cJSON *o = text ? cJSON_Parse(text) : NULL;
    if (o == NULL) {
      o = cJSON_CreateObject();
      cJSON_AddTrueToObject(o, "ok");
      cJSON_AddTrueToObject(o, "stopping");
    }
    ctl_json_print(o);
  } else {
    printf("the daemon is stopping\n");
  }
  weightd_free(text);
  ctl_disconnect(c);
  return ctl_exit_for(rc);
}

const struct ctl_cmd ctl_cmd_shutdown = {
    .name = "shutdown",
    .args = "",
    .summary = "stop the daemon (root or the daemon's user only)",
    .description = "Asks the daemon to stop: it cancels running loads, tells every client, frees every set and "
                   "exits. Allowed to root and the daemon's own uid only (PERMISSION otherwise).",
    .flags = CTL_CMD_DAEMON,
    .run = run_shutdown,
};
