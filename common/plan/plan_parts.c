/*
 * plan_parts.c - outputs made of parts of tensors, for the presets (see
 * plan_build.h): concatenation and expert stacking along dimension 0, the
 * FP8 block scales that follow their weights block by block, and the
 * tensor-parallel ranges that parts are cut to.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan_build.h"

const struct ckpt_ref *plan_scale_of(struct plan_builder *b, const struct ckpt_ref *w) {
  if (w == NULL || b->block_n == 0) return NULL;
  return plan_find(b, "%s_scale_inv", w->t->name);
}

/* ceil(a / d) for d > 0, without overflow. */
static uint64_t ceil_div(uint64_t a, uint64_t d) { return a / d + (a % d != 0); }

/*
 * The block rows covering rows [a, e) of dimension dim of a weight with that
 * dimension's size n: [a/B, ceil(e/B)), which needs a on a block boundary and
 * e on one or at the end.
 */
static int block_range(struct plan_builder *b, const struct ckpt_ref *w, unsigned dim, uint64_t a, uint64_t e,
                       uint64_t *ba, uint64_t *be) {
  uint64_t blk = dim == 0 ? b->block_n : b->block_k, n = w->t->shape[dim];
  if (a % blk != 0 || (e % blk != 0 && e != n))
    return plan_fail(b, "tensor '%s': slice [%" PRIu64 ", %" PRIu64 ") of dimension %u does not fall on %" PRIu64
                        "-wide FP8 blocks (its weight_scale_inv cannot be sliced with it)",
                     w->t->name, a, e, dim, blk);
  *ba = a / blk;
  *be = ceil_div(e, blk);
  return 0;
}

/* The scale output's name: "...weight" + "_scale_inv", else name + ".weight_scale_inv". */
static int scale_name(struct plan_builder *b, const char *name, char *out, size_t len) {
  size_t nl = strlen(name);
  bool weight = nl >= 6 && strcmp(name + nl - 6, "weight") == 0;
  int n = snprintf(out, len, "%s%s", name, weight ? "_scale_inv" : ".weight_scale_inv");
  if (n < 0 || (size_t)n >= len) return plan_fail(b, "output '%s': its scale's name is too long", name);
  return 0;
}

/* The scales of parts[0..nparts), cut to the blocks of the parts' rows, emitted as `name`'s scale. */
static int emit_scales(struct plan_builder *b, const char *name, const struct plan_part *parts, size_t nparts,
                       size_t group, bool stacked) {
  struct plan_part *sp = calloc(nparts, sizeof *sp);
  if (sp == NULL) return plan_nomem(b);
  int rc = 0;
  for (size_t i = 0; i < nparts && rc == 0; i++) {
    const struct ckpt_ref *s = plan_scale_of(b, parts[i].t);
    if (s == NULL) {
      rc = plan_fail(b, "'%s' has a weight_scale_inv but '%s', fused with it, has none", parts[0].t->t->name,
                     parts[i].t->t->name);
      break;
    }
    sp[i] = (struct plan_part){s, parts[i].dim, 0, 0};
    rc = block_range(b, parts[i].t, parts[i].dim, parts[i].a, parts[i].b, &sp[i].a, &sp[i].b);
    /* Concatenated parts keep their scale blocks apart only if all but a group's last fill whole blocks. */
    if (rc == 0 && group > 1 && (i + 1) % group != 0 && (parts[i].b - parts[i].a) % b->block_n != 0)
      rc = plan_fail(b, "output '%s': '%s' contributes %" PRIu64 " rows, not a multiple of the %" PRIu64
                        "-row FP8 block, so the blocks of what follows would straddle it",
                     name, parts[i].t->t->name, parts[i].b - parts[i].a, b->block_n);
  }
  char sname[512];
  if (rc == 0) rc = scale_name(b, name, sname, sizeof sname);
  if (rc == 0) rc = plan_emit_parts(b, sname, sp, nparts, group, stacked);
  free(sp);
  return rc;
}

