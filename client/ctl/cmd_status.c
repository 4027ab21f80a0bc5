/*
 * cmd_status.c - `weightctl status [--all]`: the daemon, its devices,
 * checkpoints, resident sets, leases (who holds them) and requests in
 * progress, a page of each (every page with --all); and `weightctl health`,
 * the readiness probe.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

/* "12.3 s", "4 min 5 s", "2 h 3 min". */
static void format_age(double s, char *buf, size_t len) {
  if (s < 60) snprintf(buf, len, "%.1f s", s);
  else if (s < 3600) snprintf(buf, len, "%d min %d s", (int)s / 60, (int)s % 60);
  else snprintf(buf, len, "%d h %d min", (int)s / 3600, (int)s / 60 % 60);
}

/* The client name a peer gave in hello, labelled as its own claim. */
static void print_client(const cJSON *x) {
  const char *name = ctl_str(x, "client_name");
  if (strcmp(name, "?") != 0 && name[0] != '\0') printf("  client '%s' (self-reported)", name);
}

/*
 * How a set came to be, for its line: "loaded in 0.912 s" once a load made
 * it ready, "re-adopted after a restart" for a set no load of this daemon
 * made, "1.00 GiB of 7.49 GiB loaded" while it loads (the daemon gives a
 * loading set no seconds), nothing for a failed one.
 */
static void set_progress(const cJSON *x, char *buf, size_t len) {
  char a[32], b[32];
  const cJSON *secs = cJSON_GetObjectItemCaseSensitive(x, "seconds");
  if (strcmp(ctl_str(x, "method"), "adopted") == 0) {
    snprintf(buf, len, "re-adopted after a restart  ");
  } else if (cJSON_IsNumber(secs)) {
    snprintf(buf, len, "loaded in %.3f s  ", secs->valuedouble);
  } else if (cJSON_GetObjectItemCaseSensitive(x, "bytes_done") != NULL) {
    ctl_human_bytes(ctl_u64(x, "bytes_done"), a, sizeof a);
    ctl_human_bytes(ctl_u64(x, "bytes"), b, sizeof b);
    snprintf(buf, len, "%s of %s loaded  ", a, b);
  } else {
    buf[0] = '\0';
  }
}

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

/* How the daemon uses several devices (status "topology"), when it does. */
static void print_topology(const cJSON *r) {
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(r, "topology");
  if (t == NULL) return;
  const cJSON *nodes = cJSON_GetObjectItemCaseSensitive(t, "numa_nodes");
  if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(t, "active"))) {
    printf("topology: one device, or no peer copies: no replicas from peers, no striping");
  } else {
    char b[32];
    ctl_human_bytes(ctl_u64(t, "stripe_min_bytes"), b, sizeof b);
    printf("topology: replicas %s, striping %s (loads of %s or more; link rates %s)", ctl_str(t, "replicas"),
           ctl_str(t, "striping"), b,
           cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(t, "link_rates_measured")) ? "measured" : "unmeasured");
  }
  if (cJSON_GetArraySize(nodes) > 1) printf(", %d NUMA nodes (numa %s)", cJSON_GetArraySize(nodes), ctl_str(t, "numa"));
  printf("\n");
}

/*
 * "checkpoints (3)", or "checkpoints (256 of 5000; --all lists every one)"
 * when the daemon left some out; then how many the daemon hid from this
 * user (a client that is no admin sees only what it may read).
 */
static void print_list_head(const cJSON *r, const char *name) {
  int shown = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(r, name));
  const cJSON *total = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, "totals"), name);
  char key[32];
  snprintf(key, sizeof key, "%s_hidden", name);
  const cJSON *hidden = cJSON_GetObjectItemCaseSensitive(r, key);
  if (cJSON_IsNumber(total) && total->valuedouble > shown)
    printf("%s (%d of %.0f; --all lists every one)", name, shown, total->valuedouble);
  else
    printf("%s (%d)", name, shown);
  if (cJSON_IsNumber(hidden) && hidden->valuedouble > 0)
    printf(", %.0f more hidden: of checkpoints you may not read", hidden->valuedouble);
  printf("\n");
}

