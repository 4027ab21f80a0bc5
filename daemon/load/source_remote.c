/*
 * source_remote.c - the remote source: a checkpoint's shards read with range
 * GETs (remote/rckpt.h) straight into the destination (see source.h).
 *
 * A contiguous read is one rck_read into dst: the engine splits it into
 * parts with several requests in flight and writes each body where it
 * belongs. A strided read (a column slice) is fetched as whole rows, as the
 * staging path reads files: runs of rows spanning at most REMOTE_BOUNCE
 * bytes go into a bounce buffer and the rows are copied out; where the gap
 * between rows is more than their width the rows are fetched one by one
 * instead, so a read never fetches more than twice its bytes.
 *
 * DESIGN (threads): fill threads call read and unchanged at once; the
 * checkpoint and its objects are immutable after open and the range-GET
 * client guards its own state. A bounce buffer is the calling read's own.
 */
#include "source.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote/rckpt.h"

/* The span of rows a strided read fetches at once. */
#define REMOTE_BOUNCE (8u << 20)
/* Fill tasks are at least this long (struct ld_source.read_min), so each read has many parts in flight. */
#define REMOTE_READ_MIN (64u << 20)

static int remote_read(void *ctx, const struct ld_read *rq, struct wd_error *err) {
  const struct rck *r = ctx;
  if (rq->height == 0 || rq->width == 0) return 0;
  int rc = ld_read_check(r->ck, rq, err);
  if (rc != 0) return rc;
  if (rq->height == 1 || rq->pitch == rq->width) {
    rc = rck_read(r, rq->shard, rq->off, rq->width * rq->height, rq->dst, rq->cancel, err);
  } else if (rq->pitch - rq->width > rq->width || rq->pitch > REMOTE_BOUNCE) {
    for (uint64_t i = 0; i < rq->height && rc == 0; i++)
      rc = rck_read(r, rq->shard, rq->off + i * rq->pitch, rq->width, rq->dst + i * rq->width, rq->cancel, err);
  } else {
    uint64_t per = REMOTE_BOUNCE / rq->pitch; /* rows a bounce holds whole, >= 1 */
    uint64_t span = (per - 1) * rq->pitch + rq->width;
    unsigned char *b = malloc((size_t)span);
    if (b == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory for a %llu-byte read", (unsigned long long)span);
    for (uint64_t i = 0; i < rq->height && rc == 0; i += per) {
      uint64_t k = rq->height - i < per ? rq->height - i : per;
      rc = rck_read(r, rq->shard, rq->off + i * rq->pitch, (k - 1) * rq->pitch + rq->width, b, rq->cancel, err);
      for (uint64_t j = 0; j < k && rc == 0; j++) memcpy(rq->dst + (i + j) * rq->width, b + j * rq->pitch, rq->width);
    }
    free(b);
  }
  if (rc == 0 && rq->counts != NULL) rq->counts[LD_SOURCE_REMOTE] += rq->width * rq->height;
  return rc;
}

static int remote_unchanged(void *ctx, struct wd_error *err) { return rck_unchanged(ctx, err); }

static void remote_destroy(void *ctx) {
  struct rck *r = ctx;
  if (r == NULL) return;
  r->ck = NULL; /* the caller's */
  rck_close(r);
}

static const struct ld_source_ops remote_ops = {
    .kind = LD_SOURCE_REMOTE,
    .read = remote_read,
    .holds = NULL,    /* every byte of every shard, one request away */
    .map = NULL,      /* nothing local to map: no direct DMA, no pinned tier */
    .prefetch = NULL, /* nothing kept warm (a node cache would) */
    .advise = NULL,
    .unchanged = remote_unchanged,
    .destroy = remote_destroy,
};

int ld_source_remote_open(struct rck *r, struct ld_source **out, struct wd_error *err) {
  *out = NULL;
  struct ld_source *s = calloc(1, sizeof *s);
  if (s == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  *s = (struct ld_source){.ops = &remote_ops, .ctx = r, .ck = r->ck, .align = 1, .read_min = REMOTE_READ_MIN};
  snprintf(s->label, sizeof s->label, "%s", ld_source_kind_name(LD_SOURCE_REMOTE));
  *out = s;
  return 0;
}
