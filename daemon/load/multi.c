/*
 * multi.c - replicas from a peer's copy and striped loads (see multi.h; the
 * striped data path is the one pipeline, pipeline.c).
 *
 * DESIGN (threads): ld_multi_fill runs on a load's job thread. The busy
 * counts are atomics; a neighbour's lending link is taken with a trylock (a
 * device lends to one striped load at a time); a lane (the stream a replica
 * copy onto a device runs on) is taken with a lock. The target's own link
 * is taken with a lock, as every pipeline load takes it.
 */
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

/* Bytes one replica copy moves at most (keeps progress and cancellation responsive). */
#define LD_COPY_CHUNK (256ull << 20)

/* ---- the decisions ------------------------------------------------------------------- */

size_t ld_stripe_split(const struct ld_link_rate *links, size_t n, uint64_t total, uint64_t grain,
                       struct ld_share *out) {
  double sum = 0;
  for (size_t i = 0; i < n; i++) sum += links[i].rate > 0 ? links[i].rate : 0;
  size_t with_bytes = 0;
  uint64_t lo = 0;
  double upto = 0;
  for (size_t i = 0; i < n; i++) {
    upto += links[i].rate > 0 ? links[i].rate : 0;
    uint64_t hi = total;
    if (i + 1 < n) {
      double cut = sum > 0 ? (double)total * (upto / sum) : 0;
      uint64_t g = grain ? grain : 1;
      hi = (uint64_t)llround(cut / (double)g) * g; /* the nearest multiple of the grain */
      if (hi > total) hi = total;
      if (hi < lo) hi = lo;
    }
    out[i] = (struct ld_share){.device = links[i].device, .lo = lo, .hi = hi};
    with_bytes += hi > lo;
    lo = hi;
  }
  return with_bytes;
}

/* True when link a is a better way to copy than link b: NVLink first, then the lower rank. */
static bool better_path(const struct wd_peer_info *a, const struct wd_peer_info *b) {
  bool na = a->link == WD_LINK_NVLINK, nb = b->link == WD_LINK_NVLINK;
  if (na != nb) return na;
  if (a->performance_rank < 0 || b->performance_rank < 0) return false;
  return a->performance_rank < b->performance_rank;
}

int ld_replica_pick(const struct topology *t, int target, const struct ld_copy *copies, size_t n, const bool *busy) {
  int best = -1;
  for (size_t i = 0; i < n; i++) {
    int d = copies[i].device;
    if (d < 0 || d >= t->ndev || d == target || !topo_peer(t, d, target)->access) continue;
    if (busy != NULL && busy[i]) continue;
    if (best < 0 || better_path(topo_peer(t, d, target), topo_peer(t, copies[best].device, target))) best = (int)i;
  }
  return best;
}

/*
 * True for a failure of the device-to-device path itself, after which the
 * usual load is tried. A failed read of the source is the source's: it would
 * fail again (a bad sector read twice), so it is the load's answer.
 */
static bool falls_back(const struct ld_target *t, int rc) {
  return rc != 0 && !t->read_failed && rc != WEIGHTD_E_CANCELED && rc != WEIGHTD_E_FAULT &&
         rc != WEIGHTD_E_STALE && rc != WEIGHTD_E_NOMEM;
}

/* Forgets what a failed attempt counted, before the usual load starts over. */
static void restart_counts(struct ld_target *t) {
  atomic_store(&t->bytes_done, 0);
  for (int k = 0; k < LD_SOURCE_KINDS; k++) atomic_store(&t->source_bytes[k], 0);
  t->nshares = 0;
}

/* ---- replicas ------------------------------------------------------------------------ */

static int copy_replica(struct loader *ld, struct ld_target *t, const struct ld_copy *src, struct wd_error *err) {
  const struct wd_backend_ops *ops = ld->backend->ops;
  void *ctx = ld->backend->ctx;
  struct ld_lane *lane = &ld->lanes[t->device];
  uint64_t total = t->plan->slab_bytes;
  int rc = 0;
  pthread_mutex_lock(&lane->lock);
  for (uint64_t off = 0; off < total && rc == 0; off += LD_COPY_CHUNK) {
    if ((rc = ld_check_cancel(t, err)) != 0) break;
    uint64_t n = total - off < LD_COPY_CHUNK ? total - off : LD_COPY_CHUNK;
    rc = ops->copy_peer(ctx, t->slab, off, src->slab, off, n, lane->stream, err);
    if (rc == 0) atomic_fetch_add(&t->bytes_done, n);
  }
  struct wd_error e2 = {0};
  int r2 = ops->event_record(ctx, lane->event, lane->stream, &e2);
  if (r2 == 0) r2 = ops->event_wait(ctx, lane->event, &e2);
  if (rc == 0 && r2 != 0) {
    rc = r2;
    *err = e2;
  }
  pthread_mutex_unlock(&lane->lock);
  return rc;
}

