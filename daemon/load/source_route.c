/*
 * source_route.c - the routing source: several sources in order, each read
 * sent to the first that holds it (see source.h).
 *
 * A contiguous read is cut where the member serving it stops holding bytes,
 * and the rest goes to whichever member holds the next byte; a strided read
 * is cut between rows. When a member's read fails (any error but FAULT,
 * CANCELED and NOMEM, which no other member would change) the same range
 * goes to the next member that holds it, and the failure is logged; the
 * last member's error is the read's. A read that is cut loses the caller's
 * slack: the pieces would otherwise write into each other.
 *
 * The routing order for a load (docs/architecture.md, "Sources"): local
 * files (the page cache, then O_DIRECT), then a node cache, then peers, then
 * an object store, as those sources exist.
 *
 * DESIGN (threads): the member list never changes after open; the members
 * guard their own state.
 */
#include "source.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

#define ROUTE_MAX 8
/* Failed member reads logged per route (one per load); later ones are counted, and the count logged once. */
#define ROUTE_LOGGED 4

struct route {
  size_t n;
  struct ld_source *m[ROUTE_MAX];
  atomic_uint failures; /* member reads that failed and were passed on */
};

static bool passes_on(int rc) {
  return rc != 0 && rc != WEIGHTD_E_FAULT && rc != WEIGHTD_E_CANCELED && rc != WEIGHTD_E_NOMEM;
}

/*
 * Reads rq (whose span, from rq->off, member `first` holds for `held` bytes)
 * from members first, first + 1, ...: each that holds all of it tries in
 * turn until one succeeds.
 */
static int read_from(struct route *r, size_t first, const struct ld_read *rq, struct wd_error *err) {
  uint64_t span = (rq->height - 1) * rq->pitch + rq->width;
  int rc = 0;
  for (size_t i = first; i < r->n; i++) {
    if (i > first && ld_source_holds(r->m[i], rq->shard, rq->off, span) < span) continue;
    struct wd_error e = {0};
    rc = ld_source_read(r->m[i], rq, &e);
    if (rc == 0) return 0;
    *err = e;
    if (!passes_on(rc)) return rc;
    unsigned k = atomic_fetch_add(&r->failures, 1) + 1;
    if (k <= ROUTE_LOGGED)
      log_msg(LOG_WARN, "%s: the %s source failed to read %llu bytes at %llu (%s)%s%s",
              rq->shard < r->m[i]->ck->nshards ? r->m[i]->ck->shards[rq->shard].rel : "?", r->m[i]->label,
              (unsigned long long)span, (unsigned long long)rq->off, e.msg,
              i + 1 < r->n ? ": trying the next source" : "",
              k == ROUTE_LOGGED ? " (later failures of this load are counted, not logged)" : "");
  }
  return rc;
}

/* The first member that holds off and how many bytes of [off, off + len) it holds; n when none does. */
static size_t first_holder(const struct route *r, uint32_t shard, uint64_t off, uint64_t len, uint64_t *held) {
  for (size_t i = 0; i < r->n; i++) {
    uint64_t h = ld_source_holds(r->m[i], shard, off, len);
    if (h > 0) {
      *held = h;
      return i;
    }
  }
  *held = 0;
  return r->n;
}

static int no_holder(const struct route *r, const struct ld_read *rq, uint64_t off, struct wd_error *err) {
  return err_set(err, WEIGHTD_E_IO, "%s: no source holds the bytes at %llu",
                 rq->shard < r->m[0]->ck->nshards ? r->m[0]->ck->shards[rq->shard].rel : "?", (unsigned long long)off);
}

