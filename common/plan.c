/*
 * plan.c - building plans from specs (see plan.h and the "Plans" section of
 * docs/protocol.md, whose semantics are vLLM's).
 *
 * Three layers: primitives that turn "rows [a, b) of dimension d of tensor T"
 * into a 2D byte piece with every check (bounds, sub-byte dtypes, FP8 block
 * boundaries); an output builder that concatenates pieces and checks the
 * declared shape; and the presets, which walk a checkpoint layer by layer and
 * emit outputs by rules keyed on tensor names. Explicit JSON plans use the
 * same primitives. Nothing here reads tensor data; plan_gather does, later.
 */
#include "plan.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jsonutil.h"
#include "modelcfg.h"

/* ---- the plan object ---------------------------------------------------------- */

void plan_free(struct plan *p) {
  if (p == NULL) return;
  for (size_t i = 0; i < p->noutputs; i++) {
    free(p->outputs[i].name);
    free(p->outputs[i].shape);
    free(p->outputs[i].pieces);
  }
  free(p->outputs);
  free(p->key);
  free(p);
}

/* Builder state shared by the presets and explicit plans. */
struct pb {
  const struct ckpt *c;
  struct plan *p;
  size_t cap;
  struct wd_error *err;
  /* the spec */
  const char *family;
  uint64_t tp, tr, ep, er;
  bool fuse;
  uint64_t *experts; /* this rank's experts (sorted), or NULL: contiguous */
  size_t nexperts;
  uint64_t block_n, block_k; /* FP8 block size, 0 when the checkpoint has none */
  /* the output being built */
  struct plan_output *cur;
  size_t piece_cap;
  uint64_t cur_bytes;
  unsigned char *used; /* per checkpoint tensor (by_name index): emitted already */
};

