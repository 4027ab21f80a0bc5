/* cmd_status.c - `weightctl status`: the daemon, its devices, checkpoints and resident sets. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

/* A device's NUMA node and peers, when the daemon has several devices. */
static void print_peers(const cJSON *dev) {
  const cJSON *peers = cJSON_GetObjectItemCaseSensitive(dev, "peers"), *p;
  const cJSON *node = cJSON_GetObjectItemCaseSensitive(dev, "numa_node");
  if (cJSON_GetArraySize(peers) == 0) return;
  printf("     NUMA node %d, peers:", cJSON_IsNumber(node) ? (int)node->valuedouble : -1);
  int any = 0;
  cJSON_ArrayForEach(p, peers) {
    if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(p, "access"))) continue;
    printf("%s %" PRIu64 " (%s)", any ? "," : "", ctl_u64(p, "index"), ctl_str(p, "link"));
    any = 1;
  }
  printf("%s\n", any ? "" : " none with peer access");
}

static void print_status(const cJSON *r) {
  const cJSON *d = cJSON_GetObjectItemCaseSensitive(r, "daemon");
  const cJSON *up = cJSON_GetObjectItemCaseSensitive(d, "uptime_s");
  printf("weightd %s, pid %" PRIu64 ", backend %s, up %.1f s, %" PRIu64 " connection%s\n  socket %s\n",
         ctl_str(d, "version"), ctl_u64(d, "pid"), ctl_str(d, "backend"), cJSON_IsNumber(up) ? up->valuedouble : 0.0,
         ctl_u64(d, "connections"), ctl_u64(d, "connections") == 1 ? "" : "s", ctl_str(d, "socket"));

  const cJSON *x;
  char a[32], b[32], c[32];
  printf("devices\n");
  cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(r, "devices")) {
    ctl_human_bytes(ctl_u64(x, "used"), a, sizeof a);
    ctl_human_bytes(ctl_u64(x, "memory_free"), b, sizeof b);
    ctl_human_bytes(ctl_u64(x, "memory_total"), c, sizeof c);
    printf("  %" PRIu64 "  %-40s %s\n     used by sets %s, free %s of %s", ctl_u64(x, "index"), ctl_str(x, "uuid"),
           ctl_str(x, "name"), a, b, c);
    if (ctl_u64(x, "budget") > 0) {
      ctl_human_bytes(ctl_u64(x, "budget"), a, sizeof a);
      printf(", budget %s", a);
    }
    printf(", sets shared through %s handles\n", ctl_str(x, "handles"));
    print_peers(x);
  }

  const cJSON *cks = cJSON_GetObjectItemCaseSensitive(r, "checkpoints");
  printf("checkpoints (%d)\n", cJSON_GetArraySize(cks));
  cJSON_ArrayForEach(x, cks) {
    ctl_human_bytes(ctl_u64(x, "bytes"), a, sizeof a);
    ctl_human_bytes(ctl_u64(x, "resident_bytes"), b, sizeof b);
    printf("  %s\n     %s, %" PRIu64 " shards, %" PRIu64 " tensors, %s (%s cached%s), %" PRIu64 " set%s\n",
           ctl_str(x, "path"), ctl_str(x, "layout"), ctl_u64(x, "shards"), ctl_u64(x, "tensors"), a, b,
           cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(x, "pinned")) ? ", pinned" : "", ctl_u64(x, "sets"),
           ctl_u64(x, "sets") == 1 ? "" : "s");
  }

  const cJSON *sets = cJSON_GetObjectItemCaseSensitive(r, "sets");
  printf("sets (%d)\n", cJSON_GetArraySize(sets));
  cJSON_ArrayForEach(x, sets) {
    ctl_human_bytes(ctl_u64(x, "bytes"), a, sizeof a);
    const cJSON *secs = cJSON_GetObjectItemCaseSensitive(x, "seconds");
    char *plan = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(x, "plan"));
    printf("  %-6s %-8s %10s  %" PRIu64 " lease%s  loaded in %.3f s  on %s\n         %s\n         plan %s\n",
           ctl_str(x, "set"), ctl_str(x, "state"), a, ctl_u64(x, "leases"), ctl_u64(x, "leases") == 1 ? " " : "s",
           cJSON_IsNumber(secs) ? secs->valuedouble : 0.0, ctl_str(x, "device"), ctl_str(x, "path"),
           plan ? plan : "?");
    const cJSON *links = cJSON_GetObjectItemCaseSensitive(x, "links");
    if (cJSON_GetObjectItemCaseSensitive(x, "source") != NULL) {
      printf("         %s from %s", ctl_str(x, "method"), ctl_str(x, "source"));
      if (links != NULL) printf(", over the host links of %d devices", cJSON_GetArraySize(links));
      printf("\n");
    }
    free(plan);
  }
}

int cmd_status(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) ctl_opts.json = 1;
    else return ctl_usage("status");
  }
  weightd_client *c;
  if (ctl_connect(&c) != 0) return CTL_EXIT_FAIL;
  cJSON *reply;
  int rc = ctl_request(c, ctl_request_new("status"), NULL, NULL, &reply);
  if (rc == 0 && !ctl_opts.json) print_status(reply);
  cJSON_Delete(reply);
  weightd_close(c);
  return rc == 0 ? CTL_EXIT_OK : CTL_EXIT_FAIL;
}
