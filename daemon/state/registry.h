/*
 * registry.h - open checkpoints: resolution, validation, mappings, the page
 * cache and the pinned-resident tier.
 *
 * The registry is loop-owned state with an explicit context (struct
 * registry): whoever creates it hands it the pools, the backend and the model
 * roots, and every job it runs reads only what its job struct holds. It
 * knows nothing of requests or the protocol: callers pass a continuation
 * (a function and an argument) that runs on the loop thread once the work is
 * done.
 *
 * Entries (struct reg_ckpt) are reference counted: the registry holds one
 * while the entry is listed, each resident set and each running job another.
 * An open entry's ckpt and mmap source never change, so jobs may read them without
 * locks; a replaced shard detaches the old entry (sets built from it keep it
 * alive) and a fresh one is opened.
 *
 * The pinned-resident tier: parts of a checkpoint's mappings registered with
 * the GPU (cudaHostRegister) so that loads copy from them with no CPU copy.
 * A checkpoint's registrations are a sorted list of page-aligned ranges of
 * its shard files (a whole shard, or the ranges one plan reads: plan.h's
 * plan_ranges), loop-owned; a load takes a copy when it is queued
 * (reg_pins_copy) and, since a checkpoint with a load queued or running is
 * never unpinned (reg_load_begin/end), the copy stays true until it ends.
 * Registrations count against the pin budget; making room unpins whole
 * checkpoints, least recently used first. The pin policy (enum reg_pin_mode)
 * decides what enters the tier by itself; prefetch with pin asks for it.
 *
 * Bounds (struct reg_limits, registry_bound.c): open entries are counted and
 * charged - their parsed headers and tables, their mappings - in total and
 * for every uid that acquired them (an entry several uids use counts for
 * each). An acquire past a bound first closes idle entries (nothing holds
 * them: no set, job, waiter, prefetch or pin), least recently used first,
 * and is refused with WEIGHTD_E_LIMIT naming the bound when none is left to
 * close. Idle entries unused for the idle time are closed by a timer.
 */
#ifndef WD_REGISTRY_H
#define WD_REGISTRY_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "backend/backend.h"
#include "checkpoint.h"
#include "error.h"
#include "manifest.h"
#include "load/pool.h"
#include "base/jobs.h"
#include "plan.h"
#include "load/source.h"

struct registry;
struct reg_roots;

enum reg_state { REG_OPENING, REG_OPEN, REG_FAILED };

/* What enters the pinned-resident tier without being asked (the `pin` setting). */
enum reg_pin_mode {
  REG_PIN_OFF,        /* only what prefetch with pin asks for */
  REG_PIN_AFTER_LOAD, /* a finished load's byte ranges, in the background, when they fit the budget */
  REG_PIN_ON_OPEN,    /* that, and a whole checkpoint that fits as soon as it is opened */
};

struct prefetch;

/*
 * The payload digests of an open checkpoint, taken while a whole prefetch read
 * it (the in-memory manifest): each file's chunk digests and file digest
 * (manifest.h; no tensor digests: ntensors 0).
 */
struct reg_digests {
  size_t nshards;
  struct mf_file *files;
};

