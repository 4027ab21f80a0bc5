/*
 * plan_presets.c - the presets (docs/protocol.md, "Plans" -> "Presets"):
 * every tensor whole, and the families' layer rules, which walk a checkpoint
 * layer by layer and emit outputs by rules keyed on tensor names - standard
 * attention with replicated kv heads, DeepSeek's latent attention, dense
 * MLPs, routed experts by expert- or tensor-parallel rank, shared experts,
 * the vocabulary-parallel embeddings - and replicate whatever no rule
 * placed.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan_build.h"

/* ---- every tensor whole -------------------------------------------------------------- */

static int cmp_file_order(const void *a, const void *b) {
  const struct plan_output *x = a, *y = b;
  const struct plan_piece *px = x->npieces ? &x->pieces[0] : NULL, *py = y->npieces ? &y->pieces[0] : NULL;
  if (px == NULL || px->src == NULL || py == NULL || py->src == NULL) return 0;
  if (px->src->shard != py->src->shard) return px->src->shard < py->src->shard ? -1 : 1;
  if (px->src->t->begin != py->src->t->begin) return px->src->t->begin < py->src->t->begin ? -1 : 1;
  return 0;
}

int plan_preset_whole(struct plan_builder *b) {
  for (size_t i = 0; i < b->c->ntensors; i++) {
    const struct ckpt_ref *r = &b->c->by_name[i];
    uint64_t shape1 = 1;
    int rc = plan_out_begin(b, r->t->name, r->t->dtype, r->t->ndim, r->t->ndim ? r->t->shape : &shape1);
    if (rc == 0) rc = plan_out_slice(b, r, 0, 0, r->t->ndim ? r->t->shape[0] : 1);
    if (rc == 0) rc = plan_out_end(b);
    if (rc != 0) return rc;
  }
  /* Whole tensors stream through each shard in file order. */
  qsort(b->p->outputs, b->p->noutputs, sizeof *b->p->outputs, cmp_file_order);
  return 0;
}

/* ---- attention ---------------------------------------------------------------------------- */

static int cfg(struct plan_builder *b, enum mcfg_field f, const char *purpose, uint64_t *out) {
  int64_t v;
  int rc = mcfg_get(b->c->config, f, purpose, &v, b->err);
  if (rc == 0) *out = (uint64_t)v; /* mcfg values are non-negative */
  return rc;
}

/* The kv-head rows of k_proj / v_proj (weight or bias) this rank gets, replicated when tp > kv heads. */
static int kv_range(struct plan_builder *b, const struct ckpt_ref *t, uint64_t kv_heads, uint64_t *a, uint64_t *e) {
  uint64_t rows = t->t->shape[0], tp = b->spec->tp_size, tr = b->spec->tp_rank;
  if (kv_heads == 0 || rows % kv_heads)
    return plan_fail(b, "tensor '%s': %" PRIu64 " rows are not %" PRIu64 " kv heads", t->t->name, rows, kv_heads);
  uint64_t d = rows / kv_heads;
  if (tp <= kv_heads) {
    if (kv_heads % tp)
      return plan_fail(b, "%" PRIu64 " kv heads do not divide by tp_size %" PRIu64 " (tensor '%s')", kv_heads, tp,
                       t->t->name);
    uint64_t per = kv_heads / tp;
    *a = tr * per * d;
    *e = *a + per * d;
    return 0;
  }
  if (tp % kv_heads)
    return plan_fail(b, "tp_size %" PRIu64 " exceeds the %" PRIu64 " kv heads and is not a multiple of them (tensor '%s')",
                     tp, kv_heads, t->t->name);
  *a = tr / (tp / kv_heads) * d;
  *e = *a + d;
  return 0;
}

