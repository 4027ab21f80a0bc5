/*
 * ctl_group.c - whole groups from weightctl: `load --all-ranks` sends one
 * load_group for every rank of a tensor/expert-parallel group and prints each
 * rank's set, device and source.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

/* The longest device name --devices takes (a UUID is 40 bytes). */
#define DEVICE_NAME_MAX 64

/* Splits "0,1,GPU-..." into a JSON array of device names; NULL (after saying why) when malformed. */
static cJSON *devices_parse(const char *list) {
  cJSON *arr = cJSON_CreateArray();
  const char *p = list;
  while (arr != NULL) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    if (len == 0 || len >= DEVICE_NAME_MAX) {
      ctl_usage_error("--devices wants device indexes or UUIDs separated by commas, such as 0,1,2,3, not '%s'", list);
      cJSON_Delete(arr);
      return NULL;
    }
    char name[DEVICE_NAME_MAX];
    memcpy(name, p, len);
    name[len] = '\0';
    cJSON_AddItemToArray(arr, cJSON_CreateString(name));
    if (comma == NULL) break;
    p = comma + 1;
  }
  return arr;
}

int ctl_group_spec(const struct ctl_plan_args *a, const char *devices, cJSON **group, cJSON **plan) {
  *group = *plan = NULL;
  if (a->file != NULL)
    return ctl_usage_error("--all-ranks plans each rank from a preset; --plan FILE is one rank's plan");
  if (a->has_tp_rank || a->has_ep_rank || a->experts != NULL)
    return ctl_usage_error(
        "--all-ranks loads every rank: give --tp-size and --ep-size, not --tp-rank, --ep-rank or --experts");
  if ((a->has_tp_size && a->tp_size == 0) || (a->has_ep_size && a->ep_size == 0))
    return ctl_usage_error("--tp-size and --ep-size must be at least 1");
  if (a->preset != NULL && strcmp(a->preset, "whole") == 0 &&
      ((a->has_tp_size && a->tp_size > 1) || (a->has_ep_size && a->ep_size > 1)))
    return ctl_usage_error("--preset whole has no ranks: give a family preset, or leave --preset out (auto)");
  cJSON *g = cJSON_CreateObject(), *p = cJSON_CreateObject();
  if (g == NULL || p == NULL) {
    cJSON_Delete(g);
    cJSON_Delete(p);
    ctl_errorf("%s: out of memory", a->cmd);
    return CTL_EXIT_FAIL;
  }
  cJSON_AddNumberToObject(g, "tp_size", a->has_tp_size ? (double)a->tp_size : 1);
  cJSON_AddNumberToObject(g, "ep_size", a->has_ep_size ? (double)a->ep_size : 1);
  if (devices != NULL) {
    cJSON *list = devices_parse(devices);
    if (list == NULL) {
      cJSON_Delete(g);
      cJSON_Delete(p);
      return CTL_EXIT_USAGE;
    }
    cJSON_AddItemToObject(g, "devices", list);
  }
  cJSON_AddStringToObject(p, "preset", a->preset != NULL ? a->preset : "auto");
  if (a->fuse) cJSON_AddTrueToObject(p, "fuse");
  *group = g;
  *plan = p;
  return 0;
}

/* One line per rank: its ranks, set, device, bytes, time, method and source, or its error. */
static void print_ranks(const cJSON *reply) {
  const cJSON *x;
  cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(reply, "ranks")) {
    printf("  rank %-3" PRIu64 " tp %-3" PRIu64 " ep %-3" PRIu64 " on %s\n", ctl_u64(x, "rank"), ctl_u64(x, "tp_rank"),
           ctl_u64(x, "ep_rank"), ctl_str(x, "device"));
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(x, "error");
    if (err != NULL) {
      printf("       failed: %s (%s)\n", ctl_str(err, "message"), ctl_str(err, "code"));
      continue;
    }
    char b[32];
    ctl_human_bytes(ctl_u64(x, "bytes"), b, sizeof b);
    printf("       set %s, %s in %.3f s (%s, from %s)%s\n", ctl_str(x, "set"), b, ctl_num(x, "seconds"),
           ctl_str(x, "method"), ctl_str(x, "source"),
           cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(x, "shared")) ? ", already resident" : "");
  }
}

int ctl_group_load(weightd_client *c, const char *path, cJSON *group, cJSON *plan, const char *source) {
  cJSON *req = ctl_request_new("load_group");
  ctl_add_path(req, path);
  cJSON_AddItemToObject(req, "group", group);
  cJSON_AddItemToObject(req, "plan", plan);
  if (source != NULL) cJSON_AddStringToObject(req, "source", source);
  char *text = cJSON_PrintUnformatted(req);
  cJSON_Delete(req);
  if (text == NULL) {
    ctl_errorf("out of memory");
    return CTL_EXIT_FAIL;
  }
  /* Not ctl_request: a failed group's error reply still lists every rank, and is printed too. */
  if (ctl_guard_reason() != CTL_GUARD_NONE) { /* a step before this one was canceled (prewarm) */
    free(text);
    return ctl_fail(c, WEIGHTD_E_CANCELED, "load_group");
  }
  char *out = NULL;
  ctl_progress_begin("load_group");
  ctl_guard_call_begin();
  int rc = weightd_request(c, text, &out, ctl_progress_cb, NULL);
  ctl_guard_call_end();
  ctl_progress_end();
  free(text);
  cJSON *reply = out != NULL ? cJSON_Parse(out) : NULL;
  weightd_free(out);
  if (rc == 0 && reply == NULL) {
    ctl_errorf("load_group: the daemon's reply is not JSON");
    return CTL_EXIT_FAIL;
  }
  if (rc != 0) ctl_fail(c, rc, "load_group");
  if (ctl_opts.json && reply != NULL && (rc == 0 || cJSON_GetObjectItemCaseSensitive(reply, "ranks") != NULL)) {
    ctl_json_print(reply);
    return ctl_exit_for(rc);
  }
  if (reply != NULL && rc == 0) {
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(reply, "group");
    char b[32];
    ctl_human_bytes(ctl_u64(reply, "bytes"), b, sizeof b);
    printf("group of %" PRIu64 " rank%s (tp_size %" PRIu64 ", ep_size %" PRIu64 "): %s in %.3f s, %.2f GiB/s\n",
           ctl_u64(g, "ranks"), ctl_u64(g, "ranks") == 1 ? "" : "s", ctl_u64(g, "tp_size"), ctl_u64(g, "ep_size"), b,
           ctl_num(reply, "seconds"), ctl_num(reply, "gib_per_s"));
  }
  if (reply != NULL && !ctl_opts.json) print_ranks(reply);
  cJSON_Delete(reply);
  return ctl_exit_for(rc);
}
