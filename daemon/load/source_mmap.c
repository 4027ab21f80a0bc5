/*
 * source_mmap.c - the mmap source and its pagecache view (see source.h).
 *
 * DESIGN: the mappings are made once, when the checkpoint is opened, and
 * never change until the source is closed, so readers on any thread use them
 * without locks. A read copies out of the mapping (the caller holds the
 * SIGBUS guard); a prefetch advises the kernel and touches the pages under
 * the guard itself. The pagecache view shares the mappings and asks mincore
 * what is resident; it owns nothing.
 */
#include "source.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/fault.h"

struct mmap_src {
  const struct ckpt *ck;
  void **maps; /* per shard: its read-only MAP_SHARED mapping (NULL for an empty file) */
  uint64_t page;
};

/* Copies rq out of the mappings, counting its bytes as kind's. */
static int copy_out(const struct mmap_src *m, const struct ld_read *rq, enum ld_source_kind kind, struct wd_error *err) {
  if (rq->height == 0 || rq->width == 0) return 0;
  int rc = ld_read_check(m->ck, rq, err);
  if (rc != 0) return rc;
  const unsigned char *src = (const unsigned char *)m->maps[rq->shard] + rq->off;
  void *(*copy)(void *, const void *, size_t) = rq->copy != NULL ? rq->copy : memcpy;
  if (rq->height == 1 || rq->pitch == rq->width) {
    copy(rq->dst, src, (size_t)(rq->width * rq->height));
  } else {
    for (uint64_t r = 0; r < rq->height; r++) copy(rq->dst + r * rq->width, src + r * rq->pitch, (size_t)rq->width);
  }
  if (rq->counts != NULL) rq->counts[kind] += rq->width * rq->height;
  return 0;
}

static int mmap_read(void *ctx, const struct ld_read *rq, struct wd_error *err) {
  return copy_out(ctx, rq, LD_SOURCE_MMAP, err);
}

static const unsigned char *mmap_map(void *ctx, uint32_t shard) {
  const struct mmap_src *m = ctx;
  return shard < m->ck->nshards ? m->maps[shard] : NULL;
}

/* Hands [p, p + n) to seen in pieces of at most 1 MiB: each piece's pages are faulted in as seen reads them. */
struct seen_call {
  const unsigned char *p;
  uint64_t n;
  void (*seen)(void *arg, const unsigned char *p, size_t n);
  void *arg;
};

static int seen_run(void *arg) {
  const struct seen_call *c = arg;
  for (uint64_t off = 0; off < c->n; off += 1u << 20)
    c->seen(c->arg, c->p + off, (size_t)(c->n - off < (1u << 20) ? c->n - off : (1u << 20)));
  return 0;
}

static int mmap_prefetch(void *ctx, uint32_t shard, uint64_t off, uint64_t len,
                         void (*seen)(void *arg, const unsigned char *p, size_t n), void *arg, struct wd_error *err) {
  const struct mmap_src *m = ctx;
  if (shard >= m->ck->nshards || m->maps[shard] == NULL || len == 0) return 0;
  uint64_t size = m->ck->shards[shard].size;
  if (off >= size) return 0;
  if (len > size - off) len = size - off;
  const unsigned char *p = (const unsigned char *)m->maps[shard] + off;
  struct seen_call c = {p, len, seen, arg};
  int rc = seen != NULL ? fault_call(seen_run, &c) : fault_touch(p, (size_t)len);
  if (rc != 0)
    return err_set(err, WEIGHTD_E_FAULT, "%s: the shard was truncated or became unreadable while it was read",
                   m->ck->shards[shard].rel);
  return 0;
}

static void mmap_advise(void *ctx, const struct plan_range *ranges, size_t n) {
  const struct mmap_src *m = ctx;
  for (size_t i = 0; i < n; i++) {
    const struct plan_range *g = &ranges[i];
    if (g->shard >= m->ck->nshards || m->maps[g->shard] == NULL || g->off >= m->ck->shards[g->shard].size) continue;
    uint64_t a = g->off / m->page * m->page, end = g->off + g->len;
    if (end > m->ck->shards[g->shard].size) end = m->ck->shards[g->shard].size;
    madvise((char *)m->maps[g->shard] + a, (size_t)(end - a), MADV_WILLNEED);
  }
}

static int mmap_unchanged(void *ctx, struct wd_error *err) {
  const struct mmap_src *m = ctx;
  return ckpt_check_unchanged(m->ck, err);
}

static void mmap_destroy(void *ctx) {
  struct mmap_src *m = ctx;
  if (m == NULL) return;
  for (size_t i = 0; m->maps != NULL && i < m->ck->nshards; i++)
    if (m->maps[i] != NULL) munmap(m->maps[i], m->ck->shards[i].size);
  free(m->maps);
  free(m);
}

