/*
 * ctl.h - weightctl's command table and what commands share.
 *
 * A command is one entry (struct ctl_cmd, defined in its cmd_*.c file as
 * tmux's cmd-*.c are): its name, positional arguments, help, its option
 * table (common/optab.h) and a run function. weightctl.c lists them;
 * ctl_cli.c parses a command's arguments against its table (plus the
 * options every command takes, and the plan flags for commands that build
 * plans) into a struct ctl_args, prints help, and generates the man page
 * and the bash completion from the same tables.
 *
 * Exit codes (documented in --help, weightctl(1) and docs/operations.md):
 *   0  success
 *   1  the operation failed (a daemon error, an invalid checkpoint, a
 *      mismatch, an interrupted command)
 *   2  usage error (unknown command or option, missing argument)
 *   3  the daemon cannot be reached (no socket, nobody listening, refused by
 *      the socket's permissions, a socket or daemon of another user refused)
 *   4  timed out (--timeout)
 *
 * Output: a command prints its result on stdout; errors go to stderr as one
 * line "weightctl: ...". With --json, stdout carries exactly one JSON object
 * for every outcome: the result, or {"error": {"code", "message"}} (the
 * daemon's code, or USAGE, CONNECT, TIMEOUT, CANCELED, FAILED for local
 * failures); ctl_cli.c prints the error object for any command that failed
 * without printing one.
 */
#ifndef WD_CTL_H
#define WD_CTL_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "clock.h"
#include "jsonutil.h"
#include "optab.h"
#include "sockpath.h"
#include "weightd.h"

#define CTL_EXIT_OK 0
#define CTL_EXIT_FAIL 1
#define CTL_EXIT_USAGE 2
#define CTL_EXIT_UNREACHABLE 3
#define CTL_EXIT_TIMEOUT 4

/* The help of --socket, a global option and every daemon command's (weightctl.c, ctl_tables.c). */
#define CTL_SOCKET_HELP "The daemon's socket, the only one tried when given (default: " SOCKPATH_SEARCH_TEXT ")."

/* Global options, set by main before a command runs (and by demo). */
struct ctl_options {
  const char *socket; /* --socket PATH; NULL: libweightd's search */
  int json;           /* --json: one JSON object on stdout */
  double timeout_s;   /* --timeout; 0: wait as long as it takes */
  const char *cmd;    /* the command running, for messages and the hello client name */
};
extern struct ctl_options ctl_opts;

/* ---- options and commands (ctl_cli.c) ---------------------------------------- */

/* Every option of every command, by meaning (one id may have several tables' rows). */
enum ctl_opt_id {
  CTL_OPT_NONE,
  CTL_OPT_HELP,
  CTL_OPT_JSON,
  CTL_OPT_SOCKET,
  CTL_OPT_TIMEOUT,
  CTL_OPT_VERSION,
  CTL_OPT_GENERATE_MAN,
  CTL_OPT_GENERATE_COMPLETION,
  CTL_OPT_DEVICE,
  CTL_OPT_DEVICES,
  CTL_OPT_ALL_RANKS,
  CTL_OPT_SOURCE,
  CTL_OPT_PIN,
  CTL_OPT_WAIT,
  CTL_OPT_VERIFY,
  CTL_OPT_HOLD,
  CTL_OPT_OUT,
  CTL_OPT_MAX_SHARD_BYTES,
  CTL_OPT_THREADS,
  CTL_OPT_PRESET,
  CTL_OPT_PLAN,
  CTL_OPT_TP_SIZE,
  CTL_OPT_TP_RANK,
  CTL_OPT_EP_SIZE,
  CTL_OPT_EP_RANK,
  CTL_OPT_EXPERTS,
  CTL_OPT_FUSE,
  CTL_OPT_LAYERS,
  CTL_OPT_SEED,
  CTL_OPT_LIST,
  CTL_OPT_SPARSE,
  CTL_OPT_DIR,
  CTL_OPT_KEEP,
  CTL_OPT_ALL,
  CTL_OPT_MANIFEST,
  CTL_OPT_SHA256,
  CTL_OPT_INTERVAL,
  CTL_OPT_ONCE,
  CTL_OPT_COUNT
};

