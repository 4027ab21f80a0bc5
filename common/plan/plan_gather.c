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

/* ---- reading the image ---------------------------------------------------------- */

struct image {
  uint64_t lo;
  unsigned char *dst;
  plan_read_fn read;
  void *arg;
};

static int image_segment(void *arg, const struct plan_segment *sg) {
  const struct image *g = arg;
  unsigned char *out = g->dst + (sg->dst - g->lo);
  if (sg->pc == NULL) {
    memset(out, 0, (size_t)(sg->width * sg->height));
    return 0;
  }
  const struct plan_piece *pc = sg->pc;
  struct plan_read rd = {.shard = pc->src->shard,
                         .off = pc->src->t->begin + pc->src_offset + sg->src,
                         .width = sg->width,
                         .pitch = sg->height > 1 ? sg->src_pitch : sg->width,
                         .height = sg->height,
                         .dst = out};
  return g->read(g->arg, &rd);
}

int plan_image_read(const struct plan *p, uint64_t lo, uint64_t hi, unsigned char *dst, plan_read_fn read, void *arg) {
  struct image g = {lo, dst, read, arg};
  return plan_segments(p, lo, hi, image_segment, &g);
}

/* ---- gathering from mappings ------------------------------------------------------ */

int plan_map_read(void *arg, const struct plan_read *rd) {
  const struct plan_maps *m = arg;
  const unsigned char *src = m->data[rd->shard] + rd->off;
  plan_copy_fn copy = m->copy != NULL ? m->copy : memcpy;
  if (rd->height <= 1 || rd->pitch == rd->width) {
    copy(rd->dst, src, (size_t)(rd->width * rd->height));
    return 0;
  }
  for (uint64_t r = 0; r < rd->height; r++) copy(rd->dst + r * rd->width, src + r * rd->pitch, (size_t)rd->width);
  return 0;
}

void plan_gather_with(const struct plan *p, const unsigned char *const *data, uint64_t lo, uint64_t hi,
                      unsigned char *dst, plan_copy_fn copy) {
  struct plan_maps m = {data, copy};
  plan_image_read(p, lo, hi, dst, plan_map_read, &m);
}

void plan_gather(const struct plan *p, const unsigned char *const *data, uint64_t lo, uint64_t hi,
                 unsigned char *dst) {
  plan_gather_with(p, data, lo, hi, dst, memcpy);
}
