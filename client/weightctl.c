/* weightctl.c - the weightctl entry point: global options and the command table. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"
#include "weightd.h"

static const struct ctl_cmd commands[] = {
    {"inspect", "validate a safetensors file or checkpoint directory and summarise it",
     "inspect PATH [--json]", cmd_inspect},
    {"mkcheckpoint", "write a synthetic checkpoint with a published model's exact layout",
     "mkcheckpoint --preset NAME --out DIR [--layers N] [--seed S] [--list]", cmd_mkcheckpoint},
    {"demo", "generate a small checkpoint and inspect it (a guided tour)", "demo [--dir DIR] [--keep]",
     cmd_demo},
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
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != '\0') return -1;
  *out = v;
  return 0;
}

static void print_help(FILE *f) {
  fprintf(f, "usage: weightctl COMMAND [ARGS...]\n\ncommands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++) fprintf(f, "  %-14s %s\n", commands[i].name, commands[i].summary);
  fprintf(f, "\nweightctl COMMAND --help shows a command's usage.\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    print_help(stderr);
    return CTL_EXIT_USAGE;
  }
  const char *name = argv[1];
  if (strcmp(name, "--help") == 0 || strcmp(name, "-h") == 0 || strcmp(name, "help") == 0) {
    print_help(stdout);
    return CTL_EXIT_OK;
  }
  if (strcmp(name, "--version") == 0) {
    printf("weightctl %s\n", weightd_version_string());
    return CTL_EXIT_OK;
  }
  for (size_t i = 0; i < NCOMMANDS; i++) {
    if (strcmp(commands[i].name, name) != 0) continue;
    for (int a = 2; a < argc; a++)
      if (strcmp(argv[a], "--help") == 0 || strcmp(argv[a], "-h") == 0) {
        printf("usage: weightctl %s\n%s\n", commands[i].usage, commands[i].summary);
        return CTL_EXIT_OK;
      }
    return commands[i].run(argc - 1, argv + 1);
  }
  ctl_errorf("unknown command '%s' (weightctl --help lists them)", name);
  return CTL_EXIT_USAGE;
}
