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
 * stream drained).
 */
struct ld_target {
  const struct plan *plan;
  struct reg_ckpt *ck; /* open: its maps and ckpt never change */
  int device;
  /*
   * The checkpoint's registered ranges when the load was queued (sorted by
   * shard and offset, disjoint; owned by the caller, which keeps them from
   * being unregistered until ld_fill returns): a load whose every source
   * byte lies in them copies straight from the mappings ("direct").
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
  /* Results (valid once ld_fill returns). */
  struct wd_slab *slab; /* the slab, owned by the caller, also when the fill failed */
  const char *method;   /* "memcpy", "staged" or "direct" */
  double alloc_seconds;
};

/* True when a load can go direct (a GPU-like backend, load_method not forced to staged): pins are of use. */
bool ld_can_direct(const struct loader *ld);

/*
 * Fills t->slab per t->plan from t->ck's mappings, allocating it first when
 * t->slab is NULL (a load that is run again refills the slab it has): direct
 * when every source byte is registered, else memcpy into host slabs, else
 * staged (load_method staged forces staged). Then checks that no shard
 * changed meanwhile (WEIGHTD_E_STALE) and seals the slab where the backend
 * can. Runs on a job thread. On failure the slab (if it was allocated) stays
 * in t->slab for the caller to free: clients that attached early may still
 * map it. Fails with WEIGHTD_E_CANCELED once t->cancel is set,
 * WEIGHTD_E_FAULT when a shard was truncated under its mapping.
 */
int ld_fill(struct loader *ld, struct ld_target *t, struct wd_error *err);

#endif
