/*
 * cmd_scrub.c - `weightctl scrub [SET]`: the daemon hashes a resident set's
 * tensors again (or every set this user may scrub) and names each tensor
 * whose bytes changed since the set was loaded.
 */
#include <inttypes.h>
#include <stdio.h>

#include "ctl.h"

/* Prints one set's result; returns how many of its tensors differ. */
static int say_set(const cJSON *o) {
  if (cJSON_GetObjectItemCaseSensitive(o, "skipped") != NULL) {
    printf("set %s: not scrubbed: %s\n", ctl_str(o, "set"), ctl_str(o, "skipped"));
    return 0;
  }
  const cJSON *mm = cJSON_GetObjectItemCaseSensitive(o, "mismatches"), *m;
  int n = cJSON_GetArraySize(mm);
  printf("set %s: %" PRIu64 " tensors, %" PRIu64 " bytes hashed: %s\n", ctl_str(o, "set"), ctl_u64(o, "tensors"),
         ctl_u64(o, "bytes"), n == 0 ? "clean" : "CORRUPT");
  cJSON_ArrayForEach(m, mm)
    printf("  tensor '%s' differs: expected %s, found %s\n", ctl_str(m, "tensor"), ctl_str(m, "expected"),
           ctl_str(m, "found"));
  return n;
}

static int run_scrub(const struct ctl_args *a) {
  weightd_client *c;
  int rc = ctl_connect(&c);
  if (rc != 0) return rc;
  cJSON *req = ctl_request_new("scrub"), *reply;
  if (a->npos > 0) cJSON_AddStringToObject(req, "set", a->pos[0]);
  rc = ctl_request(c, req, NULL, NULL, &reply);
  int exit_code = ctl_exit_for(rc);
  if (rc == 0) {
    bool clean = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(reply, "clean"));
    if (ctl_opts.json) {
      ctl_json_print(reply);
    } else {
      const cJSON *sets = cJSON_GetObjectItemCaseSensitive(reply, "sets"), *o;
      if (cJSON_GetArraySize(sets) == 0) printf("no resident set to scrub\n");
      cJSON_ArrayForEach(o, sets) say_set(o);
      cJSON_Delete(reply);
    }
    if (!clean) exit_code = CTL_EXIT_FAIL;
  }
  ctl_disconnect(c);
  return exit_code;
}

const struct ctl_cmd ctl_cmd_scrub = {
    .name = "scrub",
    .args = "[SET]",
    .max_args = 1,
    .summary = "hash a resident set's tensors again and name each one changed since it was loaded",
    .description =
        "With the daemon's scrub setting on, asks it to hash every tensor of the resident set SET (without SET: "
        "every ready set you may see in status, or every set for root, the daemon's user and admin_gids) with "
        "the same XXH3-128 it recorded when the "
        "set was loaded, and prints each tensor that differs with the digest expected and the one found. A set "
        "found corrupt stays marked so (status shows it under corrupt) and refuses new leases with BAD_CHECKSUM; "
        "its holders get a corrupt event. Exits 1 when any tensor differs, a set could not be scrubbed, or the "
        "scrub fails (UNSUPPORTED for a set with no digests: the scrub setting off, a backend that cannot hash "
        "its memory, a set re-adopted after a restart).",
    .flags = CTL_CMD_DAEMON,
    .run = run_scrub,
};