struct reg_ckpt {
  struct registry *reg;
  char *path; /* resolved; the registry key */
  uint64_t generation;
  enum reg_state state;
  struct ckpt *ck;    /* immutable once open */
  struct ld_source *src; /* its own source: mmap (every shard mapped read-only), or remote for a URL (load/source.h) */
  bool remote;           /* opened by URL from a remote root: path is the URL */
  atomic_uint_fast64_t remote_checked_ms; /* remote: when its objects were last found unchanged (job threads) */
  int refs;           /* the registry's own, sets, jobs and waiters */
  int observers;      /* of refs, those of background measurements (loop thread): they never keep it open */
  bool detached;      /* no longer in the registry (closed or replaced) */
  bool prefetching;
  struct plan_range *pins; /* registered ranges, sorted by shard and offset, disjoint */
  size_t npins;
  bool pinning;          /* a job is registering more: other pins wait for it (parked) */
  bool unpinning;        /* a job is unregistering it: no new pin until it is done */
  uint64_t pinned_bytes; /* bytes registered or being registered, counted against the pin budget */
  struct prefetch *parked; /* pin requests waiting for the running pin job */
  unsigned loads;     /* loads from it now running (reg_load_begin/end): never unpinned under them */
  /*
   * The content id: SHA-256 of the layout id and every shard's payload
   * digest (mf_content_id, manifest.h). Known once a whole prefetch digested every
   * file (digests then holds what it computed), or when a set description
   * of the same files carried it over a restart (digests NULL).
   */
  bool content_known;
  unsigned char content_id[CKPT_ID_BYTES];
  struct reg_digests *digests;
  bool digesting; /* a whole prefetch is computing them */
  uint64_t last_used_ms; /* its last use (reg_touch) */
  uint64_t use_seq;      /* the same moment in the registry's order of uses: least recently used first */
  struct reg_waiter *waiters; /* acquirers waiting for REG_OPENING */
  const struct acc_cred *open_for; /* REG_OPENING: whose access the open checks (NULL: nobody's); the open job's */
  /* What the bounds count (registry_bound.c): set once open, or when charged to a uid. */
  uint64_t charge;    /* bytes: parsed headers and tables, mappings, the plan memo (reg_entry_charge) */
  size_t nmaps;       /* shard mappings */
  bool counted;       /* charge and nmaps are in the registry's totals */
  uid_t *uids;        /* the uids it is charged to, each once */
  size_t nuids;
  struct reg_plan_memo *memo; /* plan keys by spec digest (reg_plan_key_find), REG_PLAN_MEMO of them; NULL: none yet */
  /* The page-cache bytes telemetry last measured (for metrics; status measures its own). */
  uint64_t page_cache_bytes;
  bool page_cache_known;
  struct reg_ckpt *next;
};

/*
 * The bounds on open checkpoints; 0 is no bound. An acquire past one closes
 * idle entries, least recently used first (those charged to the uid, for a
 * per-uid bound), and is refused with WEIGHTD_E_LIMIT naming the bound when
 * none is idle. The memory and mapping bounds are checked once an entry's
 * headers are read (at most control_threads entries are read at once).
 */
struct reg_limits {
  size_t max_open;         /* entries listed, those being opened included (max_open_checkpoints) */
  size_t max_open_per_uid; /* entries charged to one uid (max_open_checkpoints_per_uid) */
  uint64_t memory;         /* bytes charged to open entries (checkpoint_memory) */
  uint64_t memory_per_uid; /* bytes of the entries charged to one uid (checkpoint_memory_per_uid) */
  size_t max_maps;         /* shard mappings of open entries (a quarter of vm.max_map_count) */
  uint64_t idle_ms;        /* an idle entry unused this long is closed (checkpoint_idle_ms) */
};

/* Who an acquire is for: the peer's uid, or this for the daemon's own work (re-adoption), which no bound refuses. */
#define REG_UID_DAEMON ((uid_t)-1)

/* What the registry counts, for status and metrics (loop thread). */
struct reg_counts {
  size_t open;           /* entries listed (being opened included) */
  uint64_t charged;      /* bytes charged to open entries */
  size_t maps;           /* their shard mappings */
  uint64_t closed_idle;  /* entries closed for being unused for the idle time */
  uint64_t closed_room;  /* idle entries closed to make room under a bound */
  uint64_t refused;      /* acquires refused with LIMIT by a bound */
  uint64_t plans_reused; /* requests that found their set through a plan memo (reg_plan_reused) */
};

/* What the registry is given at creation; pointers must outlive it. */
struct reg_params {
  const struct wd_backend *backend;
  struct jobs *control; /* quick work: resolving, checking, opening */
  struct jobs *bulk;    /* long work: prefetching, pinning */
  struct ld_pool *fill;
  uint64_t pin_budget;  /* bytes of the pinned-resident tier; 0: derived (hostmem.h) */
  enum reg_pin_mode pin_mode;
  uv_loop_t *loop;      /* runs the idle timer; NULL: idle entries are closed only to make room */
  struct reg_limits limits;
};

int reg_create(const struct reg_params *p, struct registry **out, struct wd_error *err);
/* Detaches every entry (sets may still hold them) and frees the registry once none is left. */
void reg_destroy(struct registry *r);

/*
 * Replaces the model roots (resolved directories; none means no confinement).
 * Running jobs keep the roots they started with; new requests use these.
 */
int reg_roots_set(struct registry *r, const char *const *dirs, size_t n, struct wd_error *err);
/*
 * Replaces the per-directory sources (the root_sources setting: resolved
 * directories and the source loads of checkpoints under each read through).
 */
