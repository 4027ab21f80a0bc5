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
 * An open entry's ckpt and maps never change, so jobs may read them without
 * locks; a replaced shard detaches the old entry (sets built from it keep it
 * alive) and a fresh one is opened.
 */
#ifndef WD_REGISTRY_H
#define WD_REGISTRY_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "checkpoint.h"
#include "error.h"
#include "fillpool.h"
#include "jobs.h"

struct registry;
struct reg_roots;

enum reg_state { REG_OPENING, REG_OPEN, REG_FAILED };

struct reg_ckpt {
  struct registry *reg;
  char *path; /* resolved; the registry key */
  uint64_t generation;
  enum reg_state state;
  struct ckpt *ck;    /* immutable once open */
  void **maps;        /* per shard: the read-only MAP_SHARED mapping (NULL for an empty file) */
  int refs;           /* the registry's own, sets, jobs and waiters */
  bool detached;      /* no longer in the registry (closed or replaced) */
  bool prefetching;
  atomic_bool pinned; /* in the pinned-resident tier (read by load jobs) */
  bool unpinning;     /* a job is unregistering it: no new pin until it is done */
  uint64_t pinned_bytes; /* bytes registered, counted against the pin budget */
  unsigned loads;     /* loads from it now running (reg_load_begin/end): never unpinned under them */
  uint64_t last_used_ms;
  struct reg_waiter *waiters; /* acquirers waiting for REG_OPENING */
  struct reg_ckpt *next;
};

/* What the registry is given at creation; pointers must outlive it. */
struct reg_params {
  const struct wd_backend *backend;
  struct jobs *control; /* quick work: resolving, checking, opening */
  struct jobs *bulk;    /* long work: prefetching, pinning */
  struct fillpool *fill;
  uint64_t pin_budget;  /* bytes of the pinned-resident tier */
};

int reg_create(const struct reg_params *p, struct registry **out, struct wd_error *err);
/* Detaches every entry (sets may still hold them) and frees the registry once none is left. */
void reg_destroy(struct registry *r);

/*
 * Replaces the model roots (resolved directories; none means no confinement).
 * Running jobs keep the roots they started with; new requests use these.
 */
int reg_roots_set(struct registry *r, const char *const *dirs, size_t n, struct wd_error *err);
/* The current roots, for status and checks on the loop thread. */
size_t reg_roots_count(const struct registry *r);
const char *reg_root(const struct registry *r, size_t i);

/* Changes the pin budget; unpins checkpoints (least recently used, none that is loading) until it holds. Returns how many. */
size_t reg_pin_budget_set(struct registry *r, uint64_t budget);
uint64_t reg_pin_budget(const struct registry *r);
uint64_t reg_pinned_bytes(const struct registry *r);

/* The first entry of the registry's list (loop thread; follow ->next). */
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
 */
void reg_acquire(struct registry *r, const char *path, reg_ready_fn cb, void *arg);

/* Called on the loop thread with the resolved path (NULL, and err, on failure). */
typedef void (*reg_resolved_fn)(void *arg, const char *resolved, const struct wd_error *err);
/* Resolves path on a job thread and checks it against the model roots. */
void reg_resolve(struct registry *r, const char *path, reg_resolved_fn cb, void *arg);

void reg_ref(struct reg_ckpt *ck);
void reg_unref(struct reg_ckpt *ck);
/* An open checkpoint by resolved path (no I/O), or NULL. */
struct reg_ckpt *reg_find(struct registry *r, const char *resolved);
/* Removes a checkpoint nothing uses: 0, or WEIGHTD_E_BUSY / WEIGHTD_E_NOT_FOUND. */
int reg_close(struct registry *r, const char *resolved, struct wd_error *err);

/* Counts a load reading ck (a pinned checkpoint is not unpinned under it). */
void reg_load_begin(struct reg_ckpt *ck);
void reg_load_end(struct reg_ckpt *ck);

/* ---- the page cache and the pinned tier ------------------------------------- */

/* Shard bytes in the page cache (mincore). Reads only ck: runs on job threads. */
uint64_t reg_resident_bytes(const struct reg_ckpt *ck);

/*
 * Called on the loop thread when a prefetch is done: err NULL on success,
 * resident the checkpoint's page-cache bytes measured at the end.
 */
typedef void (*reg_prefetched_fn)(void *arg, struct reg_ckpt *ck, uint64_t resident, const struct wd_error *err);

/*
 * Starts a background read of every shard and, with pin, the checkpoint's
 * registration for direct DMA within the pin budget (unpinning others, least
 * recently used first, when that makes room). cb (may be NULL) runs when done.
 * Returns 0, or an error without starting anything (the pin cannot fit, or
 * the checkpoint is being unpinned).
 */
int reg_prefetch(struct registry *r, struct reg_ckpt *ck, bool pin, reg_prefetched_fn cb, void *arg,
                 struct wd_error *err);

/* A running prefetch, as reg_prefetch_start names it to its caller. */
struct reg_prefetch;

/*
 * reg_prefetch, and *handle names the running prefetch until cb (which must
 * not be NULL) runs: the caller may ask it for progress and tell it to stop.
 */
int reg_prefetch_start(struct registry *r, struct reg_ckpt *ck, bool pin, reg_prefetched_fn cb, void *arg,
                       struct reg_prefetch **handle, struct wd_error *err);

/* Bytes of the shards read so far and in all (loop thread; the count is updated by the readers). */
void reg_prefetch_progress(const struct reg_prefetch *h, uint64_t *done, uint64_t *total);

/* Tells the prefetch to stop between chunks and not to pin; its cb then gets WEIGHTD_E_CANCELED. */
void reg_prefetch_cancel(struct reg_prefetch *h);

#endif
