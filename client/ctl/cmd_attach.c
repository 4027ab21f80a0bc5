/*
 * cmd_attach.c - `weightctl attach (SET | PATH [--device D] [plan flags]) [--verify] [--hold]`:
 * lease a resident set and map it in this process, as an engine would.
 * --verify compares the set with its plan (as status reports it) rebuilt
 * here from the checkpoint's files.
 *
 * The argument is a checkpoint PATH when it contains a '/' or names an
 * existing file or directory, else a set id. With --json the output is one
 * object built here (set, lease, device, bytes, memory, tensors and, with
 * --verify, the verified counts): the daemon's reply carries the whole
 * tensor table, which is not what a script asks attach for.
 */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ctl.h"
#include "wire.h"

static int looks_like_path(const char *arg) {
  struct stat st;
  return strchr(arg, '/') != NULL || stat(arg, &st) == 0;
}

/*
 * The checkpoint path and the plan of a resident set, from status. Returns 0
 * with *path a new string and *spec the set's plan (a new object), or
 * CTL_EXIT_FAIL after printing why.
 */
static int set_origin(weightd_client *c, const char *set_id, char **path, cJSON **spec) {
  char *text = NULL, req[128];
  *path = NULL;
  *spec = NULL;
  /* The one set numbered set_id's number: a status page of the sets after the next number, one item long. */
  snprintf(req, sizeof req, "{\"op\":\"status\",\"limit\":1,\"after\":{\"sets\":%llu}}",
           strtoull(set_id + (set_id[0] != '\0'), NULL, 10) + 1);
  ctl_guard_call_begin();
  int rc = weightd_request(c, req, &text, NULL, NULL);
  ctl_guard_call_end();
  if (rc != 0) {
    weightd_free(text);
    return ctl_fail(c, rc, "status");
  }
  cJSON *r = cJSON_Parse(text);
  weightd_free(text);
  const cJSON *x;
  cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(r, "sets")) {
    if (strcmp(ctl_str(x, "set"), set_id) != 0) continue;
    const cJSON *plan = cJSON_GetObjectItemCaseSensitive(x, "plan");
    *spec = cJSON_IsObject(plan) ? cJSON_Duplicate(plan, 1) : NULL;
    *path = strdup(ctl_str(x, "path"));
    break;
  }
  cJSON_Delete(r);
  if (*path == NULL) {
    ctl_errorf("verify: the daemon's status does not list set %s", set_id);
    cJSON_Delete(*spec);
    *spec = NULL;
    return CTL_EXIT_FAIL;
  }
  return 0;
}

/* The wire name of a set's handle kind. */
static const char *handle_name(const weightd_set *s) {
  switch (weightd_set_handle_kind(s)) {
  case WEIGHTD_HANDLE_FD: return "fd";
  case WEIGHTD_HANDLE_CUDA_IPC: return "cuda_ipc";
  case WEIGHTD_HANDLE_CUDA_VMM: return "cuda_vmm";
  }
  return "?";
}

static void print_attached(const weightd_set *s, int verified, const struct ctl_verify_result *vr) {
  int cuda = weightd_set_memory_kind(s) == WEIGHTD_MEMORY_CUDA;
  if (ctl_opts.json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddTrueToObject(o, "ok");
    cJSON_AddStringToObject(o, "set", weightd_set_id(s));
    cJSON_AddStringToObject(o, "lease", weightd_set_lease(s));
    cJSON_AddStringToObject(o, "device", weightd_set_device(s));
    cJSON_AddNumberToObject(o, "bytes", (double)weightd_set_bytes(s));
    cJSON_AddStringToObject(o, "memory", cuda ? "cuda" : "host");
    cJSON_AddStringToObject(o, "handles", handle_name(s));
    cJSON_AddBoolToObject(o, "read_only", weightd_set_read_only(s));
    cJSON_AddNumberToObject(o, "tensors", (double)weightd_set_tensor_count(s));
    if (verified) {
      cJSON *v = cJSON_AddObjectToObject(o, "verified");
      cJSON_AddNumberToObject(v, "tensors", (double)vr->tensors);
      cJSON_AddNumberToObject(v, "bytes", (double)vr->bytes);
    }
    ctl_json_print(o);
    return;
  }
  char b[32];
  ctl_human_bytes(weightd_set_bytes(s), b, sizeof b);
  printf("attached set %s, lease %s\n  %zu tensors, %" PRIu64 " bytes (%s) of %s memory at %p on %s\n"
         "  through %s handles, mapped %s\n",
         weightd_set_id(s), weightd_set_lease(s), weightd_set_tensor_count(s), weightd_set_bytes(s), b,
         cuda ? "CUDA device" : "host", weightd_set_base(s), weightd_set_device(s), handle_name(s),
         weightd_set_read_only(s) ? "read-only" : "writable (every attached process shares it: never write)");
  if (verified) {
    ctl_human_bytes(vr->bytes, b, sizeof b);
    printf("verified %zu tensors, %" PRIu64 " bytes (%s): identical to its plan gathered from the checkpoint's "
           "files\n",
           vr->tensors, vr->bytes, b);
  }
}

