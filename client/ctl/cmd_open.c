/* cmd_open.c - `weightctl open PATH` and `weightctl prefetch PATH [--pin] [--wait] [plan flags]`. */
#include <stdio.h>
#include <string.h>

#include "ctl.h"

/* Sends req (consumed) and prints the reply's checkpoint as verb. */
static int run_checkpoint_op(cJSON *req, const char *verb) {
  weightd_client *c;
  if (ctl_connect(&c) != 0) {
    cJSON_Delete(req);
    return CTL_EXIT_FAIL;
  }
  cJSON *reply;
  int rc = ctl_request(c, req, NULL, NULL, &reply);
  if (rc == 0 && !ctl_opts.json) ctl_print_checkpoint(verb, cJSON_GetObjectItemCaseSensitive(reply, "checkpoint"));
  cJSON_Delete(reply);
  weightd_close(c);
  return rc == 0 ? CTL_EXIT_OK : CTL_EXIT_FAIL;
}

int cmd_open(int argc, char **argv) {
  const char *path = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) ctl_opts.json = 1;
    else if (argv[i][0] != '-' && path == NULL) path = argv[i];
    else return ctl_usage("open");
  }
  if (path == NULL) return ctl_usage("open");
  cJSON *req = ctl_request_new("open");
  ctl_add_path(req, path);
  return run_checkpoint_op(req, "opened");
}

int cmd_prefetch(int argc, char **argv) {
  const char *path = NULL;
  int pin = 0, wait = 0;
  struct ctl_plan_args pa = {.cmd = "prefetch"};
  for (int i = 1; i < argc; i++) {
    int taken = ctl_plan_arg(&pa, argc, argv, &i);
    if (taken < 0) return CTL_EXIT_USAGE;
    if (taken) continue;
    if (strcmp(argv[i], "--json") == 0) ctl_opts.json = 1;
    else if (strcmp(argv[i], "--pin") == 0) pin = 1;
    else if (strcmp(argv[i], "--wait") == 0) wait = 1;
    else if (argv[i][0] != '-' && path == NULL) path = argv[i];
    else return ctl_usage("prefetch");
  }
  if (path == NULL) return ctl_usage("prefetch");
  cJSON *plan = NULL;
  int prc = ctl_plan_spec(&pa, 0, &plan);
  if (prc != 0) return prc;
  cJSON *req = ctl_request_new("prefetch");
  ctl_add_path(req, path);
  cJSON_AddBoolToObject(req, "pin", pin);
  cJSON_AddBoolToObject(req, "wait", wait);
  if (plan != NULL) cJSON_AddItemToObject(req, "plan", plan);
  return run_checkpoint_op(req, wait ? "prefetched" : "prefetching");
}