static int fail(struct pb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(struct pb *b, const char *fmt, ...) {
  char msg[WD_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return err_set(b->err, WEIGHTD_E_BAD_PLAN, "%s", msg);
}

static int nomem(struct pb *b) { return err_set(b->err, WEIGHTD_E_NOMEM, "out of memory building a plan"); }

static const struct ckpt_ref *find(struct pb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static const struct ckpt_ref *find(struct pb *b, const char *fmt, ...) {
  char name[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(name, sizeof name, fmt, ap);
  va_end(ap);
  return ckpt_tensor_find(b->c, name);
}

static void mark_used(struct pb *b, const struct ckpt_ref *r) {
  if (r != NULL) b->used[r - b->c->by_name] = 1;
}

/* ---- pieces ----------------------------------------------------------------------- */

/*
 * Rows [start, end) of dimension dim of tensor r as a 2D piece: the tensor
 * viewed as [outer, shape[dim], inner] gives `outer` rows of
 * (end - start) * inner elements, shape[dim] * inner apart.
 */
static int piece_slice(struct pb *b, const struct ckpt_ref *r, unsigned dim, uint64_t start, uint64_t end,
                       struct plan_piece *out) {
  const struct st_tensor *t = r->t;
  if (t->ndim == 0) {
    if (dim != 0 || start != 0 || end != 1)
      return fail(b, "tensor '%s' is a scalar and cannot be sliced", t->name);
    *out = (struct plan_piece){r, 0, t->end - t->begin, t->end - t->begin, 1, 0, 0, 1};
    return 0;
  }
  if (dim >= t->ndim) return fail(b, "tensor '%s' has %u dimensions, no dimension %u", t->name, t->ndim, dim);
  if (start > end || end > t->shape[dim])
    return fail(b, "tensor '%s': rows [%" PRIu64 ", %" PRIu64 ") of dimension %u exceed its size %" PRIu64,
                t->name, start, end, dim, t->shape[dim]);
  uint64_t outer = 1, inner = 1;
  for (unsigned d = 0; d < dim; d++) outer *= t->shape[d];
  for (unsigned d = dim + 1; d < t->ndim; d++) inner *= t->shape[d];
  unsigned bits = dtype_bits(t->dtype);
  uint64_t row_bits = (end - start) * inner * bits, off_bits = start * inner * bits;
  uint64_t pitch_bits = t->shape[dim] * inner * bits;
  if (row_bits % 8 || off_bits % 8 || pitch_bits % 8)
    return fail(b, "tensor '%s' (%s): slice [%" PRIu64 ", %" PRIu64 ") of dimension %u does not cover whole bytes",
                t->name, dtype_name(t->dtype), start, end, dim);
  if (start == 0 && end == t->shape[dim]) { /* the whole tensor, whatever the dimension: one row */
    uint64_t all = t->end - t->begin;
    *out = (struct plan_piece){r, 0, all, all, all ? 1 : 0, 0, 0, t->shape[0]};
    return 0;
  }
  *out = (struct plan_piece){r, off_bits / 8, row_bits / 8, pitch_bits / 8, outer, dim, start, end};
  if (out->width == 0 || outer == 0) out->height = 0;
  if (out->height == 1) out->src_pitch = out->width;
  return 0;
}

/* ---- outputs ------------------------------------------------------------------------ */

/* Starts an output; its pieces follow, and out_end checks their bytes add up. */
static int out_begin(struct pb *b, const char *name, enum wd_dtype dtype, unsigned ndim, const uint64_t *shape) {
  struct plan *p = b->p; /* names are checked for repeats once, at the end (check_names) */
  if (p->noutputs == b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 64;
    struct plan_output *n = realloc(p->outputs, cap * sizeof *n);
    if (n == NULL) return nomem(b);
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
    return nomem(b);
  }
  p->noutputs++;
  o->dtype = dtype;
  o->ndim = ndim;
  memcpy(o->shape, shape, ndim * sizeof *shape);
  uint64_t elems = 1;
  for (unsigned d = 0; d < ndim; d++)
    if (__builtin_mul_overflow(elems, shape[d], &elems)) return fail(b, "output '%s': shape overflows", name);
  uint64_t bits;
  if (__builtin_mul_overflow(elems, (uint64_t)dtype_bits(dtype), &bits) || bits % 8)
    return fail(b, "output '%s': shape is not a whole number of bytes of %s", name, dtype_name(dtype));
  o->nbytes = bits / 8;
  b->cur = o;
  b->piece_cap = 0;
  b->cur_bytes = 0;
  return 0;
}

static int out_add(struct pb *b, const struct plan_piece *pc) {
  struct plan_output *o = b->cur;
  if (pc->src != NULL && pc->src->t->dtype != o->dtype)
    return fail(b, "output '%s' is %s but its piece from '%s' is %s", o->name, dtype_name(o->dtype),
                pc->src->t->name, dtype_name(pc->src->t->dtype));
  if (o->npieces == b->piece_cap) {
    size_t cap = b->piece_cap ? b->piece_cap * 2 : 4;
    struct plan_piece *n = realloc(o->pieces, cap * sizeof *n);
    if (n == NULL) return nomem(b);
    o->pieces = n;
    b->piece_cap = cap;
  }
  o->pieces[o->npieces++] = *pc;
  if (__builtin_add_overflow(b->cur_bytes, pc->width * pc->height, &b->cur_bytes) || b->cur_bytes > o->nbytes)
    return fail(b, "output '%s': its pieces hold more bytes than its shape", o->name);
  mark_used(b, pc->src);
  return 0;
}

/* Adds rows [start, end) of dimension dim of r to the current output. */
static int out_slice(struct pb *b, const struct ckpt_ref *r, unsigned dim, uint64_t start, uint64_t end) {
  struct plan_piece pc;
  int rc = piece_slice(b, r, dim, start, end, &pc);
  return rc ? rc : out_add(b, &pc);
}

/* Adds `rows` rows of zeros of the output's row size (its shape without dimension 0). */
static int out_zeros(struct pb *b, uint64_t rows) {
  struct plan_output *o = b->cur;
  uint64_t inner = 1, bits;
  for (unsigned d = 1; d < o->ndim; d++) inner *= o->shape[d]; /* bounded: the output's size did not overflow */
  if (__builtin_mul_overflow(rows, inner, &bits) || __builtin_mul_overflow(bits, (uint64_t)dtype_bits(o->dtype), &bits) ||
      bits / 8 > o->nbytes)
    return fail(b, "output '%s': %" PRIu64 " zero rows exceed the output", o->name, rows);
  if (bits % 8) return fail(b, "output '%s': %" PRIu64 " zero rows are not whole bytes", o->name, rows);
  struct plan_piece pc = {NULL, 0, bits / 8, bits / 8, 1, 0, 0, rows};
  if (pc.width == 0) pc.height = 0;
  return out_add(b, &pc);
}

static int out_end(struct pb *b) {
  struct plan_output *o = b->cur;
  if (b->cur_bytes != o->nbytes)
    return fail(b, "output '%s': its pieces hold %" PRIu64 " bytes but its shape needs %" PRIu64, o->name,
                b->cur_bytes, o->nbytes);
  b->cur = NULL;
  return 0;
}

/* ---- FP8 block scales --------------------------------------------------------------- */

/* The scale tensor of a weight ("x.weight" -> "x.weight_scale_inv"), or NULL. */
static const struct ckpt_ref *scale_of(struct pb *b, const struct ckpt_ref *w) {
  if (w == NULL || b->block_n == 0) return NULL;
  return find(b, "%s_scale_inv", w->t->name);
}

static uint64_t ceil_div(uint64_t a, uint64_t d) { return (a + d - 1) / d; }

/*
 * The block rows covering rows [a, b) of dimension dim of a weight with that
 * dimension's size n: [a/B, ceil(b/B)), which needs a on a block boundary and
 * b on one or at the end.
 */
static int block_range(struct pb *b, const struct ckpt_ref *w, unsigned dim, uint64_t a, uint64_t e,
                       uint64_t *ba, uint64_t *be) {
  uint64_t blk = dim == 0 ? b->block_n : b->block_k, n = w->t->shape[dim];
  if (a % blk != 0 || (e % blk != 0 && e != n))
    return fail(b, "tensor '%s': slice [%" PRIu64 ", %" PRIu64 ") of dimension %u does not fall on %" PRIu64
                   "-wide FP8 blocks (its weight_scale_inv cannot be sliced with it)",
                w->t->name, a, e, dim, blk);
  *ba = a / blk;
  *be = ceil_div(e, blk);
  return 0;
}

/* One part of an output: rows [a, b) of dimension dim of a tensor. */
struct part {
  const struct ckpt_ref *t;
  unsigned dim;
  uint64_t a, b;
};

/*
 * Emits `name` as the concatenation of parts along dimension 0 (each part
 * sliced along its own dim), and, when the parts have FP8 scales, the scale
 * output ("...weight" + "_scale_inv") sliced and concatenated the same way.
 * stacked: the parts form nparts/group groups of `group` (experts), and the
 * output gets a leading dimension of nparts/group.
 */
static int emit_parts(struct pb *b, const char *name, const struct part *parts, size_t nparts, size_t group,
                      bool stacked) {
  const struct st_tensor *t0 = parts[0].t->t;
  unsigned ndim = t0->ndim ? t0->ndim : 1;
  uint64_t shape[8] = {0};
  if (ndim + 1 > 8) return fail(b, "tensor '%s' has too many dimensions for a plan", t0->name);
  /* The first dimension adds up over one group; the others are the parts' own (after slicing). */
  uint64_t rows = 0;
  for (size_t i = 0; i < group; i++) {
    const struct part *pt = &parts[i];
    if (pt->t->t->ndim != t0->ndim)
      return fail(b, "output '%s': '%s' and '%s' differ in rank", name, t0->name, pt->t->t->name);
    rows += pt->dim == 0 ? pt->b - pt->a : (pt->t->t->ndim ? pt->t->t->shape[0] : 1);
  }
  for (unsigned d = 1; d < ndim; d++) shape[d] = t0->shape[d];
  if (parts[0].dim != 0 && parts[0].dim < ndim) shape[parts[0].dim] = parts[0].b - parts[0].a;
  shape[0] = rows;
  int rc;
  if (stacked) { /* [nparts/group, rows, ...] */
    memmove(shape + 1, shape, ndim * sizeof *shape);
    shape[0] = nparts / group;
    rc = out_begin(b, name, t0->dtype, ndim + 1, shape);
  } else {
    rc = out_begin(b, name, t0->dtype, t0->ndim ? ndim : 0, shape);
  }
  for (size_t i = 0; rc == 0 && i < nparts; i++) rc = out_slice(b, parts[i].t, parts[i].dim, parts[i].a, parts[i].b);
  if (rc == 0) rc = out_end(b);
  if (rc != 0) return rc;

  /* FP8: the scales follow their weights block by block. */
  const struct ckpt_ref *s0 = scale_of(b, parts[0].t);
  if (s0 == NULL) return 0;
  struct part *sp = calloc(nparts, sizeof *sp);
  if (sp == NULL) return nomem(b);
  for (size_t i = 0; i < nparts && rc == 0; i++) {
    const struct ckpt_ref *s = scale_of(b, parts[i].t);
    if (s == NULL) {
      rc = fail(b, "'%s' has a weight_scale_inv but '%s', fused with it, has none", t0->name, parts[i].t->t->name);
      break;
    }
    sp[i] = (struct part){s, parts[i].dim, 0, 0};
    rc = block_range(b, parts[i].t, parts[i].dim, parts[i].a, parts[i].b, &sp[i].a, &sp[i].b);
    /* Concatenated parts keep their scale blocks apart only if all but a group's last fill whole blocks. */
    if (rc == 0 && group > 1 && (i + 1) % group != 0 && (parts[i].b - parts[i].a) % b->block_n != 0)
      rc = fail(b, "output '%s': '%s' contributes %" PRIu64 " rows, not a multiple of the %" PRIu64
                   "-row FP8 block, so the blocks of what follows would straddle it",
                name, parts[i].t->t->name, parts[i].b - parts[i].a, b->block_n);
  }
  if (rc == 0) {
    char sname[512];
    size_t nl = strlen(name);
    if (nl >= 6 && strcmp(name + nl - 6, "weight") == 0) snprintf(sname, sizeof sname, "%s_scale_inv", name);
    else snprintf(sname, sizeof sname, "%s.weight_scale_inv", name);
    rc = emit_parts(b, sname, sp, nparts, group, stacked);
  }
  free(sp);
  return rc;
}

static int emit_one(struct pb *b, const char *name, const struct ckpt_ref *t, unsigned dim, uint64_t a,
                    uint64_t e) {
  struct part pt = {t, dim, a, e};
  return emit_parts(b, name, &pt, 1, 1, false);
}

/* A tensor whole, under its own name (with its scale, if any). */
static int emit_whole(struct pb *b, const struct ckpt_ref *t) {
  if (t == NULL) return 0;
  return emit_one(b, t->t->name, t, 0, 0, t->t->ndim ? t->t->shape[0] : 1);
}

/* Rows [r*n/parts, (r+1)*n/parts) of dimension dim; n must divide. */
static int split_range(struct pb *b, const struct ckpt_ref *t, unsigned dim, uint64_t parts, uint64_t r,
                       uint64_t unit, uint64_t *a, uint64_t *e) {
  if (dim >= t->t->ndim) return fail(b, "tensor '%s' has no dimension %u to split", t->t->name, dim);
  uint64_t n = t->t->shape[dim];
  if (unit == 0 || n % unit != 0 || (n / unit) % parts != 0)
    return fail(b, "tensor '%s': dimension %u (%" PRIu64 ") does not split into %" PRIu64 " equal parts%s",
                t->t->name, dim, n, parts, unit > 1 ? " of whole heads" : "");
  uint64_t per = n / unit / parts * unit;
  *a = r * per;
  *e = *a + per;
  return 0;
}

/* ---- the presets ----------------------------------------------------------------------- */

/* Column- (dim 0) or row- (dim 1) parallel over tp ranks, in units of whole heads. */
static int emit_split(struct pb *b, const struct ckpt_ref *t, unsigned dim, uint64_t unit) {
  if (t == NULL) return 0;
  uint64_t a = 0, e = 0;
  int rc = split_range(b, t, dim, b->tp, b->tr, unit, &a, &e);
  return rc ? rc : emit_one(b, t->t->name, t, dim, a, e);
}

/* The kv-head rows of k_proj / v_proj (weight or bias) this rank gets, replicated when tp > kv heads. */
static int kv_range(struct pb *b, const struct ckpt_ref *t, uint64_t kv_heads, uint64_t *a, uint64_t *e) {
  uint64_t rows = t->t->shape[0];
  if (kv_heads == 0 || rows % kv_heads) return fail(b, "tensor '%s': %" PRIu64 " rows are not %" PRIu64 " kv heads", t->t->name, rows, kv_heads);
  uint64_t d = rows / kv_heads;
  if (b->tp <= kv_heads) {
    if (kv_heads % b->tp)
      return fail(b, "%" PRIu64 " kv heads do not divide by tp_size %" PRIu64 " (tensor '%s')", kv_heads, b->tp, t->t->name);
    uint64_t per = kv_heads / b->tp;
    *a = b->tr * per * d;
    *e = *a + per * d;
    return 0;
  }
  if (b->tp % kv_heads)
    return fail(b, "tp_size %" PRIu64 " exceeds the %" PRIu64 " kv heads and is not a multiple of them (tensor '%s')",
                b->tp, kv_heads, t->t->name);
  uint64_t h = b->tr / (b->tp / kv_heads);
  *a = h * d;
  *e = *a + d;
  return 0;
}

static int cfg(struct pb *b, enum mcfg_field f, const char *purpose, uint64_t *out) {
  int64_t v;
  int rc = mcfg_get(b->c->config, f, purpose, &v, b->err);
  if (rc == 0) *out = (uint64_t)v;
  return rc;
}

/* Standard attention: q/k/v column-parallel by heads (kv heads replicated when needed), o row-parallel. */
static int layer_attention(struct pb *b, const char *pre) {
  const struct ckpt_ref *q = find(b, "%sself_attn.q_proj.weight", pre), *k = find(b, "%sself_attn.k_proj.weight", pre),
                        *v = find(b, "%sself_attn.v_proj.weight", pre), *o = find(b, "%sself_attn.o_proj.weight", pre);
  if (q == NULL || k == NULL || v == NULL) return fail(b, "%s: attention needs q_proj, k_proj and v_proj", pre);
  uint64_t heads = 0, kv = 0;
  int rc = cfg(b, MCFG_NUM_ATTENTION_HEADS, "the tensor-parallel attention layout", &heads);
  if (rc == 0) rc = cfg(b, MCFG_NUM_KEY_VALUE_HEADS, "the tensor-parallel attention layout", &kv);
  if (rc != 0) return rc;
  if (heads == 0 || heads % b->tp)
    return fail(b, "%" PRIu64 " query heads do not divide by tp_size %" PRIu64, heads, b->tp);
  uint64_t qd = q->t->shape[0] / heads;
  const char *kinds[] = {"weight", "bias"};
  for (int kind = 0; kind < 2; kind++) {
    const struct ckpt_ref *qt = find(b, "%sself_attn.q_proj.%s", pre, kinds[kind]);
    const struct ckpt_ref *kt = find(b, "%sself_attn.k_proj.%s", pre, kinds[kind]);
    const struct ckpt_ref *vt = find(b, "%sself_attn.v_proj.%s", pre, kinds[kind]);
    if (qt == NULL && kt == NULL && vt == NULL) continue;
    if (qt == NULL || kt == NULL || vt == NULL) return fail(b, "%s: q/k/v_proj.%s must all be present", pre, kinds[kind]);
    struct part parts[3] = {{qt, 0, 0, 0}, {kt, 0, 0, 0}, {vt, 0, 0, 0}};
    if ((rc = split_range(b, qt, 0, b->tp, b->tr, qd, &parts[0].a, &parts[0].b)) != 0) return rc;
    if ((rc = kv_range(b, kt, kv, &parts[1].a, &parts[1].b)) != 0) return rc;
    if ((rc = kv_range(b, vt, kv, &parts[2].a, &parts[2].b)) != 0) return rc;
    if (b->fuse) {
      char name[512];
      snprintf(name, sizeof name, "%sself_attn.qkv_proj.%s", pre, kinds[kind]);
      rc = emit_parts(b, name, parts, 3, 3, false);
    } else {
      for (int i = 0; i < 3 && rc == 0; i++) rc = emit_parts(b, parts[i].t->t->name, &parts[i], 1, 1, false);
    }
    if (rc != 0) return rc;
  }
  if (o != NULL && (rc = emit_split(b, o, 1, qd)) != 0) return rc;
  return 0;
}

/* Multi-head latent attention (DeepSeek): a-projections replicated, b-projections by heads, o by heads. */
static int layer_mla(struct pb *b, const char *pre) {
  uint64_t heads = 0, nope = 0, rope = 0, vdim = 0;
  int rc = cfg(b, MCFG_NUM_ATTENTION_HEADS, "the MLA layout", &heads);
  if (rc == 0) rc = cfg(b, MCFG_QK_NOPE_HEAD_DIM, "the MLA layout", &nope);
  if (rc == 0) rc = cfg(b, MCFG_QK_ROPE_HEAD_DIM, "the MLA layout", &rope);
  if (rc == 0) rc = cfg(b, MCFG_V_HEAD_DIM, "the MLA layout", &vdim);
  if (rc != 0) return rc;
  if (heads == 0 || heads % b->tp) return fail(b, "%" PRIu64 " query heads do not divide by tp_size %" PRIu64, heads, b->tp);
  const struct ckpt_ref *qa = find(b, "%sself_attn.q_a_proj.weight", pre);
  const struct ckpt_ref *kva = find(b, "%sself_attn.kv_a_proj_with_mqa.weight", pre);
  if (b->fuse && qa != NULL && kva != NULL) {
    struct part parts[2] = {{qa, 0, 0, qa->t->shape[0]}, {kva, 0, 0, kva->t->shape[0]}};
    char name[512];
    snprintf(name, sizeof name, "%sself_attn.fused_qkv_a_proj.weight", pre);
    if ((rc = emit_parts(b, name, parts, 2, 2, false)) != 0) return rc;
  } else {
    if ((rc = emit_whole(b, qa)) != 0 || (rc = emit_whole(b, kva)) != 0) return rc;
  }
  if ((rc = emit_whole(b, find(b, "%sself_attn.q_a_layernorm.weight", pre))) != 0) return rc;
  if ((rc = emit_whole(b, find(b, "%sself_attn.kv_a_layernorm.weight", pre))) != 0) return rc;
  const struct ckpt_ref *qb = find(b, "%sself_attn.q_b_proj.weight", pre);
  if (qb == NULL) qb = find(b, "%sself_attn.q_proj.weight", pre); /* no q LoRA */
  if ((rc = emit_split(b, qb, 0, nope + rope)) != 0) return rc;
  if ((rc = emit_split(b, find(b, "%sself_attn.kv_b_proj.weight", pre), 0, nope + vdim)) != 0) return rc;
  return emit_split(b, find(b, "%sself_attn.o_proj.weight", pre), 1, vdim);
}

/* A dense MLP at prefix mlp (e.g. "model.layers.0.mlp." or "...mlp.shared_experts."). */
static int dense_mlp(struct pb *b, const char *mlp) {
  const struct ckpt_ref *g = find(b, "%sgate_proj.weight", mlp), *u = find(b, "%sup_proj.weight", mlp),
                        *d = find(b, "%sdown_proj.weight", mlp);
  if (g == NULL && u == NULL && d == NULL) return 0;
  if (g == NULL || u == NULL || d == NULL) return fail(b, "%s: an MLP needs gate_proj, up_proj and down_proj", mlp);
  struct part parts[2] = {{g, 0, 0, 0}, {u, 0, 0, 0}};
  int rc = split_range(b, g, 0, b->tp, b->tr, 1, &parts[0].a, &parts[0].b);
  if (rc == 0) rc = split_range(b, u, 0, b->tp, b->tr, 1, &parts[1].a, &parts[1].b);
  if (rc != 0) return rc;
  if (b->fuse) {
    char name[512];
    snprintf(name, sizeof name, "%sgate_up_proj.weight", mlp);
    rc = emit_parts(b, name, parts, 2, 2, false);
  } else {
    rc = emit_parts(b, g->t->name, &parts[0], 1, 1, false);
    if (rc == 0) rc = emit_parts(b, u->t->name, &parts[1], 1, 1, false);
  }
  return rc ? rc : emit_split(b, d, 1, 1);
}

/* This rank's experts of n: an explicit list, else a contiguous range (the first n % ep ranks hold one more). */
static int rank_experts(struct pb *b, uint64_t n, uint64_t **out, size_t *count) {
  if (b->ep == 1) {
    *out = malloc((n ? n : 1) * sizeof **out);
    if (*out == NULL) return nomem(b);
    for (uint64_t e = 0; e < n; e++) (*out)[e] = e;
    *count = n;
    return 0;
  }
  if (b->experts != NULL) {
    for (size_t i = 0; i < b->nexperts; i++)
      if (b->experts[i] >= n) return fail(b, "expert %" PRIu64 " does not exist (the model has %" PRIu64 ")", b->experts[i], n);
    *out = malloc((b->nexperts ? b->nexperts : 1) * sizeof **out);
    if (*out == NULL) return nomem(b);
    memcpy(*out, b->experts, b->nexperts * sizeof **out);
    *count = b->nexperts;
    return 0;
  }
  if (b->ep > n) return fail(b, "ep_size %" PRIu64 " exceeds the %" PRIu64 " experts", b->ep, n);
  uint64_t base = n / b->ep, extra = n % b->ep;
  uint64_t start = b->er * base + (b->er < extra ? b->er : extra), cnt = base + (b->er < extra ? 1 : 0);
  *out = malloc(cnt * sizeof **out);
  if (*out == NULL) return nomem(b);
  for (uint64_t i = 0; i < cnt; i++) (*out)[i] = start + i;
  *count = cnt;
  return 0;
}

/* The routed experts of one MoE layer: this rank's, and no others. */
static int layer_experts(struct pb *b, const char *pre, uint64_t n) {
  static const char *const projs[] = {"gate_proj", "up_proj", "down_proj"};
  for (uint64_t e = 0; e < n; e++) /* experts other ranks hold are not left over for replication */
    for (int k = 0; k < 3; k++) {
      const struct ckpt_ref *w = find(b, "%smlp.experts.%" PRIu64 ".%s.weight", pre, e, projs[k]);
      mark_used(b, w);
      mark_used(b, scale_of(b, w));
    }
  uint64_t *ex = NULL;
  size_t cnt = 0;
  int rc = rank_experts(b, n, &ex, &cnt);
  if (rc != 0) return rc;
  struct part *w13 = calloc(2 * (cnt ? cnt : 1), sizeof *w13), *w2 = calloc(cnt ? cnt : 1, sizeof *w2);
  if (w13 == NULL || w2 == NULL) {
    rc = nomem(b);
    goto out;
  }
  for (size_t i = 0; i < cnt && rc == 0; i++) {
    const struct ckpt_ref *g = find(b, "%smlp.experts.%" PRIu64 ".gate_proj.weight", pre, ex[i]);
    const struct ckpt_ref *u = find(b, "%smlp.experts.%" PRIu64 ".up_proj.weight", pre, ex[i]);
    const struct ckpt_ref *d = find(b, "%smlp.experts.%" PRIu64 ".down_proj.weight", pre, ex[i]);
    if (g == NULL || u == NULL || d == NULL) {
      rc = fail(b, "%smlp.experts.%" PRIu64 ": gate_proj, up_proj or down_proj is missing", pre, ex[i]);
      break;
    }
    /* With expert parallelism a rank holds its experts whole; otherwise they are TP-sliced. */
    uint64_t tp = b->ep > 1 ? 1 : b->tp, tr = b->ep > 1 ? 0 : b->tr;
    uint64_t save_tp = b->tp, save_tr = b->tr;
    b->tp = tp;
    b->tr = tr;
    w13[2 * i] = (struct part){g, 0, 0, 0};
    w13[2 * i + 1] = (struct part){u, 0, 0, 0};
    w2[i] = (struct part){d, 1, 0, 0};
    rc = split_range(b, g, 0, tp, tr, 1, &w13[2 * i].a, &w13[2 * i].b);
    if (rc == 0) rc = split_range(b, u, 0, tp, tr, 1, &w13[2 * i + 1].a, &w13[2 * i + 1].b);
    if (rc == 0) rc = split_range(b, d, 1, tp, tr, 1, &w2[i].a, &w2[i].b);
    if (rc == 0 && !b->fuse) {
      rc = emit_parts(b, g->t->name, &w13[2 * i], 1, 1, false);
      if (rc == 0) rc = emit_parts(b, u->t->name, &w13[2 * i + 1], 1, 1, false);
      if (rc == 0) rc = emit_parts(b, d->t->name, &w2[i], 1, 1, false);
    }
    b->tp = save_tp;
    b->tr = save_tr;
  }
  if (rc == 0 && b->fuse && cnt > 0) {
    char name[512];
    snprintf(name, sizeof name, "%smlp.experts.w13_weight", pre);
    rc = emit_parts(b, name, w13, 2 * cnt, 2, true);
    if (rc == 0) {
      snprintf(name, sizeof name, "%smlp.experts.w2_weight", pre);
      rc = emit_parts(b, name, w2, cnt, 1, true);
    }
  }
out:
  free(ex);
  free(w13);
  free(w2);
  return rc;
}

/* Vocabulary-parallel: padded to a multiple of 64, divided by tp, padding rows zero. */
static int emit_vocab(struct pb *b, const struct ckpt_ref *t) {
  if (t == NULL) return 0;
  if (scale_of(b, t) != NULL) return fail(b, "tensor '%s': a quantized vocabulary is not supported", t->t->name);
  if (t->t->ndim != 2) return fail(b, "tensor '%s' should be [vocab, hidden]", t->t->name);
  uint64_t v = t->t->shape[0], vp = ceil_div(v, 64) * 64;
  if (vp % b->tp) return fail(b, "the padded vocabulary (%" PRIu64 ") does not divide by tp_size %" PRIu64, vp, b->tp);
  uint64_t per = vp / b->tp, a = b->tr * per, e = a + per;
  uint64_t real_a = a < v ? a : v, real_e = e < v ? e : v;
  uint64_t shape[2] = {per, t->t->shape[1]};
  int rc = out_begin(b, t->t->name, t->t->dtype, 2, shape);
  if (rc == 0 && real_e > real_a) rc = out_slice(b, t, 0, real_a, real_e);
  if (rc == 0 && per > real_e - real_a) rc = out_zeros(b, per - (real_e - real_a));
  mark_used(b, t);
  return rc ? rc : out_end(b);
}

/* Counts the routed experts a layer has ("mlp.experts.N." present). */
static uint64_t count_experts(struct pb *b, const char *pre) {
  uint64_t n = 0;
  while (find(b, "%smlp.experts.%" PRIu64 ".down_proj.weight", pre, n) != NULL) n++;
  return n;
}

static int preset_layers(struct pb *b) {
  uint64_t nlayers = 0;
  while (find(b, "model.layers.%" PRIu64 ".input_layernorm.weight", nlayers) != NULL ||
         find(b, "model.layers.%" PRIu64 ".post_attention_layernorm.weight", nlayers) != NULL)
    nlayers++;
  int rc = 0;
  for (uint64_t i = 0; i < nlayers && rc == 0; i++) {
    char pre[64], mlp[96];
    snprintf(pre, sizeof pre, "model.layers.%" PRIu64 ".", i);
    rc = emit_whole(b, find(b, "%sinput_layernorm.weight", pre));
    if (rc == 0) {
      if (find(b, "%sself_attn.kv_a_proj_with_mqa.weight", pre) != NULL) rc = layer_mla(b, pre);
      else if (find(b, "%sself_attn.q_proj.weight", pre) != NULL) rc = layer_attention(b, pre);
    }
    if (rc == 0) rc = emit_whole(b, find(b, "%sself_attn.q_norm.weight", pre));
    if (rc == 0) rc = emit_whole(b, find(b, "%sself_attn.k_norm.weight", pre));
    if (rc == 0) rc = emit_whole(b, find(b, "%spost_attention_layernorm.weight", pre));
    uint64_t ne = count_experts(b, pre);
    if (rc == 0 && ne > 0) {
      uint64_t cfg_e = 0;
      if (strcmp(b->family, "dense") == 0)
        rc = fail(b, "%s has experts: use the qwen3_moe or deepseek_v3 preset", pre);
      else if (cfg(b, MCFG_NUM_EXPERTS, "the expert-parallel layout", &cfg_e) == 0 && cfg_e != ne)
        rc = fail(b, "%s has %" PRIu64 " experts but config.json says %" PRIu64, pre, ne, cfg_e);
      if (rc == 0) rc = emit_whole(b, find(b, "%smlp.gate.weight", pre));
      if (rc == 0) rc = emit_whole(b, find(b, "%smlp.gate.e_score_correction_bias", pre));
      if (rc == 0) rc = layer_experts(b, pre, ne);
      snprintf(mlp, sizeof mlp, "%smlp.shared_experts.", pre);
      if (rc == 0) rc = dense_mlp(b, mlp);
      snprintf(mlp, sizeof mlp, "%smlp.shared_expert.", pre);
      if (rc == 0) rc = dense_mlp(b, mlp);
      if (rc == 0) rc = emit_whole(b, find(b, "%smlp.shared_expert_gate.weight", pre));
    } else if (rc == 0) {
      snprintf(mlp, sizeof mlp, "%smlp.", pre);
      rc = dense_mlp(b, mlp);
    }
  }
  if (rc != 0) return rc;
  int64_t tied = 0;
  if (b->c->config != NULL) mcfg_get(b->c->config, MCFG_TIE_WORD_EMBEDDINGS, "embeddings", &tied, NULL);
  const struct ckpt_ref *embed = ckpt_tensor_find(b->c, "model.embed_tokens.weight");
  const struct ckpt_ref *head = ckpt_tensor_find(b->c, "lm_head.weight");
  if ((rc = emit_vocab(b, embed)) != 0) return rc;
  if ((rc = emit_whole(b, ckpt_tensor_find(b->c, "model.norm.weight"))) != 0) return rc;
  if (tied && embed != NULL) mark_used(b, head); /* tied embeddings are served once */
  else if ((rc = emit_vocab(b, head)) != 0) return rc;
  /* Anything the rules did not place is replicated whole (extra buffers, MTP layers...). */
  for (size_t i = 0; i < b->c->ntensors && rc == 0; i++) {
    const struct ckpt_ref *r = &b->c->by_name[i];
    if (b->used[i]) continue;
    size_t nl = r->t->name_len;
    if (nl > 10 && strcmp(r->t->name + nl - 10, "_scale_inv") == 0) continue; /* emitted with its weight */
    rc = emit_whole(b, r);
  }
  return rc;
}

static int preset_whole(struct pb *b) {
  for (size_t i = 0; i < b->c->ntensors; i++) {
    const struct ckpt_ref *r = &b->c->by_name[i];
    uint64_t shape1 = 1;
    int rc = out_begin(b, r->t->name, r->t->dtype, r->t->ndim, r->t->ndim ? r->t->shape : &shape1);
    if (rc == 0) {
      struct plan_piece pc = {r, 0, r->t->end - r->t->begin, r->t->end - r->t->begin, 1, 0, 0,
                              r->t->ndim ? r->t->shape[0] : 1};
      if (pc.width == 0) pc.height = 0;
      rc = out_add(b, &pc);
    }
    if (rc == 0) rc = out_end(b);
    if (rc != 0) return rc;
  }
  return 0;
}

/* ---- explicit plans ------------------------------------------------------------------------- */

/* A JSON number that is an integer in [0, 2^53): range first, so no cast overflows. */
static bool json_uint(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble <= 9007199254740991.0) ||
      v->valuedouble != (double)(uint64_t)v->valuedouble)
    return false;
  *out = (uint64_t)v->valuedouble;
  return true;
}

static int get_u64(struct pb *b, const cJSON *o, const char *key, uint64_t def, uint64_t *out, const char *where) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (v == NULL) {
    *out = def;
    return 0;
  }
  if (!json_uint(v, out)) return fail(b, "%s: '%s' must be a non-negative integer", where, key);
  return 0;
}

static int explicit_output(struct pb *b, const cJSON *jo, size_t index) {
  char where[64];
  snprintf(where, sizeof where, "plan output %zu", index);
  const cJSON *name = cJSON_GetObjectItemCaseSensitive(jo, "name"), *dt = cJSON_GetObjectItemCaseSensitive(jo, "dtype"),
              *shape = cJSON_GetObjectItemCaseSensitive(jo, "shape"), *pieces = cJSON_GetObjectItemCaseSensitive(jo, "pieces");
  if (!cJSON_IsObject(jo) || !cJSON_IsString(name) || !cJSON_IsString(dt) || !cJSON_IsArray(shape) || !cJSON_IsArray(pieces))
    return fail(b, "%s: needs 'name', 'dtype', 'shape' and 'pieces'", where);
  enum wd_dtype t = dtype_from_name(dt->valuestring, strlen(dt->valuestring));
  if (t == WD_DTYPE_INVALID) return fail(b, "output '%s': unknown dtype '%s'", name->valuestring, dt->valuestring);
  uint64_t sh[8] = {0};
  int nd = cJSON_GetArraySize(shape);
  if (nd > 8) return fail(b, "output '%s': more than 8 dimensions", name->valuestring);
  for (int d = 0; d < nd; d++) {
    const cJSON *e = cJSON_GetArrayItem(shape, d);
    if (!json_uint(e, &sh[d])) return fail(b, "output '%s': shape entries must be non-negative integers", name->valuestring);
  }
  int rc = out_begin(b, name->valuestring, t, (unsigned)nd, sh);
  if (rc != 0) return rc;
  const cJSON *pj;
  cJSON_ArrayForEach(pj, pieces) {
    const cJSON *tn = cJSON_GetObjectItemCaseSensitive(pj, "tensor");
    const cJSON *z = cJSON_GetObjectItemCaseSensitive(pj, "zeros");
    if (z != NULL) {
      uint64_t rows = 0;
      if ((rc = get_u64(b, pj, "zeros", 0, &rows, name->valuestring)) != 0) return rc;
      if ((rc = out_zeros(b, rows)) != 0) return rc;
      continue;
    }
    if (!cJSON_IsString(tn)) return fail(b, "output '%s': a piece needs 'tensor' or 'zeros'", name->valuestring);
    const struct ckpt_ref *r = ckpt_tensor_find(b->c, tn->valuestring);
    if (r == NULL) return fail(b, "output '%s': no tensor '%s' in the checkpoint", name->valuestring, tn->valuestring);
    uint64_t dim = 0, a = 0, e = 0;
    if ((rc = get_u64(b, pj, "dim", 0, &dim, name->valuestring)) != 0) return rc;
    uint64_t full = r->t->ndim == 0 ? 1 : dim < r->t->ndim ? r->t->shape[dim] : 0;
    if ((rc = get_u64(b, pj, "start", 0, &a, name->valuestring)) != 0) return rc;
    if ((rc = get_u64(b, pj, "end", full, &e, name->valuestring)) != 0) return rc;
    struct plan_piece pc;
    if ((rc = piece_slice(b, r, (unsigned)dim, a, e, &pc)) != 0) return rc;
    /* Concatenation or stacking along dimension 0: the trailing dimensions must agree. */
    const struct st_tensor *st = r->t;
    bool concat = st->ndim == (unsigned)nd, stack = st->ndim + 1 == (unsigned)nd;
    for (unsigned d = 1; concat && d < st->ndim; d++) concat = (d == dim ? e - a : st->shape[d]) == sh[d];
    for (unsigned d = 1; stack && d < st->ndim; d++) stack = (d == dim ? e - a : st->shape[d]) == sh[d + 1];
    if (nd > 0 && st->ndim > 0 && !concat && !stack)
      return fail(b, "output '%s': piece '%s' does not match the output's trailing dimensions", name->valuestring, st->name);
    if ((rc = out_add(b, &pc)) != 0) return rc;
  }
  return out_end(b);
}

static int build_explicit(struct pb *b, const cJSON *outputs) {
  if (!cJSON_IsArray(outputs) || cJSON_GetArraySize(outputs) == 0)
    return fail(b, "plan 'outputs' must be a non-empty array");
  size_t i = 0;
  const cJSON *o;
  cJSON_ArrayForEach(o, outputs) {
    int rc = explicit_output(b, o, i++);
    if (rc != 0) return rc;
  }
  return 0;
}

/* ---- the spec --------------------------------------------------------------------------------- */

static const struct {
  const char *model_type;
  const char *family;
} families[] = {
    {"qwen3", "dense"},         {"qwen2", "dense"},        {"llama", "dense"},      {"mistral", "dense"},
    {"qwen3_moe", "qwen3_moe"}, {"qwen2_moe", "qwen3_moe"}, {"deepseek_v3", "deepseek_v3"},
    {"deepseek_v2", "deepseek_v3"}, {"glm4_moe", "deepseek_v3"}, {"kimi_k2", "deepseek_v3"},
};

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Reads the preset fields and writes the canonical key. */
static int read_preset(struct pb *b, const cJSON *spec, const char *preset) {
  if (strcmp(preset, "auto") == 0) {
    const char *mt = b->c->config ? b->c->config->model_type : NULL;
    if (mt == NULL) return fail(b, "preset 'auto' needs config.json's model_type");
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++)
      if (strcmp(families[i].model_type, mt) == 0) preset = families[i].family;
    if (strcmp(preset, "auto") == 0)
      return fail(b, "no preset for model_type '%s': name one (dense, qwen3_moe, deepseek_v3) or send an explicit plan", mt);
  }
  bool known = false;
  for (size_t i = 0; i < sizeof families / sizeof families[0]; i++) known |= strcmp(families[i].family, preset) == 0;
  if (!known) return fail(b, "unknown plan preset '%s' (whole, auto, dense, qwen3_moe, deepseek_v3)", preset);
  b->family = preset;
  int rc = get_u64(b, spec, "tp_size", 1, &b->tp, "plan");
  if (rc == 0) rc = get_u64(b, spec, "tp_rank", 0, &b->tr, "plan");
  if (rc == 0) rc = get_u64(b, spec, "ep_size", 1, &b->ep, "plan");
  if (rc == 0) rc = get_u64(b, spec, "ep_rank", 0, &b->er, "plan");
  if (rc != 0) return rc;
  if (b->tp == 0) return fail(b, "tp_size must be at least 1");
  if (b->ep == 0) return fail(b, "ep_size must be at least 1");
  if (b->tr >= b->tp) return fail(b, "tp_rank %" PRIu64 " must be below tp_size %" PRIu64, b->tr, b->tp);
  if (b->er >= b->ep) return fail(b, "ep_rank %" PRIu64 " must be below ep_size %" PRIu64, b->er, b->ep);
  const cJSON *fuse = cJSON_GetObjectItemCaseSensitive(spec, "fuse");
  if (fuse != NULL && !cJSON_IsBool(fuse)) return fail(b, "'fuse' must be true or false");
  b->fuse = cJSON_IsTrue(fuse);
  const cJSON *ex = cJSON_GetObjectItemCaseSensitive(spec, "experts");
  if (ex != NULL) {
    if (!cJSON_IsArray(ex) || b->ep == 1) return fail(b, "'experts' must be a list, with ep_size > 1");
    b->nexperts = (size_t)cJSON_GetArraySize(ex);
    b->experts = calloc(b->nexperts ? b->nexperts : 1, sizeof *b->experts);
    if (b->experts == NULL) return nomem(b);
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, ex) {
      if (!json_uint(e, &b->experts[i++])) return fail(b, "'experts' must list non-negative integers");
    }
    qsort(b->experts, b->nexperts, sizeof *b->experts, cmp_u64);
    for (i = 0; i + 1 < b->nexperts; i++)
      if (b->experts[i] == b->experts[i + 1]) return fail(b, "expert %" PRIu64 " is listed twice", b->experts[i]);
  }
  if (b->c->config != NULL && b->c->config->weight_block_size[0] > 0) {
    b->block_n = (uint64_t)b->c->config->weight_block_size[0];
    b->block_k = (uint64_t)b->c->config->weight_block_size[1];
  }
  /* The canonical key: every field, defaults included, experts sorted. */
  char key[4096];
  size_t o = (size_t)snprintf(key, sizeof key,
                              "{\"preset\":\"%s\",\"tp_size\":%" PRIu64 ",\"tp_rank\":%" PRIu64 ",\"ep_size\":%" PRIu64
                              ",\"ep_rank\":%" PRIu64 ",\"fuse\":%s",
                              preset, b->tp, b->tr, b->ep, b->er, b->fuse ? "true" : "false");
  if (b->experts != NULL) {
    o += (size_t)snprintf(key + o, sizeof key - o, ",\"experts\":[");
    for (size_t i = 0; i < b->nexperts && o < sizeof key; i++)
      o += (size_t)snprintf(key + o, sizeof key - o, "%s%" PRIu64, i ? "," : "", b->experts[i]);
    if (o < sizeof key) o += (size_t)snprintf(key + o, sizeof key - o, "]");
  }
  if (o + 2 >= sizeof key) return fail(b, "the expert list is too long");
  snprintf(key + o, sizeof key - o, "}");
  b->p->key = strdup(key);
  return b->p->key ? 0 : nomem(b);
}

