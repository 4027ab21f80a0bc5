/*
 * stripe.h - the striped data path: one slab filled over several devices'
 * host links at once (multigpu.h decides when, and with which links).
 *
 * Each link owns a kit on its device. The target's link moves its range
 * straight into the slab; a neighbour's link moves its range into a bounce
 * buffer on the neighbour and forwards it to the slab with a peer copy on
 * the same stream, so the forward starts as soon as the window has landed.
 * A link's range is cut into windows of the kit's size, used alternately
 * from its two slots; the windows of all links are taken in step (each
 * link's next window when its share of the way through is the smallest), so
 * every link is busy at once.
 *
 * Sources: staged (fill threads gather each window of the slab image into
 * the link's pinned slot, the last task of a window sends it: the staging
 * pipeline of loader.c with a slot pair per link) or direct (every byte the
 * plan reads is registered, ld_plan_pinned: the job thread has the copy
 * engines read the mappings segment by segment, plan_segments, split where
 * registrations end, zeros from a pinned zero buffer).
 */
#ifndef WD_STRIPE_H
#define WD_STRIPE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "error.h"
#include "fillpool.h"
#include "load_target.h"

#define STRIPE_SLOTS 2

/* What a device needs to move a share of a striped load. */
struct stripe_kit {
  pthread_mutex_t lock; /* held by the striped load that uses the kit */
  int device;
  size_t bytes;                         /* each slot's and bounce buffer's size: one window */
  void *slots[STRIPE_SLOTS];            /* pinned host memory */
  struct wd_slab *bounce[STRIPE_SLOTS]; /* device memory a neighbour forwards from */
  struct wd_stream *streams[STRIPE_SLOTS];
  struct wd_event *events[STRIPE_SLOTS];
};

/* Allocates device's kit; 0, or an error (what was made is freed by stripe_kit_fini). */
int stripe_kit_init(struct stripe_kit *k, const struct wd_backend *b, int device, size_t bytes,
                    struct wd_error *err);
void stripe_kit_fini(struct stripe_kit *k, const struct wd_backend *b);

struct stripe_link {
  struct stripe_kit *kit;
  uint64_t lo, hi; /* its share of the slab */
};

struct stripe_job {
  const struct wd_backend *backend;
  struct fillpool *fill;
  struct ld_target *t;
  const struct stripe_link *links; /* links[0]: the target's own */
  size_t nlinks;
  bool direct;               /* the copy engines read the registered mappings */
  const unsigned char *zeros; /* pinned zeros, for direct copies of gaps and padding */
  size_t zeros_bytes;
};

/* Fills t->slab over the links; every kit is idle again when it returns. */
int stripe_fill(const struct stripe_job *j, struct wd_error *err);

#endif
