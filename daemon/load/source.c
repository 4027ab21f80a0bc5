/*
 * source.c - what every source shares (see source.h): the names of the
 * kinds and choices, the calls with their defaults for operations a source
 * leaves NULL, and the reader that turns a plan's reads into source reads.
 * No state of its own.
 */
#include "source.h"

#include <stdlib.h>
#include <string.h>

static const char *const kind_names[LD_SOURCE_KINDS] = {
    [LD_SOURCE_MMAP] = "mmap",
    [LD_SOURCE_PAGECACHE] = "pagecache",
    [LD_SOURCE_DIRECT] = "direct",
    [LD_SOURCE_ROUTE] = "route",
    [LD_SOURCE_REMOTE] = "remote",
};

static const char *const choice_names[LD_CHOOSE_COUNT] = {
    [LD_CHOOSE_AUTO] = "auto",
    [LD_CHOOSE_MMAP] = "mmap",
    [LD_CHOOSE_DIRECT] = "direct",
};

const char *ld_source_kind_name(enum ld_source_kind k) {
  return (unsigned)k < LD_SOURCE_KINDS && kind_names[k] != NULL ? kind_names[k] : "?";
}

const char *ld_source_choice_name(enum ld_source_choice c) {
  return (unsigned)c < LD_CHOOSE_COUNT ? choice_names[c] : "?";
}

int ld_source_choice_parse(const char *name, enum ld_source_choice *out) {
  for (int i = 0; i < LD_CHOOSE_COUNT; i++)
    if (strcmp(name, choice_names[i]) == 0) {
      *out = (enum ld_source_choice)i;
      return 0;
    }
  return -1;
}

uint64_t ld_source_holds(const struct ld_source *s, uint32_t shard, uint64_t off, uint64_t len) {
  return s->ops->holds != NULL ? s->ops->holds(s->ctx, shard, off, len) : len;
}

int ld_read_check(const struct ckpt *ck, const struct ld_read *rq, struct wd_error *err) {
  uint64_t span = (rq->height - 1) * rq->pitch + rq->width;
  if (rq->shard < ck->nshards && rq->off <= ck->shards[rq->shard].size && span <= ck->shards[rq->shard].size - rq->off)
    return 0;
  return err_set(err, WEIGHTD_E_INTERNAL, "%s: a read of %llu bytes at %llu lies outside the file",
                 rq->shard < ck->nshards ? ck->shards[rq->shard].rel : "?", (unsigned long long)span,
                 (unsigned long long)rq->off);
}

const unsigned char *ld_source_map(const struct ld_source *s, uint32_t shard) {
  return s->ops->map != NULL ? s->ops->map(s->ctx, shard) : NULL;
}

int ld_source_unchanged(const struct ld_source *s, struct wd_error *err) {
  return s->ops->unchanged != NULL ? s->ops->unchanged(s->ctx, err) : 0;
}

int ld_source_prefetch(const struct ld_source *s, uint32_t shard, uint64_t off, uint64_t len,
                       void (*seen)(void *arg, const unsigned char *p, size_t n), void *arg, struct wd_error *err) {
  return s->ops->prefetch != NULL ? s->ops->prefetch(s->ctx, shard, off, len, seen, arg, err) : 0;
}

void ld_source_advise(const struct ld_source *s, const struct plan_range *ranges, size_t n) {
  if (s->ops->advise != NULL) s->ops->advise(s->ctx, ranges, n);
}

void ld_source_close(struct ld_source *s) {
  if (s == NULL) return;
  if (s->ops->destroy != NULL) s->ops->destroy(s->ctx);
  free(s);
}

uint64_t ld_piece_file_off(const struct ckpt *ck, const struct plan_piece *pc) {
  return ck->shards[pc->src->shard].hdr->data_start + pc->src->t->begin + pc->src_offset;
}

/* ---- reading plans through a source ------------------------------------------------ */

int ld_reader_read(void *arg, const struct plan_read *rd) {
  struct ld_reader *r = arg;
  const struct ckpt *ck = r->src->ck;
  if (rd->shard >= ck->nshards) return err_set(&r->err, WEIGHTD_E_INTERNAL, "a read of shard %u of %zu", rd->shard, ck->nshards);
  struct ld_read rq = {.shard = rd->shard,
                       .off = ck->shards[rd->shard].hdr->data_start + rd->off,
                       .width = rd->width,
                       .pitch = rd->pitch,
                       .height = rd->height,
                       .dst = rd->dst,
                       .copy = r->copy,
                       .slack = rd->slack,
                       .counts = r->counts,
                       .cancel = r->cancel,
                       .checks = r->checks};
  if (r->src->ops->readv != NULL && (rq.height == 1 || rq.pitch == rq.width)) {
    if (r->queued == r->cap) {
      size_t cap = r->cap ? r->cap * 2 : 64;
      struct ld_read *q = realloc(r->queue, cap * sizeof *q);
      if (q == NULL) return err_set(&r->err, WEIGHTD_E_NOMEM, "out of memory for a fill task's reads");
      r->queue = q;
      r->cap = cap;
    }
    r->queue[r->queued++] = rq;
    return 0;
  }
  return ld_source_read(r->src, &rq, &r->err);
}

int ld_reader_flush(struct ld_reader *r) {
  size_t n = r->queued;
  r->queued = 0;
  return n > 0 ? r->src->ops->readv(r->src->ctx, r->queue, n, &r->err) : 0;
}

void ld_reader_clear(struct ld_reader *r) {
  free(r->queue);
  r->queue = NULL;
  r->queued = r->cap = 0;
}
