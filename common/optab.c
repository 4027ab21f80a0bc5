/* optab.c - options as tables: parsing, help, man pages, completion words (see optab.h). */
#include "optab.h"

#include <getopt.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "suggest.h"

/* getopt_long's value for row k of the combined tables. */
#define ROW_BASE 256

/* ---- parsing --------------------------------------------------------------------------- */

struct rows {
  const struct optab_opt **v;
  size_t n;
};

static int rows_collect(const struct optab_list *lists, size_t nlists, struct rows *r) {
  size_t total = 0;
  for (size_t i = 0; i < nlists; i++) total += lists[i].n;
  r->v = calloc(total ? total : 1, sizeof *r->v);
  r->n = 0;
  if (r->v == NULL) return -1;
  for (size_t i = 0; i < nlists; i++)
    for (size_t k = 0; k < lists[i].n; k++) r->v[r->n++] = &lists[i].opts[k];
  return 0;
}

static const struct optab_opt *row_by_short(const struct rows *r, int c) {
  for (size_t k = 0; k < r->n; k++)
    if (r->v[k]->short_name != 0 && r->v[k]->short_name == c) return r->v[k];
  return NULL;
}

/* One sentence about an option getopt_long refused: unknown, ambiguous, or given a value it does not take. */
static void describe_refusal(const struct rows *r, char **argv, int at, int optopt_value, char *why, size_t whylen) {
  if (optopt_value >= ROW_BASE && (size_t)(optopt_value - ROW_BASE) < r->n) {
    snprintf(why, whylen, "--%s takes no value", r->v[optopt_value - ROW_BASE]->name);
    return;
  }
  if (optopt_value > 0) {
    snprintf(why, whylen, "unknown option '-%c'", optopt_value);
    return;
  }
  const char *token = argv[at];
  char name[128];
  const char *start = token;
  while (*start == '-') start++;
  size_t len = strcspn(start, "=");
  snprintf(name, sizeof name, "%.*s", (int)(len < sizeof name ? len : sizeof name - 1), start);
  /* A prefix of several names is ambiguous: list them. */
  size_t nprefix = 0;
  char list[512] = "";
  for (size_t k = 0; k < r->n; k++) {
    if ((r->v[k]->flags & OPTAB_HIDDEN) || strncmp(r->v[k]->name, name, strlen(name)) != 0) continue;
    size_t used = strlen(list);
    snprintf(list + used, sizeof list - used, "%s--%s", nprefix ? ", " : "", r->v[k]->name);
    nprefix++;
  }
  if (nprefix > 1 && name[0] != '\0') {
    snprintf(why, whylen, "'--%s' is ambiguous: %s", name, list);
    return;
  }
  const char **names = calloc(r->n ? r->n : 1, sizeof *names);
  const char *best = NULL;
  if (names != NULL) {
    for (size_t k = 0; k < r->n; k++) names[k] = (r->v[k]->flags & OPTAB_HIDDEN) ? NULL : r->v[k]->name;
    best = suggest_closest(name, names, r->n);
  }
  if (best != NULL) snprintf(why, whylen, "unknown option '%.*s'; did you mean '--%s'?", (int)(start - token + len), token, best);
  else snprintf(why, whylen, "unknown option '%.*s'", (int)(start - token + len), token);
  free(names);
}

