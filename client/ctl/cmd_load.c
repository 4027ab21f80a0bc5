/* cmd_load.c - `weightctl load PATH [--device D] [plan flags]`: load one rank's plan onto a device. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "ctl.h"

static const struct optab_opt load_opts[] = {
    {CTL_OPT_DEVICE, "device", 0, OPTAB_VALUE, "D",
     "The device to load onto: the daemon's index (0, 1, ...) or a UUID (GPU-..., host-...); default 0.", 0,
     NULL},
};

static int run_load(const struct ctl_args *a) {
  struct ctl_plan_args pa;
  cJSON *plan = NULL;
  int rc = ctl_plan_args_get(a, &pa);
  if (rc == 0) rc = ctl_plan_spec(&pa, 0, &plan);
  if (rc != 0) return rc;
  weightd_client *c;
  if ((rc = ctl_connect(&c)) != 0) {
    cJSON_Delete(plan);
    return rc;
  }
  cJSON *req = ctl_request_new("load"), *reply;
  ctl_add_path(req, a->pos[0]);
  ctl_add_device(req, ctl_val(a, CTL_OPT_DEVICE));
  if (plan != NULL) cJSON_AddItemToObject(req, "plan", plan);
  ctl_progress_begin("load");
  rc = ctl_request(c, req, ctl_progress_cb, NULL, &reply);
  ctl_progress_end();
  if (rc == 0 && ctl_opts.json) {
    ctl_json_print(reply);
  } else if (rc == 0) {
    char b[32];
    uint64_t bytes = ctl_u64(reply, "bytes");
    ctl_human_bytes(bytes, b, sizeof b);
    printf("set %s on %s\n  %" PRIu64 " tensors, %" PRIu64 " bytes (%s) in %.3f s, %.2f GiB/s (%s)%s\n",
           ctl_str(reply, "set"), ctl_str(reply, "device"), ctl_u64(reply, "tensors"), bytes, b,
           ctl_num(reply, "seconds"), ctl_num(reply, "gib_per_s"), ctl_str(reply, "method"),
           cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(reply, "shared")) ? "; already resident, shared" : "");
    cJSON_Delete(reply);
  }
  ctl_disconnect(c);
  return ctl_exit_for(rc);
}

const struct ctl_cmd ctl_cmd_load = {
    .name = "load",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "load a checkpoint (one rank's plan) onto a device and print its resident set",
    .description =
        "Loads the tensors of one rank's plan of the checkpoint at PATH into one slab of device memory (a "
        "resident set) and prints the set's id, its size, the time and the rate. A set that is already resident "
        "is shared, not loaded again. On a terminal a progress line shows the bytes, rate and time left; Ctrl-C "
        "cancels the load.",
    .opts = CTL_OPTS(load_opts),
    .flags = CTL_CMD_DAEMON | CTL_CMD_PLAN,
    .run = run_load,
};