static int fill_replica(struct loader *ld, struct ld_target *t, bool *filled, struct wd_error *err) {
  bool busy[LD_MAX_LINKS * 4] = {0};
  size_t n = t->ncopies < sizeof busy / sizeof busy[0] ? t->ncopies : sizeof busy / sizeof busy[0];
  for (size_t i = 0; i < n; i++) busy[i] = atomic_load(&ld->busy[t->copies[i].device]) > 0;
  int pick = ld_replica_pick(ld->topo, t->device, t->copies, n, busy);
  if (pick < 0) {
    log_msg(LOG_DEBUG, "%s onto device %d: no idle copy on a peer (%zu elsewhere): from host memory", t->name,
            t->device, n);
    return 0;
  }
  const struct ld_copy *src = &t->copies[pick];
  atomic_fetch_add(&ld->busy[src->device], 1);
  atomic_store(&t->reading_device, src->device);
  int rc = copy_replica(ld, t, src, err);
  atomic_fetch_sub(&ld->busy[src->device], 1);
  if (falls_back(t, rc)) {
    atomic_store(&t->reading_device, -1);
    log_msg(LOG_WARN, "%s onto device %d: the copy from device %d failed (%s): loading from host memory instead",
            t->name, t->device, src->device, err->msg);
    restart_counts(t);
    memset(err, 0, sizeof *err);
    return 0;
  }
  *filled = true;
  if (rc == 0) {
    t->method = LD_METHOD_PEER;
    t->source_device = src->device;
  }
  return rc;
}

/* ---- striping ---------------------------------------------------------------------------- */

/* Lends idle neighbours' links with peer access to target: appends them to links/rates after the target's. */
static void take_links(struct loader *ld, int target, struct ld_link **links, struct ld_link_rate *rates, size_t *n) {
  for (int d = 0; d < ld->ndevices && *n < LD_MAX_LINKS; d++) {
    if (d == target || !topo_peer(ld->topo, d, target)->access || atomic_load(&ld->busy[d]) > 0) continue;
    if (pthread_mutex_trylock(&ld->lend[d].lock) != 0) continue; /* lending to another load */
    atomic_fetch_add(&ld->busy[d], 1);
    links[*n] = &ld->lend[d];
    rates[(*n)++] = (struct ld_link_rate){d, ld->topo->dev[d].link_rate};
  }
}

static void give_link(struct loader *ld, struct ld_link *l) {
  atomic_fetch_sub(&ld->busy[l->device], 1);
  pthread_mutex_unlock(&l->lock);
}

static int fill_striped(struct loader *ld, struct ld_target *t, const struct ld_source *src, bool *filled,
                        struct wd_error *err) {
  uint64_t total = t->plan->slab_bytes;
  if (total < ld->stripe_min_bytes) return 0;
  struct ld_link *links[LD_MAX_LINKS];
  struct ld_link_rate rates[LD_MAX_LINKS];
  links[0] = &ld->home[t->device];
  rates[0] = (struct ld_link_rate){t->device, ld->topo->dev[t->device].link_rate};
  size_t n = 1;
  pthread_mutex_lock(&links[0]->lock); /* the target's own link, as any pipeline load takes it */
  take_links(ld, t->device, links, rates, &n);
  struct ld_share shares[LD_MAX_LINKS];
  if (n < 2 || ld_stripe_split(rates, n, total, links[0]->slot_bytes, shares) < 2) {
    for (size_t i = 1; i < n; i++) give_link(ld, links[i]);
    pthread_mutex_unlock(&links[0]->lock);
    log_msg(LOG_DEBUG, "%s onto device %d: no idle neighbour to stripe over", t->name, t->device);
    return 0;
  }
  /* The target keeps its own link even without bytes; neighbours without bytes go back. */
  struct ld_link *used[LD_MAX_LINKS];
  uint64_t cuts[LD_MAX_LINKS + 1];
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && shares[i].hi == shares[i].lo) {
      give_link(ld, links[i]);
      continue;
    }
    used[k] = links[i];
    cuts[k++] = shares[i].lo;
  }
  cuts[k] = total;
  bool direct = !ld->staged_only && src == t->mmap && ld_plan_pinned(t);
  int rc = ld_pipe_run(ld, t, src, used, cuts, k, direct, err);
  for (size_t i = 1; i < k; i++) give_link(ld, used[i]);
  pthread_mutex_unlock(&links[0]->lock);
  if (falls_back(t, rc)) {
    log_msg(LOG_WARN, "%s onto device %d: the striped load failed (%s): loading over its own link instead", t->name,
            t->device, err->msg);
    restart_counts(t);
    memset(err, 0, sizeof *err);
    return 0;
  }
  *filled = true;
  if (rc == 0) t->method = LD_METHOD_STRIPED;
  else t->nshares = 0;
  return rc;
}

int ld_multi_fill(struct loader *ld, struct ld_target *t, const struct ld_source *src, bool *filled,
                  struct wd_error *err) {
  *filled = false;
  if (!ld->peers) return 0;
  int rc = 0;
  if (ld->lanes != NULL && t->ncopies > 0) rc = fill_replica(ld, t, filled, err);
  if (rc == 0 && !*filled && ld->lend != NULL && ld->home != NULL) rc = fill_striped(ld, t, src, filled, err);
  return rc;
}
