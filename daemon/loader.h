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
#include "registry.h"

struct loader;
struct mg;

struct ld_params {
  const struct wd_backend *backend;
  struct fillpool *fill;
  int ndevices;
  enum cfg_load_method method;
  size_t staging_slots;      /* per GPU */
  size_t staging_slot_bytes;
  struct mg *mg; /* loads over several devices (multigpu.h); NULL: each load uses its own device only */
  const int *device_nodes; /* per device, its NUMA node (-1: none), for the fill threads; NULL: none */
  /* Called on the creating thread before device d's staging slots are allocated (NUMA placement); may be NULL. */
  void (*place)(void *arg, int device);
  void *place_arg;
};

/* Allocates the staging slots (pinned host memory) of every GPU, once. */
int ld_create(const struct ld_params *p, struct loader **out, struct wd_error *err);
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

/* One load: what to fill from where, and what the load reports back. */
struct ld_target {
  const struct plan *plan;
  struct reg_ckpt *ck; /* open: its maps and ckpt never change */
  int device;
  atomic_uint_fast64_t bytes_done; /* progress, in slab bytes (read by the loop) */
  atomic_bool cancel;              /* set by the loop: the load stops between windows */
  /* Copies of the same set on other devices, kept resident by the caller until ld_fill returns. */
  const struct ld_source *sources;
  size_t nsources;
  /* Results (valid once ld_fill returns). */
  struct wd_slab *slab; /* the filled slab, owned by the caller from then on */
  const char *method;   /* "memcpy", "staged", "direct", "peer" (a replica) or "striped" */
  double alloc_seconds;
  int source_device;    /* method "peer": the device whose copy was copied; else -1 (host memory) */
  size_t nshares;       /* method "striped": the links that moved the bytes, the target's first */
  struct ld_share shares[LD_MAX_LINKS];
};

/*
 * Allocates t->slab and fills it per t->plan from t->ck's mappings, then
 * checks that no shard changed meanwhile (WEIGHTD_E_STALE) and seals the slab
 * where the backend can. Runs on a job thread. On failure the slab is freed
 * and t->slab is NULL. Fails with WEIGHTD_E_CANCELED once t->cancel is set,
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
