/*
 * plan_ranges.c - the byte ranges of the shard files a plan reads (see
 * plan.h): what pinning and prefetching per plan register and read.
 */
#include <stdlib.h>

#include "plan.h"

static int cmp_range(const void *a, const void *b) {
  const struct plan_range *x = a, *y = b;
  if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
  if (x->off != y->off) return x->off < y->off ? -1 : 1;
  return 0;
}

int plan_ranges(const struct plan *p, const struct ckpt *c, uint64_t page, uint64_t gap, struct plan_range **out,
                size_t *n, struct wd_error *err) {
  *out = NULL;
  *n = 0;
  size_t cap = 0;
  for (size_t i = 0; i < p->noutputs; i++) cap += p->outputs[i].npieces;
  if (cap == 0) return 0;
  struct plan_range *v = malloc(cap * sizeof *v);
  if (v == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory listing a plan's byte ranges");
  size_t k = 0;
  for (size_t i = 0; i < p->noutputs; i++)
    for (size_t j = 0; j < p->outputs[i].npieces; j++) {
      const struct plan_piece *pc = &p->outputs[i].pieces[j];
      if (pc->src == NULL || pc->width == 0 || pc->height == 0) continue;
      const struct ckpt_shard *sh = &c->shards[pc->src->shard];
      /* The plan was built with checked sums, so the span lies inside the file. */
      uint64_t a = sh->hdr->data_start + pc->src->t->begin + pc->src_offset;
      uint64_t b = a + (pc->height - 1) * pc->src_pitch + pc->width;
      a &= ~(page - 1);
      b = (b + page - 1) & ~(page - 1);
      if (b > sh->size) b = sh->size;
      v[k++] = (struct plan_range){pc->src->shard, a, b - a};
    }
  if (k == 0) {
    free(v);
    return 0;
  }
  qsort(v, k, sizeof *v, cmp_range);
  size_t m = 0;
  for (size_t i = 1; i < k; i++) {
    struct plan_range *last = &v[m];
    uint64_t end = last->off + last->len;
    if (v[i].shard == last->shard && v[i].off <= end + gap) {
      uint64_t e2 = v[i].off + v[i].len;
      if (e2 > end) last->len = e2 - last->off;
    } else {
      v[++m] = v[i];
    }
  }
  *n = m + 1;
  struct plan_range *shrunk = realloc(v, *n * sizeof *v);
  *out = shrunk != NULL ? shrunk : v;
  return 0;
}

uint64_t plan_ranges_bytes(const struct plan_range *r, size_t n) {
  uint64_t b = 0;
  for (size_t i = 0; i < n; i++) b += r[i].len;
  return b;
}