int plan_emit_parts(struct plan_builder *b, const char *name, const struct plan_part *parts, size_t nparts,
                    size_t group, bool stacked) {
  const struct st_tensor *t0 = parts[0].t->t;
  unsigned ndim = t0->ndim ? t0->ndim : 1;
  uint64_t shape[PLAN_MAX_DIMS] = {0};
  if (ndim + 1 > PLAN_MAX_DIMS) return plan_fail(b, "tensor '%s' has too many dimensions for a plan", t0->name);
  /* The first dimension adds up over one group; the others are the parts' own (after slicing). */
  uint64_t rows = 0;
  for (size_t i = 0; i < group; i++) {
    const struct plan_part *pt = &parts[i];
    if (pt->t->t->ndim != t0->ndim)
      return plan_fail(b, "output '%s': '%s' and '%s' differ in rank", name, t0->name, pt->t->t->name);
    uint64_t n = pt->dim == 0 ? pt->b - pt->a : (pt->t->t->ndim ? pt->t->t->shape[0] : 1);
    if (__builtin_add_overflow(rows, n, &rows)) return plan_fail(b, "output '%s': its rows overflow 64 bits", name);
  }
  for (unsigned d = 1; d < ndim; d++) shape[d] = t0->shape[d];
  if (parts[0].dim != 0 && parts[0].dim < ndim) shape[parts[0].dim] = parts[0].b - parts[0].a;
  shape[0] = rows;
  int rc;
  if (stacked) { /* [nparts/group, rows, ...] */
    memmove(shape + 1, shape, ndim * sizeof *shape);
    shape[0] = nparts / group;
    rc = plan_out_begin(b, name, t0->dtype, ndim + 1, shape);
  } else {
    rc = plan_out_begin(b, name, t0->dtype, t0->ndim ? ndim : 0, shape);
  }
  for (size_t i = 0; rc == 0 && i < nparts; i++) rc = plan_out_slice(b, parts[i].t, parts[i].dim, parts[i].a, parts[i].b);
  if (rc == 0) rc = plan_out_end(b);
  if (rc != 0) return rc;
  /* FP8: the scales follow their weights block by block. */
  return plan_scale_of(b, parts[0].t) != NULL ? emit_scales(b, name, parts, nparts, group, stacked) : 0;
}

int plan_emit_whole(struct plan_builder *b, const struct ckpt_ref *t) {
  if (t == NULL) return 0;
  struct plan_part pt = {t, 0, 0, t->t->ndim ? t->t->shape[0] : 1};
  return plan_emit_parts(b, t->t->name, &pt, 1, 1, false);
}

int plan_split_range(struct plan_builder *b, const struct ckpt_ref *t, unsigned dim, uint64_t parts, uint64_t r,
                     uint64_t unit, uint64_t *a, uint64_t *e) {
  if (dim >= t->t->ndim) return plan_fail(b, "tensor '%s' has no dimension %u to split", t->t->name, dim);
  uint64_t n = t->t->shape[dim];
  if (unit == 0 || n % unit != 0 || (n / unit) % parts != 0)
    return plan_fail(b, "tensor '%s': dimension %u (%" PRIu64 ") does not split into %" PRIu64 " equal parts%s",
                     t->t->name, dim, n, parts, unit > 1 ? " of whole heads" : "");
  uint64_t per = n / unit / parts * unit;
  *a = r * per;
  *e = *a + per;
  return 0;
}

int plan_emit_split(struct plan_builder *b, const struct ckpt_ref *t, unsigned dim, uint64_t unit) {
  if (t == NULL) return 0;
  struct plan_part pt = {t, dim, 0, 0};
  int rc = plan_split_range(b, t, dim, b->spec->tp_size, b->spec->tp_rank, unit, &pt.a, &pt.b);
  return rc ? rc : plan_emit_parts(b, t->t->name, &pt, 1, 1, false);
}
