/*
 * plan_gather.c - the slab image of a plan, gathered from the shards'
 * mappings (see plan.h): the one gather routine every load method and
 * weightctl's export and verify use.
 */
#include <string.h>

#include "plan.h"

/* Copies bytes [a, b) of a piece (in output order) to out. */
static void gather_piece(const struct plan_piece *pc, const unsigned char *const *data, uint64_t a, uint64_t b,
                         unsigned char *out) {
  if (pc->src == NULL) {
    memset(out, 0, (size_t)(b - a));
    return;
  }
  const unsigned char *src = data[pc->src->shard] + pc->src->t->begin + pc->src_offset;
  if (pc->height <= 1 || pc->src_pitch == pc->width) {
    memcpy(out, src + a, (size_t)(b - a));
    return;
  }
  while (a < b) {
    uint64_t row = a / pc->width, col = a % pc->width;
    uint64_t n = pc->width - col < b - a ? pc->width - col : b - a;
    memcpy(out, src + row * pc->src_pitch + col, (size_t)n);
    out += n;
    a += n;
  }
}

void plan_gather(const struct plan *p, const unsigned char *const *data, uint64_t lo, uint64_t hi,
                 unsigned char *dst) {
  uint64_t pos = lo;
  for (const struct plan_output *o = plan_output_at(p, lo); o != NULL && o < p->outputs + p->noutputs && pos < hi;
       o++) {
    if (o->offset > pos) { /* an alignment gap */
      uint64_t gap_end = o->offset < hi ? o->offset : hi;
      memset(dst + (pos - lo), 0, (size_t)(gap_end - pos));
      pos = gap_end;
      if (pos >= hi) break;
    }
    uint64_t piece_start = o->offset;
    for (size_t k = 0; k < o->npieces && pos < hi; k++) {
      const struct plan_piece *pc = &o->pieces[k];
      uint64_t len = pc->width * pc->height, piece_end = piece_start + len;
      if (piece_end > pos) {
        uint64_t a = pos - piece_start, b = (piece_end < hi ? piece_end : hi) - piece_start;
        gather_piece(pc, data, a, b, dst + (pos - lo));
        pos = piece_start + b;
      }
      piece_start = piece_end;
    }
  }
  if (pos < hi) memset(dst + (pos - lo), 0, (size_t)(hi - pos)); /* the tail gap */
}