int reg_sources_set(struct registry *r, const char *const *dirs, const enum ld_source_choice *choices, size_t n,
                    struct wd_error *err);
/* The source configured for a checkpoint at resolved path `path` (the longest directory that holds it); false: none. */
bool reg_source_for(const struct registry *r, const char *path, enum ld_source_choice *out);

struct rroots;
/*
 * The remote roots (remote/rroots.h), set once before the first acquire
 * (the daemon owns them and frees them after the registry). A path that is
 * a URL (wire_path_is_url) is acquired from them: refused with PATH_DENIED
 * when it lies within none (or none is configured), opened with range GETs
 * otherwise. Every client that may use the daemon may use what they hold:
 * there are no per-user rights to check on an object store the daemon
 * reaches with the node's credentials. Their opens and checks run on pool
 * (they wait on the network), never on the control pool.
 */
void reg_remote_set(struct registry *r, const struct rroots *remote, struct jobs *pool);

/* The current roots, for status and checks on the loop thread. */
size_t reg_roots_count(const struct registry *r);
const char *reg_root(const struct registry *r, size_t i);

/*
 * Changes the configured pin budget (0: derived, half of what hostmem.h
 * reads, evaluated whenever a pin is considered); unpins checkpoints (least
 * recently used, none that is loading) until the budget holds. Returns how many.
 */
size_t reg_pin_budget_set(struct registry *r, uint64_t budget);
/* The budget in force now, and where it comes from ("host_pin_budget", "MemTotal", "cgroup"). */
uint64_t reg_pin_budget(const struct registry *r);
const char *reg_pin_budget_source(const struct registry *r);
uint64_t reg_pinned_bytes(const struct registry *r);
void reg_pin_mode_set(struct registry *r, enum reg_pin_mode mode);
enum reg_pin_mode reg_pin_mode(const struct registry *r);

/* Replaces the bounds (a reload); entries over a lowered bound stay until they are closed. */
void reg_limits_set(struct registry *r, const struct reg_limits *l);
const struct reg_limits *reg_limits(const struct registry *r);
void reg_counts(const struct registry *r, struct reg_counts *out);

/*
 * The first entry of the registry's list (loop thread; follow ->next). The
 * list is newest first: generations strictly decrease along it.
 */
struct reg_ckpt *reg_first(const struct registry *r);

/* Tells prefetches to stop early (shutdown): safe from any thread. */
void reg_stop(struct registry *r);

/* ---- acquiring -------------------------------------------------------------- */

/*
 * Called on the loop thread once an acquire is done: with the open entry and
 * a reference the callee must drop with reg_unref, or with ck NULL and err
 * saying why.
 */
typedef void (*reg_ready_fn)(void *arg, struct reg_ckpt *ck, const struct wd_error *err);

/*
 * Resolves path, checks it against the model roots, and calls cb with the
 * open checkpoint: opening it, or checking an open one and reopening it if a
 * shard was replaced, on a job thread. cb may run before reg_acquire returns
 * (only when memory runs out).
 *
 * Whose access: who names the client the checkpoint is acquired for (NULL:
 * root, the daemon's own uid or the daemon itself, who could read the files
 * anyway). The client's own access is checked on the job thread before
 * anything of the files reaches it (access.h): the directories on the way
 * to the path as given, then, for an open, each file before it is read
 * (ckpt_opts' access), and for an open checkpoint, every one of its files
 * on every request, beside the check that they are unchanged. Refused, cb
 * gets WEIGHTD_E_PERMISSION naming the path and what the client may not
 * search or read, never an error about what a file holds. An open under way
 * for other credentials is not joined: the request waits for it to end and
 * then goes on as if it had just arrived (checked against the open
 * checkpoint, or opening it itself when that open failed).
 */
void reg_acquire(struct registry *r, const char *path, const struct acc_cred *who, reg_ready_fn cb, void *arg);
/* reg_acquire for uid: the entry is charged to uid, within the bounds (struct reg_limits), or cb gets LIMIT. */
void reg_acquire_as(struct registry *r, const char *path, uid_t uid, const struct acc_cred *who, reg_ready_fn cb,
                    void *arg);

/* Called on the loop thread with the resolved path (NULL, and err, on failure). */
typedef void (*reg_resolved_fn)(void *arg, const char *resolved, const struct wd_error *err);
/* Resolves path on a job thread and checks it against the model roots, and the directories on the way for who. */
void reg_resolve(struct registry *r, const char *path, const struct acc_cred *who, reg_resolved_fn cb, void *arg);