/* Standard attention: q/k/v column-parallel by heads (kv heads replicated when needed), o row-parallel. */
static int layer_attention(struct plan_builder *b, const char *pre) {
  const struct ckpt_ref *q = plan_find(b, "%sself_attn.q_proj.weight", pre);
  const struct ckpt_ref *k = plan_find(b, "%sself_attn.k_proj.weight", pre);
  const struct ckpt_ref *v = plan_find(b, "%sself_attn.v_proj.weight", pre);
  if (q == NULL || k == NULL || v == NULL) return plan_fail(b, "%s: attention needs q_proj, k_proj and v_proj", pre);
  uint64_t heads = 0, kv = 0, tp = b->spec->tp_size;
  int rc = cfg(b, MCFG_NUM_ATTENTION_HEADS, "the tensor-parallel attention layout", &heads);
  if (rc == 0) rc = cfg(b, MCFG_NUM_KEY_VALUE_HEADS, "the tensor-parallel attention layout", &kv);
  if (rc != 0) return rc;
  if (heads == 0 || heads % tp) return plan_fail(b, "%" PRIu64 " query heads do not divide by tp_size %" PRIu64, heads, tp);
  uint64_t qd = q->t->shape[0] / heads;
  static const char *const kinds[] = {"weight", "bias"};
  for (int kind = 0; kind < 2; kind++) {
    const struct ckpt_ref *qt = plan_find(b, "%sself_attn.q_proj.%s", pre, kinds[kind]);
    const struct ckpt_ref *kt = plan_find(b, "%sself_attn.k_proj.%s", pre, kinds[kind]);
    const struct ckpt_ref *vt = plan_find(b, "%sself_attn.v_proj.%s", pre, kinds[kind]);
    if (qt == NULL && kt == NULL && vt == NULL) continue;
    if (qt == NULL || kt == NULL || vt == NULL)
      return plan_fail(b, "%s: q/k/v_proj.%s must all be present", pre, kinds[kind]);
    struct plan_part parts[3] = {{qt, 0, 0, 0}, {kt, 0, 0, 0}, {vt, 0, 0, 0}};
    if ((rc = plan_split_range(b, qt, 0, tp, b->spec->tp_rank, qd, &parts[0].a, &parts[0].b)) != 0) return rc;
    if ((rc = kv_range(b, kt, kv, &parts[1].a, &parts[1].b)) != 0) return rc;
    if ((rc = kv_range(b, vt, kv, &parts[2].a, &parts[2].b)) != 0) return rc;
    if (b->spec->fuse) {
      char name[512];
      snprintf(name, sizeof name, "%sself_attn.qkv_proj.%s", pre, kinds[kind]);
      rc = plan_emit_parts(b, name, parts, 3, 3, false);
    } else {
      for (int i = 0; i < 3 && rc == 0; i++) rc = plan_emit_parts(b, parts[i].t->t->name, &parts[i], 1, 1, false);
    }
    if (rc != 0) return rc;
  }
  return plan_emit_split(b, plan_find(b, "%sself_attn.o_proj.weight", pre), 1, qd);
}

