/*
 * ctl.h - weightctl's command table and the helpers commands share.
 *
 * Each command is one entry: a name, a one-line summary, a usage line and a
 * run function that takes the arguments after the command name (argv[0] is
 * the command's name) and returns the process exit code.
 *
 * Exit codes (documented in docs/operations.md):
 *   0  success
 *   1  the operation failed (invalid checkpoint, daemon error, mismatch)
 *   2  usage error (unknown command or option, missing argument)
 */
#ifndef WD_CTL_H
#define WD_CTL_H

#define CTL_EXIT_OK 0
#define CTL_EXIT_FAIL 1
#define CTL_EXIT_USAGE 2

struct ctl_cmd {
  const char *name;
  const char *summary;
  const char *usage;
  int (*run)(int argc, char **argv);
};

/* Commands, one file each. */
int cmd_inspect(int argc, char **argv);
int cmd_mkcheckpoint(int argc, char **argv);
int cmd_demo(int argc, char **argv);

/* Prints "weightctl: <message>" to stderr. */
void ctl_errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Prints the usage line of the named command to stderr; returns CTL_EXIT_USAGE. */
int ctl_usage(const char *cmd);

/* Parses a non-negative decimal integer fully; returns 0 on success. */
int ctl_parse_u64(const char *s, unsigned long long *out);

#endif
