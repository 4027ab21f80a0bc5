/* cmd_release.c - `weightctl release LEASE` and `weightctl evict (SET | --device D)`. */
#include <stdio.h>
#include <string.h>

#include "ctl.h"

int cmd_release(int argc, char **argv) {
  const char *lease = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) ctl_opts.json = 1;
    else if (argv[i][0] != '-' && lease == NULL) lease = argv[i];
    else return ctl_usage("release");
  }
  if (lease == NULL) return ctl_usage("release");
  weightd_client *c;
  if (ctl_connect(&c) != 0) return CTL_EXIT_FAIL;
  cJSON *req = ctl_request_new("release"), *reply;
  cJSON_AddStringToObject(req, "lease", lease);
  int rc = ctl_request(c, req, NULL, NULL, &reply);
  if (rc == 0 && !ctl_opts.json)
    printf(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(reply, "released")) ? "released lease %s\n"
                                                                             : "lease %s was not held\n",
           lease);
  cJSON_Delete(reply);
  weightd_close(c);
  return rc == 0 ? CTL_EXIT_OK : CTL_EXIT_FAIL;
}

int cmd_evict(int argc, char **argv) {
  const char *set = NULL, *device = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) ctl_opts.json = 1;
    else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) device = argv[++i];
    else if (argv[i][0] != '-' && set == NULL) set = argv[i];
    else return ctl_usage("evict");
  }
  if ((set == NULL) == (device == NULL)) return ctl_usage("evict");
  weightd_client *c;
  if (ctl_connect(&c) != 0) return CTL_EXIT_FAIL;
  cJSON *req = ctl_request_new("evict"), *reply;
  if (set != NULL) cJSON_AddStringToObject(req, "set", set);
  ctl_add_device(req, device);
  int rc = ctl_request(c, req, NULL, NULL, &reply);
  if (rc == 0 && !ctl_opts.json) {
    const cJSON *ev = cJSON_GetObjectItemCaseSensitive(reply, "evicted"), *x;
    if (cJSON_GetArraySize(ev) == 0) printf("nothing evicted\n");
    else {
      printf("evicted");
      cJSON_ArrayForEach(x, ev) printf(" %s", cJSON_IsString(x) ? x->valuestring : "?");
      printf("\n");
    }
  }
  cJSON_Delete(reply);
  weightd_close(c);
  return rc == 0 ? CTL_EXIT_OK : CTL_EXIT_FAIL;
}