/* Values kept per option at most (--device of prewarm may be repeated). */
#define CTL_MAX_VALUES 64
#define CTL_MAX_ARGS 8

/* A command's arguments, parsed. */
struct ctl_args {
  const struct ctl_cmd *cmd;
  struct {
    unsigned n;
    const char *v[CTL_MAX_VALUES];
  } opt[CTL_OPT_COUNT];
  int npos;
  const char *pos[CTL_MAX_ARGS];
};

/* True when the option was given. */
static inline bool ctl_has(const struct ctl_args *a, enum ctl_opt_id id) { return a->opt[id].n > 0; }
/* The option's value (the last one given), or NULL. */
static inline const char *ctl_val(const struct ctl_args *a, enum ctl_opt_id id) {
  return a->opt[id].n > 0 ? a->opt[id].v[a->opt[id].n - 1] : NULL;
}

#define CTL_CMD_DAEMON (1u << 0) /* talks to the daemon: takes --socket and --timeout */
#define CTL_CMD_PLAN (1u << 1)   /* takes the plan flags (ctl_plan_options) */
#define CTL_CMD_LOCAL (1u << 2)  /* reads the checkpoint at PATH on this machine: a URL is refused (the daemon's to fetch) */

struct ctl_cmd {
  const char *name;
  const char *args;        /* the positional arguments as help shows them ("PATH"), "" for none */
  int min_args, max_args;
  const char *summary;     /* one line */
  const char *description; /* what it does and prints, in sentences; a blank line separates paragraphs */
  const struct optab_opt *opts;
  size_t nopts;
  unsigned flags; /* CTL_CMD_* */
  int (*run)(const struct ctl_args *a);
};

#define CTL_OPTS(table) (table), (sizeof(table) / sizeof((table)[0]))

/* The commands, one file each (open and prefetch share one, as do release and evict). */
extern const struct ctl_cmd ctl_cmd_status, ctl_cmd_health, ctl_cmd_open, ctl_cmd_prefetch, ctl_cmd_load,
    ctl_cmd_attach, ctl_cmd_prewarm, ctl_cmd_cancel, ctl_cmd_release, ctl_cmd_evict, ctl_cmd_shutdown,
    ctl_cmd_inspect, ctl_cmd_plan, ctl_cmd_export, ctl_cmd_mkcheckpoint, ctl_cmd_demo,
    ctl_cmd_manifest, ctl_cmd_verify, ctl_cmd_top, ctl_cmd_scrub;

/* The command table (weightctl.c), in the order help lists it. */
extern const struct ctl_cmd *const ctl_commands[];
extern const size_t ctl_ncommands;

/*
 * The global options (weightctl.c); those every command takes, and those of
 * commands that talk to the daemon (ctl_tables.c).
 */
extern const struct optab_list ctl_global_options, ctl_common_options, ctl_daemon_options;

/* The option tables a command parses, in the order help lists them (ctl_tables.c); returns how many (at most 4). */
size_t ctl_cmd_lists(const struct ctl_cmd *cmd, struct optab_list lists[4]);

/*
 * Parses a command's arguments (argv[0] is its name) into *a. Returns 0; or
 * prints the command's help and returns -1 with *exit_code 0 for --help; or
 * reports a usage error and returns -1 with *exit_code CTL_EXIT_USAGE.
 */
int ctl_cli_parse(const struct ctl_cmd *cmd, int argc, char **argv, struct ctl_args *a, int *exit_code);

/* Runs a command: parses, sets the global options it was given, runs it, prints the JSON error object if due. */
int ctl_cli_run(const struct ctl_cmd *cmd, int argc, char **argv);

/* The command called name, or NULL. */
const struct ctl_cmd *ctl_cmd_find(const char *name);

/* Writes a command's help: usage line, description, options, exit codes. */
void ctl_cmd_help(FILE *f, const struct ctl_cmd *cmd);

/* Writes weightctl(1) / the bash completion file, from the tables. */
void ctl_write_man(FILE *f);
void ctl_write_completion(FILE *f);

/* Writes the exit codes' table of help texts. */
void ctl_exit_codes_help(FILE *f);

/* ---- errors and output (ctl_cli.c) ------------------------------------------------- */

