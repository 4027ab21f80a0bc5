/*
 * multigpu.c - replicas from a peer's copy and striped loads (see
 * multigpu.h; the striped data path is stripe.c).
 *
 * DESIGN (threads): mg_fill runs on a load's job thread. The busy counts
 * are atomics; a kit is taken with a trylock (a device lends to one striped
 * load at a time, and a striped load uses its target's kit for its own
 * link); a lane (the stream a replica copy onto a device runs on) is taken
 * with a lock. Everything else is written only by mg_create.
 */
#include "multigpu.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "load_source.h"
#include "base/log.h"
#include "stripe.h"

/* Bytes one replica copy moves at most (keeps progress and cancellation responsive). */
#define MG_COPY_CHUNK (256ull << 20)
/* Pinned zeros that direct striped windows copy gaps and padding from. */
#define MG_ZEROS (1u << 20)

/* The stream replica copies onto one device run on. */
struct lane {
  pthread_mutex_t lock;
  struct wd_stream *stream;
  struct wd_event *event;
};

struct mg {
  const struct wd_backend *backend;
  struct fillpool *fill;
  const struct topology *topo;
  int ndev;
  bool replicas, staged_only;
  uint64_t stripe_min_bytes;
  atomic_int *busy;         /* per device: loads onto it, lendings, copies read from it */
  struct stripe_kit *kits;  /* per device, when striping is on; else NULL */
  struct lane *lanes;       /* per device, when replicas are on; else NULL */
  void *zeros;              /* MG_ZEROS pinned zero bytes, with kits */
};

/* ---- the decisions ------------------------------------------------------------------- */