/* Multi-head latent attention (DeepSeek): a-projections replicated, b-projections by heads, o by heads. */
static int layer_mla(struct plan_builder *b, const char *pre) {
  uint64_t heads = 0, nope = 0, rope = 0, vdim = 0, tp = b->spec->tp_size;
  int rc = cfg(b, MCFG_NUM_ATTENTION_HEADS, "the MLA layout", &heads);
  if (rc == 0) rc = cfg(b, MCFG_QK_NOPE_HEAD_DIM, "the MLA layout", &nope);
  if (rc == 0) rc = cfg(b, MCFG_QK_ROPE_HEAD_DIM, "the MLA layout", &rope);
  if (rc == 0) rc = cfg(b, MCFG_V_HEAD_DIM, "the MLA layout", &vdim);
  if (rc != 0) return rc;
  if (heads == 0 || heads % tp) return plan_fail(b, "%" PRIu64 " query heads do not divide by tp_size %" PRIu64, heads, tp);
  uint64_t qk;
  if (__builtin_add_overflow(nope, rope, &qk)) return plan_fail(b, "config.json: the MLA head sizes overflow");
  const struct ckpt_ref *qa = plan_find(b, "%sself_attn.q_a_proj.weight", pre);
  const struct ckpt_ref *kva = plan_find(b, "%sself_attn.kv_a_proj_with_mqa.weight", pre);
  if (b->spec->fuse && qa != NULL && kva != NULL) {
    struct plan_part parts[2] = {{qa, 0, 0, qa->t->shape[0]}, {kva, 0, 0, kva->t->shape[0]}};
    char name[512];
    snprintf(name, sizeof name, "%sself_attn.fused_qkv_a_proj.weight", pre);
    if ((rc = plan_emit_parts(b, name, parts, 2, 2, false)) != 0) return rc;
  } else {
    if ((rc = plan_emit_whole(b, qa)) != 0 || (rc = plan_emit_whole(b, kva)) != 0) return rc;
  }
  if ((rc = plan_emit_whole(b, plan_find(b, "%sself_attn.q_a_layernorm.weight", pre))) != 0) return rc;
  if ((rc = plan_emit_whole(b, plan_find(b, "%sself_attn.kv_a_layernorm.weight", pre))) != 0) return rc;
  const struct ckpt_ref *qb = plan_find(b, "%sself_attn.q_b_proj.weight", pre);
  if (qb == NULL) qb = plan_find(b, "%sself_attn.q_proj.weight", pre); /* no q LoRA */
  if ((rc = plan_emit_split(b, qb, 0, qk)) != 0) return rc;
  uint64_t kvd;
  if (__builtin_add_overflow(nope, vdim, &kvd)) return plan_fail(b, "config.json: the MLA head sizes overflow");
  if ((rc = plan_emit_split(b, plan_find(b, "%sself_attn.kv_b_proj.weight", pre), 0, kvd)) != 0) return rc;
  return plan_emit_split(b, plan_find(b, "%sself_attn.o_proj.weight", pre), 1, vdim);
}

/* ---- MLPs and experts ---------------------------------------------------------------------- */

/*
 * gate and up (column-parallel, fused as `fused` when fusing) and down
 * (row-parallel) over tp ranks; unfused parts keep their own names.
 * Returns the parts through w13 and w2 without emitting when `stack` is set.
 */
static int mlp_parts(struct plan_builder *b, const struct ckpt_ref *g, const struct ckpt_ref *u,
                     const struct ckpt_ref *d, uint64_t tp, uint64_t tr, struct plan_part w13[2], struct plan_part *w2) {
  w13[0] = (struct plan_part){g, 0, 0, 0};
  w13[1] = (struct plan_part){u, 0, 0, 0};
  *w2 = (struct plan_part){d, 1, 0, 0};
  int rc = plan_split_range(b, g, 0, tp, tr, 1, &w13[0].a, &w13[0].b);
  if (rc == 0) rc = plan_split_range(b, u, 0, tp, tr, 1, &w13[1].a, &w13[1].b);
  if (rc == 0) rc = plan_split_range(b, d, 1, tp, tr, 1, &w2->a, &w2->b);
  return rc;
}

/* Emits the parts of an MLP under their own names. */
static int emit_unfused(struct plan_builder *b, const struct plan_part w13[2], const struct plan_part *w2) {
  int rc = plan_emit_parts(b, w13[0].t->t->name, &w13[0], 1, 1, false);
  if (rc == 0) rc = plan_emit_parts(b, w13[1].t->t->name, &w13[1], 1, 1, false);
  return rc ? rc : plan_emit_parts(b, w2->t->t->name, w2, 1, 1, false);
}

