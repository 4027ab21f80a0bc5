/*
 * plan_out.c - the plan builder's primitives (see plan_build.h): failing,
 * finding a checkpoint tensor, turning "rows [a, b) of dimension d of tensor
 * T" into a 2D byte piece with every check (bounds, sub-byte dtypes,
 * overflow), and outputs that concatenate pieces and must be filled exactly
 * by them. Every way of building a plan (plan.c's explicit plans,
 * plan_presets.c through plan_parts.c) goes through these; they call
 * nothing above them.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan_build.h"

/* ---- builder helpers ------------------------------------------------------------- */

int plan_fail(struct plan_builder *b, const char *fmt, ...) {
  char msg[WD_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return err_set(b->err, WEIGHTD_E_BAD_PLAN, "%s", msg);
}

int plan_nomem(struct plan_builder *b) { return err_set(b->err, WEIGHTD_E_NOMEM, "out of memory building a plan"); }

const struct ckpt_ref *plan_find(struct plan_builder *b, const char *fmt, ...) {
  char name[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(name, sizeof name, fmt, ap);
  va_end(ap);
  return n >= 0 && (size_t)n < sizeof name ? ckpt_tensor_find(b->c, name) : NULL;
}

void plan_mark_used(struct plan_builder *b, const struct ckpt_ref *r) {
  if (r != NULL) b->used[r - b->c->by_name] = 1;
}

/* The product of shape[from..to) into *out; false when it overflows 64 bits. */
static bool dims_product(const uint64_t *shape, unsigned from, unsigned to, uint64_t *out) {
  uint64_t n = 1;
  for (unsigned d = from; d < to; d++)
    if (__builtin_mul_overflow(n, shape[d], &n)) return false;
  *out = n;
  return true;
}

/* a * b * c into *out; false when it overflows 64 bits. */
static bool mul3(uint64_t a, uint64_t b, uint64_t c, uint64_t *out) {
  return !__builtin_mul_overflow(a, b, out) && !__builtin_mul_overflow(*out, c, out);
}

/* ---- pieces -------------------------------------------------------------------------- */

/*
 * The tensor viewed as [outer, shape[dim], inner] gives `outer` rows of
 * (end - start) * inner elements, shape[dim] * inner apart.
 */
int plan_piece_slice(struct plan_builder *b, const struct ckpt_ref *r, uint64_t dim, uint64_t start,
                     uint64_t end, struct plan_piece *out) {
  const struct st_tensor *t = r->t;
  uint64_t all = t->end - t->begin;
  if (t->ndim == 0) {
    if (dim != 0 || start != 0 || end != 1)
      return plan_fail(b, "tensor '%s' is a scalar and cannot be sliced", t->name);
    *out = (struct plan_piece){r, 0, all, all, 1, 0, 0, 1};
    return 0;
  }
  if (dim >= t->ndim)
    return plan_fail(b, "tensor '%s' has %u dimensions, no dimension %" PRIu64, t->name, t->ndim, dim);
  unsigned d = (unsigned)dim;
  if (start > end || end > t->shape[d])
    return plan_fail(b, "tensor '%s': rows [%" PRIu64 ", %" PRIu64 ") of dimension %u exceed its size %" PRIu64,
                     t->name, start, end, d, t->shape[d]);
  if (d == 0 && start == 0 && end == t->shape[0]) { /* the whole tensor (whole bytes, as validated) */
    *out = (struct plan_piece){r, 0, all, all, all ? 1 : 0, 0, 0, t->shape[0]};
    return 0;
  }
  uint64_t outer, inner, bits = dtype_bits(t->dtype), row_bits, off_bits, pitch_bits;
  if (!dims_product(t->shape, 0, d, &outer) || !dims_product(t->shape, d + 1, t->ndim, &inner) ||
      !mul3(end - start, inner, bits, &row_bits) || !mul3(start, inner, bits, &off_bits) ||
      !mul3(t->shape[d], inner, bits, &pitch_bits))
    return plan_fail(b, "tensor '%s': slicing dimension %u of its shape overflows 64 bits", t->name, d);
  if (row_bits % 8 || off_bits % 8 || pitch_bits % 8)
    return plan_fail(b, "tensor '%s' (%s): slice [%" PRIu64 ", %" PRIu64 ") of dimension %u does not cover whole bytes",
                     t->name, dtype_name(t->dtype), start, end, d);
  if (start == 0 && end == t->shape[d]) { /* the whole tensor along a later dimension */
    *out = (struct plan_piece){r, 0, all, all, all ? 1 : 0, 0, 0, t->shape[0]};
    return 0;
  }
  *out = (struct plan_piece){r, off_bits / 8, row_bits / 8, pitch_bits / 8, outer, d, start, end};
  if (out->width == 0 || outer == 0) out->height = 0;
  if (out->height == 1) out->src_pitch = out->width;
  return 0;
}

/* ---- outputs --------------------------------------------------------------------------- */

int plan_out_begin(struct plan_builder *b, const char *name, enum wd_dtype dtype, unsigned ndim,
                   const uint64_t *shape) {
  struct plan *p = b->p; /* names are checked for repeats once, at the end (check_names) */
  if (ndim > PLAN_MAX_DIMS) return plan_fail(b, "output '%s': more than %u dimensions", name, PLAN_MAX_DIMS);
  if (p->noutputs == b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 64;
    struct plan_output *n = realloc(p->outputs, cap * sizeof *n);
    if (n == NULL) return plan_nomem(b);
    p->outputs = n;
    b->cap = cap;
  }
  struct plan_output *o = &p->outputs[p->noutputs];
  memset(o, 0, sizeof *o);
  o->name = strdup(name);
  o->shape = malloc((ndim ? ndim : 1) * sizeof *o->shape);
  if (o->name == NULL || o->shape == NULL) {
    free(o->name);
    free(o->shape);
    return plan_nomem(b);
  }
  p->noutputs++;
  o->dtype = dtype;
  o->ndim = ndim;
  memcpy(o->shape, shape, ndim * sizeof *shape);
  uint64_t elems, bits;
  if (!dims_product(shape, 0, ndim, &elems) || __builtin_mul_overflow(elems, (uint64_t)dtype_bits(dtype), &bits))
    return plan_fail(b, "output '%s': its size overflows 64 bits", name);
  if (bits % 8) return plan_fail(b, "output '%s': shape is not a whole number of bytes of %s", name, dtype_name(dtype));
  o->nbytes = bits / 8;
  b->cur = o;
  b->piece_cap = 0;
  b->cur_bytes = 0;
  return 0;
}

int plan_out_add(struct plan_builder *b, const struct plan_piece *pc) {
  struct plan_output *o = b->cur;
  if (pc->src != NULL && pc->src->t->dtype != o->dtype)
    return plan_fail(b, "output '%s' is %s but its piece from '%s' is %s", o->name, dtype_name(o->dtype),
                     pc->src->t->name, dtype_name(pc->src->t->dtype));
  if (o->npieces == b->piece_cap) {
    size_t cap = b->piece_cap ? b->piece_cap * 2 : 4;
    struct plan_piece *n = realloc(o->pieces, cap * sizeof *n);
    if (n == NULL) return plan_nomem(b);
    o->pieces = n;
    b->piece_cap = cap;
  }
  o->pieces[o->npieces++] = *pc;
  uint64_t bytes;
  if (__builtin_mul_overflow(pc->width, pc->height, &bytes) || __builtin_add_overflow(b->cur_bytes, bytes, &b->cur_bytes) ||
      b->cur_bytes > o->nbytes)
    return plan_fail(b, "output '%s': its pieces hold more bytes than its shape", o->name);
  plan_mark_used(b, pc->src);
  return 0;
}

int plan_out_slice(struct plan_builder *b, const struct ckpt_ref *r, uint64_t dim, uint64_t start, uint64_t end) {
  struct plan_piece pc;
  int rc = plan_piece_slice(b, r, dim, start, end, &pc);
  return rc ? rc : plan_out_add(b, &pc);
}

int plan_out_zeros(struct plan_builder *b, uint64_t rows) {
  struct plan_output *o = b->cur;
  uint64_t inner, bits;
  if (!dims_product(o->shape, 1, o->ndim, &inner) || !mul3(rows, inner, dtype_bits(o->dtype), &bits) ||
      bits / 8 > o->nbytes)
    return plan_fail(b, "output '%s': %" PRIu64 " zero rows exceed the output", o->name, rows);
  if (bits % 8) return plan_fail(b, "output '%s': %" PRIu64 " zero rows are not whole bytes", o->name, rows);
  struct plan_piece pc = {NULL, 0, bits / 8, bits / 8, 1, 0, 0, rows};
  if (pc.width == 0) pc.height = 0;
  return plan_out_add(b, &pc);
}

int plan_out_end(struct plan_builder *b) {
  struct plan_output *o = b->cur;
  if (b->cur_bytes != o->nbytes)
    return plan_fail(b, "output '%s': its pieces hold %" PRIu64 " bytes but its shape needs %" PRIu64, o->name,
                     b->cur_bytes, o->nbytes);
  b->cur = NULL;
  return 0;
}
