/*
 * ctl_docs.c - what weightctl says about itself, generated from the command
 * and option tables: a command's help, the man page weightctl(1) and the
 * bash completion file (the build writes both with the hidden options
 * --generate-man and --generate-completion, and cmake --install installs them).
 */
#include <stdio.h>
#include <string.h>

#include "ctl.h"

/* The exit codes, for help texts and the man page. */
static const struct {
  int code;
  const char *meaning;
} exit_codes[] = {
    {CTL_EXIT_OK, "success"},
    {CTL_EXIT_FAIL, "the operation failed (a daemon error, an invalid checkpoint, a verification mismatch, an "
                    "interrupt)"},
    {CTL_EXIT_USAGE, "usage error (an unknown command or option, a missing or malformed argument)"},
    {CTL_EXIT_UNREACHABLE, "the daemon cannot be reached (no socket, no daemon listening, refused by the socket's "
                           "permissions, a socket or daemon of another user refused)"},
    {CTL_EXIT_TIMEOUT, "timed out (--timeout)"},
};

void ctl_exit_codes_help(FILE *f) {
  fputs("exit codes:\n", f);
  for (size_t i = 0; i < sizeof exit_codes / sizeof exit_codes[0]; i++) {
    fprintf(f, "  %d  ", exit_codes[i].code);
    optab_wrap(f, exit_codes[i].meaning, 5, 5);
  }
}

static void exit_codes_man(FILE *f) {
  for (size_t i = 0; i < sizeof exit_codes / sizeof exit_codes[0]; i++) {
    fprintf(f, ".TP\n\\fB%d\\fR\n", exit_codes[i].code);
    optab_man_text(f, exit_codes[i].meaning);
    fputc('\n', f);
  }
}

void ctl_cmd_help(FILE *f, const struct ctl_cmd *cmd) {
  fprintf(f, "usage: weightctl %s%s%s [OPTION]...\n\n", cmd->name, cmd->args[0] ? " " : "", cmd->args);
  optab_paragraphs(f, cmd->description, 2);
  struct optab_list lists[4];
  size_t n = ctl_cmd_lists(cmd, lists);
  /* The titles of the lists, in ctl_cmd_lists' order. */
  const char *titles[4];
  size_t t = 0;
  titles[t++] = "options";
  if (cmd->flags & CTL_CMD_PLAN) titles[t++] = "plan options";
  if (cmd->flags & CTL_CMD_DAEMON) titles[t++] = "daemon options";
  titles[t++] = "common options";
  for (size_t i = 0; i < n && i < t; i++) {
    if (lists[i].n == 0) continue;
    fprintf(f, "\n%s:\n", titles[i]);
    optab_help(f, &lists[i], 1);
  }
  fputc('\n', f);
  ctl_exit_codes_help(f);
}

/* ---- the man page ------------------------------------------------------------------------- */

static void man_paragraphs(FILE *f, const char *text) {
  const char *p = text;
  while (*p != '\0') {
    const char *end = strstr(p, "\n\n");
    size_t n = end ? (size_t)(end - p) : strlen(p);
    char buf[4096];
    snprintf(buf, sizeof buf, "%.*s", (int)(n < sizeof buf ? n : sizeof buf - 1), p);
    optab_man_text(f, buf);
    fputc('\n', f);
    if (end == NULL) break;
    fputs(".PP\n", f);
    p = end + 2;
  }
}

