/*
 * loader.h - moving a plan's bytes from the shard mappings into a slab.
 *
 * The loader is an explicit context (struct loader) holding what load jobs
 * read: the backend, the fill pool, the configured method and each GPU's
 * staging slots. It knows nothing of sets, requests or the protocol: a load
 * is described by a struct ld_target (load_target.h) that the caller owns,
 * and ld_fill runs on the caller's job thread until the slab is filled or
 * the load fails.
 */
#ifndef WD_LOADER_H
#define WD_LOADER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "base/config.h"
#include "error.h"
#include "fillpool.h"
#include "load_target.h"
#include "plan.h"
#include "plan_stage.h"
#include "state/registry.h"

struct loader;
struct mg;

/* How fill threads write the staging slots (the staging_writes setting, docs/operations.md). */
enum ld_writes {
  LD_WRITES_CACHED,         /* plain stores into cached pinned memory */
  LD_WRITES_STREAMING,      /* non-temporal stores (stream_copy.h) into cached pinned memory */
  LD_WRITES_WRITE_COMBINED, /* plain stores into write-combined pinned memory */
};

struct ld_params {
  const struct wd_backend *backend;
  struct fillpool *fill;
  int ndevices;
  enum cfg_load_method method;
  enum plan_strided strided; /* staged loads: how strided pieces are staged (plan_stage.h) */
  size_t staging_slots;      /* per GPU */
  size_t staging_slot_bytes;
  enum ld_writes writes;
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

/* True when a load can go direct (a GPU-like backend, load_method not forced to staged): pins are of use. */
bool ld_can_direct(const struct loader *ld);

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

#endif