static const struct ld_source_ops mmap_ops = {
    .kind = LD_SOURCE_MMAP,
    .read = mmap_read,
    .readv = NULL, /* a copy out of the page cache costs no round trip: one by one */
    .holds = NULL, /* every byte: the files are local */
    .map = mmap_map,
    .prefetch = mmap_prefetch,
    .advise = mmap_advise,
    .unchanged = mmap_unchanged,
    .destroy = mmap_destroy,
};

int ld_source_mmap_open(struct ckpt *ck, struct ld_source **out, struct wd_error *err) {
  *out = NULL;
  struct ld_source *s = calloc(1, sizeof *s);
  struct mmap_src *m = calloc(1, sizeof *m);
  if (s == NULL || m == NULL || (m->maps = calloc(ck->nshards ? ck->nshards : 1, sizeof *m->maps)) == NULL) {
    free(s);
    free(m);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  m->ck = ck;
  m->page = (uint64_t)sysconf(_SC_PAGESIZE);
  for (size_t i = 0; i < ck->nshards; i++) {
    if (ck->shards[i].size == 0) continue;
    void *p = mmap(NULL, ck->shards[i].size, PROT_READ, MAP_SHARED, ck->shards[i].fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      mmap_destroy(m);
      free(s);
      return err_set(err, WEIGHTD_E_IO, "%s: mmap: %s", ck->shards[i].rel, strerror(e));
    }
    m->maps[i] = p;
  }
  /* The mappings keep the files; the descriptors are no longer needed. */
  for (size_t i = 0; i < ck->nshards; i++) {
    if (ck->shards[i].fd >= 0) close(ck->shards[i].fd);
    ck->shards[i].fd = -1;
  }
  *s = (struct ld_source){.ops = &mmap_ops, .ctx = m, .ck = ck, .align = 1};
  snprintf(s->label, sizeof s->label, "%s", ld_source_kind_name(LD_SOURCE_MMAP));
  *out = s;
  return 0;
}

/* ---- the pagecache view ------------------------------------------------------------------ */

/* Bytes from off that the page cache holds now, at most len (whole pages, mincore). */
static uint64_t pagecache_holds(void *ctx, uint32_t shard, uint64_t off, uint64_t len) {
  const struct mmap_src *m = ctx;
  if (shard >= m->ck->nshards || m->maps[shard] == NULL) return 0;
  uint64_t size = m->ck->shards[shard].size;
  if (off >= size) return 0;
  if (len > size - off) len = size - off;
  enum { CHUNK_PAGES = 1024 };
  unsigned char vec[CHUNK_PAGES];
  uint64_t a = off / m->page * m->page, end = off + len, held = 0;
  while (a < end) {
    uint64_t n = (end - a + m->page - 1) / m->page;
    if (n > CHUNK_PAGES) n = CHUNK_PAGES;
    if (mincore((char *)m->maps[shard] + a, (size_t)(n * m->page > size - a ? size - a : n * m->page), vec) != 0)
      return held;
    for (uint64_t k = 0; k < n; k++) {
      if (!(vec[k] & 1)) return held;
      uint64_t page_end = a + (k + 1) * m->page;
      held = (page_end < end ? page_end : end) - off;
    }
    a += n * m->page;
  }
  return held;
}

static int pagecache_read(void *ctx, const struct ld_read *rq, struct wd_error *err) {
  return copy_out(ctx, rq, LD_SOURCE_PAGECACHE, err);
}

static const struct ld_source_ops pagecache_ops = {
    .kind = LD_SOURCE_PAGECACHE,
    .read = pagecache_read,
    .readv = NULL, /* as mmap */
    .holds = pagecache_holds,
    .map = NULL,      /* a view for reads only: the mmap source maps */
    .prefetch = NULL, /* it holds what is warm; warming is the mmap source's */
    .advise = NULL,
    .unchanged = mmap_unchanged,
    .destroy = NULL, /* the mmap source owns the mappings */
};

int ld_source_pagecache_open(const struct ld_source *m, struct ld_source **out, struct wd_error *err) {
  *out = NULL;
  if (m->ops != &mmap_ops) return err_set(err, WEIGHTD_E_INTERNAL, "a pagecache view needs an mmap source");
  struct ld_source *s = calloc(1, sizeof *s);
  if (s == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  *s = (struct ld_source){.ops = &pagecache_ops, .ctx = m->ctx, .ck = m->ck, .align = 1};
  snprintf(s->label, sizeof s->label, "%s", ld_source_kind_name(LD_SOURCE_PAGECACHE));
  *out = s;
  return 0;
}
