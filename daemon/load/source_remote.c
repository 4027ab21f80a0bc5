/*
 * source_remote.c - the remote source: a checkpoint's shards read with range
 * GETs (remote/rckpt.h) straight into the destination (see source.h).
 *
 * A contiguous read is one rck_read into dst: the engine splits it into
 * parts with several requests in flight and writes each body where it
 * belongs. A fill task's contiguous reads come as one batch (readv): sorted
 * by shard and offset, each shard's become one vectored read (rck_readv),
 * which fetches reads that touch in the file as one run of parts
 * (remote/fetch.h's merge rule; no byte outside the reads). The engine
 * faults each part's destination pages in on the calling fill thread before
 * it sends the part's request, so its own thread only copies bodies. A
 * strided read (a column slice) is fetched as whole rows, as the
 * staging path reads files: runs of rows spanning at most REMOTE_BOUNCE
 * bytes go into a bounce buffer and the rows are copied out, so a TP rank
 * of N fetches its column-sliced tensors whole (N times their share of the
 * bytes) in few large requests rather than one small request per row, the
 * round trip an object store charges for each. Only rows more than
 * REMOTE_BOUNCE apart (each then a large read) are fetched one by one.
 *
 * With a manifest (weightd.manifest.json beside the index, validated at
 * open), every read is fetched as the whole manifest chunks it touches and
 * each chunk's digest is checked before a byte of it is copied out: the
 * bytes a load keeps are the manifest's, whatever the network or the store
 * did. A chunk that differs is logged and fetched once more; if it differs
 * again the read fails with BAD_CHECKSUM naming the URL, the file and the
 * bytes. The price is the chunks' edges (at most a chunk on each side of a
 * read, and per row of a column slice whose rows are more than a chunk
 * apart) and one XXH3 pass over them.
 *
 * DESIGN (threads): fill threads call read and unchanged at once; the
 * checkpoint and its objects are immutable after open and the range-GET
 * client guards its own state. A bounce buffer is the calling read's own.
 */
#include "source.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "manifest.h"
#include "remote/rckpt.h"

/* The span of rows a strided read fetches at once. */
#define REMOTE_BOUNCE (8u << 20)
/* A checked read fetches at most this many manifest chunks at once (its buffer). */
#define REMOTE_CHECK_CHUNKS 4
/* Fill tasks are at least this long (struct ld_source.read_min), so each read has many parts in flight. */
#define REMOTE_READ_MIN (64u << 20)

/* ---- reads checked against the manifest ----------------------------------------------------- */

/* Chunks [c, c + k) of the shard, fetched into buf and each checked; fetched once more when one differs. */
static int fetch_checked(const struct rck *r, const struct ld_read *rq, uint64_t c, uint64_t k, unsigned char *buf,
                         struct wd_error *err) {
  const struct mf_file *f = &r->ck->manifest->files[rq->shard];
  uint64_t size = r->ck->shards[rq->shard].size;
  uint64_t lo = c * MF_CHUNK_BYTES, hi = (c + k) * MF_CHUNK_BYTES < size ? (c + k) * MF_CHUNK_BYTES : size;
  for (int attempt = 0;; attempt++) {
    int rc = rck_read(r, rq->shard, lo, hi - lo, buf, rq->cancel, err);
    if (rc != 0) return rc;
    uint64_t bad = UINT64_MAX;
    for (uint64_t j = c; j < c + k && bad == UINT64_MAX; j++) {
      uint64_t a = j * MF_CHUNK_BYTES, b = a + MF_CHUNK_BYTES < size ? a + MF_CHUNK_BYTES : size;
      unsigned char d[MF_DIGEST_BYTES];
      mf_digest(buf + (a - lo), (size_t)(b - a), d);
      if (memcmp(d, f->chunks[j], MF_DIGEST_BYTES) != 0) bad = j;
    }
    if (rq->checks != NULL) rq->checks[0] += bad == UINT64_MAX || attempt > 0 ? k : 0;
    if (bad == UINT64_MAX) return 0;
    if (rq->checks != NULL && attempt == 0) rq->checks[1]++;
    uint64_t a = bad * MF_CHUNK_BYTES, b = a + MF_CHUNK_BYTES < size ? a + MF_CHUNK_BYTES : size;
    if (attempt > 0)
      return err_set(err, WEIGHTD_E_BAD_CHECKSUM,
                     "%s: %s: bytes %llu-%llu (manifest chunk %llu) differ from %s, fetched twice", r->name,
                     r->ck->shards[rq->shard].rel, (unsigned long long)a, (unsigned long long)(b - 1),
                     (unsigned long long)bad, MF_FILE_NAME);
    log_msg(LOG_WARN, "%s: %s: bytes %llu-%llu (manifest chunk %llu) differ from %s: fetching them again", r->name,
            r->ck->shards[rq->shard].rel, (unsigned long long)a, (unsigned long long)(b - 1), (unsigned long long)bad,
            MF_FILE_NAME);
  }
}

/*
 * rq read as whole manifest chunks, REMOTE_CHECK_CHUNKS at a time, each
 * checked before its bytes are copied out: all the chunks of the span when
 * rows are at most a chunk apart, else only those each row touches.
 */