size_t mg_stripe_split(const struct mg_link *links, size_t n, uint64_t total, uint64_t grain, struct ld_share *out) {
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

int mg_replica_pick(const struct topology *t, int target, const struct ld_source *srcs, size_t n, const bool *busy) {
  int best = -1;
  for (size_t i = 0; i < n; i++) {
    int d = srcs[i].device;
    if (d < 0 || d >= t->ndev || d == target || !topo_peer(t, d, target)->access) continue;
    if (busy != NULL && busy[i]) continue;
    if (best < 0 || better_path(topo_peer(t, d, target), topo_peer(t, srcs[best].device, target))) best = (int)i;
  }
  return best;
}

/* ---- the context --------------------------------------------------------------------- */

void mg_reserve(struct mg *m, int device) {
  if (m != NULL) atomic_fetch_add(&m->busy[device], 1);
}

void mg_release(struct mg *m, int device) {
  if (m != NULL) atomic_fetch_sub(&m->busy[device], 1);
}

int mg_busy(const struct mg *m, int device) { return m != NULL ? atomic_load(&m->busy[device]) : 0; }

int mg_create(const struct mg_params *p, struct mg **out, struct wd_error *err) {
  *out = NULL;
  const struct wd_backend_ops *ops = p->backend->ops;
  int n = p->topo->ndev;
  if (n < 2 || ops->copy_peer == NULL || ops->peer_query == NULL || ops->scratch_alloc == NULL) return 0;
  struct mg *m = calloc(1, sizeof *m);
  if (m == NULL || (m->busy = calloc((size_t)n, sizeof *m->busy)) == NULL) {
    free(m);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  m->backend = p->backend;
  m->fill = p->fill;
  m->topo = p->topo;
  m->ndev = n;
  m->replicas = p->replicas;
  m->staged_only = p->staged_only;
  m->stripe_min_bytes = p->stripe_min_bytes;
  for (int d = 0; d < n; d++) atomic_init(&m->busy[d], 0);
  int rc = 0;
  if (p->replicas && (m->lanes = calloc((size_t)n, sizeof *m->lanes)) == NULL)
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (int d = 0; m->lanes != NULL && d < n; d++) pthread_mutex_init(&m->lanes[d].lock, NULL);
  for (int d = 0; rc == 0 && m->lanes != NULL && d < n; d++) {
    rc = ops->stream_create(p->backend->ctx, d, &m->lanes[d].stream, err);
    if (rc == 0) rc = ops->event_create(p->backend->ctx, d, &m->lanes[d].event, err);
    if (rc != 0) err_prefix(err, "replica lane of device %d", d);
  }
  if (rc == 0 && p->striping) {
    m->kits = calloc((size_t)n, sizeof *m->kits);
    if (m->kits == NULL) rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    if (rc == 0 && (rc = ops->pinned_alloc(p->backend->ctx, 0, MG_ZEROS, 0, &m->zeros, err)) == 0)
      memset(m->zeros, 0, MG_ZEROS);
    for (int d = 0; rc == 0 && d < n; d++) {
      if (p->place != NULL) p->place(p->place_arg, d);
      rc = stripe_kit_init(&m->kits[d], p->backend, d, p->window_bytes, err);
      if (rc != 0) err_prefix(err, "striping kit of device %d", d);
    }
    if (rc == 0)
      log_msg(LOG_INFO, "striping: every device lends its host link through 2 pinned slots and 2 bounce buffers of %zu MiB",
              p->window_bytes >> 20);
  }
  *out = m;
  if (rc != 0) {
    mg_destroy(m);
    *out = NULL;
  }
  return rc;
}

void mg_destroy(struct mg *m) {
  if (m == NULL) return;
  const struct wd_backend_ops *ops = m->backend->ops;
  void *ctx = m->backend->ctx;
  for (int d = 0; m->kits != NULL && d < m->ndev; d++)
    if (m->kits[d].bytes > 0 || m->kits[d].slots[0] != NULL) stripe_kit_fini(&m->kits[d], m->backend);
  for (int d = 0; m->lanes != NULL && d < m->ndev; d++) {
    if (m->lanes[d].event != NULL) ops->event_destroy(ctx, m->lanes[d].event);
    if (m->lanes[d].stream != NULL) ops->stream_destroy(ctx, m->lanes[d].stream);
    pthread_mutex_destroy(&m->lanes[d].lock);
  }
  if (m->zeros != NULL) ops->pinned_free(ctx, 0, m->zeros);
  free(m->kits);
  free(m->lanes);
  free(m->busy);
  free(m);
}

/* True for a failure of the device-to-device path itself, after which the usual load is tried. */
static bool falls_back(int rc) {
  return rc != 0 && rc != WEIGHTD_E_CANCELED && rc != WEIGHTD_E_FAULT && rc != WEIGHTD_E_STALE &&
         rc != WEIGHTD_E_NOMEM;
}

/* ---- replicas ------------------------------------------------------------------------ */

static int copy_replica(struct mg *m, struct ld_target *t, const struct ld_source *src, struct wd_error *err) {
  const struct wd_backend_ops *ops = m->backend->ops;
  void *ctx = m->backend->ctx;
  struct lane *lane = &m->lanes[t->device];
  uint64_t total = t->plan->slab_bytes;
  int rc = 0;
  pthread_mutex_lock(&lane->lock);
  for (uint64_t off = 0; off < total && rc == 0; off += MG_COPY_CHUNK) {
    if (atomic_load(&t->cancel)) {
      rc = err_set(err, WEIGHTD_E_CANCELED, "load of %s canceled", t->ck->path);
      break;
    }
    uint64_t n = total - off < MG_COPY_CHUNK ? total - off : MG_COPY_CHUNK;
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

static int fill_replica(struct mg *m, struct ld_target *t, bool *filled, struct wd_error *err) {
  bool busy[LD_MAX_LINKS * 4] = {0};
  size_t n = t->nsources < sizeof busy / sizeof busy[0] ? t->nsources : sizeof busy / sizeof busy[0];
  for (size_t i = 0; i < n; i++) busy[i] = atomic_load(&m->busy[t->sources[i].device]) > 0;
  int pick = mg_replica_pick(m->topo, t->device, t->sources, n, busy);
  if (pick < 0) {
    log_msg(LOG_DEBUG, "%s onto device %d: no idle copy on a peer (%zu elsewhere): from host memory", t->ck->path,
            t->device, n);
    return 0;
  }
  const struct ld_source *src = &t->sources[pick];
  atomic_fetch_add(&m->busy[src->device], 1);
  int rc = copy_replica(m, t, src, err);
  atomic_fetch_sub(&m->busy[src->device], 1);
  if (falls_back(rc)) {
    log_msg(LOG_WARN, "%s onto device %d: the copy from device %d failed (%s): loading from host memory instead",
            t->ck->path, t->device, src->device, err->msg);
    atomic_store(&t->bytes_done, 0);
    return 0;
  }
  *filled = true;
  if (rc == 0) {
    t->method = "peer";
    t->source_device = src->device;
  }
  return rc;
}

/* ---- striping ---------------------------------------------------------------------------- */

/* Takes the target's kit and those of idle neighbours with peer access; *n links, the target's first. */
static void take_links(struct mg *m, int target, struct mg_link *links, size_t *n) {
  *n = 0;
  if (pthread_mutex_trylock(&m->kits[target].lock) != 0) return; /* another striped load onto it */
  links[(*n)++] = (struct mg_link){target, m->topo->dev[target].link_rate};
  for (int d = 0; d < m->ndev && *n < LD_MAX_LINKS; d++) {
    if (d == target || !topo_peer(m->topo, d, target)->access || atomic_load(&m->busy[d]) > 0) continue;
    if (pthread_mutex_trylock(&m->kits[d].lock) != 0) continue; /* lending to another load */
    atomic_fetch_add(&m->busy[d], 1);
    links[(*n)++] = (struct mg_link){d, m->topo->dev[d].link_rate};
  }
}

static void give_link(struct mg *m, int device, int target) {
  if (device != target) atomic_fetch_sub(&m->busy[device], 1);
  pthread_mutex_unlock(&m->kits[device].lock);
}

static int fill_striped(struct mg *m, struct ld_target *t, bool *filled, struct wd_error *err) {
  uint64_t total = t->plan->slab_bytes;
  if (total < m->stripe_min_bytes) return 0;
  struct mg_link links[LD_MAX_LINKS];
  size_t n = 0;
  take_links(m, t->device, links, &n);
  if (n == 0) return 0;
  struct ld_share shares[LD_MAX_LINKS];
  if (mg_stripe_split(links, n, total, m->kits[t->device].bytes, shares) < 2) {
    for (size_t i = 0; i < n; i++) give_link(m, links[i].device, t->device);
    log_msg(LOG_DEBUG, "%s onto device %d: no idle neighbour to stripe over", t->ck->path, t->device);
    return 0;
  }
  /* The target keeps its own link (links[0]) even without bytes; neighbours without bytes go back. */
  struct stripe_link sl[LD_MAX_LINKS];
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && shares[i].hi == shares[i].lo) {
      give_link(m, links[i].device, t->device);
      continue;
    }
    sl[k] = (struct stripe_link){&m->kits[links[i].device], shares[i].lo, shares[i].hi};
    t->shares[k++] = shares[i];
  }
  t->nshares = k;
  struct stripe_job jb = {.backend = m->backend,
                          .fill = m->fill,
                          .t = t,
                          .links = sl,
                          .nlinks = k,
                          .direct = !m->staged_only && ld_plan_pinned(t),
                          .zeros = m->zeros,
                          .zeros_bytes = MG_ZEROS};
  int rc = stripe_fill(&jb, err);
  for (size_t i = 0; i < k; i++) give_link(m, sl[i].kit->device, t->device);
  if (falls_back(rc)) {
    log_msg(LOG_WARN, "%s onto device %d: the striped load failed (%s): loading over its own link instead",
            t->ck->path, t->device, err->msg);
    atomic_store(&t->bytes_done, 0);
    t->nshares = 0;
    return 0;
  }
  *filled = true;
  if (rc == 0) t->method = "striped";
  else t->nshares = 0;
  return rc;
}

int mg_fill(struct mg *m, struct ld_target *t, bool *filled, struct wd_error *err) {
  *filled = false;
  if (m == NULL) return 0;
  int rc = 0;
  if (m->lanes != NULL && t->nsources > 0) rc = fill_replica(m, t, filled, err);
  if (rc == 0 && !*filled && m->kits != NULL) rc = fill_striped(m, t, filled, err);
  return rc;
}