static int cmp_output_names(const void *a, const void *b) {
  return strcmp((*(const struct plan_output *const *)a)->name, (*(const struct plan_output *const *)b)->name);
}

/* No output name twice: sorted once, O(n log n), however many tensors. */
static int check_names(struct pb *b) {
  struct plan *p = b->p;
  const struct plan_output **v = malloc((p->noutputs ? p->noutputs : 1) * sizeof *v);
  if (v == NULL) return nomem(b);
  for (size_t i = 0; i < p->noutputs; i++) v[i] = &p->outputs[i];
  qsort(v, p->noutputs, sizeof *v, cmp_output_names);
  int rc = 0;
  for (size_t i = 0; i + 1 < p->noutputs && rc == 0; i++)
    if (strcmp(v[i]->name, v[i + 1]->name) == 0) rc = fail(b, "plan lists output '%s' twice", v[i]->name);
  free(v);
  return rc;
}

/* Places the outputs in the slab at aligned offsets. */
static void place(struct plan *p) {
  uint64_t off = 0;
  p->payload_bytes = 0;
  for (size_t i = 0; i < p->noutputs; i++) {
    p->outputs[i].offset = off;
    p->payload_bytes += p->outputs[i].nbytes;
    off += (p->outputs[i].nbytes + PLAN_ALIGN - 1) / PLAN_ALIGN * PLAN_ALIGN;
  }
  p->slab_bytes = off;
}

