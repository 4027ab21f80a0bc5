/*
 * cmd_load.c - `weightctl load PATH [--device D] [plan flags]`: load one
 * rank's plan onto a device; with --all-ranks, every rank of the group
 * (ctl_group.c).
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "ctl.h"

int cmd_load(int argc, char **argv) {
  const char *path = NULL, *device = NULL, *devices = NULL;
  int all_ranks = 0;
  struct ctl_plan_args pa = {.cmd = "load"};
  for (int i = 1; i < argc; i++) {
    int taken = ctl_plan_arg(&pa, argc, argv, &i);
    if (taken < 0) return CTL_EXIT_USAGE;
    if (taken) continue;
    if (strcmp(argv[i], "--json") == 0) ctl_opts.json = 1;
    else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) device = argv[++i];
    else if (strcmp(argv[i], "--all-ranks") == 0) all_ranks = 1;
    else if (strcmp(argv[i], "--devices") == 0 && i + 1 < argc) devices = argv[++i];
    else if (argv[i][0] != '-' && path == NULL) path = argv[i];
    else return ctl_usage("load");
  }
  if (path == NULL) return ctl_usage("load");
  if (devices != NULL && !all_ranks) {
    ctl_errorf("load: --devices lists one device per rank of --all-ranks (one rank: --device D)");
    return CTL_EXIT_USAGE;
  }
  if (all_ranks && device != NULL) {
    ctl_errorf("load: --all-ranks places ranks with --devices D,D,... (one per rank), not --device");
    return CTL_EXIT_USAGE;
  }
  if (all_ranks) {
    cJSON *group = NULL, *base = NULL;
    int grc = ctl_group_spec(&pa, devices, &group, &base);
    weightd_client *gc = NULL;
    if (grc == 0 && ctl_connect(&gc) != 0) grc = CTL_EXIT_FAIL;
    if (grc != 0) {
      cJSON_Delete(group);
      cJSON_Delete(base);
      return grc;
    }
    grc = ctl_group_load(gc, path, group, base);
    weightd_close(gc);
    return grc;
  }
  cJSON *plan = NULL;
  int prc = ctl_plan_spec(&pa, 0, &plan);
  if (prc != 0) return prc;

  weightd_client *c;
  if (ctl_connect(&c) != 0) {
    cJSON_Delete(plan);
    return CTL_EXIT_FAIL;
  }
  cJSON *req = ctl_request_new("load"), *reply;
  ctl_add_path(req, path);
  ctl_add_device(req, device);
  if (plan != NULL) cJSON_AddItemToObject(req, "plan", plan);
  int rc = ctl_request(c, req, ctl_progress, NULL, &reply);
  ctl_progress_done();
  if (rc == 0 && !ctl_opts.json) {
    char b[32];
    uint64_t bytes = ctl_u64(reply, "bytes");
    const cJSON *secs = cJSON_GetObjectItemCaseSensitive(reply, "seconds");
    const cJSON *rate = cJSON_GetObjectItemCaseSensitive(reply, "gib_per_s");
    ctl_human_bytes(bytes, b, sizeof b);
    printf("set %s on %s\n  %" PRIu64 " tensors, %" PRIu64 " bytes (%s) in %.3f s, %.2f GiB/s (%s)%s\n",
           ctl_str(reply, "set"), ctl_str(reply, "device"), ctl_u64(reply, "tensors"), bytes, b,
           cJSON_IsNumber(secs) ? secs->valuedouble : 0.0, cJSON_IsNumber(rate) ? rate->valuedouble : 0.0,
           ctl_str(reply, "method"),
           cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(reply, "shared")) ? "; already resident, shared" : "");
  }
  cJSON_Delete(reply);
  weightd_close(c);
  return rc == 0 ? CTL_EXIT_OK : CTL_EXIT_FAIL;
}
