/* cmd_open.c - `weightctl open PATH` and `weightctl prefetch PATH [--pin] [--wait] [plan flags]`. */
#include <stdio.h>
#include <string.h>

#include "ctl.h"

/* Sends req (consumed) and prints the reply's checkpoint as verb; progress on a terminal while it waits. */
static int run_checkpoint_op(cJSON *req, const char *verb, bool progress) {
  weightd_client *c;
  int rc = ctl_connect(&c);
  if (rc != 0) {
    cJSON_Delete(req);
    return rc;
  }
  cJSON *reply;
  if (progress) ctl_progress_begin(verb);
  rc = ctl_request(c, req, progress ? ctl_progress_cb : NULL, NULL, &reply);
  if (progress) ctl_progress_end();
  if (rc == 0 && ctl_opts.json) {
    ctl_json_print(reply);
  } else if (rc == 0) {
    ctl_print_checkpoint(verb, cJSON_GetObjectItemCaseSensitive(reply, "checkpoint"));
    cJSON_Delete(reply);
  }
  ctl_disconnect(c);
  return ctl_exit_for(rc);
}

static int run_open(const struct ctl_args *a) {
  cJSON *req = ctl_request_new("open");
  ctl_add_path(req, a->pos[0]);
  return run_checkpoint_op(req, "opened", false);
}

const struct ctl_cmd ctl_cmd_open = {
    .name = "open",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "validate and map a checkpoint in the daemon",
    .description = "Has the daemon validate every shard header of the checkpoint at PATH (a directory or a "
                   ".safetensors file) and map it, and prints its layout, shards, tensors, bytes and how much of it "
                   "is in the page cache.",
    .flags = CTL_CMD_DAEMON,
    .run = run_open,
};

static const struct optab_opt prefetch_opts[] = {
    {CTL_OPT_PIN, "pin", 0, OPTAB_SWITCH, NULL,
     "Also register the checkpoint for direct DMA (the pinned-resident tier, within host_pin_budget); loads "
     "from it then copy with no CPU copy.",
     0, NULL},
    {CTL_OPT_WAIT, "wait", 0, OPTAB_SWITCH, NULL,
     "Wait until the read (and the pinning) is done, with a progress line on a terminal; Ctrl-C cancels it.", 0,
     NULL},
};

static int run_prefetch(const struct ctl_args *a) {
  struct ctl_plan_args pa;
  cJSON *plan = NULL;
  int prc = ctl_plan_args_get(a, &pa);
  if (prc == 0) prc = ctl_plan_spec(&pa, 0, &plan);
  if (prc != 0) return prc;
  cJSON *req = ctl_request_new("prefetch");
  ctl_add_path(req, a->pos[0]);
  bool wait = ctl_has(a, CTL_OPT_WAIT);
  cJSON_AddBoolToObject(req, "pin", ctl_has(a, CTL_OPT_PIN));
  cJSON_AddBoolToObject(req, "wait", wait);
  if (plan != NULL) cJSON_AddItemToObject(req, "plan", plan);
  return run_checkpoint_op(req, wait ? "prefetched" : "prefetching", wait);
}

const struct ctl_cmd ctl_cmd_prefetch = {
    .name = "prefetch",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "warm a checkpoint in the page cache (--pin: the pinned-resident tier; a plan: only its bytes)",
    .description = "Has the daemon read the checkpoint at PATH into the page cache on its own threads, so that "
                   "loads do not wait for the disk. Without --wait it answers at once and reads in the background. "
                   "With plan flags only the byte ranges that rank's plan reads are read (and, with --pin, "
                   "registered), so a rank of a model larger than host memory can be pinned.",
    .opts = CTL_OPTS(prefetch_opts),
    .flags = CTL_CMD_DAEMON | CTL_CMD_PLAN,
    .run = run_prefetch,
};