static int cmp_file_order(const void *a, const void *b) {
  const struct plan_output *x = a, *y = b;
  const struct plan_piece *px = x->npieces ? &x->pieces[0] : NULL, *py = y->npieces ? &y->pieces[0] : NULL;
  if (px == NULL || px->src == NULL || py == NULL || py->src == NULL) return 0;
  if (px->src->shard != py->src->shard) return px->src->shard < py->src->shard ? -1 : 1;
  if (px->src->t->begin != py->src->t->begin) return px->src->t->begin < py->src->t->begin ? -1 : 1;
  return 0;
}

int plan_build(const struct ckpt *c, const cJSON *spec, struct plan **out, struct wd_error *err) {
  *out = NULL;
  struct pb b = {.c = c, .err = err, .tp = 1, .ep = 1};
  b.p = calloc(1, sizeof *b.p);
  b.used = calloc(c->ntensors ? c->ntensors : 1, 1);
  int rc = 0;
  if (b.p == NULL || b.used == NULL) {
    rc = nomem(&b);
    goto fail;
  }
  for (size_t i = 0; i < c->ntensors; i++)
    if (strlen(c->by_name[i].t->name) != c->by_name[i].t->name_len) {
      rc = fail(&b, "tensor '%s...' has U+0000 in its name, which the protocol cannot carry", c->by_name[i].t->name);
      goto fail;
    }
  const char *preset = "whole";
  const cJSON *outputs = NULL;
  if (spec != NULL) {
    if (!cJSON_IsObject(spec)) {
      rc = fail(&b, "plan must be an object");
      goto fail;
    }
    const cJSON *pr = cJSON_GetObjectItemCaseSensitive(spec, "preset");
    outputs = cJSON_GetObjectItemCaseSensitive(spec, "outputs");
    if (pr != NULL && !cJSON_IsString(pr)) {
      rc = fail(&b, "plan 'preset' must be a string");
      goto fail;
    }
    if (pr != NULL && outputs != NULL) {
      rc = fail(&b, "plan has both 'preset' and 'outputs'");
      goto fail;
    }
    if (pr != NULL) preset = pr->valuestring;
  }
  if (outputs != NULL) {
    b.p->key = cJSON_PrintUnformatted(spec);
    if (b.p->key == NULL) {
      rc = nomem(&b);
      goto fail;
    }
    rc = build_explicit(&b, outputs);
  } else if (strcmp(preset, "whole") == 0) {
    b.p->key = strdup("{\"preset\":\"whole\"}");
    rc = b.p->key ? preset_whole(&b) : nomem(&b);
    /* Whole tensors stream through each shard in file order. */
    if (rc == 0) qsort(b.p->outputs, b.p->noutputs, sizeof *b.p->outputs, cmp_file_order);
  } else {
    rc = read_preset(&b, spec, preset);
    if (rc == 0) rc = preset_layers(&b);
  }
  if (rc == 0) rc = check_names(&b);
  if (rc != 0) goto fail;
  place(b.p);
  free(b.used);
  free(b.experts);
  *out = b.p;
  return 0;
fail:
  free(b.used);
  free(b.experts);
  plan_free(b.p);
  return rc;
}