static void print_status(const cJSON *r) {
  const cJSON *d = cJSON_GetObjectItemCaseSensitive(r, "daemon");
  printf("weightd %s, pid %" PRIu64 ", backend %s, up %.1f s, %" PRIu64 " connection%s\n  socket %s\n",
         ctl_str(d, "version"), ctl_u64(d, "pid"), ctl_str(d, "backend"), ctl_num(d, "uptime_s"),
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
  print_topology(r);

  const cJSON *cks = cJSON_GetObjectItemCaseSensitive(r, "checkpoints");
  print_list_head(r, "checkpoints");
  cJSON_ArrayForEach(x, cks) {
    ctl_human_bytes(ctl_u64(x, "bytes"), a, sizeof a);
    ctl_human_bytes(ctl_u64(x, "resident_bytes"), b, sizeof b);
    printf("  %s\n     %s, %" PRIu64 " shards, %" PRIu64 " tensors, %s (%s cached%s), %" PRIu64 " set%s\n",
           ctl_str(x, "path"), ctl_str(x, "layout"), ctl_u64(x, "shards"), ctl_u64(x, "tensors"), a, b,
           cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(x, "pinned")) ? ", pinned" : "", ctl_u64(x, "sets"),
           ctl_u64(x, "sets") == 1 ? "" : "s");
  }

  const cJSON *sets = cJSON_GetObjectItemCaseSensitive(r, "sets");
  print_list_head(r, "sets");
  cJSON_ArrayForEach(x, sets) {
    ctl_human_bytes(ctl_u64(x, "bytes"), a, sizeof a);
    char *plan = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(x, "plan"));
    char progress[96];
    set_progress(x, progress, sizeof progress);
    printf("  %-6s %-8s %10s  %" PRIu64 " lease%s  %son %s\n         %s\n         plan %s\n", ctl_str(x, "set"),
           ctl_str(x, "state"), a, ctl_u64(x, "leases"), ctl_u64(x, "leases") == 1 ? " " : "s", progress,
           ctl_str(x, "device"), ctl_str(x, "path"), plan ? plan : "?");
    const cJSON *links = cJSON_GetObjectItemCaseSensitive(x, "links");
    if (cJSON_GetObjectItemCaseSensitive(x, "source") != NULL) {
      printf("         %s from %s", ctl_str(x, "method"), ctl_str(x, "source"));
      if (links != NULL) printf(", over the host links of %d devices", cJSON_GetArraySize(links));
      printf("\n");
    }
    const cJSON *corrupt = cJSON_GetObjectItemCaseSensitive(x, "corrupt"), *t;
    if (cJSON_GetArraySize(corrupt) > 0) {
      printf("         CORRUPT (a scrub found changed; new leases refused):");
      cJSON_ArrayForEach(t, corrupt) printf(" %s", cJSON_IsString(t) ? t->valuestring : "?");
      printf("\n");
    }
    free(plan);
  }

  const cJSON *leases = cJSON_GetObjectItemCaseSensitive(r, "leases");
  print_list_head(r, "leases");
  cJSON_ArrayForEach(x, leases) {
    format_age(ctl_num(x, "age_s"), a, sizeof a);
    printf("  %-6s set %-6s pid %" PRIu64 "  uid %" PRIu64 "  held %s", ctl_str(x, "lease"), ctl_str(x, "set"),
           ctl_u64(x, "pid"), ctl_u64(x, "uid"), a);
    print_client(x);
    printf("\n");
  }

  const cJSON *reqs = cJSON_GetObjectItemCaseSensitive(r, "requests");
  print_list_head(r, "requests");
  cJSON_ArrayForEach(x, reqs) {
    format_age(ctl_num(x, "age_s"), a, sizeof a);
    printf("  %-6s %-8s %-7s pid %" PRIu64 "  uid %" PRIu64 "  for %s", ctl_str(x, "request"), ctl_str(x, "op"),
           ctl_str(x, "state"), ctl_u64(x, "pid"), ctl_u64(x, "uid"), a);
    print_client(x);
    printf("\n");
    const char *what = strcmp(ctl_str(x, "path"), "?") != 0 ? ctl_str(x, "path") : ctl_str(x, "set");
    if (strcmp(what, "?") != 0) {
      printf("         %s", what);
      if (ctl_u64(x, "bytes_total") > 0) {
        ctl_human_bytes(ctl_u64(x, "bytes_done"), b, sizeof b);
        ctl_human_bytes(ctl_u64(x, "bytes_total"), c, sizeof c);
        printf("  %s of %s", b, c);
      }
      printf("\n");
    }
  }
}

static const char *const status_lists[] = {"checkpoints", "sets", "leases", "requests"};

/*
 * Asks for the pages after the first (whose reply is r) until no list is
 * left out, appending each page's items to r's lists; r then lists everything
 * and has no "next" or "left_out". 0, or the failed request's code.
 */
