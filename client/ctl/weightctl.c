/* weightctl.c - the weightctl entry point: global options and the command table. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"
#include "weightd.h"

struct ctl_options ctl_opts;

static const struct ctl_cmd commands[] = {
    {"status", "show the daemon's devices, checkpoints, resident sets and leases", "status [--json]",
     cmd_status},
    {"open", "validate and map a checkpoint in the daemon", "open PATH [--json]", cmd_open},
    {"prefetch", "warm a checkpoint in the page cache (--pin: the pinned-resident tier)",
     "prefetch PATH [--pin] [--wait] [--json]", cmd_prefetch},
    {"load", "load a checkpoint (one rank's plan, or every rank of a group) onto devices and print the resident sets",
     "load PATH [--device D] " CTL_PLAN_USAGE " " CTL_GROUP_USAGE " [--json]", cmd_load},
    {"attach", "lease a resident set, map it here; --verify compares every byte with the plan from the files",
     "attach (SET | PATH [--device D] " CTL_PLAN_USAGE ") [--verify] [--hold] [--json]", cmd_attach},
    {"release", "end a lease (of another connection: root or the daemon's user only)",
     "release LEASE [--json]", cmd_release},
    {"evict", "free a resident set, or every unleased set of a device", "evict (SET | --device D) [--json]",
     cmd_evict},
    {"shutdown", "stop the daemon", "shutdown [--json]", cmd_shutdown},
    {"inspect", "validate a safetensors file or checkpoint directory and summarise it",
     "inspect PATH [--json]", cmd_inspect},
    {"plan", "show a rank's plan for a checkpoint (no daemon); --tp-size N alone: bytes per rank",
     "plan PATH " CTL_PLAN_USAGE " [--json]", cmd_plan},
    {"export", "write one rank's plan outputs as a safetensors checkpoint",
     "export PATH " CTL_PLAN_USAGE " --out DIR [--max-shard-bytes N] [--threads N]", cmd_export},
    {"mkcheckpoint", "write a synthetic checkpoint with a published model's exact layout",
     "mkcheckpoint --preset NAME --out DIR [--layers N] [--experts N] [--seed S] [--list]", cmd_mkcheckpoint},
    {"demo", "start a private daemon, then load, attach and verify a small checkpoint (a guided tour)",
     "demo [--dir DIR] [--keep]", cmd_demo},
};

#define NCOMMANDS (sizeof commands / sizeof commands[0])

void ctl_errorf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("weightctl: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

int ctl_usage(const char *cmd) {
  for (size_t i = 0; i < NCOMMANDS; i++)
    if (strcmp(commands[i].name, cmd) == 0) fprintf(stderr, "usage: weightctl %s\n", commands[i].usage);
  return CTL_EXIT_USAGE;
}

int ctl_parse_u64(const char *s, unsigned long long *out) {
  if (s == NULL || *s < '0' || *s > '9') return -1;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != '\0' || errno == ERANGE) return -1;
  *out = v;
  return 0;
}

static void print_help(FILE *f) {
  fprintf(f, "usage: weightctl [--socket PATH] [--json] [--timeout MS] COMMAND [ARGS...]\n\ncommands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++) fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].summary);
  fprintf(f, "\noptions:\n"
             "  --socket PATH  the daemon's socket (default: $WEIGHTD_SOCKET, /run/weightd/weightd.sock,\n"
             "                 then $XDG_RUNTIME_DIR/weightd.sock or /tmp/weightd-$UID.sock)\n"
             "  --json         print the daemon's reply object instead of a summary\n"
             "  --timeout MS   give up waiting for the daemon after MS milliseconds\n"
             "\nexit codes: 0 success, 1 the operation failed (daemon error, invalid checkpoint,\n"
             "verification mismatch), 2 usage error.\n"
             "\nweightctl COMMAND --help shows a command's usage.\n");
}

int main(int argc, char **argv) {
  int a = 1;
  /* Global options come before the command. */
  for (; a < argc && argv[a][0] == '-'; a++) {
    if (strcmp(argv[a], "--socket") == 0 && a + 1 < argc) {
      ctl_opts.socket = argv[++a];
    } else if (strcmp(argv[a], "--json") == 0) {
      ctl_opts.json = 1;
    } else if (strcmp(argv[a], "--timeout") == 0 && a + 1 < argc) {
      unsigned long long ms;
      if (ctl_parse_u64(argv[++a], &ms) != 0 || ms == 0 || ms > 86400000ull) {
        ctl_errorf("--timeout wants milliseconds between 1 and 86400000, not '%s'", argv[a]);
        return CTL_EXIT_USAGE;
      }
      ctl_opts.timeout_ms = (int)ms;
    } else if (strcmp(argv[a], "--help") == 0 || strcmp(argv[a], "-h") == 0) {
      print_help(stdout);
      return CTL_EXIT_OK;
    } else if (strcmp(argv[a], "--version") == 0) {
      printf("weightctl %s\n", weightd_version_string());
      return CTL_EXIT_OK;
    } else {
      ctl_errorf("unknown option '%s' (weightctl --help lists them)", argv[a]);
      return CTL_EXIT_USAGE;
    }
  }
  if (a >= argc) {
    print_help(stderr);
    return CTL_EXIT_USAGE;
  }
  const char *name = argv[a];
  if (strcmp(name, "help") == 0) {
    print_help(stdout);
    return CTL_EXIT_OK;
  }
  for (size_t i = 0; i < NCOMMANDS; i++) {
    if (strcmp(commands[i].name, name) != 0) continue;
    for (int k = a + 1; k < argc; k++)
      if (strcmp(argv[k], "--help") == 0 || strcmp(argv[k], "-h") == 0) {
        printf("usage: weightctl %s\n%s\n", commands[i].usage, commands[i].summary);
        return CTL_EXIT_OK;
      }
    if (ctl_opts.json && commands[i].run == cmd_inspect) {
      /* inspect reads its own --json: pass the global one on. */
      int n = argc - a;
      char **args = calloc((size_t)n + 2, sizeof *args);
      if (args == NULL) return CTL_EXIT_FAIL;
      memcpy(args, argv + a, (size_t)n * sizeof *args);
      args[n] = "--json";
      int rc = cmd_inspect(n + 1, args);
      free(args);
      return rc;
    }
    return commands[i].run(argc - a, argv + a);
  }
  ctl_errorf("unknown command '%s' (weightctl --help lists them)", name);
  return CTL_EXIT_USAGE;
}