static int read_checked(const struct rck *r, const struct ld_read *rq, struct wd_error *err) {
  unsigned char *buf = malloc((size_t)(REMOTE_CHECK_CHUNKS * MF_CHUNK_BYTES));
  if (buf == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory for a checked read");
  uint64_t span_end = rq->off + (rq->height - 1) * rq->pitch + rq->width;
  uint64_t have = UINT64_MAX, have_k = 0; /* the chunks in buf: [have, have + have_k) */
  int rc = 0;
  for (uint64_t i = 0; i < rq->height && rc == 0; i++) {
    uint64_t lo = rq->off + i * rq->pitch, hi = lo + rq->width;
    while (lo < hi && rc == 0) {
      uint64_t c = lo / MF_CHUNK_BYTES;
      if (have == UINT64_MAX || c < have || c >= have + have_k) {
        uint64_t until = rq->height == 1 || rq->pitch <= MF_CHUNK_BYTES ? span_end : hi; /* the chunks still needed */
        uint64_t k = (until - 1) / MF_CHUNK_BYTES - c + 1;
        if (k > REMOTE_CHECK_CHUNKS) k = REMOTE_CHECK_CHUNKS;
        have = UINT64_MAX;
        if ((rc = fetch_checked(r, rq, c, k, buf, err)) != 0) break;
        have = c;
        have_k = k;
      }
      uint64_t end = (have + have_k) * MF_CHUNK_BYTES < hi ? (have + have_k) * MF_CHUNK_BYTES : hi;
      memcpy(rq->dst + i * rq->width + (lo - (rq->off + i * rq->pitch)), buf + (lo - have * MF_CHUNK_BYTES),
             (size_t)(end - lo));
      lo = end;
    }
  }
  free(buf);
  return rc;
}

/* ---- reads ---------------------------------------------------------------------------------- */

static int remote_read(void *ctx, const struct ld_read *rq, struct wd_error *err) {
  const struct rck *r = ctx;
  if (rq->height == 0 || rq->width == 0) return 0;
  int rc = ld_read_check(r->ck, rq, err);
  if (rc != 0) return rc;
  if (r->ck->manifest != NULL) {
    rc = read_checked(r, rq, err);
    if (rc == 0 && rq->counts != NULL) rq->counts[LD_SOURCE_REMOTE] += rq->width * rq->height;
    return rc;
  }
  if (rq->height == 1 || rq->pitch == rq->width) {
    rc = rck_read(r, rq->shard, rq->off, rq->width * rq->height, rq->dst, rq->cancel, err);
  } else if (rq->pitch > REMOTE_BOUNCE) { /* rows so far apart that each is a large read of its own */
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

/* Orders a batch's extents by shard, then file offset (qsort over struct batch_ext). */
struct batch_ext {
  uint32_t shard;
  struct rf_extent e;
};

static int batch_cmp(const void *pa, const void *pb) {
  const struct batch_ext *a = pa, *b = pb;
  if (a->shard != b->shard) return a->shard < b->shard ? -1 : 1;
  return a->e.off < b->e.off ? -1 : a->e.off > b->e.off;
}

/*
 * A fill task's contiguous reads at once: sorted by shard and offset, each
 * shard's reads handed to the engine as one vectored read, which fetches
 * reads that touch in the file as one run (fetch.h's merge rule: parts of
 * part_bytes, no byte outside the reads). With a manifest each read is
 * checked on its own (read_checked fetches whole chunks already).
 */
static int remote_readv(void *ctx, const struct ld_read *rq, size_t n, struct wd_error *err) {
  const struct rck *r = ctx;
  int rc = 0;
  if (r->ck->manifest != NULL) {
    for (size_t i = 0; i < n && rc == 0; i++) rc = remote_read(ctx, &rq[i], err);
    return rc;
  }
  struct batch_ext *b = malloc((n ? n : 1) * sizeof *b);
  struct rf_extent *ext = malloc((n ? n : 1) * sizeof *ext);
  if (b == NULL || ext == NULL) {
    free(b);
    free(ext);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory for %zu reads", n);
  }
  size_t k = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    uint64_t len = rq[i].width * rq[i].height;
    if (len == 0) continue;
    if ((rc = ld_read_check(r->ck, &rq[i], err)) != 0) break;
    if (rq[i].height > 1 && rq[i].pitch != rq[i].width) { /* the contract (source.h): readv takes runs of bytes */
      rc = err_set(err, WEIGHTD_E_INTERNAL, "%s: a strided read reached the remote source's readv", r->name);
      break;
    }
    b[k++] = (struct batch_ext){.shard = rq[i].shard, .e = {.off = rq[i].off, .len = len, .dst = rq[i].dst}};
    bytes += len;
  }
  if (rc == 0) qsort(b, k, sizeof *b, batch_cmp);
  for (size_t i = 0; i < k && rc == 0;) { /* shard by shard; a batch's reads share one reader's cancel and counts */
    uint32_t shard = b[i].shard;
    size_t m = 0;
    for (; i < k && b[i].shard == shard; i++) ext[m++] = b[i].e;
    rc = rck_readv(r, shard, ext, m, rq[0].cancel, err);
  }
  free(ext);
  free(b);
  if (rc == 0 && n > 0 && rq[0].counts != NULL) rq[0].counts[LD_SOURCE_REMOTE] += bytes;
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
    .readv = remote_readv,
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
