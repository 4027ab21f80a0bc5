/*
 * multigpu.h - loads that use more than their own device: a replica copied
 * from a peer's resident copy, and a load striped over idle neighbours' host
 * links. docs/multi-gpu.md says when each is chosen and how to turn it off.
 *
 * Residency reserves a device when it queues a load onto it and releases
 * it when the load is done (through the loader); the loader calls mg_fill
 * once a load's slab is allocated; mg_fill either moves the bytes itself or says
 * that the load goes the usual way (staged, direct or memcpy over the
 * target's own link). Decisions are made when the load job starts, from
 * what the devices are doing then:
 *
 *   replica  replicas=auto, the caller offered ready copies of the same set
 *            on other devices (ld_target.sources), and one of them sits on a
 *            device with peer access to the target that is not busy (no load
 *            onto it, no lending, no other copy from it): the slab is copied
 *            device to device from it, NVLink before PCIe, then the lower
 *            performance rank. Otherwise, or when the copy fails (not when it
 *            is canceled), the load reads host memory as usual.
 *   striped  striping=auto, the slab is at least stripe_min_bytes, and
 *            neighbours with peer access to the target are idle (not busy,
 *            their lending kit free): the slab is split into one contiguous
 *            range per link, in proportion to the links' rates (link_rates;
 *            equal when unmeasured), cut at window multiples; the target
 *            loads its range over its own link while each neighbour streams
 *            its range into a bounce buffer on itself and forwards each
 *            window over the peer link as it lands (stripe.h). The target's
 *            share comes first. A failure of the striped path (not a
 *            cancel, a truncated shard or a changed file) falls back to the
 *            usual load.
 *
 * "Busy" is a per-device count of loads queued or running onto the device,
 * its lending to a striped load and copies read from it; neighbours and replica sources must
 * be at zero. A load that starts on a device after it was borrowed shares
 * its link with the striped load for the rest of it.
 *
 * DESIGN (threads): the context is immutable after mg_create except the
 * busy counts (atomics), each kit's lock (one striped load at a time uses a
 * device's kit) and each lane's lock (one replica copy onto a device at a
 * time). Everything runs on the load's job thread and the fill threads.
 */
#ifndef WD_MULTIGPU_H
#define WD_MULTIGPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "error.h"
#include "fillpool.h"
#include "load_target.h"
#include "base/topology.h"

struct mg;

struct mg_params {
  const struct wd_backend *backend;
  struct fillpool *fill;
  const struct topology *topo; /* outlives the context */
  bool replicas;               /* replicas = auto */
  bool striping;               /* striping = auto: every device gets a lending kit */
  bool staged_only;            /* load_method = staged: striped loads gather on the CPU, never direct */
  uint64_t stripe_min_bytes;
  size_t window_bytes; /* a striped window: the size of each kit slot and bounce buffer */
  /* Called on the creating thread before device d's kit is allocated (NUMA placement); may be NULL. */
  void (*place)(void *arg, int device);
  void *place_arg;
};

/*
 * Builds the context: a lending kit per device when striping is on (two
 * pinned slots, two bounce buffers on the device, two streams and events),
 * a copy lane per device when replicas are on. *out is NULL (and 0 is
 * returned) when the backend has a single device or no peer copies: every
 * load then uses its own device only.
 */
int mg_create(const struct mg_params *p, struct mg **out, struct wd_error *err);
void mg_destroy(struct mg *m);

/*
 * A load onto device was queued, or has finished: it counts as busy from the
 * moment it is queued (so the ranks of a group, queued together, never
 * borrow each other's links), until it is done. NULL-safe.
 */
void mg_reserve(struct mg *m, int device);
void mg_release(struct mg *m, int device);

/* How many loads, lendings and copies keep device busy now (a snapshot). */
int mg_busy(const struct mg *m, int device);

/*
 * Fills t->slab (allocated, not yet sealed) from a peer's copy or striped
 * over neighbours when the settings, the topology and the devices allow it,
 * and says so in t (method, source_device, shares). *filled false: nothing
 * was moved (the caller fills the slab the usual way; 0 is returned). True:
 * the result is the fill's. NULL-safe (nothing is filled).
 */
int mg_fill(struct mg *m, struct ld_target *t, bool *filled, struct wd_error *err);

/* ---- the decisions, as pure functions (tests call them) ---------------------------- */

/* A link a striped load may use: a device and its host-to-device rate. */
struct mg_link {
  int device;
  double rate;
};

/*
 * Splits slab bytes [0, total) into one contiguous range per link, in the
 * links' order, with bytes in proportion to their rates, every boundary but
 * the last a multiple of grain. A link whose share rounds to nothing gets an
 * empty range. Returns how many links got bytes.
 */
size_t mg_stripe_split(const struct mg_link *links, size_t n, uint64_t total, uint64_t grain, struct ld_share *out);

/*
 * The source a replica onto `target` is copied from: among srcs whose device
 * has peer access to target and is not marked in busy (NULL: none busy),
 * NVLink before other links, then the lower performance rank, then the
 * first. Its index, or -1 when none qualifies.
 */
int mg_replica_pick(const struct topology *t, int target, const struct ld_source *srcs, size_t n, const bool *busy);

#endif