static int status_rest(weightd_client *c, cJSON *r) {
  for (;;) {
    cJSON *next = cJSON_DetachItemFromObjectCaseSensitive(r, "next");
    cJSON_DeleteItemFromObjectCaseSensitive(r, "left_out");
    if (next == NULL) return 0;
    cJSON *req = ctl_request_new("status");
    cJSON_AddItemToObject(req, "after", next);
    cJSON *page;
    int rc = ctl_request(c, req, NULL, NULL, &page);
    if (rc != 0) return rc;
    for (size_t i = 0; i < sizeof status_lists / sizeof status_lists[0]; i++) {
      cJSON *items = cJSON_GetObjectItemCaseSensitive(page, status_lists[i]);
      cJSON *into = cJSON_GetObjectItemCaseSensitive(r, status_lists[i]);
      cJSON *x;
      while (cJSON_IsArray(into) && (x = cJSON_DetachItemFromArray(items, 0)) != NULL) cJSON_AddItemToArray(into, x);
    }
    cJSON *more = cJSON_DetachItemFromObjectCaseSensitive(page, "next");
    if (more != NULL) cJSON_AddItemToObject(r, "next", more);
    cJSON_Delete(page);
  }
}

static const struct optab_opt status_opts[] = {
    {CTL_OPT_ALL, "all", 0, OPTAB_SWITCH, NULL,
     "List every checkpoint, set, lease and request: ask for the daemon's pages after the first (each list "
     "is a page of at most 256 items) until none is left out.",
     0, NULL},
};

static int run_status(const struct ctl_args *a) {
  weightd_client *c;
  int rc = ctl_connect(&c);
  if (rc != 0) return rc;
  cJSON *reply;
  rc = ctl_request(c, ctl_request_new("status"), NULL, NULL, &reply);
  if (rc == 0 && ctl_has(a, CTL_OPT_ALL) && (rc = status_rest(c, reply)) != 0) {
    cJSON_Delete(reply);
    reply = NULL;
  }
  if (rc == 0 && ctl_opts.json) {
    ctl_json_print(reply);
  } else if (rc == 0) {
    print_status(reply);
    cJSON_Delete(reply);
  }
  ctl_disconnect(c);
  return ctl_exit_for(rc);
}

const struct ctl_cmd ctl_cmd_status = {
    .name = "status",
    .args = "",
    .summary = "show the daemon's devices, checkpoints, sets, leases (and who holds them) and requests",
    .description =
        "Shows the daemon (version, pid, backend, uptime, socket), its devices with the memory sets use (with "
        "several devices: each one's NUMA node and peers, and whether replicas and striping are in use), the "
        "checkpoints it has open with how much of them is in the page cache, the resident sets (each with how "
        "it was loaded and from where: the files, or a peer's copy), every lease "
        "(its id, set, the holder's pid and uid as the kernel reports them, the client name the holder gave, "
        "which is self-reported, and how long it has been held) and every request in progress or queued, by "
        "its daemon-wide id (rN), which cancel takes.\n\nEach list is a page of the newest 256 items; a list "
        "the daemon cut says how many it holds in all (\"checkpoints (256 of 5000; --all lists every one)\"), "
        "and --all asks for the rest.",
    .opts = status_opts,
    .nopts = sizeof status_opts / sizeof status_opts[0],
    .flags = CTL_CMD_DAEMON,
    .run = run_status,
};

static int run_health(const struct ctl_args *a) {
  (void)a;
  weightd_client *c;
  int rc = ctl_connect(&c);
  if (rc != 0) return rc;
  cJSON *reply;
  rc = ctl_request(c, ctl_request_new("health"), NULL, NULL, &reply);
  int exit_code = ctl_exit_for(rc);
  if (rc == 0) {
    bool ready = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(reply, "ready"));
    if (!ready) {
      exit_code = CTL_EXIT_FAIL;
      if (!ctl_opts.json) ctl_errorc("NOT_READY", "health: not ready: %s", ctl_str(reply, "reason"));
    } else if (!ctl_opts.json) {
      printf("ready\n");
    }
    if (ctl_opts.json) ctl_json_print(reply);
    else cJSON_Delete(reply);
  }
  ctl_disconnect(c);
  return exit_code;
}

const struct ctl_cmd ctl_cmd_health = {
    .name = "health",
    .args = "",
    .summary = "exit 0 when the daemon is ready to serve (the check of /readyz), for probes",
    .description =
        "Asks the daemon whether it is ready to serve, the same check its /readyz endpoint makes: prints "
        "\"ready\" and exits 0, or prints why not and exits 1. Exits 3 when no daemon answers, 4 after "
        "--timeout. With --json: {\"ok\": true, \"ready\": BOOL, \"reason\": TEXT when not ready}.",
    .flags = CTL_CMD_DAEMON,
    .run = run_health,
};