/* A dense MLP at prefix mlp (e.g. "model.layers.0.mlp." or "...mlp.shared_experts."). */
static int dense_mlp(struct plan_builder *b, const char *mlp) {
  const struct ckpt_ref *g = plan_find(b, "%sgate_proj.weight", mlp), *u = plan_find(b, "%sup_proj.weight", mlp),
                        *d = plan_find(b, "%sdown_proj.weight", mlp);
  if (g == NULL && u == NULL && d == NULL) return 0;
  if (g == NULL || u == NULL || d == NULL) return plan_fail(b, "%s: an MLP needs gate_proj, up_proj and down_proj", mlp);
  struct plan_part w13[2], w2;
  int rc = mlp_parts(b, g, u, d, b->spec->tp_size, b->spec->tp_rank, w13, &w2);
  if (rc != 0 || !b->spec->fuse) return rc ? rc : emit_unfused(b, w13, &w2);
  char name[512];
  snprintf(name, sizeof name, "%sgate_up_proj.weight", mlp);
  rc = plan_emit_parts(b, name, w13, 2, 2, false);
  return rc ? rc : plan_emit_parts(b, d->t->name, &w2, 1, 1, false);
}

/* This rank's experts of n: an explicit list, else a contiguous range (the first n % ep ranks hold one more). */
static int rank_experts(struct plan_builder *b, uint64_t n, uint64_t **out, size_t *count) {
  const struct plan_spec *s = b->spec;
  uint64_t start = 0, cnt = n;
  if (s->ep_size > 1 && s->experts != NULL) {
    for (size_t i = 0; i < s->nexperts; i++)
      if (s->experts[i] >= n)
        return plan_fail(b, "expert %" PRIu64 " does not exist (the model has %" PRIu64 ")", s->experts[i], n);
    cnt = s->nexperts;
  } else if (s->ep_size > 1) {
    if (s->ep_size > n) return plan_fail(b, "ep_size %" PRIu64 " exceeds the %" PRIu64 " experts", s->ep_size, n);
    uint64_t base = n / s->ep_size, extra = n % s->ep_size, r = s->ep_rank;
    start = r * base + (r < extra ? r : extra);
    cnt = base + (r < extra ? 1 : 0);
  }
  if (cnt > SIZE_MAX / sizeof **out) return plan_nomem(b);
  *out = malloc((cnt ? cnt : 1) * sizeof **out);
  if (*out == NULL) return plan_nomem(b);
  for (uint64_t i = 0; i < cnt; i++) (*out)[i] = s->ep_size > 1 && s->experts != NULL ? s->experts[i] : start + i;
  *count = (size_t)cnt;
  return 0;
}

/* The routed experts of one MoE layer: this rank's, and no others. */
static int layer_experts(struct plan_builder *b, const char *pre, uint64_t n) {
  static const char *const projs[] = {"gate_proj", "up_proj", "down_proj"};
  for (uint64_t e = 0; e < n; e++) /* experts other ranks hold are not left over for replication */
    for (int k = 0; k < 3; k++) {
      const struct ckpt_ref *w = plan_find(b, "%smlp.experts.%" PRIu64 ".%s.weight", pre, e, projs[k]);
      plan_mark_used(b, w);
      plan_mark_used(b, plan_scale_of(b, w));
    }
  uint64_t *ex = NULL;
  size_t cnt = 0;
  int rc = rank_experts(b, n, &ex, &cnt);
  if (rc != 0) return rc;
  struct plan_part *w13 = calloc(2 * (cnt ? cnt : 1), sizeof *w13), *w2 = calloc(cnt ? cnt : 1, sizeof *w2);
  if (w13 == NULL || w2 == NULL) rc = plan_nomem(b);
  /* With expert parallelism a rank holds its experts whole; otherwise they are TP-sliced. */
  bool ep = b->spec->ep_size > 1;
  for (size_t i = 0; i < cnt && rc == 0; i++) {
    const struct ckpt_ref *g = plan_find(b, "%smlp.experts.%" PRIu64 ".gate_proj.weight", pre, ex[i]);
    const struct ckpt_ref *u = plan_find(b, "%smlp.experts.%" PRIu64 ".up_proj.weight", pre, ex[i]);
    const struct ckpt_ref *d = plan_find(b, "%smlp.experts.%" PRIu64 ".down_proj.weight", pre, ex[i]);
    if (g == NULL || u == NULL || d == NULL)
      rc = plan_fail(b, "%smlp.experts.%" PRIu64 ": gate_proj, up_proj or down_proj is missing", pre, ex[i]);
    if (rc == 0) rc = mlp_parts(b, g, u, d, ep ? 1 : b->spec->tp_size, ep ? 0 : b->spec->tp_rank, &w13[2 * i], &w2[i]);
    if (rc == 0 && !b->spec->fuse) rc = emit_unfused(b, &w13[2 * i], &w2[i]);
  }
  if (rc == 0 && b->spec->fuse && cnt > 0) {
    char name[512];
    snprintf(name, sizeof name, "%smlp.experts.w13_weight", pre);
    rc = plan_emit_parts(b, name, w13, 2 * cnt, 2, true);
    snprintf(name, sizeof name, "%smlp.experts.w2_weight", pre);
    if (rc == 0) rc = plan_emit_parts(b, name, w2, cnt, 1, true);
  }
  free(ex);
  free(w13);
  free(w2);
  return rc;
}

