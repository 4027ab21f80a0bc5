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
};

/* Allocates the staging slots (pinned host memory) of every GPU, once. */
int ld_create(const struct ld_params *p, struct loader **out, struct wd_error *err);
void ld_destroy(struct loader *ld);

/* One load: what to fill from where, and what the load reports back. */
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
  atomic_uint_fast64_t bytes_done; /* progress, in slab bytes (read by the loop) */
  atomic_bool cancel;              /* set by the loop: the load stops between windows */
  /* Results (valid once ld_fill returns). */
  struct wd_slab *slab; /* the filled slab, owned by the caller from then on */
  const char *method;   /* "memcpy", "staged" or "direct" */
  double alloc_seconds;
};

/* True when a load can go direct (a GPU-like backend, load_method not forced to staged): pins are of use. */
bool ld_can_direct(const struct loader *ld);

/*
 * Allocates t->slab and fills it per t->plan from t->ck's mappings (direct
 * when every source byte is registered, else memcpy into host slabs, else
 * staged; load_method staged forces staged), then
 * checks that no shard changed meanwhile (WEIGHTD_E_STALE) and seals the slab
 * where the backend can. Runs on a job thread. On failure the slab is freed
 * and t->slab is NULL. Fails with WEIGHTD_E_CANCELED once t->cancel is set,
 * WEIGHTD_E_FAULT when a shard was truncated under its mapping.
 */
int ld_fill(struct loader *ld, struct ld_target *t, struct wd_error *err);

#endif