int optab_parse(const struct optab_list *lists, size_t nlists, int argc, char **argv, bool stop_at_positional,
                optab_fn fn, void *arg, int *next, char *why, size_t whylen) {
  struct rows r;
  struct option *lo = NULL;
  char *shorts = NULL;
  int rc = 0;
  if (next != NULL) *next = argc;
  if (rows_collect(lists, nlists, &r) != 0) goto nomem;
  lo = calloc(r.n + 1, sizeof *lo);
  shorts = malloc(3 + 2 * r.n + 1);
  if (lo == NULL || shorts == NULL) goto nomem;
  size_t s = 0;
  shorts[s++] = stop_at_positional ? '+' : '-';
  shorts[s++] = ':';
  for (size_t k = 0; k < r.n; k++) {
    lo[k] = (struct option){r.v[k]->name, r.v[k]->arg == OPTAB_VALUE ? required_argument : no_argument, NULL,
                            ROW_BASE + (int)k};
    if (r.v[k]->short_name != 0) {
      shorts[s++] = r.v[k]->short_name;
      if (r.v[k]->arg == OPTAB_VALUE) shorts[s++] = ':';
    }
  }
  shorts[s] = '\0';
  opterr = 0;
  optind = 0; /* GNU: 0 reinitialises, so the parse can run again (a reload, a second table) */
  for (;;) {
    int before = optind > 0 ? optind : 1;
    int c = getopt_long(argc, argv, shorts, lo, NULL);
    if (c == -1) break;
    if (c == 1) {
      rc = fn(arg, NULL, optarg);
    } else if (c >= ROW_BASE) {
      rc = fn(arg, r.v[c - ROW_BASE], optarg);
    } else if (c == ':') {
      const struct optab_opt *o = optopt >= ROW_BASE ? r.v[optopt - ROW_BASE] : row_by_short(&r, optopt);
      if (o != NULL) snprintf(why, whylen, "--%s needs a value", o->name);
      else snprintf(why, whylen, "-%c needs a value", optopt);
      rc = -1;
    } else if (c == '?') {
      int at = optind > before ? optind - 1 : before;
      if (at >= argc) at = argc - 1;
      describe_refusal(&r, argv, at, optopt, why, whylen);
      rc = -1;
    } else {
      const struct optab_opt *o = row_by_short(&r, c);
      if (o == NULL) {
        snprintf(why, whylen, "unknown option '-%c'", c);
        rc = -1;
      } else {
        rc = fn(arg, o, optarg);
      }
    }
    if (rc != 0) break;
  }
  if (rc == 0) {
    if (stop_at_positional) {
      if (next != NULL) *next = optind;
    } else {
      for (int i = optind; i < argc && rc == 0; i++) rc = fn(arg, NULL, argv[i]);
    }
  }
  free(r.v);
  free(lo);
  free(shorts);
  return rc;
nomem:
  free(r.v);
  free(lo);
  free(shorts);
  snprintf(why, whylen, "out of memory");
  return -1;
}

const struct optab_opt *optab_find(const struct optab_list *lists, size_t nlists, const char *name) {
  for (size_t i = 0; i < nlists; i++)
    for (size_t k = 0; k < lists[i].n; k++)
      if (strcmp(lists[i].opts[k].name, name) == 0) return &lists[i].opts[k];
  return NULL;
}

/* ---- help ---------------------------------------------------------------------------- */

#define HELP_COLUMN 26
#define HELP_WIDTH 79

void optab_wrap(FILE *f, const char *text, int col, int indent) {
  const char *p = text;
  while (*p != '\0') {
    while (*p == ' ') p++;
    size_t word = strcspn(p, " ");
    if (word == 0) break;
    if (col > indent && col + 1 + (int)word > HELP_WIDTH) {
      fprintf(f, "\n%*s", indent, "");
      col = indent;
    } else if (col > indent) {
      fputc(' ', f);
      col++;
    }
    fwrite(p, 1, word, f);
    col += (int)word;
    p += word;
  }
  fputc('\n', f);
}

void optab_paragraphs(FILE *f, const char *text, int indent) {
  const char *p = text;
  while (*p != '\0') {
    const char *end = strstr(p, "\n\n");
    size_t n = end ? (size_t)(end - p) : strlen(p);
    char *para = strndup(p, n);
    if (para == NULL) return;
    for (char *q = para; *q != '\0'; q++)
      if (*q == '\n') *q = ' ';
    fprintf(f, "%*s", indent, "");
    optab_wrap(f, para, indent, indent);
    free(para);
    if (end == NULL) break;
    fputc('\n', f);
    p = end + 2;
  }
}

