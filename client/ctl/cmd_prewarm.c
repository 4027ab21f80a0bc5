/*
 * cmd_prewarm.c - `weightctl prewarm PATH [plan flags] [--device D]... [--pin]
 * [--timeout S]`: the autoscaler's hook. Makes one rank's plan of a
 * checkpoint resident on each named device and returns when it is:
 * open (validate, map), prefetch with wait (and pin) of the bytes the plan
 * reads (the whole checkpoint for the whole plan), then load on each device
 * that does not hold the set yet.
 *
 * It is idempotent: the plan's key is built here from the checkpoint's
 * headers (as plan does) and compared with the sets status lists, so a set
 * already resident on every device returns at once without reading the
 * checkpoint again. When the files cannot be read here, every step runs
 * (a resident set is then shared by the load, still without loading twice).
 * Ctrl-C and --timeout cancel the step in flight (exit 1 and 4). A
 * checkpoint named by URL is opened and loaded, never prefetched (it has no
 * local files to read ahead).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "ctl.h"
#include "plan.h"
#include "wire.h"

static const struct optab_opt prewarm_opts[] = {
    {CTL_OPT_DEVICE, "device", 0, OPTAB_VALUE, "D",
     "A device to make the set resident on: an index or a UUID; repeat for several (default 0).", OPTAB_REPEAT,
     NULL},
    {CTL_OPT_ALL_RANKS, "all-ranks", 0, OPTAB_SWITCH, NULL,
     "Prewarm every rank of the group that --tp-size and --ep-size describe: the checkpoint is prefetched "
     "whole (and pinned with --pin), then one load_group loads each rank onto its device (ranks already "
     "resident are shared, not loaded again); not with --tp-rank, --ep-rank, --experts, --plan or --device.",
     0, NULL},
    {CTL_OPT_DEVICES, "devices", 0, OPTAB_VALUE, "D,D,...",
     "With --all-ranks: the device of each rank, in rank order; default: rank r on device r mod the device "
     "count.",
     0, NULL},
    {CTL_OPT_PIN, "pin", 0, OPTAB_SWITCH, NULL,
     "Pin the bytes the plan reads (the pinned-resident tier, within host_pin_budget) before loading, so that "
     "loads copy by direct DMA.",
     0, NULL},
};

/* One requested device, and what prewarm found or did there. */
struct target {
  const char *arg;  /* as given */
  char uuid[96];    /* as the daemon names it */
  bool resident;    /* held the set before prewarm */
  cJSON *load;      /* the load's reply, when one ran */
};

/* The plan's key built here from the checkpoint's headers; NULL when the files cannot be read here. */
static char *local_key(const char *path, const cJSON *spec) {
  struct ckpt *ck = NULL;
  struct plan *p = NULL;
  struct wd_error err;
  err_clear(&err);
  char *key = NULL;
  if (ckpt_open(path, NULL, &ck, &err) == 0 && plan_build(ck, spec, &p, &err) == 0) key = strdup(p->key);
  plan_free(p);
  ckpt_free(ck);
  return key;
}

/* Resolves each target's device to its UUID from status; 0, or the exit code after saying which is unknown. */
static int resolve_devices(const cJSON *status, struct target *t, size_t n) {
  const cJSON *devs = cJSON_GetObjectItemCaseSensitive(status, "devices"), *d;
  for (size_t i = 0; i < n; i++) {
    t[i].uuid[0] = '\0';
    cJSON_ArrayForEach(d, devs) {
      char index[24];
      snprintf(index, sizeof index, "%" PRIu64, ctl_u64(d, "index"));
      if (strcmp(t[i].arg, index) == 0 || strcmp(t[i].arg, ctl_str(d, "uuid")) == 0)
        snprintf(t[i].uuid, sizeof t[i].uuid, "%s", ctl_str(d, "uuid"));
    }
    if (t[i].uuid[0] == '\0') {
      ctl_errorx("NOT_FOUND", "prewarm: no device '%s' (the daemon has %d: give an index or a UUID)", t[i].arg,
                 cJSON_GetArraySize(devs));
      return CTL_EXIT_FAIL;
    }
  }
  return 0;
}