/* Counts the routed experts a layer has ("mlp.experts.N." present). */
static uint64_t count_experts(struct plan_builder *b, const char *pre) {
  uint64_t n = 0;
  while (plan_find(b, "%smlp.experts.%" PRIu64 ".down_proj.weight", pre, n) != NULL) n++;
  return n;
}

/* An MoE layer's MLP: the router, this rank's experts, the shared experts. */
static int moe_mlp(struct plan_builder *b, const char *pre, uint64_t ne) {
  uint64_t cfg_e = 0;
  if (b->spec->family == FAMILY_DENSE) return plan_fail(b, "%s has experts: use the qwen3_moe or deepseek_v3 preset", pre);
  if (cfg(b, MCFG_NUM_EXPERTS, "the expert-parallel layout", &cfg_e) == 0 && cfg_e != ne)
    return plan_fail(b, "%s has %" PRIu64 " experts but config.json says %" PRIu64, pre, ne, cfg_e);
  int rc = plan_emit_whole(b, plan_find(b, "%smlp.gate.weight", pre));
  if (rc == 0) rc = plan_emit_whole(b, plan_find(b, "%smlp.gate.e_score_correction_bias", pre));
  if (rc == 0) rc = layer_experts(b, pre, ne);
  char mlp[96];
  snprintf(mlp, sizeof mlp, "%smlp.shared_experts.", pre);
  if (rc == 0) rc = dense_mlp(b, mlp);
  snprintf(mlp, sizeof mlp, "%smlp.shared_expert.", pre);
  if (rc == 0) rc = dense_mlp(b, mlp);
  return rc ? rc : plan_emit_whole(b, plan_find(b, "%smlp.shared_expert_gate.weight", pre));
}

/* ---- the model ---------------------------------------------------------------------------- */

