/*
 * cmd_load.c - `weightctl load PATH [--device D] [plan flags]`: load one
 * rank's plan onto a device; with --all-ranks, every rank of the group
 * (ctl_group.c).
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "ctl.h"

static const struct optab_opt load_opts[] = {
    {CTL_OPT_DEVICE, "device", 0, OPTAB_VALUE, "D",
     "The device to load onto: the daemon's index (0, 1, ...) or a UUID (GPU-..., host-...); default 0.", 0,
     NULL},
    {CTL_OPT_ALL_RANKS, "all-ranks", 0, OPTAB_SWITCH, NULL,
     "Load every rank of the group that --tp-size and --ep-size describe (the plan from --preset, auto by "
     "default, and --fuse), each onto its device, in one request; not with --tp-rank, --ep-rank, --experts, "
     "--plan or --device.",
     0, NULL},
    {CTL_OPT_SOURCE, "source", 0, OPTAB_VALUE, "S",
     "Where a new load reads the checkpoint from: mmap (the page cache), direct (O_DIRECT reads, no page-cache "
     "use) or auto; default: the daemon's source setting for the checkpoint's directory. A set already "
     "resident or loading is shared however it reads.",
     0, "auto mmap direct"},
    {CTL_OPT_DEVICES, "devices", 0, OPTAB_VALUE, "D,D,...",
     "With --all-ranks: the device of each rank, in rank order (indexes or UUIDs; a device may be named for "
     "several ranks); default: rank r on device r mod the device count.",
     0, NULL},
};

/* --all-ranks: one load_group for the whole group. */
static int run_load_group(const struct ctl_args *a, const struct ctl_plan_args *pa) {
  if (ctl_has(a, CTL_OPT_DEVICE))
    return ctl_usage_error("--all-ranks places ranks with --devices D,D,... (one per rank), not --device");
  cJSON *group = NULL, *plan = NULL;
  int rc = ctl_group_spec(pa, ctl_val(a, CTL_OPT_DEVICES), &group, &plan);
  if (rc != 0) return rc;
  weightd_client *c;
  if ((rc = ctl_connect(&c)) != 0) {
    cJSON_Delete(group);
    cJSON_Delete(plan);
    return rc;
  }
  rc = ctl_group_load(c, a->pos[0], group, plan, ctl_val(a, CTL_OPT_SOURCE));
  ctl_disconnect(c);
  return rc;
}

static int run_load(const struct ctl_args *a) {
  struct ctl_plan_args pa;
  cJSON *plan = NULL;
  int rc = ctl_plan_args_get(a, &pa);
  if (rc != 0) return rc;
  if (ctl_has(a, CTL_OPT_ALL_RANKS)) return run_load_group(a, &pa);
  if (ctl_has(a, CTL_OPT_DEVICES))
    return ctl_usage_error("--devices lists one device per rank of --all-ranks (one rank: --device D)");
  if ((rc = ctl_plan_spec(&pa, 0, &plan)) != 0) return rc;
  weightd_client *c;
  if ((rc = ctl_connect(&c)) != 0) {
    cJSON_Delete(plan);
    return rc;
  }
  cJSON *req = ctl_request_new("load"), *reply;
  ctl_add_path(req, a->pos[0]);
  ctl_add_device(req, ctl_val(a, CTL_OPT_DEVICE));
  if (plan != NULL) cJSON_AddItemToObject(req, "plan", plan);
  if (ctl_has(a, CTL_OPT_SOURCE)) cJSON_AddStringToObject(req, "source", ctl_val(a, CTL_OPT_SOURCE));
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
    const cJSON *links = cJSON_GetObjectItemCaseSensitive(reply, "links");
    const cJSON *source = cJSON_GetObjectItemCaseSensitive(reply, "source");
    const cJSON *read = cJSON_GetObjectItemCaseSensitive(reply, "read_from");
    if ((cJSON_IsString(source) && strcmp(source->valuestring, "host") != 0) || links != NULL || cJSON_IsString(read)) {
      if (cJSON_IsString(source) && strcmp(source->valuestring, "host") != 0) printf("  from %s", source->valuestring);
      else printf("  read through %s", ctl_str(reply, "read_from"));
      if (links != NULL) printf(", over the host links of %d devices", cJSON_GetArraySize(links));
      printf("\n");
    }
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
    .summary = "load a checkpoint (one rank's plan, or every rank of a group) and print the resident sets",
    .description =
        "Loads the tensors of one rank's plan of the checkpoint at PATH (a path, or an s3:// or http(s):// URL "
        "within the daemon's remote roots) into one slab of device memory (a resident set) and prints the set's id, its size, the time and the rate, and where the bytes came from: "
        "the source the files were read through (--source), a peer's copy, or several host links (striped). A "
        "set that is already "
        "resident is shared, not loaded again. On a terminal a progress line shows the bytes, rate and time left; "
        "Ctrl-C cancels the load.\n\nWith --all-ranks, every rank of the group that --tp-size and --ep-size "
        "describe loads at once, each onto its device (--devices, or rank r on device r mod the device count), "
        "in one load_group request; it prints the group's bytes, time and rate, then one line per rank: its "
        "tp and ep ranks, device, set, method and source, or its error (ranks that loaded stay resident). With "
        "--json: the daemon's load_group reply, per-rank errors included.",
    .opts = CTL_OPTS(load_opts),
    .flags = CTL_CMD_DAEMON | CTL_CMD_PLAN,
    .run = run_load,
};