/* Marks the targets whose device already holds a ready set of path with this plan key. */
static void find_resident(const cJSON *status, const char *path, const char *key, struct target *t, size_t n) {
  cJSON *want = key ? cJSON_Parse(key) : NULL;
  const cJSON *s;
  cJSON_ArrayForEach(s, cJSON_GetObjectItemCaseSensitive(status, "sets")) {
    if (want == NULL || strcmp(ctl_str(s, "path"), path) != 0 || strcmp(ctl_str(s, "state"), "ready") != 0 ||
        !cJSON_Compare(cJSON_GetObjectItemCaseSensitive(s, "plan"), want, 1))
      continue;
    for (size_t i = 0; i < n; i++)
      if (strcmp(ctl_str(s, "device"), t[i].uuid) == 0) t[i].resident = true;
  }
  cJSON_Delete(want);
}

static void print_result(const char *path, const char *key, const struct target *t, size_t n, bool prefetched,
                         double open_s, double prefetch_s, double load_s, double total_s) {
  if (ctl_opts.json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddTrueToObject(o, "ok");
    cJSON_AddStringToObject(o, "path", path);
    cJSON *plan = key ? cJSON_Parse(key) : NULL;
    if (plan != NULL) cJSON_AddItemToObject(o, "plan", plan);
    else cJSON_AddNullToObject(o, "plan");
    cJSON_AddBoolToObject(o, "prefetched", prefetched);
    cJSON *sets = cJSON_AddArrayToObject(o, "sets");
    for (size_t i = 0; i < n; i++) {
      cJSON *x = cJSON_CreateObject();
      cJSON_AddStringToObject(x, "device", t[i].uuid);
      cJSON_AddBoolToObject(x, "resident_before", t[i].resident);
      if (t[i].load != NULL) {
        cJSON_AddStringToObject(x, "set", ctl_str(t[i].load, "set"));
        cJSON_AddItemToObject(x, "bytes", json_u64_create(ctl_u64(t[i].load, "bytes")));
        cJSON_AddNumberToObject(x, "load_s", ctl_num(t[i].load, "seconds"));
        cJSON_AddNumberToObject(x, "gib_per_s", ctl_num(t[i].load, "gib_per_s"));
        cJSON_AddBoolToObject(x, "shared", cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(t[i].load, "shared")));
        cJSON_AddStringToObject(x, "method", ctl_str(t[i].load, "method"));
      }
      cJSON_AddItemToArray(sets, x);
    }
    cJSON *tm = cJSON_AddObjectToObject(o, "timings");
    cJSON_AddNumberToObject(tm, "open_s", open_s);
    cJSON_AddNumberToObject(tm, "prefetch_s", prefetch_s);
    cJSON_AddNumberToObject(tm, "load_s", load_s);
    cJSON_AddNumberToObject(tm, "total_s", total_s);
    ctl_json_print(o);
    return;
  }
  printf("%s resident on %zu device%s in %.3f s (open %.3f s, prefetch %.3f s, loads %.3f s)\n", path, n,
         n == 1 ? "" : "s", total_s, open_s, prefetch_s, load_s);
  if (key != NULL) printf("  plan %s\n", key);
  for (size_t i = 0; i < n; i++) {
    if (t[i].load == NULL) {
      printf("  %s: already resident\n", t[i].uuid);
    } else {
      char b[32];
      ctl_human_bytes(ctl_u64(t[i].load, "bytes"), b, sizeof b);
      printf("  %s: set %s, %s %s in %.3f s, %.2f GiB/s (%s)\n", t[i].uuid, ctl_str(t[i].load, "set"), b,
             cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(t[i].load, "shared")) ? "shared" : "loaded",
             ctl_num(t[i].load, "seconds"), ctl_num(t[i].load, "gib_per_s"), ctl_str(t[i].load, "method"));
    }
  }
}