/* What reg_check asks of an open checkpoint's files besides the caller's read access. */
enum reg_check_mode {
  REG_CHECK_PATHS,      /* the files at its paths now, whichever they are (close) */
  REG_CHECK_SAME_FILES, /* the very files it was opened from: one gone or replaced is PERMISSION, since the
                           caller's access to what was read cannot be shown (attach by set id) */
  REG_CHECK_SAME_OR_GONE, /* the same, but files gone or replaced pass: the caller may use what was read from
                             them anyway (the set's own loader, a member of admin_gids) */
};

/*
 * Checks on a job thread that who may read every file of the open
 * checkpoint ck as they are at its paths now (ckpt_access_check), as mode
 * asks, for a request that reaches ck another way than by its path (a set
 * id): cb gets ck with a new reference, or NULL and WEIGHTD_E_PERMISSION
 * prefixed with label. With who NULL, cb runs at once with ck.
 */
void reg_check(struct registry *r, struct reg_ckpt *ck, const struct acc_cred *who, const char *label,
               enum reg_check_mode mode, reg_ready_fn cb, void *arg);

/* Called on the loop thread with readable[i] for each checkpoint asked about (readable NULL: out of memory). */
typedef void (*reg_readable_fn)(void *arg, const bool *readable);

/*
 * Decides on a job thread, for each of the n open checkpoints cks (kept
 * alive by the caller until cb), whether who may read the very files it was
 * opened from (ckpt_access_check with same_files: one gone or replaced is
 * not readable, since the access cannot be shown): for a listing that shows
 * a client only what it may read (status). Each checkpoint's walk starts
 * afresh (the directories of one checkpoint's files are shared, not those
 * of all), so the work is linear in the files; ACLs come from the
 * registry's memory. The answers go to cb, owned by the registry.
 */
void reg_readable(struct registry *r, struct reg_ckpt *const *cks, size_t n, const struct acc_cred *who,
                  reg_readable_fn cb, void *arg);

void reg_ref(struct reg_ckpt *ck);
void reg_unref(struct reg_ckpt *ck);
/*
 * A reference for a measurement (status, telemetry; loop thread): it keeps
 * ck alive but not open, so that close is not refused while one runs.
 */
void reg_observe(struct reg_ckpt *ck);
void reg_unobserve(struct reg_ckpt *ck);
/*
 * Records a use of ck now: its idle time and its place in the least recently
 * used order start again. Acquires, the end of a load or a prefetch and a set
 * of it going away are uses; a status or a measurement is not.
 */
void reg_touch(struct reg_ckpt *ck);
/* An open checkpoint by resolved path (no I/O), or NULL. */
struct reg_ckpt *reg_find(struct registry *r, const char *resolved);
/* Removes a checkpoint nothing uses: 0, or WEIGHTD_E_BUSY / WEIGHTD_E_NOT_FOUND. */
int reg_close(struct registry *r, const char *resolved, struct wd_error *err);

/* Counts a load reading ck (a pinned checkpoint is not unpinned under it). */
void reg_load_begin(struct reg_ckpt *ck);
void reg_load_end(struct reg_ckpt *ck);

/* A copy of ck's registered ranges for a load (*out NULL when none); 0, or WEIGHTD_E_NOMEM. */
int reg_pins_copy(const struct reg_ckpt *ck, struct plan_range **out, size_t *n);
/* True when every shard of ck is registered whole. */
bool reg_pinned_whole(const struct reg_ckpt *ck);
/* Bytes registered now (without registrations under way). */
uint64_t reg_pins_bytes(const struct reg_ckpt *ck);

/* Ranges of a plan closer than this are read and pinned as one. */
#define REG_PIN_MERGE_GAP (2ull << 20)

/* The page-aligned byte ranges of ck's files plan p reads (plan_ranges with the page size and REG_PIN_MERGE_GAP). */
int reg_plan_ranges(const struct reg_ckpt *ck, const struct plan *p, struct plan_range **out, size_t *n,
                    struct wd_error *err);

/* True when finished loads should report their ranges (pin after_load or on_open, on a backend that registers). */
bool reg_pin_wants_ranges(const struct registry *r);

