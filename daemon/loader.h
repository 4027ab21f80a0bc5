/*
 * loader.h - moving a plan's bytes from the shard mappings into a slab.
 *
 * The loader is an explicit context (struct loader) holding what load jobs
 * read: the backend, the fill pool, the configured method and each GPU's
 * staging slots. It knows nothing of sets, requests or the protocol: a load
 * is described by a struct ld_target that the caller owns, and ld_fill runs
 * on the caller's job thread until the slab is filled or the load fails.
 */
#ifndef WD_LOADER_H
#define WD_LOADER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "config.h"
#include "error.h"
#include "fillpool.h"
#include "plan.h"
#include "plan_stage.h"
#include "registry.h"

struct loader;
struct mg;

struct ld_params {
  const struct wd_backend *backend;
  struct fillpool *fill;
  int ndevices;
  enum cfg_load_method method;
  enum plan_strided strided; /* staged loads: how strided pieces are staged (plan_stage.h) */
  size_t staging_slots;      /* per GPU */
  size_t staging_slot_bytes;
  /*
   * For tests only (NULL or "": none): a FIFO from which loads read one byte
   * before each window they fill (memcpy loads: each 256 MiB window; staged
   * loads: each window of the staging schedule, once every window before it
   * has landed); end of file lets every window through. A test holds a load
   * at a window boundary with it.
   */
  const char *test_load_gate;
  struct mg *mg; /* loads over several devices (multigpu.h); NULL: each load uses its own device only */
  const int *device_nodes; /* per device, its NUMA node (-1: none), for the fill threads; NULL: none */
  /* Called on the creating thread before device d's staging slots are allocated (NUMA placement); may be NULL. */
  void (*place)(void *arg, int device);
  void *place_arg;
};

/* Allocates the staging slots (pinned host memory) of every GPU, once. */
/* Creates the loader; its staging slots come later, from ld_staging_start. */
int ld_create(const struct ld_params *p, struct loader **out, struct wd_error *err);
/*
 * Allocates the pinned staging slots, streams and events of every device
 * (nothing on a host backend unless load_method is staged). The daemon calls
 * it right after READY, before it serves a request, so that a restart is
 * READY before paying for them; tests call it after ld_create. 0 or an error.
 */
int ld_staging_start(struct loader *ld, struct wd_error *err);
void ld_destroy(struct loader *ld);

/* The most devices one striped load uses: its own and up to LD_MAX_LINKS - 1 neighbours. */
#define LD_MAX_LINKS 16

/* A ready copy of the same set on another device, which a replica may be copied from. */
struct ld_source {
  const struct wd_slab *slab;
  int device;
};

/* A share of a striped load: slab bytes [lo, hi) came over `device`'s host link. */
struct ld_share {
  int device;
  uint64_t lo, hi;
};

/*
 * One load: what to fill from where, and what the load reports back.
 *
 * The slab fills in offset order, as far as anyone outside can tell:
 * ready_bytes is a watermark below which every slab byte holds its final
 * value (on a GPU, the copy that wrote it has completed). It only grows;
 * memcpy loads raise it as each contiguous run of fill tasks finishes,
 * staged loads as each window of the staging schedule (plan_stage.h: a
 * contiguous slab range, its image runs and 2D copies of whole rows alike) is
 * known complete (its slot's event waited for) together with every window
 * before it, direct loads at sync points every LD_DIRECT_SYNC bytes (every
 * stream drained), replicas and striped loads once, when they finish.
 */
struct ld_target {
  const struct plan *plan;
  struct reg_ckpt *ck; /* open: its maps and ckpt never change */
  int device;
  /*
   * The checkpoint's registered ranges when the load was queued (sorted by
   * shard and offset, disjoint; owned by the caller, which keeps them from
   * being unregistered until ld_fill returns): a load whose every source
   * byte lies in them copies straight from the mappings ("direct", or a
   * striped load's direct shares).
   */
  const struct plan_range *pins;
  size_t npins;
  atomic_uint_fast64_t bytes_done;  /* progress, in slab bytes (read by the loop) */
  atomic_uint_fast64_t ready_bytes; /* the watermark, in slab bytes */
  atomic_bool cancel;               /* set by the loop: the load stops between windows */
  /*
   * Hooks, each may be NULL; they run on the load's threads. allocated runs
   * once the slab exists (t->slab is set and stays so); ready each time
   * ready_bytes grows (calls from several fill threads may overlap and come
   * out of order: each passes the value it raised ready_bytes to).
   */
  void (*allocated)(struct ld_target *t);
  void (*ready)(struct ld_target *t, uint64_t ready_bytes);
  /* Copies of the same set on other devices, kept resident by the caller until ld_fill returns. */
  const struct ld_source *sources;
  size_t nsources;
  /* Results (valid once ld_fill returns). */
  struct wd_slab *slab; /* the slab, owned by the caller, also when the fill failed */
  const char *method;   /* "memcpy", "staged", "direct", "peer" (a replica) or "striped" */
  double alloc_seconds;
  int source_device;    /* method "peer": the device whose copy was copied; else -1 (host memory) */
  size_t nshares;       /* method "striped": the links that moved the bytes, the target's first */
  struct ld_share shares[LD_MAX_LINKS];
};

/* True when a load can go direct (a GPU-like backend, load_method not forced to staged): pins are of use. */
bool ld_can_direct(const struct loader *ld);

/*
 * The per-plan pin test: true when every source byte of t's plan lies in
 * t->pins, so that the copy engines may read the mappings themselves.
 */
bool ld_plan_pinned(const struct ld_target *t);

/*
 * Bytes from file offset off of shard `shard` that lie in one of t->pins
 * (a direct copy never crosses from one registration into the next), or 0
 * when off is not registered.
 */
uint64_t ld_pinned_run(const struct ld_target *t, uint32_t shard, uint64_t off);

/*
 * Fills t->slab per t->plan from t->ck's mappings, allocating it first when
 * t->slab is NULL (a load that is run again refills the slab it has): a
 * replica copied from t->sources or a load striped over idle neighbours
 * where the multi-device context decides so (multigpu.h), else direct when
 * every source byte is registered, else memcpy into host slabs, else staged
 * (load_method staged forces staged). Then checks that no shard
 * changed meanwhile (WEIGHTD_E_STALE) and seals the slab where the backend
 * can. Runs on a job thread. On failure the slab (if it was allocated) stays
 * in t->slab for the caller to free: clients that attached early may still
 * map it. Fails with WEIGHTD_E_CANCELED once t->cancel is set,
 * WEIGHTD_E_FAULT when a shard was truncated under its mapping.
 */
int ld_fill(struct loader *ld, struct ld_target *t, struct wd_error *err);

/*
 * A load onto device was queued, or has finished (the loop thread, around
 * the load job): the device counts as busy meanwhile, so a striped load
 * does not borrow its link nor a replica read from it.
 */
void ld_reserve(struct loader *ld, int device);
void ld_unreserve(struct loader *ld, int device);

/* Per shard of t's checkpoint, where its data section starts in the mapping (a new array, or NULL). */
const unsigned char **ld_shard_data(const struct ld_target *t);

/* A FAULT error naming the tensor at slab offset off (a shard truncated while it was read). */
int ld_fault_error(const struct ld_target *t, uint64_t off, struct wd_error *err);

#endif
