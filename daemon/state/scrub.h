/*
 * scrub.h - scrubbing resident sets: each set's tensors hashed again and
 * compared with the digests recorded when it was loaded (load/digest.c).
 *
 * A scrub of a set runs the backend's slab_hash over the set's plan outputs
 * on the scrubber's worker thread, never the loop, and reports back on the
 * loop through a typed continuation with every tensor that differs (its
 * output index, the digest at load, the digest found). The set is held
 * while its scrub runs (res_set.scrubbing: not evicted meanwhile, as a
 * lease holds it), so an eviction asked for then answers BUSY and a release
 * mid-scrub frees nothing under the worker.
 *
 * A tensor found to differ marks the set corrupt (res_set.corrupt, kept
 * until the set goes): it is logged and counted, it refuses new leases with
 * BAD_CHECKSUM, and the on_corrupt hook tells whoever holds it and may
 * retire the set and load it again (ops_scrub.c; status then no longer
 * shows it).
 *
 * Background scrubs: with a duty cycle above 0 (percent of the worker's
 * time spent hashing; it sleeps in proportion to each batch it hashed), the
 * loop hands the worker one ready set at a time in turn (by set id), the
 * next one interval_ms after the last one finished. Scrubs asked for over
 * the protocol run at full speed, ahead of a background one.
 */
#ifndef WD_SCRUB_H
#define WD_SCRUB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "backend/backend.h"
#include "residency.h"

struct scrubber;

/*
 * The batch for a backend whose slab_hash runs on the CPU (host: 64 MiB, a
 * few ms of one thread). A GPU's kernels want whole sets: a call's fixed
 * cost (the leaf list, an allocation, two launches, a synchronize) and its
 * parallelism (one warp per 256 KiB leaf: 64 MiB feeds 256 warps of the
 * thousands a GPU runs) make 64 MiB batches of a 7.49 GiB set two orders
 * slower than one call, which hashes it in milliseconds.
 */
#define SCRUB_BATCH_BYTES (64ull << 20)
#define SCRUB_BATCH_BYTES_DEVICE (64ull << 30)

struct scrub_params {
  uv_loop_t *loop;
  const struct wd_backend *backend;
  struct residency *res;
  bool off;             /* the scrub setting is off: loads record no digests (scrubs say so) */
  unsigned duty;        /* percent, 0: no background scrubs */
  uint64_t interval_ms; /* between the end of one background scrub and the start of the next */
  /* The most bytes one slab_hash call covers (at least one whole output): the grain at which an asked-for
   * scrub goes ahead of a background one. 0: SCRUB_BATCH_BYTES. */
  uint64_t batch_bytes;
  /* A scrub found outputs outs[0..n) of s to differ for the first time (loop thread, after that scrub's
   * continuation, with s no longer held by it: the hook may retire s, which may free it); may be NULL. */
  void (*on_corrupt)(void *arg, struct res_set *s, const size_t *outs, size_t n);
  void *on_corrupt_arg;
};

/* One tensor that differs. */
struct scrub_mismatch {
  size_t output; /* index into the set's plan outputs */
  unsigned char want[WD_DIGEST_BYTES], got[WD_DIGEST_BYTES];
};

struct scrub_report {
  uint64_t bytes;   /* bytes hashed */
  size_t tensors;   /* outputs hashed */
  double seconds;   /* from queued to done */
  size_t nmismatch; /* tensors that differ */
  const struct scrub_mismatch *mismatch;
  const unsigned char (*found)[WD_DIGEST_BYTES]; /* every output's digest as hashed now, in plan order */
};

/*
 * Runs on the loop when a scrub of s ends: with its report (err NULL), or
 * with rep NULL and err (the backend failed, the daemon stops: CANCELED).
 * s is still resident when it runs.
 */
typedef void (*scrub_done_fn)(void *arg, struct res_set *s, const struct scrub_report *rep, const struct wd_error *err);

struct scrub_stats {
  uint64_t scrubbed_bytes; /* by every scrub, background and asked for */
  uint64_t mismatches;     /* tensors found to differ (each once per scrub that found it) */
  uint64_t scrubs;         /* scrubs of a set completed */
  uint64_t background;     /* of them, background ones */
};

int scrub_create(const struct scrub_params *p, struct scrubber **out, struct wd_error *err);
/* Stops the worker; scrubs not reported yet are answered CANCELED. Loop thread; before res_destroy. */
void scrub_stop(struct scrubber *sc);
/* Frees it (after scrub_stop; NULL-safe): its loop handles close on the loop's next turn. */
void scrub_destroy(struct scrubber *sc);

/*
 * Queues a scrub of s (loop thread): 0, or an error without queuing: BUSY
 * for a set that is not ready, UNSUPPORTED for one without digests (the
 * backend cannot hash slabs, or the set was re-adopted after a restart).
 */
int scrub_set(struct scrubber *sc, struct res_set *s, scrub_done_fn done, void *arg, struct wd_error *err);

const struct scrub_stats *scrub_stats(const struct scrubber *sc);
/* The duty cycle and interval in force. */
unsigned scrub_duty(const struct scrubber *sc);

#endif