/* ---- describing and gathering ------------------------------------------------------------------ */

static cJSON *outputs_json(const struct plan *p, bool with_pieces) {
  cJSON *outs = cJSON_CreateArray();
  for (size_t i = 0; outs != NULL && i < p->noutputs; i++) {
    const struct plan_output *po = &p->outputs[i];
    cJSON *jo = cJSON_CreateObject();
    cJSON_AddStringToObject(jo, "name", po->name);
    cJSON_AddStringToObject(jo, "dtype", dtype_name(po->dtype));
    cJSON *sh = cJSON_AddArrayToObject(jo, "shape");
    for (unsigned d = 0; d < po->ndim; d++) json_u64_add(sh, NULL, po->shape[d]);
    json_u64_add(jo, "offset", po->offset);
    json_u64_add(jo, "nbytes", po->nbytes);
    cJSON *pcs = with_pieces ? cJSON_AddArrayToObject(jo, "pieces") : NULL;
    for (size_t k = 0; pcs != NULL && k < po->npieces; k++) {
      const struct plan_piece *pc = &po->pieces[k];
      cJSON *jp = cJSON_CreateObject();
      if (pc->src == NULL) {
        json_u64_add(jp, "zeros", pc->end);
      } else {
        cJSON_AddStringToObject(jp, "tensor", pc->src->t->name);
        cJSON_AddNumberToObject(jp, "dim", pc->dim);
        json_u64_add(jp, "start", pc->start);
        json_u64_add(jp, "end", pc->end);
      }
      cJSON_AddItemToArray(pcs, jp);
    }
    cJSON_AddItemToArray(outs, jo);
  }
  return outs;
}

cJSON *plan_describe(const struct plan *p) {
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) return NULL;
  cJSON_AddItemToObject(o, "key", cJSON_Parse(p->key));
  json_u64_add(o, "payload_bytes", p->payload_bytes);
  json_u64_add(o, "slab_bytes", p->slab_bytes);
  cJSON_AddItemToObject(o, "outputs", outputs_json(p, true));
  return o;
}

cJSON *plan_table(const struct plan *p) { return outputs_json(p, false); }

const struct plan_output *plan_output_at(const struct plan *p, uint64_t lo) {
  size_t a = 0, b = p->noutputs;
  while (a < b) { /* the first output that ends after lo */
    size_t m = a + (b - a) / 2;
    if (p->outputs[m].offset + p->outputs[m].nbytes <= lo) a = m + 1;
    else b = m;
  }
  return a < p->noutputs ? &p->outputs[a] : NULL;
}

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