/* Vocabulary-parallel: padded to a multiple of 64, divided by tp, padding rows zero. */
static int emit_vocab(struct plan_builder *b, const struct ckpt_ref *t) {
  if (t == NULL) return 0;
  uint64_t tp = b->spec->tp_size;
  if (plan_scale_of(b, t) != NULL) return plan_fail(b, "tensor '%s': a quantized vocabulary is not supported", t->t->name);
  if (t->t->ndim != 2) return plan_fail(b, "tensor '%s' should be [vocab, hidden]", t->t->name);
  uint64_t v = t->t->shape[0], vp = v / 64 * 64;
  if (vp != v && __builtin_add_overflow(vp, 64, &vp)) return plan_fail(b, "tensor '%s': its vocabulary overflows", t->t->name);
  if (vp % tp) return plan_fail(b, "the padded vocabulary (%" PRIu64 ") does not divide by tp_size %" PRIu64, vp, tp);
  uint64_t per = vp / tp, a = b->spec->tp_rank * per, e = a + per;
  uint64_t real_a = a < v ? a : v, real_e = e < v ? e : v;
  uint64_t shape[2] = {per, t->t->shape[1]};
  int rc = plan_out_begin(b, t->t->name, t->t->dtype, 2, shape);
  if (rc == 0 && real_e > real_a) rc = plan_out_slice(b, t, 0, real_a, real_e);
  if (rc == 0 && per > real_e - real_a) rc = plan_out_zeros(b, per - (real_e - real_a));
  plan_mark_used(b, t);
  return rc ? rc : plan_out_end(b);
}

static int layer(struct plan_builder *b, uint64_t i) {
  char pre[64], mlp[96];
  snprintf(pre, sizeof pre, "model.layers.%" PRIu64 ".", i);
  int rc = plan_emit_whole(b, plan_find(b, "%sinput_layernorm.weight", pre));
  if (rc == 0) {
    if (plan_find(b, "%sself_attn.kv_a_proj_with_mqa.weight", pre) != NULL) rc = layer_mla(b, pre);
    else if (plan_find(b, "%sself_attn.q_proj.weight", pre) != NULL) rc = layer_attention(b, pre);
  }
  if (rc == 0) rc = plan_emit_whole(b, plan_find(b, "%sself_attn.q_norm.weight", pre));
  if (rc == 0) rc = plan_emit_whole(b, plan_find(b, "%sself_attn.k_norm.weight", pre));
  if (rc == 0) rc = plan_emit_whole(b, plan_find(b, "%spost_attention_layernorm.weight", pre));
  if (rc != 0) return rc;
  uint64_t ne = count_experts(b, pre);
  if (ne > 0) return moe_mlp(b, pre, ne);
  snprintf(mlp, sizeof mlp, "%smlp.", pre);
  return dense_mlp(b, mlp);
}

int plan_preset_layers(struct plan_builder *b) {
  uint64_t nlayers = 0;
  while (plan_find(b, "model.layers.%" PRIu64 ".input_layernorm.weight", nlayers) != NULL ||
         plan_find(b, "model.layers.%" PRIu64 ".post_attention_layernorm.weight", nlayers) != NULL)
    nlayers++;
  int rc = 0;
  for (uint64_t i = 0; i < nlayers && rc == 0; i++) rc = layer(b, i);
  if (rc != 0) return rc;
  int64_t tied = 0;
  if (b->c->config != NULL) mcfg_get(b->c->config, MCFG_TIE_WORD_EMBEDDINGS, "embeddings", &tied, NULL);
  const struct ckpt_ref *embed = ckpt_tensor_find(b->c, "model.embed_tokens.weight");
  const struct ckpt_ref *head = ckpt_tensor_find(b->c, "lm_head.weight");
  if ((rc = emit_vocab(b, embed)) != 0) return rc;
  if ((rc = plan_emit_whole(b, ckpt_tensor_find(b->c, "model.norm.weight"))) != 0) return rc;
  if (tied && embed != NULL) plan_mark_used(b, head); /* tied embeddings are served once */
  else if ((rc = emit_vocab(b, head)) != 0) return rc;
  /* Anything the rules did not place is replicated whole (extra buffers, MTP layers...). */
  for (size_t i = 0; i < b->c->ntensors && rc == 0; i++) {
    const struct ckpt_ref *r = &b->c->by_name[i];
    if (b->used[i]) continue;
    size_t nl = r->t->name_len;
    if (nl > 10 && strcmp(r->t->name + nl - 10, "_scale_inv") == 0) continue; /* emitted with its weight */
    rc = plan_emit_whole(b, r);
  }
  return rc;
}
