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

#include "clock.h"
#include "jsonutil.h"
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
int cmd_plan(int argc, char **argv);
int cmd_export(int argc, char **argv);

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

/* Formats a byte count as "7.49 GiB". */
void ctl_human_bytes(uint64_t b, char *buf, size_t len);

/* A member as uint64 (0 when absent or not a number). */
uint64_t ctl_u64(const cJSON *o, const char *key);

/* A member as a string ("?" when absent). */
const char *ctl_str(const cJSON *o, const char *key);

/* Prints a checkpoint object of a reply in one line: path, layout, shards, tensors, bytes. */
void ctl_print_checkpoint(const char *verb, const cJSON *ck);

/* ---- plans (ctl_plan.c) -------------------------------------------------- */

/*
 * The plan flags that load, attach, plan and export share, as given:
 * --preset NAME, --plan FILE, --tp-size N, --tp-rank R, --ep-size N,
 * --ep-rank R, --experts LIST, --fuse.
 */
struct ctl_plan_args {
  const char *cmd;    /* the command, for messages */
  const char *preset; /* --preset NAME */
  const char *file;   /* --plan FILE */
  int has_tp_size, has_tp_rank, has_ep_size, has_ep_rank;
  unsigned long long tp_size, tp_rank, ep_size, ep_rank;
  const char *experts; /* --experts LIST, comma-separated ids */
  int fuse;            /* --fuse */
};

/* The usage text of the plan flags, for the command table. */
#define CTL_PLAN_USAGE \
  "[--preset NAME | --plan FILE] [--tp-size N --tp-rank R] [--ep-size N --ep-rank R] [--experts LIST] [--fuse]"

/*
 * Takes argv[*i] (and its value, advancing *i) when it is a plan flag.
 * Returns 1 when taken, 0 when argv[*i] is not a plan flag, -1 after printing
 * why the flag is malformed (a usage error).
 */
int ctl_plan_arg(struct ctl_plan_args *a, int argc, char **argv, int *i);

/*
 * Checks the flags together and builds the plan spec as docs/protocol.md
 * writes it: --plan FILE's object, or {"preset": NAME} followed by exactly the
 * fields given (tp_size, tp_rank, ep_size, ep_rank, experts, fuse), with
 * preset "auto" when only layout flags were given. *spec is NULL when no plan
 * flag was given (the daemon's default, whole). With ranks_optional, a size
 * without its rank is accepted (the plan command's per-rank table);
 * otherwise a size above 1 needs its rank. Returns 0, CTL_EXIT_USAGE after one
 * line saying what is wrong, or CTL_EXIT_FAIL when the plan file cannot be read.
 */
int ctl_plan_spec(const struct ctl_plan_args *a, int ranks_optional, cJSON **spec);

/* Reads a plan file: one JSON object. NULL (after printing why) when it is not. */
cJSON *ctl_plan_read(const char *file);

/* The spec as compact JSON text (a new string), "{\"preset\":\"whole\"}" for NULL. */
char *ctl_plan_text(const cJSON *spec);

struct ckpt;
struct plan;

/*
 * A checkpoint opened here, with its plan built here, and (when mapped) each
 * shard mapped read-only: data[i] is shard i's data section, as plan_gather
 * takes it.
 */
struct ctl_local {
  struct ckpt *ck;
  struct plan *plan;
  size_t nmaps;
  void **maps;
  size_t *map_len;
  const unsigned char **data;
};

/*
 * Opens the checkpoint at path, builds spec's plan for it and, with map,
 * maps its shards. Prints "weightctl: what: <why> (CODE)" and returns
 * CTL_EXIT_FAIL on failure; 0 otherwise.
 */
int ctl_local_open(const char *path, const cJSON *spec, int map, const char *what, struct ctl_local *out);

/* Unmaps and frees what ctl_local_open made; safe on a zeroed struct. */
void ctl_local_close(struct ctl_local *l);

/* Bytes a plan reads from the files: its pieces with a source (zeros are not read). */
uint64_t ctl_plan_read_bytes(const struct plan *p);

/*
 * Turns a SIGBUS (a mapped shard truncated under us) into one error line,
 * "weightctl: what: a shard was truncated or became unreadable while it was
 * read", and exit status 1, after unlinking the NULL-terminated list of
 * paths in cleanup (which must stay valid; NULL for none). Installing again
 * replaces the message and the list.
 */
void ctl_sigbus_guard(const char *what, const char *const *cleanup);

/* ---- whole groups (ctl_group.c) ------------------------------------------ */

/* The flags a command that loads takes to load every rank of a group. */
#define CTL_GROUP_USAGE "[--all-ranks [--devices D,D,...]]"

/*
 * --all-ranks: builds the load_group request's "group" (the sizes of
 * --tp-size and --ep-size, and the devices of --devices LIST, one per rank)
 * and its base "plan" (the preset, auto by default, and --fuse) from the
 * plan flags; ranks, --experts and --plan FILE are usage errors. Returns 0,
 * CTL_EXIT_USAGE after one line saying why, or CTL_EXIT_FAIL.
 */
int ctl_group_spec(const struct ctl_plan_args *a, const char *devices, cJSON **group, cJSON **plan);

/* Sends load_group (group and plan are consumed) and prints each rank's result; returns the exit code. */
int ctl_group_load(weightd_client *c, const char *path, cJSON *group, cJSON *plan);

/* ---- attach --verify (cmd_verify.c) ------------------------------------- */

struct ctl_verify_result {
  size_t tensors;
  uint64_t bytes;
};

/*
 * Compares the attached set with what plan `spec` (NULL: whole) gives for the
 * checkpoint at ckpt_path, with the plan built here: the same outputs (names,
 * dtypes, shapes, sizes) and every byte, gathered here from the shard files
 * (host memory read directly, CUDA memory copied to the host in chunks).
 * Prints the first mismatch (tensor and byte offset) to stderr. Returns 0 when
 * everything matched, else CTL_EXIT_FAIL.
 */
int ctl_verify_set(const weightd_set *s, const char *ckpt_path, const cJSON *spec, struct ctl_verify_result *res);

#endif