static int route_read(void *ctx, const struct ld_read *rq, struct wd_error *err) {
  struct route *r = ctx;
  if (rq->height == 0 || rq->width == 0) return 0;
  if (rq->height == 1 || rq->pitch == rq->width) {
    uint64_t len = rq->width * rq->height;
    for (uint64_t done = 0; done < len;) {
      uint64_t held;
      size_t i = first_holder(r, rq->shard, rq->off + done, len - done, &held);
      if (i == r->n) return no_holder(r, rq, rq->off + done, err);
      struct ld_read part = *rq;
      part.off = rq->off + done;
      part.width = held;
      part.pitch = held;
      part.height = 1;
      part.dst = rq->dst + done;
      part.slack = rq->slack && done == 0 && held == len; /* a cut read loses its slack */
      int rc = read_from(r, i, &part, err);
      if (rc != 0) return rc;
      done += held;
    }
    return 0;
  }
  for (uint64_t row = 0; row < rq->height;) {
    uint64_t at = rq->off + row * rq->pitch, rest = (rq->height - 1 - row) * rq->pitch + rq->width, held = 0;
    size_t i = 0;
    for (; i < r->n; i++) /* the first member that holds at least this whole row */
      if ((held = ld_source_holds(r->m[i], rq->shard, at, rest)) >= rq->width) break;
    if (i == r->n) return no_holder(r, rq, at, err);
    uint64_t rows = held >= rest ? rq->height - row : (held - rq->width) / rq->pitch + 1;
    struct ld_read part = *rq;
    part.off = at;
    part.height = rows;
    part.dst = rq->dst + row * rq->width;
    part.slack = false;
    int rc = read_from(r, i, &part, err);
    if (rc != 0) return rc;
    row += rows;
  }
  return 0;
}

static uint64_t route_holds(void *ctx, uint32_t shard, uint64_t off, uint64_t len) {
  const struct route *r = ctx;
  uint64_t done = 0;
  while (done < len) {
    uint64_t held;
    if (first_holder(r, shard, off + done, len - done, &held) == r->n) break;
    done += held;
  }
  return done;
}

static int route_unchanged(void *ctx, struct wd_error *err) {
  const struct route *r = ctx;
  for (size_t i = 0; i < r->n; i++) {
    int rc = ld_source_unchanged(r->m[i], err);
    if (rc != 0) return rc;
  }
  return 0;
}

static void route_destroy(void *ctx) {
  struct route *r = ctx;
  unsigned k = atomic_load(&r->failures);
  if (k > ROUTE_LOGGED && r->n > 0)
    log_msg(LOG_WARN, "%s: %u failed reads passed to the next source in all (%u not logged)",
            r->m[0]->ck->nshards > 0 ? r->m[0]->ck->shards[0].rel : "?", k, k - ROUTE_LOGGED);
  free(ctx);
}

static const struct ld_source_ops route_ops = {
    .kind = LD_SOURCE_ROUTE,
    .read = route_read,
    .readv = NULL, /* each read may go to another member: one by one */
    .holds = route_holds,
    .map = NULL,      /* bytes may come from anywhere: nothing to map as one */
    .prefetch = NULL, /* each member warms what it keeps */
    .advise = NULL,
    .unchanged = route_unchanged,
    .destroy = route_destroy,
};

int ld_source_route_open(struct ld_source *const *members, size_t n, struct ld_source **out, struct wd_error *err) {
  *out = NULL;
  if (n == 0 || n > ROUTE_MAX) return err_set(err, WEIGHTD_E_INTERNAL, "a route of %zu sources", n);
  struct ld_source *s = calloc(1, sizeof *s);
  struct route *r = calloc(1, sizeof *r);
  if (s == NULL || r == NULL) {
    free(s);
    free(r);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  *s = (struct ld_source){.ops = &route_ops, .ctx = r, .ck = members[0]->ck, .align = 1};
  size_t used = 0;
  for (size_t i = 0; i < n; i++) {
    r->m[r->n++] = members[i];
    if (members[i]->align > s->align) s->align = members[i]->align;
    if (members[i]->read_min > s->read_min) s->read_min = members[i]->read_min;
    int w = snprintf(s->label + used, sizeof s->label - used, "%s%s", i ? "+" : "", members[i]->label);
    if (w > 0 && (size_t)w < sizeof s->label - used) used += (size_t)w;
  }
  *out = s;
  return 0;
}
