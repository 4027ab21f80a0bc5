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

#include <cjson/cJSON.h>
#include <stdint.h>

#include "weightd.h"

#define CTL_EXIT_OK 0
#define CTL_EXIT_FAIL 1
#define CTL_EXIT_USAGE 2

/* Global options, set by main before a command runs (and by demo). */
struct ctl_options {
  const char *socket; /* --socket PATH; NULL: libweightd's search */
  int json;           /* --json: print the daemon's reply object */
  int timeout_ms;     /* --timeout MS; 0: wait forever */
};
extern struct ctl_options ctl_opts;

struct ctl_cmd {
  const char *name;
  const char *summary;
  const char *usage;
  int (*run)(int argc, char **argv);
};

/* Commands, one file each (open and prefetch share one, as do release and evict). */
int cmd_inspect(int argc, char **argv);
int cmd_mkcheckpoint(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_status(int argc, char **argv);
int cmd_open(int argc, char **argv);
int cmd_prefetch(int argc, char **argv);
int cmd_load(int argc, char **argv);
int cmd_attach(int argc, char **argv);
int cmd_release(int argc, char **argv);
int cmd_evict(int argc, char **argv);
int cmd_shutdown(int argc, char **argv);

/* Prints "weightctl: <message>" to stderr. */
void ctl_errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Prints the usage line of the named command to stderr; returns CTL_EXIT_USAGE. */
int ctl_usage(const char *cmd);

/* Parses a non-negative decimal integer fully; returns 0 on success. */
int ctl_parse_u64(const char *s, unsigned long long *out);

/* ---- talking to the daemon (ctl_client.c) ------------------------------ */

/* Connects with the global options; prints why it failed. 0 or CTL_EXIT_FAIL. */
int ctl_connect(weightd_client **out);

/* Prints "weightctl: what: <last error> (CODE)"; returns CTL_EXIT_FAIL. */
int ctl_fail(weightd_client *c, int rc, const char *what);

/*
 * Sends req (consumed) and parses the reply into *reply (the caller deletes
 * it; also set on a daemon error). With --json the reply is printed to
 * stdout as the daemon sent it. Returns 0 or the WEIGHTD_E code, after
 * printing the error.
 */
int ctl_request(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *arg, cJSON **reply);

/* A new request {"op": op}; exits on out-of-memory (there is nothing useful left to do). */
cJSON *ctl_request_new(const char *op);

/* Adds "path": the path made absolute against the current directory. */
void ctl_add_path(cJSON *req, const char *path);

/* Adds "device": D as given (a UUID or an index, which the daemon accepts as text). */
void ctl_add_device(cJSON *req, const char *device);

/*
 * A progress callback that draws a bar on stderr when stderr is a terminal
 * (nothing otherwise); ctl_progress_done clears it. arg is unused.
 */
void ctl_progress(uint64_t done, uint64_t total, void *arg);
void ctl_progress_done(void);

/* Reads a plan file: one JSON object. NULL (after printing why) when it is not. */
cJSON *ctl_plan_read(const char *file);

/* Formats a byte count as "7.49 GiB". */
void ctl_human_bytes(uint64_t b, char *buf, size_t len);

/* A member as uint64 (0 when absent or not a number). */
uint64_t ctl_u64(const cJSON *o, const char *key);

/* A member as a string ("?" when absent). */
const char *ctl_str(const cJSON *o, const char *key);

/* Prints a checkpoint object of a reply in one line: path, layout, shards, tensors, bytes. */
void ctl_print_checkpoint(const char *verb, const cJSON *ck);

/* ---- attach --verify (cmd_verify.c) ------------------------------------- */

struct ctl_verify_result {
  size_t tensors;
  uint64_t bytes;
};

/*
 * Compares every tensor of the attached set with the checkpoint at ckpt_path:
 * dtype, shape and every byte (host memory read directly, CUDA memory copied
 * to the host in chunks). whole says the set should hold every tensor of the
 * checkpoint. Prints the first mismatch (tensor and byte offset) to stderr.
 * Returns 0 when everything matched, else CTL_EXIT_FAIL.
 */
int ctl_verify_set(const weightd_set *s, const char *ckpt_path, int whole, struct ctl_verify_result *res);

#endif
