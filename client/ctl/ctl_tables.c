/*
 * ctl_tables.c - the option tables every command shares: the common options
 * (--json, --help), the daemon commands' (--socket, --timeout), and the
 * lists a command parses, which parsing (ctl_cli.c) and help, the man page
 * and the completion (ctl_docs.c) all read.
 */
#include "ctl.h"

/* ---- the options every command takes ------------------------------------------------- */

static const struct optab_opt common_table[] = {
    {CTL_OPT_JSON, "json", 0, OPTAB_SWITCH, NULL,
     "Print exactly one JSON object on stdout: the result, or {\"error\": {\"code\": ..., \"message\": ...}} "
     "(no progress, nothing else).",
     0, NULL},
    {CTL_OPT_HELP, "help", 'h', OPTAB_SWITCH, NULL, "Describe the command and every option.", 0, NULL},
};

static const struct optab_opt daemon_table[] = {
    {CTL_OPT_SOCKET, "socket", 0, OPTAB_VALUE, "PATH",
     CTL_SOCKET_HELP,
     0, "@file"},
    {CTL_OPT_TIMEOUT, "timeout", 0, OPTAB_VALUE, "DURATION",
     "Give up after DURATION (seconds, or 500ms, 30s, 2m, 1h): cancel what the command started and exit 4.", 0,
     NULL},
};

const struct optab_list ctl_common_options = {CTL_OPTS(common_table)};
const struct optab_list ctl_daemon_options = {CTL_OPTS(daemon_table)};

/* The tables a command parses: its own, the plan flags, the daemon's, the common ones. */
size_t ctl_cmd_lists(const struct ctl_cmd *cmd, struct optab_list lists[4]) {
  size_t n = 0;
  lists[n++] = (struct optab_list){cmd->opts, cmd->nopts};
  if (cmd->flags & CTL_CMD_PLAN) lists[n++] = ctl_plan_options;
  if (cmd->flags & CTL_CMD_DAEMON) lists[n++] = ctl_daemon_options;
  lists[n++] = ctl_common_options;
  return n;
}
