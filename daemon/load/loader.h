/*
 * loader.h - the load room's entry: moving a plan's bytes from a source into
 * a slab, on one device or several.
 *
 * The loader is an explicit context (struct loader) holding what load jobs
 * read: the backend, the fill pool, the settings, and the memory loads move
 * bytes through (each GPU's staging link; with several devices, lending
 * links and replica lanes). It knows nothing of sets, requests or the
 * protocol: a load is described by a struct ld_target (target.h) that the
 * caller owns, and ld_fill runs on the caller's job thread until the slab is
 * filled or the load fails.
 *
 * The room (daemon/load/): loader.c chooses how a load moves its bytes and
 * fills host slabs in place; pipeline.c is the one staging pipeline (staged
 * or direct windows, over one host link or several); multi.c decides
 * replicas and striping; control.c is what every way obeys (watermark,
 * cancel, test gate, task sizes); pool.c the fill threads; source*.c where
 * bytes come from (source.h).
 */
#ifndef WD_LOADER_H
#define WD_LOADER_H

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "error.h"
#include "plan.h"
#include "plan_stage.h"
#include "pool.h"
#include "source.h"
#include "target.h"

struct loader;
struct topology;

/* How fill threads write the staging slots (the staging_writes setting, docs/operations.md). */
enum ld_writes {
  LD_WRITES_CACHED,         /* plain stores into cached pinned memory */
  LD_WRITES_STREAMING,      /* non-temporal stores (stream_copy.h) into cached pinned memory */
  LD_WRITES_WRITE_COMBINED, /* plain stores into write-combined pinned memory */
};

struct ld_params {
  const struct wd_backend *backend;
  struct ld_pool *pool;
  int ndevices;
  bool staged_only;          /* load_method staged: never direct nor in place */
  enum plan_strided strided; /* staged loads: how strided pieces are staged (plan_stage.h) */
  size_t staging_slots;      /* per GPU */
  size_t staging_slot_bytes;
  enum ld_writes writes;
  /*
   * For tests only (NULL or "": none): a FIFO from which loads read one byte
   * before each window they fill (memcpy loads: each 256 MiB window; pipeline
   * loads: each window of the staging schedule, once every window before it
   * has landed); end of file lets every window through. A test holds a load
   * at a window boundary with it.
   */
  const char *test_load_gate;
  bool test_refuse_odirect; /* for tests only: every O_DIRECT open fails as a filesystem that refuses it would */
  uint64_t auto_direct_bytes; /* source auto reads O_DIRECT for plans larger than this; 0: LD_AUTO_DIRECT_PERCENT of host memory */
  bool verify;                /* check the file bytes of every load against the checkpoint's manifest (verify.c) */
  bool digests;               /* record each set's digests as loaded (digest.c; the scrub setting) */
  /* Several devices (docs/multi-gpu.md); topo NULL or one device: each load uses its own device only. */
  const struct topology *topo; /* outlives the loader */
  bool replicas;               /* replicas = auto */
  bool striping;               /* striping = auto: every device gets a lending link */
  uint64_t stripe_min_bytes;
  const int *device_nodes; /* per device, its NUMA node (-1: none), for the fill threads; NULL: none */
  /* Called on the creating thread before device d's staging memory is allocated (NUMA placement); may be NULL. */
  void (*place)(void *arg, int device);
  void *place_arg;
};

/* Creates the loader; its staging memory comes later, from ld_staging_start. */
int ld_create(const struct ld_params *p, struct loader **out, struct wd_error *err);
/*
 * Allocates the pinned staging slots, streams and events of every device,
 * and with several devices the lending links and replica lanes (nothing on a
 * host backend unless load_method is staged or striping is on). The daemon
 * calls it right after READY, before it serves a request, so that a restart
 * is READY before paying for them; tests call it after ld_create. 0 or an
 * error (what was made is freed by ld_destroy).
 */
int ld_staging_start(struct loader *ld, struct wd_error *err);
void ld_destroy(struct loader *ld);

/* True when a load can go direct (a GPU-like backend, load_method not forced to staged): pins are of use. */
bool ld_can_direct(const struct loader *ld);
/* True when loads may use other devices (several devices with peer copies): replicas can be offered. */
bool ld_has_peers(const struct loader *ld);

/*
 * Fills t->slab per t->plan, allocating it first when t->slab is NULL (a
 * load that is run again refills the slab it has). The source is t->src
 * when given, else t->choice over t->mmap (source.h: auto reads O_DIRECT
 * past auto_direct_bytes; a filesystem that refuses O_DIRECT falls back to
 * mmap with a log line). The way: a replica copied from t->copies or a load striped over
 * idle neighbours where multi.c decides so, else direct when every source
 * byte is registered, else in place into host slabs, else staged
 * (load_method staged forces staged). Then checks that no shard changed
 * meanwhile (WEIGHTD_E_STALE) and seals the slab where the backend can.
 * Runs on a job thread. On failure the slab (if it was allocated) stays in
 * t->slab for the caller to free: clients that attached early may still map
 * it. Fails with WEIGHTD_E_CANCELED once t->cancel is set, WEIGHTD_E_FAULT
 * when a shard was truncated while it was read.
 */
int ld_fill(struct loader *ld, struct ld_target *t, struct wd_error *err);

/*
 * A load onto device was queued, or has finished (the loop thread, around
 * the load job): the device counts as busy meanwhile, so a striped load
 * does not borrow its link nor a replica read from it. NULL-safe.
 */
void ld_reserve(struct loader *ld, int device);
void ld_unreserve(struct loader *ld, int device);
/* How many loads, lendings and copies keep device busy now (a snapshot). */
int ld_busy(const struct loader *ld, int device);

#endif
