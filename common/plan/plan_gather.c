/*
 * plan_gather.c - the slab image of a plan, cut into segments (plan_segments)
 * and gathered from the shards' mappings (see plan.h): the one walk of the
 * image that every load method and weightctl's export and verify use.
 */
#include <string.h>

#include "plan.h"

/* Gives fn the segments of bytes [a, b) of piece pc, whose first byte is at slab offset base. */
static int piece_segments(const struct plan_piece *pc, uint64_t base, uint64_t a, uint64_t b, plan_segment_fn fn,
                          void *arg) {
  struct plan_segment sg = {.pc = pc->src != NULL ? pc : NULL, .dst = base + a, .src = a, .width = b - a, .height = 1};
  if (pc->src == NULL || pc->height <= 1 || pc->src_pitch == pc->width) return fn(arg, &sg);
  uint64_t w = pc->width;
  int rc = 0;
  if (a % w != 0) { /* the end of a row */
    uint64_t n = w - a % w < b - a ? w - a % w : b - a;
    sg.src = (a / w) * pc->src_pitch + a % w;
    sg.width = n;
    rc = fn(arg, &sg);
    a += n;
  }
  if (rc == 0 && b - a >= w) { /* whole rows */
    struct plan_segment rows = {.pc = pc, .dst = base + a, .src = (a / w) * pc->src_pitch, .src_pitch = pc->src_pitch,
                                .width = w, .height = (b - a) / w};
    rc = fn(arg, &rows);
    a += rows.height * w;
  }
  if (rc == 0 && a < b) { /* the start of a row */
    struct plan_segment head = {.pc = pc, .dst = base + a, .src = (a / w) * pc->src_pitch, .width = b - a, .height = 1};
    rc = fn(arg, &head);
  }
  return rc;
}

static int zero_segment(uint64_t at, uint64_t n, plan_segment_fn fn, void *arg) {
  struct plan_segment sg = {.pc = NULL, .dst = at, .width = n, .height = 1};
  return fn(arg, &sg);
}

int plan_segments(const struct plan *p, uint64_t lo, uint64_t hi, plan_segment_fn fn, void *arg) {
  uint64_t pos = lo;
  int rc = 0;
  for (const struct plan_output *o = plan_output_at(p, lo);
       rc == 0 && o != NULL && o < p->outputs + p->noutputs && pos < hi; o++) {
    if (o->offset > pos) { /* an alignment gap */
      uint64_t gap_end = o->offset < hi ? o->offset : hi;
      rc = zero_segment(pos, gap_end - pos, fn, arg);
      pos = gap_end;
      if (pos >= hi) break;
    }
    uint64_t piece_start = o->offset;
    for (size_t k = 0; k < o->npieces && pos < hi && rc == 0; k++) {
      const struct plan_piece *pc = &o->pieces[k];
      uint64_t len = pc->width * pc->height, piece_end = piece_start + len;
      if (piece_end > pos) {
        uint64_t a = pos - piece_start, b = (piece_end < hi ? piece_end : hi) - piece_start;
        rc = piece_segments(pc, piece_start, a, b, fn, arg);
        pos = piece_start + b;
      }
      piece_start = piece_end;
    }
  }
  if (rc == 0 && pos < hi) rc = zero_segment(pos, hi - pos, fn, arg); /* the tail gap */
  return rc;
}

/* ---- gathering ---------------------------------------------------------------- */

struct gather {
  const unsigned char *const *data;
  uint64_t lo;
  unsigned char *dst;
  plan_copy_fn copy;
};

static int gather_segment(void *arg, const struct plan_segment *sg) {
  const struct gather *g = arg;
  unsigned char *out = g->dst + (sg->dst - g->lo);
  if (sg->pc == NULL) {
    memset(out, 0, (size_t)(sg->width * sg->height));
    return 0;
  }
  const struct plan_piece *pc = sg->pc;
  const unsigned char *src = g->data[pc->src->shard] + pc->src->t->begin + pc->src_offset + sg->src;
  if (sg->height == 1) {
    g->copy(out, src, (size_t)sg->width);
    return 0;
  }
  for (uint64_t r = 0; r < sg->height; r++) g->copy(out + r * sg->width, src + r * sg->src_pitch, (size_t)sg->width);
  return 0;
}

void plan_gather_with(const struct plan *p, const unsigned char *const *data, uint64_t lo, uint64_t hi,
                      unsigned char *dst, plan_copy_fn copy) {
  struct gather g = {data, lo, dst, copy};
  plan_segments(p, lo, hi, gather_segment, &g);
}

void plan_gather(const struct plan *p, const unsigned char *const *data, uint64_t lo, uint64_t hi,
                 unsigned char *dst) {
  plan_gather_with(p, data, lo, hi, dst, memcpy);
}
