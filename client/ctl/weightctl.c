/* weightctl.c - the weightctl entry point: global options and the command table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"
#include "suggest.h"
#include "weightd.h"

/* The commands, in the order help lists them. */
const struct ctl_cmd *const ctl_commands[] = {
    &ctl_cmd_status, &ctl_cmd_top, &ctl_cmd_health,   &ctl_cmd_open,    &ctl_cmd_prefetch, &ctl_cmd_load,
    &ctl_cmd_attach, &ctl_cmd_prewarm,  &ctl_cmd_cancel,  &ctl_cmd_release,  &ctl_cmd_evict,    &ctl_cmd_scrub,
    &ctl_cmd_shutdown, &ctl_cmd_inspect, &ctl_cmd_plan,   &ctl_cmd_export,   &ctl_cmd_mkcheckpoint,
    &ctl_cmd_manifest, &ctl_cmd_verify, &ctl_cmd_demo,
};
const size_t ctl_ncommands = sizeof ctl_commands / sizeof ctl_commands[0];

static const struct optab_opt global_table[] = {
    {CTL_OPT_SOCKET, "socket", 0, OPTAB_VALUE, "PATH",
     CTL_SOCKET_HELP,
     0, "@file"},
    {CTL_OPT_JSON, "json", 0, OPTAB_SWITCH, NULL,
     "Print exactly one JSON object on stdout for every outcome: the result, or {\"error\": {\"code\", "
     "\"message\"}}.",
     0, NULL},
    {CTL_OPT_TIMEOUT, "timeout", 0, OPTAB_VALUE, "DURATION",
     "Give up after DURATION (seconds, or 500ms, 30s, 2m, 1h): cancel what the command started and exit 4.", 0,
     NULL},
    {CTL_OPT_HELP, "help", 'h', OPTAB_SWITCH, NULL, "List the commands and these options.", 0, NULL},
    {CTL_OPT_VERSION, "version", 0, OPTAB_SWITCH, NULL, "Print the version.", 0, NULL},
    {CTL_OPT_GENERATE_MAN, "generate-man", 0, OPTAB_SWITCH, NULL, "Write weightctl(1) to stdout.", OPTAB_HIDDEN,
     NULL},
    {CTL_OPT_GENERATE_COMPLETION, "generate-completion", 0, OPTAB_SWITCH, NULL,
     "Write the bash completion file to stdout.", OPTAB_HIDDEN, NULL},
};
const struct optab_list ctl_global_options = {CTL_OPTS(global_table)};

static void print_help(FILE *f) {
  fprintf(f, "usage: weightctl [OPTION]... COMMAND [ARG]...\n\n"
             "Drives the weightd daemon: load, attach, prewarm and inspect model checkpoints.\n\ncommands:\n");
  for (size_t i = 0; i < ctl_ncommands; i++)
    fprintf(f, "  %-14s %s\n", ctl_commands[i]->name, ctl_commands[i]->summary);
  fprintf(f, "  %-14s %s\n", "help", "describe a command and every option: weightctl help COMMAND");
  fprintf(f, "\noptions (before the command; every command also takes them after its name):\n");
  optab_help(f, &ctl_global_options, 1);
  fputc('\n', f);
  ctl_exit_codes_help(f);
}

/* `weightctl help [COMMAND]`. */
static int help_command(int argc, char **argv) {
  if (argc < 2) {
    print_help(stdout);
    return CTL_EXIT_OK;
  }
  const struct ctl_cmd *c = ctl_cmd_find(argv[1]);
  if (c == NULL) {
    const char *names[64];
    for (size_t i = 0; i < ctl_ncommands && i < 64; i++) names[i] = ctl_commands[i]->name;
    const char *best = suggest_closest(argv[1], names, ctl_ncommands);
    if (best != NULL) return ctl_usage_error("help: no command '%s'; did you mean '%s'?", argv[1], best);
    return ctl_usage_error("help: no command '%s'", argv[1]);
  }
  ctl_cmd_help(stdout, c);
  return CTL_EXIT_OK;
}

struct global_state {
  int action; /* CTL_OPT_HELP, _VERSION, _GENERATE_* or 0 */
  const char *timeout;
};

static int take_global(void *arg, const struct optab_opt *o, const char *v) {
  struct global_state *g = arg;
  switch (o->id) {
  case CTL_OPT_SOCKET: ctl_opts.socket = v; break;
  case CTL_OPT_JSON: ctl_opts.json = 1; break;
  case CTL_OPT_TIMEOUT: g->timeout = v; break;
  default: g->action = o->id; break;
  }
  return 0;
}

/* With --json anywhere before "--", even a usage error found first is answered in JSON. */
static void scan_json(int argc, char **argv) {
  for (int i = 1; i < argc && strcmp(argv[i], "--") != 0; i++)
    if (strcmp(argv[i], "--json") == 0) ctl_opts.json = 1;
}

static int run(int argc, char **argv) {
  struct global_state g = {0};
  char why[512];
  int next = argc;
  scan_json(argc, argv);
  if (optab_parse(&ctl_global_options, 1, argc, argv, true, take_global, &g, &next, why, sizeof why) != 0)
    return ctl_usage_error("%s", why);
  if (g.timeout != NULL && ctl_parse_duration(g.timeout, &ctl_opts.timeout_s) != 0)
    return ctl_usage_error("--timeout wants a duration such as 30, 30s, 500ms or 2m, not '%s'", g.timeout);
  switch (g.action) {
  case CTL_OPT_HELP: print_help(stdout); return CTL_EXIT_OK;
  case CTL_OPT_VERSION: printf("weightctl %s\n", weightd_version_string()); return CTL_EXIT_OK;
  case CTL_OPT_GENERATE_MAN: ctl_write_man(stdout); return CTL_EXIT_OK;
  case CTL_OPT_GENERATE_COMPLETION: ctl_write_completion(stdout); return CTL_EXIT_OK;
  default: break;
  }
  if (next >= argc) {
    print_help(stderr);
    return ctl_usage_error("no command given");
  }
  const char *name = argv[next];
  if (strcmp(name, "help") == 0) return help_command(argc - next, argv + next);
  const struct ctl_cmd *c = ctl_cmd_find(name);
  if (c == NULL) {
    const char *names[64];
    for (size_t i = 0; i < ctl_ncommands && i < 64; i++) names[i] = ctl_commands[i]->name;
    const char *best = suggest_closest(name, names, ctl_ncommands);
    if (best != NULL) return ctl_usage_error("unknown command '%s'; did you mean '%s'?", name, best);
    return ctl_usage_error("unknown command '%s'", name);
  }
  return ctl_cli_run(c, argc - next, argv + next);
}

int main(int argc, char **argv) {
  int rc = run(argc, argv);
  /* A usage error before any command ran still owes --json its object. */
  if (rc != 0) ctl_json_finish(rc);
  return rc;
}