/* open: validates (and reopens a changed checkpoint); *path gets the resolved path its reply names. */
static int open_checkpoint(weightd_client *c, const char *arg, char **path) {
  cJSON *req = ctl_request_new("open"), *reply = NULL;
  ctl_add_path(req, arg);
  int rc = ctl_request(c, req, NULL, NULL, &reply);
  if (rc == 0 && (*path = strdup(ctl_str(cJSON_GetObjectItemCaseSensitive(reply, "checkpoint"), "path"))) == NULL) {
    ctl_errorf("out of memory");
    rc = WEIGHTD_E_NOMEM;
  }
  cJSON_Delete(reply);
  return rc;
}

/* prefetch with wait (and pin) of what spec reads, or of the whole checkpoint when spec is NULL. */
static int prefetch_wait(weightd_client *c, const char *path, bool pin, const cJSON *spec) {
  cJSON *req = ctl_request_new("prefetch"), *reply = NULL;
  cJSON_AddStringToObject(req, "path", path);
  cJSON_AddBoolToObject(req, "pin", pin);
  cJSON_AddTrueToObject(req, "wait");
  /* Only the rank's byte ranges: a rank of a checkpoint larger than host memory can be prewarmed (and pinned). */
  if (spec != NULL) cJSON_AddItemToObject(req, "plan", cJSON_Duplicate(spec, 1));
  ctl_progress_begin("prefetch");
  int rc = ctl_request(c, req, ctl_progress_cb, NULL, &reply);
  ctl_progress_end();
  cJSON_Delete(reply);
  return rc;
}

/* --all-ranks: open, prefetch the whole checkpoint (every rank reads most of it), one load_group. */
static int run_prewarm_group(const struct ctl_args *a, const struct ctl_plan_args *pa) {
  if (ctl_has(a, CTL_OPT_DEVICE))
    return ctl_usage_error("--all-ranks places ranks with --devices D,D,... (one per rank), not --device");
  cJSON *group = NULL, *plan = NULL;
  char *path = NULL;
  int rc = ctl_group_spec(pa, ctl_val(a, CTL_OPT_DEVICES), &group, &plan);
  if (rc != 0) return rc;
  weightd_client *c = NULL;
  int exit_code = ctl_connect(&c);
  if (exit_code != 0) goto out;
  if ((rc = open_checkpoint(c, a->pos[0], &path)) != 0 ||
      (!wire_path_is_url(path) && (rc = prefetch_wait(c, path, ctl_has(a, CTL_OPT_PIN), NULL)) != 0))
    goto fail;
  exit_code = ctl_group_load(c, a->pos[0], group, plan, NULL); /* consumes group and plan */
  group = plan = NULL;
  goto out;
fail:
  exit_code = ctl_exit_for(rc);
out:
  cJSON_Delete(group);
  cJSON_Delete(plan);
  free(path);
  ctl_disconnect(c);
  return exit_code;
}