/*
 * Prints "weightctl: <message>" to stderr. The first error message of a
 * run is also kept for the --json error object (with code FAILED unless
 * ctl_errorc names one).
 */
void ctl_errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* ctl_errorf with the error's code for --json ("NOT_FOUND", "USAGE"). */
void ctl_errorc(const char *code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prints "weightctl: <message> (CODE)" and keeps the message (without the code) and the code for --json. */
void ctl_errorx(const char *code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A usage error of the running command: one line naming the problem and where help is; returns CTL_EXIT_USAGE. */
int ctl_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/*
 * Prints o (consumed) as the run's JSON result on stdout, one line: numbers
 * that are integers exactly, other numbers with 6 significant digits, no
 * exponents; the member "id" of daemon replies is dropped. Only the first
 * call of a run prints.
 */
void ctl_json_print(cJSON *o);

/* Whether the run printed its JSON object. */
bool ctl_json_printed(void);

/*
 * With --json, prints the run's object if no command printed one (and no
 * help was shown): {"ok": true} for exit 0, else {"error": {"code",
 * "message"}} from the run's first error (its code, or USAGE, CONNECT,
 * TIMEOUT or FAILED by the exit code).
 */
void ctl_json_finish(int exit_code);

/* Parses a non-negative decimal integer fully; returns 0 on success. */
int ctl_parse_u64(const char *s, unsigned long long *out);

/* Parses a duration: "30", "30s", "500ms", "2m", "1h"; returns 0 with seconds in *out. */
int ctl_parse_duration(const char *s, double *out);

/* ---- talking to the daemon (ctl_client.c) ---------------------------------------- */

/*
 * Connects with the global options, as client "weightctl <command>", and
 * starts watching for an interrupt and the --timeout deadline (ctl_guard.c).
 * Returns 0, or the exit code after printing why (3 when the daemon cannot
 * be reached).
 */
int ctl_connect(weightd_client **out);

/* Stops the watch ctl_connect started and closes c. */
void ctl_disconnect(weightd_client *c);

/*
 * The exit code for a libweightd result: 0, 3 for CONNECT, 4 for TIMEOUT
 * and for a request canceled because --timeout passed, 1 otherwise.
 */
int ctl_exit_for(int rc);

/*
 * Prints "weightctl: what: <last error> (CODE)" (for an interrupted or
 * timed-out request, what happened instead) and keeps it for --json;
 * returns ctl_exit_for(rc).
 */
int ctl_fail(weightd_client *c, int rc, const char *what);

/*
 * Sends req (consumed) and parses the reply into *reply (the caller deletes
 * it; NULL on failure). Returns 0 or the WEIGHTD_E code, after printing the
 * error (ctl_fail).
 */
int ctl_request(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *arg, cJSON **reply);

/* A new request {"op": op}; exits on out-of-memory (there is nothing useful left to do). */
cJSON *ctl_request_new(const char *op);

/*
 * Adds "path": the path made absolute against the current directory. When
 * it cannot be (no working directory, too long), says so naming the path
 * and exits with CTL_EXIT_FAIL, as lib_add_path fails.
 */
void ctl_add_path(cJSON *req, const char *path);

/* Adds "device": D as given (a UUID or an index, which the daemon accepts as text). */
void ctl_add_device(cJSON *req, const char *device);

/* Formats a byte count in binary units: "7.49 GiB", "12.0 MiB", "512 B". */
void ctl_human_bytes(uint64_t b, char *buf, size_t len);

/* Prints a checkpoint object of a reply in one line: path, layout, shards, tensors, bytes. */
void ctl_print_checkpoint(const char *verb, const cJSON *ck);

/* ---- reading replies (ctl_json.c) ------------------------------------------------- */

/* A member as uint64 (0 when absent or not a number). */
uint64_t ctl_u64(const cJSON *o, const char *key);

/* A member as a double (0 when absent or not a number). */
double ctl_num(const cJSON *o, const char *key);

/* A member as a string ("?" when absent). */
const char *ctl_str(const cJSON *o, const char *key);

/* ---- interrupts and deadlines (ctl_guard.c) --------------------------------------- */

/*
 * While a command talks to the daemon, a watcher thread takes SIGINT and
 * SIGTERM (blocked in the other threads) and the --timeout deadline: it
 * opens a second connection, finds this process's requests in status and
 * cancels each by its daemon-wide id, so that the waiting call returns
 * CANCELED. If the call has not returned a few seconds later (nothing was
 * cancelable, or the daemon does not answer), the watcher reports and exits
 * itself. A second interrupt exits at once. Between calls the command
 * reports on its own and stops before its next request.
 */
void ctl_guard_start(void);
void ctl_guard_stop(void);
/* The socket the command connected to, for the watcher's own connection. */
void ctl_guard_socket(const char *path);
/*
 * Around every call to the daemon in the command's thread: the watcher exits
 * the process itself only while a call is in progress. call_end waits while
 * the watcher is reporting (it exits meanwhile), so that output never mixes.
 */
void ctl_guard_call_begin(void);
void ctl_guard_call_end(void);

enum ctl_guard_reason { CTL_GUARD_NONE, CTL_GUARD_INTERRUPTED, CTL_GUARD_TIMEOUT };
/* Why the watcher canceled what this process started (CTL_GUARD_NONE: it did not). */
enum ctl_guard_reason ctl_guard_reason(void);

/* ---- progress (ctl_progress.c) ----------------------------------------------------- */

/*
 * One progress line for long commands: bytes done of the total in GiB, the
 * rate in GiB/s and the time left, redrawn in place on stderr at most ten
 * times a second, and only when stdout and stderr are terminals and --json
 * is off. ctl_progress_begin starts a line with a label; ctl_progress_update
 * (or the weightd_progress_fn ctl_progress_cb) moves it; ctl_progress_end
 * clears it. Thread-safe.
 */
void ctl_progress_begin(const char *label);
void ctl_progress_update(uint64_t done, uint64_t total);
void ctl_progress_cb(uint64_t done, uint64_t total, void *arg);
void ctl_progress_end(void);

/*
 * For work that counts its own progress (the safetensors writer): a thread
 * calls get(arg, &done, &total) every 100 ms and draws it, from
 * ctl_progress_watch until ctl_progress_end. Does nothing when no line
 * would be drawn.
 */
void ctl_progress_watch(const char *label, void (*get)(void *arg, uint64_t *done, uint64_t *total), void *arg);

/* True when progress lines are drawn (stdout and stderr are terminals, no --json). */
bool ctl_progress_enabled(void);

/* ---- plans (ctl_plan.c) ---------------------------------------------------------------- */

/* The plan flags, as one option table (commands with CTL_CMD_PLAN take it). */
extern const struct optab_list ctl_plan_options;

/*
 * The plan flags that load, attach, prewarm, plan and export share, as given:
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

/* Reads the plan flags out of parsed arguments; 0, or CTL_EXIT_USAGE after saying which value is malformed. */
int ctl_plan_args_get(const struct ctl_args *a, struct ctl_plan_args *pa);

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

/*
 * --all-ranks: builds the load_group request's "group" (the sizes of
 * --tp-size and --ep-size, and the devices of --devices LIST, one per rank;
 * devices NULL: the daemon's default) and its base "plan" (the preset, auto
 * by default, and --fuse) from the plan flags; ranks, --experts and --plan
 * FILE are usage errors. Returns 0, CTL_EXIT_USAGE after one line saying
 * why (ctl_usage_error), or CTL_EXIT_FAIL.
 */
int ctl_group_spec(const struct ctl_plan_args *a, const char *devices, cJSON **group, cJSON **plan);

/*
 * Sends load_group for the checkpoint at path (group and plan are consumed)
 * with a progress line, and prints the group and each rank's result, also
 * each failed rank's error when the group failed (with --json: the reply,
 * or the error reply with its ranks). Returns the exit code.
 */
int ctl_group_load(weightd_client *c, const char *path, cJSON *group, cJSON *plan, const char *source);

/* ---- attach --verify (cmd_attach_verify.c) ------------------------------------- */

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

/* ---- commands that run others (demo) ----------------------------------------------------- */

/* Runs a command's run function on argv as the command line would (parse included); returns its exit code. */
int ctl_run_argv(const struct ctl_cmd *cmd, int argc, char **argv);

#endif