/*
 * The pin policy after a load of ck finished: registers, in the background,
 * the ranges it read (page-aligned, plan_ranges) that are not registered yet,
 * when they fit the pin budget (unpinning others, least recently used first,
 * when that makes room), so that later loads of them go direct. Does nothing
 * under pin off, while ck is being pinned or unpinned, or when they cannot
 * fit. Takes the ranges (a malloc'd array) in every case.
 */
void reg_pin_after_load(struct reg_ckpt *ck, struct plan_range *ranges, size_t n);

/* ---- plans remembered ---------------------------------------------------------- */

/*
 * An entry remembers the plan keys its recent plans were built with, by the
 * SHA-256 of their spec (the request's plan object, compactly printed), so
 * that a request naming a resident set by path and plan finds it without
 * building the plan again (an entry is immutable: the same spec gives the
 * same plan). REG_PLAN_MEMO of them, the least recently used replaced.
 */
#define REG_PLAN_MEMO 8
#define REG_SPEC_DIGEST 32
struct reg_plan_memo {
  unsigned char spec[REG_SPEC_DIGEST];
  char *key; /* NULL: unused */
  uint64_t used;
};

/* The key the spec with this digest gave ck's plan, or NULL. */
const char *reg_plan_key_find(struct reg_ckpt *ck, const unsigned char spec[REG_SPEC_DIGEST]);
/* Counts a request that found its set through ck's memo, building no plan (reg_counts.plans_reused). */
void reg_plan_reused(struct reg_ckpt *ck);
/* Remembers the key a spec gave ck's plan (nothing when memory runs out). */
void reg_plan_key_remember(struct reg_ckpt *ck, const unsigned char spec[REG_SPEC_DIGEST], const char *key);

/* ---- identity ------------------------------------------------------------------ */

/* Records a content id carried over a restart for ck (whose files the carrier checked unchanged). */
void reg_content_adopt(struct reg_ckpt *ck, const unsigned char id[CKPT_ID_BYTES]);

/* ---- the page cache and the pinned tier ------------------------------------- */

/* Shard bytes in the page cache (mincore). Reads only ck: runs on job threads. */
uint64_t reg_resident_bytes(const struct reg_ckpt *ck);

/* What a prefetch did. */
struct reg_prefetched {
  uint64_t resident;    /* the checkpoint's page-cache bytes, measured at the end */
  uint64_t registered;  /* bytes this prefetch registered (0: nothing new to pin, or no pin asked) */
  double read_seconds;  /* reading the ranges into the page cache */
  double pin_seconds;   /* registering them (unpinning others first included) */
};

/* Called on the loop thread when a prefetch is done: err NULL on success. */
typedef void (*reg_prefetched_fn)(void *arg, struct reg_ckpt *ck, const struct reg_prefetched *res,
                                  const struct wd_error *err);

/*
 * Starts a background read of the given ranges of ck's shard files (NULL:
 * every shard whole; the array is copied; a whole read of a checkpoint whose
 * content id is not known yet digests every file as it reads them, and then
 * knows it) and, with pin, their registration
 * for direct DMA within the pin budget (unpinning others, least recently used
 * first, when that makes room); ranges already registered are left as they
 * are. While another pin of ck runs, this one waits for it. cb (may be NULL)
 * runs when done. Returns 0, or an error without starting anything (the pin
 * cannot fit: LIMIT; the checkpoint is being unpinned: BUSY).
 */
int reg_prefetch(struct registry *r, struct reg_ckpt *ck, const struct plan_range *ranges, size_t nranges, bool pin,
                 reg_prefetched_fn cb, void *arg, struct wd_error *err);

/* A running prefetch, as reg_prefetch_start names it to its caller. */
struct reg_prefetch;

/*
 * reg_prefetch, and *handle names the running prefetch until cb (which must
 * not be NULL) runs: the caller may ask it for progress and tell it to stop.
 */
int reg_prefetch_start(struct registry *r, struct reg_ckpt *ck, const struct plan_range *ranges, size_t nranges,
                       bool pin, reg_prefetched_fn cb, void *arg, struct reg_prefetch **handle, struct wd_error *err);

/* Bytes of the shards read so far and in all (loop thread; the count is updated by the readers). */
void reg_prefetch_progress(const struct reg_prefetch *h, uint64_t *done, uint64_t *total);

/* Tells the prefetch to stop between chunks and not to pin; its cb then gets WEIGHTD_E_CANCELED. */
void reg_prefetch_cancel(struct reg_prefetch *h);

#endif
