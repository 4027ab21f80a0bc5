/*
 * multi.h - loads that use more than their own device: a replica copied
 * from a peer's resident copy, and a load striped over idle neighbours' host
 * links. docs/multi-gpu.md says when each is chosen and how to turn it off.
 *
 * Residency reserves a device when it queues a load onto it and releases it
 * when the load is done (ld_reserve, ld_unreserve); ld_fill asks multi.c
 * first, once the slab is allocated, and it either moves the bytes or says
 * that the load goes the usual way. Decisions are made when the load job
 * starts, from what the devices are doing then:
 *
 *   replica  replicas=auto, the caller offered ready copies of the same set
 *            on other devices (ld_target.copies), and one of them sits on a
 *            device with peer access to the target that is not busy (no load
 *            onto it, no lending, no other copy from it): the slab is copied
 *            device to device from it, NVLink before PCIe, then the lower
 *            performance rank. Otherwise, or when the copy fails (not when it
 *            is canceled), the load reads host memory as usual.
 *   striped  striping=auto, the slab is at least stripe_min_bytes, and
 *            neighbours with peer access to the target are idle (not busy,
 *            their lending link free): the staging pipeline (pipeline.c) runs
 *            over several host links, the target's own and each neighbour's
 *            lending link, which moves its windows into a bounce buffer on
 *            the neighbour and forwards each over the peer link as it lands.
 *            The slab is split into one contiguous range per link, in
 *            proportion to the links' rates (link_rates; equal when
 *            unmeasured), cut at window boundaries; the target's share comes
 *            first. A failure of the striped path (not a cancel, a truncated
 *            shard or a changed file) falls back to the usual load.
 *
 * "Busy" is a per-device count of loads queued or running onto the device,
 * its lending to a striped load and copies read from it; neighbours and
 * replica sources must be at zero. A load that starts on a device after it
 * was borrowed shares its link with the striped load for the rest of it
 * (its own staging link is not the one it lent).
 */
#ifndef WD_LD_MULTI_H
#define WD_LD_MULTI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/topology.h"
#include "target.h"

/* A link a striped load may use: a device and its host-to-device rate. */
struct ld_link_rate {
  int device;
  double rate;
};

/*
 * Splits slab bytes [0, total) into one contiguous range per link, in the
 * links' order, with bytes in proportion to their rates, every boundary but
 * the last a multiple of grain. A link whose share rounds to nothing gets an
 * empty range. Returns how many links got bytes.
 */
size_t ld_stripe_split(const struct ld_link_rate *links, size_t n, uint64_t total, uint64_t grain,
                       struct ld_share *out);

/*
 * The copy a replica onto `target` is copied from: among copies whose device
 * has peer access to target and is not marked in busy (NULL: none busy),
 * NVLink before other links, then the lower performance rank, then the
 * first. Its index, or -1 when none qualifies.
 */
int ld_replica_pick(const struct topology *t, int target, const struct ld_copy *copies, size_t n, const bool *busy);

#endif
