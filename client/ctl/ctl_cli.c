/*
 * ctl_cli.c - a command's arguments, errors and JSON output: parsing against
 * the command's option tables (common/optab.h), usage errors that name the
 * problem, the first error of a run kept for --json, and the one JSON object
 * a run prints.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"
#include "wire.h"

struct ctl_options ctl_opts;

/* Help was printed instead of running a command: no JSON object follows. */
static bool help_shown;

/* ---- parsing --------------------------------------------------------------------------- */

struct parse_state {
  struct ctl_args *a;
  char why[512];
};

static int take(void *arg, const struct optab_opt *o, const char *v) {
  struct parse_state *st = arg;
  struct ctl_args *a = st->a;
  if (o == NULL) {
    if (a->npos >= a->cmd->max_args || a->npos >= CTL_MAX_ARGS) {
      if (a->cmd->max_args == 0)
        snprintf(st->why, sizeof st->why, "unexpected argument '%s' (%s takes no arguments)", v, a->cmd->name);
      else
        snprintf(st->why, sizeof st->why, "unexpected argument '%s' (%s takes %s)", v, a->cmd->name, a->cmd->args);
      return 1;
    }
    a->pos[a->npos++] = v;
    return 0;
  }
  if (o->id <= CTL_OPT_NONE || o->id >= CTL_OPT_COUNT) return 0;
  __typeof__(a->opt[0]) *slot = &a->opt[o->id];
  if (o->arg == OPTAB_VALUE && slot->n > 0 && !(o->flags & OPTAB_REPEAT)) {
    snprintf(st->why, sizeof st->why, "--%s is given twice", o->name);
    return 1;
  }
  if (slot->n == CTL_MAX_VALUES) {
    snprintf(st->why, sizeof st->why, "--%s is given more than %d times", o->name, CTL_MAX_VALUES);
    return 1;
  }
  slot->v[slot->n++] = v != NULL ? v : "";
  return 0;
}

int ctl_cli_parse(const struct ctl_cmd *cmd, int argc, char **argv, struct ctl_args *a, int *exit_code) {
  memset(a, 0, sizeof *a);
  a->cmd = cmd;
  struct parse_state st = {.a = a};
  struct optab_list lists[4];
  size_t n = ctl_cmd_lists(cmd, lists);
  int rc = optab_parse(lists, n, argc, argv, false, take, &st, NULL, st.why, sizeof st.why);
  if (rc != 0) {
    *exit_code = ctl_usage_error("%s", st.why);
    return -1;
  }
  if (ctl_has(a, CTL_OPT_HELP)) {
    ctl_cmd_help(stdout, cmd);
    help_shown = true;
    *exit_code = CTL_EXIT_OK;
    return -1;
  }
  if (a->npos < cmd->min_args) {
    *exit_code = ctl_usage_error("%s needs %s", cmd->name, cmd->args);
    return -1;
  }
  return 0;
}

/* Applies the common options a command was given to the global ones. */
static int apply_common(const struct ctl_args *a) {
  if (ctl_has(a, CTL_OPT_JSON)) ctl_opts.json = 1;
  if (ctl_has(a, CTL_OPT_SOCKET)) ctl_opts.socket = ctl_val(a, CTL_OPT_SOCKET);
  if (ctl_has(a, CTL_OPT_TIMEOUT) && ctl_parse_duration(ctl_val(a, CTL_OPT_TIMEOUT), &ctl_opts.timeout_s) != 0)
    return ctl_usage_error("--timeout wants a duration such as 30, 30s, 500ms or 2m, not '%s'",
                           ctl_val(a, CTL_OPT_TIMEOUT));
  return 0;
}

int ctl_run_argv(const struct ctl_cmd *cmd, int argc, char **argv) {
  struct ctl_args *a = calloc(1, sizeof *a);
  if (a == NULL) {
    ctl_errorf("out of memory");
    return CTL_EXIT_FAIL;
  }
  const char *saved = ctl_opts.cmd;
  ctl_opts.cmd = cmd->name;
  int rc;
  if (ctl_cli_parse(cmd, argc, argv, a, &rc) == 0) {
    rc = apply_common(a);
    for (int i = 0; rc == 0 && (cmd->flags & CTL_CMD_LOCAL) && i < a->npos; i++)
      if (wire_path_is_url(a->pos[i]))
        rc = ctl_usage_error("this command reads the checkpoint's files on this machine, and %.200s is a URL: the daemon "
                             "fetches URLs (weightctl load, attach or prewarm take one)", a->pos[i]);
    if (rc == 0) rc = cmd->run(a);
  }
  ctl_opts.cmd = saved;
  free(a);
  return rc;
}

int ctl_cli_run(const struct ctl_cmd *cmd, int argc, char **argv) {
  int rc = ctl_run_argv(cmd, argc, argv);
  ctl_json_finish(rc);
  return rc;
}

const struct ctl_cmd *ctl_cmd_find(const char *name) {
  for (size_t i = 0; i < ctl_ncommands; i++)
    if (strcmp(ctl_commands[i]->name, name) == 0) return ctl_commands[i];
  return NULL;
}

/* ---- numbers ----------------------------------------------------------------------------- */

int ctl_parse_u64(const char *s, unsigned long long *out) {
  if (s == NULL || *s < '0' || *s > '9') return -1;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != '\0' || errno == ERANGE) return -1;
  *out = v;
  return 0;
}

