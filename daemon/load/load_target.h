/*
 * load_target.h - what one load is: the target a caller fills in and the
 * loader, the multi-device code and the striped data path all read
 * (loader.h, multigpu.h, stripe.h), with the copies a replica may come from
 * and the shares of a striped load.
 */
#ifndef WD_LOAD_TARGET_H
#define WD_LOAD_TARGET_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "plan.h"
#include "state/registry.h"

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

#endif