void ctl_write_man(FILE *f) {
  fprintf(f, ".TH WEIGHTCTL 1 \"\" \"weightd %s\" \"User Commands\"\n", weightd_version_string());
  fputs(".SH NAME\nweightctl \\- drive the weightd daemon: load, attach, prewarm and inspect model checkpoints\n"
        ".SH SYNOPSIS\n.B weightctl\n[\\fIOPTION\\fR]... \\fICOMMAND\\fR [\\fIARG\\fR]...\n.br\n"
        ".B weightctl help\n\\fICOMMAND\\fR\n.SH DESCRIPTION\n",
        f);
  man_paragraphs(f, "weightctl is the command-line client of weightd(8), for operators and autoscalers. Commands "
                    "that talk to the daemon connect to its Unix socket; inspect, plan, export and mkcheckpoint "
                    "work on files alone.\n\nOptions may be written --opt=value or --opt value, anywhere after the "
                    "command; a misspelt option is named with the closest valid one. On a terminal, long "
                    "commands draw one progress line (bytes, rate in GiB/s, time left) on stderr.");
  fputs(".SH GLOBAL OPTIONS\n", f);
  man_paragraphs(f, "Given before the command; every command also accepts them after its name.");
  optab_man(f, &ctl_global_options, 1);
  fputs(".SH COMMANDS\n", f);
  for (size_t i = 0; i < ctl_ncommands; i++) {
    const struct ctl_cmd *c = ctl_commands[i];
    fputs(".SS \"", f);
    optab_man_text(f, c->name);
    if (c->args[0] != '\0') {
      fputc(' ', f);
      optab_man_text(f, c->args);
    }
    fputs("\"\n", f);
    man_paragraphs(f, c->description);
    if (c->nopts > 0) {
      struct optab_list own = {c->opts, c->nopts};
      optab_man(f, &own, 1);
    }
    if (c->flags & CTL_CMD_PLAN) fputs(".PP\nTakes the plan options (PLAN OPTIONS).\n", f);
  }
  fputs(".SH PLAN OPTIONS\n", f);
  man_paragraphs(f, "load, attach, prewarm, plan and export take one rank's plan. Without any of these options "
                    "the plan is whole (every tensor as the files hold it); layout options without --preset "
                    "imply --preset auto.");
  optab_man(f, &ctl_plan_options, 1);
  fputs(".SH DAEMON OPTIONS\n", f);
  man_paragraphs(f, "Commands that talk to the daemon also take:");
  optab_man(f, &ctl_daemon_options, 1);
  fputs(".SH COMMON OPTIONS\n", f);
  optab_man(f, &ctl_common_options, 1);
  fputs(".SH JSON OUTPUT\n", f);
  man_paragraphs(f, "With --json, stdout carries exactly one JSON object for every command and every outcome: the "
                    "result, or {\"error\": {\"code\": CODE, \"message\": TEXT}}. CODE is the daemon's error code "
                    "(NOT_FOUND, BUSY, PERMISSION, ...) or, for failures found here, USAGE (exit 2), CONNECT (exit "
                    "3), TIMEOUT (exit 4), CANCELED or FAILED (exit 1). Internal request ids are not printed; "
                    "integers are exact, other numbers have 6 significant digits. Fields are only ever added, "
                    "never renamed or removed.");
  fputs(".SH EXIT STATUS\n", f);
  exit_codes_man(f);
  fputs(".SH ENVIRONMENT\n.TP\n\\fBWEIGHTD_SOCKET\\fR\nThe daemon's socket when --socket is not given, and then "
        "the only one tried.\n.TP\n\\fBXDG_RUNTIME_DIR\\fR\nThe directory of the per-user socket, weightd.sock; "
        "without it, /tmp/weightd-$UID/weightd.sock, in a directory that must be the user's own with mode 0700.\n"
        ".SH SEE ALSO\n\\fBweightd\\fR(8); docs/operations.md and docs/protocol.md in the documentation.\n",
        f);
}

/* ---- bash completion ------------------------------------------------------------------------ */

void ctl_write_completion(FILE *f) {
  fputs("# bash completion for weightctl, generated from its option tables (weightctl --generate-completion).\n"
        "_weightctl() {\n"
        "  local cur=\"${COMP_WORDS[COMP_CWORD]}\" prev=\"${COMP_WORDS[COMP_CWORD-1]}\" cmd=\"\" i\n"
        "  for ((i = 1; i < COMP_CWORD; i++)); do\n"
        "    case \"${COMP_WORDS[i]}\" in\n",
        f);
  /* Global options with a value skip it. */
  int first = 1;
  for (size_t k = 0; k < ctl_global_options.n; k++) {
    const struct optab_opt *o = &ctl_global_options.opts[k];
    if (o->arg != OPTAB_VALUE || (o->flags & OPTAB_HIDDEN)) continue;
    fprintf(f, "%s--%s", first ? "      " : "|", o->name);
    first = 0;
  }
  if (!first) fputs(") ((i++)) ;;\n", f);
  fputs("      -*) ;;\n      *) cmd=\"${COMP_WORDS[i]}\"; break ;;\n    esac\n  done\n"
        "  if [[ -z \"$cmd\" ]]; then\n    case \"$prev\" in\n",
        f);
  optab_complete_values(f, &ctl_global_options, 1);
  fputs("    esac\n    if [[ \"$cur\" == -* ]]; then\n      COMPREPLY=($(compgen -W \"", f);
  optab_words(f, &ctl_global_options, 1);
  fputs("\" -- \"$cur\"))\n    else\n      COMPREPLY=($(compgen -W \"help", f);
  for (size_t i = 0; i < ctl_ncommands; i++) fprintf(f, " %s", ctl_commands[i]->name);
  fputs("\" -- \"$cur\"))\n    fi\n    return 0\n  fi\n  case \"$cmd\" in\n", f);
  fputs("    help)\n      COMPREPLY=($(compgen -W \"", f);
  for (size_t i = 0; i < ctl_ncommands; i++) fprintf(f, "%s%s", i ? " " : "", ctl_commands[i]->name);
  fputs("\" -- \"$cur\")) ;;\n", f);
  for (size_t i = 0; i < ctl_ncommands; i++) {
    const struct ctl_cmd *c = ctl_commands[i];
    struct optab_list lists[4];
    size_t n = ctl_cmd_lists(c, lists);
    fprintf(f, "    %s)\n      case \"$prev\" in\n", c->name);
    optab_complete_values(f, lists, n);
    fputs("      esac\n      if [[ \"$cur\" == -* ]]; then\n        COMPREPLY=($(compgen -W \"", f);
    optab_words(f, lists, n);
    fputs("\" -- \"$cur\"))\n", f);
    if (strstr(c->args, "PATH") != NULL) fputs("      else\n        COMPREPLY=($(compgen -f -- \"$cur\"))\n", f);
    fputs("      fi ;;\n", f);
  }
  fputs("  esac\n  return 0\n}\ncomplete -o filenames -F _weightctl weightctl\n", f);
}
