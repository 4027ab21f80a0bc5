/*
 * optab.h - command-line options as tables (tmux options-table.c): one row
 * per option with its name, value, help and completion, from which come the
 * getopt_long parse, the --help text, the man page's option lists and the
 * bash completion words. weightd and weightctl both parse through it.
 *
 * Parsing is GNU getopt_long's (--opt=value and --opt value, unambiguous
 * prefixes of long names), with its diagnostics replaced by one sentence
 * that names the option and, for a misspelt one, the closest valid name.
 */
#ifndef WD_OPTAB_H
#define WD_OPTAB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

enum optab_arg { OPTAB_SWITCH, OPTAB_VALUE };

#define OPTAB_REPEAT (1u << 0) /* may be given more than once: each value is passed on in order */
#define OPTAB_HIDDEN (1u << 1) /* accepted, never listed (help, man pages, completion, suggestions) */

struct optab_opt {
  int id;               /* the caller's number for it */
  const char *name;     /* the long name, without the dashes */
  char short_name;      /* a one-letter alias, or 0 */
  enum optab_arg arg;
  const char *metavar;  /* OPTAB_VALUE: how the value is shown ("PATH") */
  const char *help;     /* what it does, in sentences */
  unsigned flags;       /* OPTAB_* */
  const char *complete; /* bash completion of the value: "@file", "@dir", words separated by spaces, or NULL */
};

/* One table of a parse (a program parses several together: common, its own, shared groups). */
struct optab_list {
  const struct optab_opt *opts;
  size_t n;
};

/*
 * Called for every option in order (o the row, value its argument or NULL)
 * and every positional argument (o NULL, value the argument). Returns 0 to
 * go on; anything else stops the parse and is returned by optab_parse.
 */
typedef int (*optab_fn)(void *arg, const struct optab_opt *o, const char *value);

/*
 * Parses argv[1..argc) (argv[0] is the program or command name) against the
 * tables. With stop_at_positional the first positional argument ends the
 * parse and *next is its index (argc when there is none); otherwise options
 * and positional arguments mix, "--" ends the options and *next is argc.
 * Returns 0, the callback's non-zero value, or -1 with one sentence in why,
 * such as "unknown option '--tp-sise'; did you mean '--tp-size'?",
 * "--device needs a value", "--json takes no value" or
 * "'--tp' is ambiguous: --tp-size, --tp-rank".
 */
int optab_parse(const struct optab_list *lists, size_t nlists, int argc, char **argv, bool stop_at_positional,
                optab_fn fn, void *arg, int *next, char *why, size_t whylen);

/* The option of the tables called name (long name without dashes), or NULL. */
const struct optab_opt *optab_find(const struct optab_list *lists, size_t nlists, const char *name);

/* Writes the help of every listed option: "  --name VALUE   help", wrapped at 79 columns. */
void optab_help(FILE *f, const struct optab_list *lists, size_t nlists);

/*
 * Writes text wrapped at 79 columns and a newline: the caller has written
 * the first line up to column col; the following lines are indented by indent.
 */
void optab_wrap(FILE *f, const char *text, int col, int indent);

/*
 * Writes text wrapped at 79 columns, every line indented by indent; a blank
 * line ("\n\n") in text separates paragraphs.
 */
void optab_paragraphs(FILE *f, const char *text, int indent);

/* Writes text for troff (man pages): backslashes, hyphens and leading dots escaped. */
void optab_man_text(FILE *f, const char *text);

/* Writes every listed option as a man page .TP entry. */
void optab_man(FILE *f, const struct optab_list *lists, size_t nlists);

/* Writes the listed options' names ("--a --b ...") for a completion word list. */
void optab_words(FILE *f, const struct optab_list *lists, size_t nlists);

/*
 * Writes a bash `case` arm body that completes the value of the options
 * that take one (for use inside `case "$prev" in ... esac`); nothing for
 * options without a completion hint.
 */
void optab_complete_values(FILE *f, const struct optab_list *lists, size_t nlists);

#endif