static int run_prewarm(const struct ctl_args *a) {
  struct ctl_plan_args pa;
  cJSON *spec = NULL;
  int rc = ctl_plan_args_get(a, &pa);
  if (rc != 0) return rc;
  if (ctl_has(a, CTL_OPT_ALL_RANKS)) return run_prewarm_group(a, &pa);
  if (ctl_has(a, CTL_OPT_DEVICES))
    return ctl_usage_error("--devices lists one device per rank of --all-ranks (one rank: --device D)");
  if ((rc = ctl_plan_spec(&pa, 0, &spec)) != 0) return rc;
  /* The devices, as given, each once. */
  struct target t[CTL_MAX_VALUES];
  size_t n = 0;
  unsigned ndev = a->opt[CTL_OPT_DEVICE].n;
  for (unsigned i = 0; i < (ndev ? ndev : 1); i++) {
    const char *d = ndev ? a->opt[CTL_OPT_DEVICE].v[i] : "0";
    bool seen = false;
    for (size_t k = 0; k < n; k++) seen |= strcmp(t[k].arg, d) == 0;
    if (!seen) t[n++] = (struct target){.arg = d};
  }
  double t0 = clock_s(), open_s = 0, prefetch_s = 0, load_s = 0;
  bool prefetched = false;
  char *path = NULL, *key = NULL;
  cJSON *status = NULL;
  weightd_client *c = NULL;
  int exit_code = ctl_connect(&c);
  if (exit_code != 0) goto out;

  if ((rc = open_checkpoint(c, a->pos[0], &path)) != 0) goto fail;
  open_s = clock_s() - t0;
  /* A URL's headers are not here: every step runs (a resident set is shared by the load). */
  bool remote = wire_path_is_url(path);
  key = remote ? NULL : local_key(a->pos[0], spec);

  if ((rc = ctl_request(c, ctl_request_new("status"), NULL, NULL, &status)) != 0) goto fail;
  if ((exit_code = resolve_devices(status, t, n)) != 0) goto out;
  find_resident(status, path, key, t, n);
  bool all = true;
  for (size_t i = 0; i < n; i++) all &= t[i].resident;

  if (!all) {
    double tp = clock_s();
    if (!remote) { /* a remote checkpoint has nothing to read ahead here: its loads fetch the rank's bytes */
      if ((rc = prefetch_wait(c, path, ctl_has(a, CTL_OPT_PIN), spec)) != 0) goto fail;
      prefetched = true;
    }
    prefetch_s = clock_s() - tp;
    double tl = clock_s();
    for (size_t i = 0; i < n; i++) {
      if (t[i].resident) continue;
      cJSON *req = ctl_request_new("load");
      cJSON_AddStringToObject(req, "path", path);
      cJSON_AddStringToObject(req, "device", t[i].uuid);
      if (spec != NULL) cJSON_AddItemToObject(req, "plan", cJSON_Duplicate(spec, 1));
      ctl_progress_begin("load");
      rc = ctl_request(c, req, ctl_progress_cb, NULL, &t[i].load);
      ctl_progress_end();
      if (rc != 0) goto fail;
    }
    load_s = clock_s() - tl;
  }
  print_result(path, key, t, n, prefetched, open_s, prefetch_s, load_s, clock_s() - t0);
  goto out;

fail:
  exit_code = ctl_exit_for(rc);
out:
  for (size_t i = 0; i < n; i++) cJSON_Delete(t[i].load);
  cJSON_Delete(status);
  cJSON_Delete(spec);
  free(path);
  free(key);
  ctl_disconnect(c);
  return exit_code;
}

const struct ctl_cmd ctl_cmd_prewarm = {
    .name = "prewarm",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "make a rank's plan resident on each named device and wait for it (for autoscalers)",
    .description =
        "Makes one rank's plan of the checkpoint at PATH resident on each --device and returns when it is: the "
        "daemon opens the checkpoint, reads the bytes the plan reads into the page cache (and pins them with "
        "--pin), then loads it on every device that does not hold the set yet. It is idempotent: when every device already holds the "
        "set it returns at once without reading the checkpoint. On a terminal progress lines show each step; "
        "Ctrl-C cancels the step in flight (exit 1) and so does --timeout (exit 4).\n\nWith --json: {\"ok\": "
        "true, \"path\", \"plan\" (the plan's key), \"prefetched\", \"sets\": [{\"device\", \"resident_before\", "
        "\"set\", \"bytes\", \"load_s\", \"gib_per_s\", \"shared\", \"method\"}], \"timings\": {\"open_s\", "
        "\"prefetch_s\", \"load_s\", \"total_s\"}}. With --all-ranks the checkpoint is prefetched whole and one "
        "load_group loads the group; the output is load --all-ranks's.",
    .opts = CTL_OPTS(prewarm_opts),
    .flags = CTL_CMD_DAEMON | CTL_CMD_PLAN,
    .run = run_prewarm,
};