void optab_help(FILE *f, const struct optab_list *lists, size_t nlists) {
  for (size_t i = 0; i < nlists; i++)
    for (size_t k = 0; k < lists[i].n; k++) {
      const struct optab_opt *o = &lists[i].opts[k];
      if (o->flags & OPTAB_HIDDEN) continue;
      char left[96];
      int n;
      if (o->short_name != 0)
        n = snprintf(left, sizeof left, "  -%c, --%s%s%s", o->short_name, o->name, o->arg == OPTAB_VALUE ? " " : "",
                     o->arg == OPTAB_VALUE ? o->metavar : "");
      else
        n = snprintf(left, sizeof left, "      --%s%s%s", o->name, o->arg == OPTAB_VALUE ? " " : "",
                     o->arg == OPTAB_VALUE ? o->metavar : "");
      fputs(left, f);
      if (n + 2 <= HELP_COLUMN) {
        fprintf(f, "%*s", HELP_COLUMN - n, "");
      } else {
        fprintf(f, "\n%*s", HELP_COLUMN, "");
      }
      optab_wrap(f, o->help, HELP_COLUMN, HELP_COLUMN);
    }
}

/* ---- man pages ----------------------------------------------------------------------- */

void optab_man_text(FILE *f, const char *text) {
  int line_start = 1;
  for (const char *p = text; *p != '\0'; p++) {
    if (line_start && (*p == '.' || *p == '\'')) fputs("\\&", f);
    if (*p == '\\') fputs("\\e", f);
    else if (*p == '-') fputs("\\-", f);
    else fputc(*p, f);
    line_start = *p == '\n';
  }
}

void optab_man(FILE *f, const struct optab_list *lists, size_t nlists) {
  for (size_t i = 0; i < nlists; i++)
    for (size_t k = 0; k < lists[i].n; k++) {
      const struct optab_opt *o = &lists[i].opts[k];
      if (o->flags & OPTAB_HIDDEN) continue;
      fputs(".TP\n", f);
      if (o->short_name != 0) fprintf(f, "\\fB\\-%c\\fR, ", o->short_name);
      fputs("\\fB\\-\\-", f);
      optab_man_text(f, o->name);
      fputs("\\fR", f);
      if (o->arg == OPTAB_VALUE) {
        fputs(" \\fI", f);
        optab_man_text(f, o->metavar);
        fputs("\\fR", f);
      }
      fputc('\n', f);
      optab_man_text(f, o->help);
      fputc('\n', f);
    }
}

/* ---- completion ------------------------------------------------------------------------ */

void optab_words(FILE *f, const struct optab_list *lists, size_t nlists) {
  int first = 1;
  for (size_t i = 0; i < nlists; i++)
    for (size_t k = 0; k < lists[i].n; k++) {
      const struct optab_opt *o = &lists[i].opts[k];
      if (o->flags & OPTAB_HIDDEN) continue;
      fprintf(f, "%s--%s", first ? "" : " ", o->name);
      first = 0;
    }
}

void optab_complete_values(FILE *f, const struct optab_list *lists, size_t nlists) {
  for (size_t i = 0; i < nlists; i++)
    for (size_t k = 0; k < lists[i].n; k++) {
      const struct optab_opt *o = &lists[i].opts[k];
      if ((o->flags & OPTAB_HIDDEN) || o->arg != OPTAB_VALUE) continue;
      fprintf(f, "      --%s)\n", o->name);
      if (o->complete == NULL) fputs("        return 0 ;;\n", f); /* a value nothing can guess: offer none */
      else if (strcmp(o->complete, "@file") == 0)
        fputs("        COMPREPLY=($(compgen -f -- \"$cur\")); return 0 ;;\n", f);
      else if (strcmp(o->complete, "@dir") == 0)
        fputs("        COMPREPLY=($(compgen -d -- \"$cur\")); return 0 ;;\n", f);
      else fprintf(f, "        COMPREPLY=($(compgen -W \"%s\" -- \"$cur\")); return 0 ;;\n", o->complete);
    }
}