int ctl_parse_duration(const char *s, double *out) {
  if (s == NULL || !((*s >= '0' && *s <= '9') || *s == '.')) return -1;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || errno != 0 || !isfinite(v) || v <= 0) return -1;
  static const struct {
    const char *suffix;
    double seconds;
  } units[] = {{"", 1}, {"s", 1}, {"ms", 1e-3}, {"m", 60}, {"min", 60}, {"h", 3600}};
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
    if (strcmp(end, units[i].suffix) == 0) {
      v *= units[i].seconds;
      if (v > 86400.0 * 7) return -1;
      *out = v;
      return 0;
    }
  return -1;
}

/* ---- errors ----------------------------------------------------------------------------- */

static char first_message[1024];
static char first_code_text[32];
static bool have_first;

static void record(const char *code, const char *msg) {
  if (have_first) return;
  have_first = true;
  snprintf(first_message, sizeof first_message, "%s", msg);
  snprintf(first_code_text, sizeof first_code_text, "%s", code ? code : "");
}

static void verror(const char *code, const char *fmt, va_list ap) {
  char msg[1024];
  vsnprintf(msg, sizeof msg, fmt, ap);
  ctl_progress_end(); /* the line, when one is drawn, goes first */
  fprintf(stderr, "weightctl: %s\n", msg);
  record(code, msg);
}

void ctl_errorf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  verror(NULL, fmt, ap);
  va_end(ap);
}

void ctl_errorc(const char *code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  verror(code, fmt, ap);
  va_end(ap);
}

void ctl_errorx(const char *code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  ctl_progress_end();
  fprintf(stderr, "weightctl: %s (%s)\n", msg, code);
  record(code, msg);
}

int ctl_usage_error(const char *fmt, ...) {
  char msg[700];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (ctl_opts.cmd != NULL)
    ctl_errorc("USAGE", "%s: %s (weightctl help %s)", ctl_opts.cmd, msg, ctl_opts.cmd);
  else
    ctl_errorc("USAGE", "%s (weightctl --help)", msg);
  return CTL_EXIT_USAGE;
}

/* The --json code of a run that failed with exit_code: the recorded one, else by the exit code. */
static const char *first_code(int exit_code) {
  if (have_first && first_code_text[0] != '\0') return first_code_text;
  switch (exit_code) {
  case CTL_EXIT_USAGE: return "USAGE";
  case CTL_EXIT_UNREACHABLE: return "CONNECT";
  case CTL_EXIT_TIMEOUT: return "TIMEOUT";
  default: return "FAILED";
  }
}

void ctl_json_finish(int exit_code) {
  if (!ctl_opts.json || ctl_json_printed() || help_shown) return;
  if (exit_code == 0) { /* every command prints its result; a success without one still gets an object */
    cJSON *ok = cJSON_CreateObject();
    cJSON_AddTrueToObject(ok, "ok");
    ctl_json_print(ok);
    return;
  }
  cJSON *o = cJSON_CreateObject();
  cJSON *e = cJSON_AddObjectToObject(o, "error");
  cJSON_AddStringToObject(e, "code", first_code(exit_code));
  cJSON_AddStringToObject(e, "message", have_first ? first_message : "the command failed");
  ctl_json_print(o);
}

/* ---- JSON output -------------------------------------------------------------------------- */

static bool json_printed;

bool ctl_json_printed(void) { return json_printed; }

/* A number as JSON text: exact integers below 2^53, else 6 significant digits without an exponent. */
static void number_text(double v, char *buf, size_t len) {
  if (!isfinite(v)) {
    snprintf(buf, len, "null");
    return;
  }
  if (v == floor(v) && fabs(v) < 9007199254740992.0) {
    snprintf(buf, len, "%.0f", v);
    return;
  }
  double a = fabs(v);
  int e = (int)floor(log10(a));
  if (e < -12 || e > 15) {
    snprintf(buf, len, "%.6g", v);
    return;
  }
  int decimals = 5 - e;
  if (decimals < 0) decimals = 0;
  snprintf(buf, len, "%.*f", decimals, v);
  if (strchr(buf, '.') != NULL) {
    size_t n = strlen(buf);
    while (n > 0 && buf[n - 1] == '0') buf[--n] = '\0';
    if (n > 0 && buf[n - 1] == '.') buf[--n] = '\0';
  }
}

/* Replaces every number of the tree by its text (raw), so that cJSON prints it as number_text writes it. */
static void numbers_format(cJSON *o) {
  for (cJSON *x = o ? o->child : NULL, *next; x != NULL; x = next) {
    next = x->next;
    if (cJSON_IsNumber(x)) {
      char buf[64];
      number_text(x->valuedouble, buf, sizeof buf);
      cJSON *raw = cJSON_CreateRaw(buf);
      if (raw == NULL) continue;
      if (cJSON_IsObject(o)) cJSON_ReplaceItemInObjectCaseSensitive(o, x->string, raw);
      else cJSON_ReplaceItemViaPointer(o, x, raw);
    } else if (cJSON_IsObject(x) || cJSON_IsArray(x)) {
      numbers_format(x);
    }
  }
}

void ctl_json_print(cJSON *o) {
  if (o == NULL) return;
  if (json_printed) {
    cJSON_Delete(o);
    return;
  }
  cJSON_DeleteItemFromObjectCaseSensitive(o, "id");
  numbers_format(o);
  char *text = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (text == NULL) return;
  puts(text);
  fflush(stdout);
  free(text);
  json_printed = true;
}