/* Blocks until SIGINT or SIGTERM (blocked by the caller beforehand). */
static void hold(const weightd_set *s, const sigset_t *sigs) {
  if (!ctl_opts.json)
    printf("holding lease %s on set %s; interrupt (Ctrl-C) or SIGTERM releases it\n", weightd_set_lease(s),
           weightd_set_id(s));
  fflush(stdout);
  int sig;
  sigwait(sigs, &sig);
}

static const struct optab_opt attach_opts[] = {
    {CTL_OPT_DEVICE, "device", 0, OPTAB_VALUE, "D",
     "With a PATH: the device of the set, an index or a UUID (default 0).", 0, NULL},
    {CTL_OPT_VERIFY, "verify", 0, OPTAB_SWITCH, NULL,
     "Compare every tensor and byte of the set with its plan rebuilt here from the checkpoint's files (a "
     "progress line on a terminal); exit 1 at the first difference, naming the tensor and the byte.",
     0, NULL},
    {CTL_OPT_HOLD, "hold", 0, OPTAB_SWITCH, NULL,
     "Keep the lease until interrupted (Ctrl-C or SIGTERM), as an engine would hold it.", 0, NULL},
};

static int run_attach(const struct ctl_args *a) {
  const char *target = a->pos[0], *device = ctl_val(a, CTL_OPT_DEVICE);
  bool verify = ctl_has(a, CTL_OPT_VERIFY), holding = ctl_has(a, CTL_OPT_HOLD);
  struct ctl_plan_args pa;
  int by_path = looks_like_path(target);
  cJSON *spec = NULL;
  int prc = ctl_plan_args_get(a, &pa);
  if (prc == 0) prc = ctl_plan_spec(&pa, 0, &spec);
  if (prc != 0) return prc;
  if (verify && wire_path_is_url(target)) {
    cJSON_Delete(spec);
    return ctl_usage_error("--verify compares a set with the checkpoint's files on this machine, and %.200s is a "
                           "URL: attach it without --verify", target);
  }
  if (!by_path && (device != NULL || spec != NULL)) {
    cJSON_Delete(spec);
    return ctl_usage_error("--device and plan flags go with a checkpoint PATH; '%s' is taken as a set id", target);
  }
  char *plan_json = spec != NULL ? cJSON_PrintUnformatted(spec) : NULL;
  cJSON_Delete(spec);
  spec = NULL;
  /* Signals that end --hold wait for sigwait, from before the lease exists. */
  sigset_t sigs, old;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  if (holding) sigprocmask(SIG_BLOCK, &sigs, &old);

  weightd_client *c = NULL;
  weightd_set *s = NULL;
  int rc, exit_code = ctl_connect(&c);
  if (exit_code != 0) goto done;
  if (by_path) {
    struct weightd_load_options o = {
        .struct_size = sizeof o, .device = device, .plan_json = plan_json, .progress = ctl_progress_cb};
    ctl_progress_begin("attach");
    ctl_guard_call_begin();
    rc = weightd_attach_path(c, target, &o, &s);
    ctl_guard_call_end();
    ctl_progress_end();
  } else {
    ctl_guard_call_begin();
    rc = weightd_attach(c, target, &s);
    ctl_guard_call_end();
  }
  if (rc != 0) {
    exit_code = ctl_fail(c, rc, "attach");
    goto done;
  }
  struct ctl_verify_result vr = {0};
  if (verify) {
    char *path = NULL;
    if (set_origin(c, weightd_set_id(s), &path, &spec) != 0 ||
        ctl_verify_set(s, by_path ? target : path, spec, &vr) != 0)
      exit_code = ctl_guard_reason() != CTL_GUARD_NONE ? ctl_exit_for(WEIGHTD_E_CANCELED) : CTL_EXIT_FAIL;
    free(path);
  }
  if (exit_code == CTL_EXIT_OK) {
    print_attached(s, verify, &vr);
    if (holding) {
      ctl_guard_stop(); /* the signals end the hold now */
      hold(s, &sigs);
    }
  }
  ctl_guard_call_begin();
  rc = weightd_release(s);
  ctl_guard_call_end();
  if (rc != 0 && exit_code == CTL_EXIT_OK) exit_code = ctl_fail(c, rc, "release");
done:
  ctl_disconnect(c);
  cJSON_Delete(spec);
  free(plan_json);
  if (holding) sigprocmask(SIG_SETMASK, &old, NULL);
  return exit_code;
}

const struct ctl_cmd ctl_cmd_attach = {
    .name = "attach",
    .args = "(SET | PATH)",
    .min_args = 1,
    .max_args = 1,
    .summary = "lease a resident set, map it here; --verify compares every byte with the plan from the files",
    .description =
        "Leases a resident set and maps its memory in this process, as an engine does: by set id (s3), or by "
        "checkpoint PATH with --device and the plan flags (the set is loaded first when it is not resident, "
        "with a progress line on a terminal; Ctrl-C cancels the load). Prints the set, the lease, the memory "
        "and where it is mapped; the lease ends when attach exits, or with --hold when interrupted.\n\nThe "
        "argument is a PATH when it contains a '/' or names an existing file or directory, else a set id.",
    .opts = CTL_OPTS(attach_opts),
    .flags = CTL_CMD_DAEMON | CTL_CMD_PLAN,
    .run = run_attach,
};
