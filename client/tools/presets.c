/*
 * presets.c - the preset table, the per-family tensor generators, the
 * shard rules and the config.json table behind `weightctl mkcheckpoint`.
 *
 * Tensor order is the PyTorch state-dict order of the transformers model
 * classes: model.embed_tokens, then each layer (self_attn, mlp,
 * input_layernorm, post_attention_layernorm, every submodule in the order
 * its __init__ creates it), then model.norm and lm_head.
 *
 * Shard rules (see layout_shard()):
 *  - The full model (every layer) follows save_pretrained: walk the tensors
 *    in order and start a new shard when adding the next tensor would push
 *    the open shard past max_shard_size (decimal bytes). Qwen3 uses
 *    4,000,000,000, which gives the published 1, 3, 5 and 16 shards.
 *    DeepSeek-V3 was split by its own tool; 4,160,000,000 gives its
 *    published 163 shards for the tensors generated here (any limit from
 *    4,140,752,608 to 4,170,119,903 does).
 *  - A model cut with --layers, --experts or both keeps the published
 *    shard count (but never more shards than tensors) and splits the
 *    tensors in order into shards of about equal bytes: shard k ends with
 *    the first tensor whose end reaches (k+1)/S of the payload, taking at
 *    least one tensor and leaving at least one for every later shard.
 *
 * A variant with fewer routed experts keeps experts 0 to N-1 of every MoE
 * layer, a router (mlp.gate) of N rows and, for DeepSeek, an
 * e_score_correction_bias of N; its config.json says N and fits the
 * router settings to it (see router_fit()).
 */
#include "presets.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* ---- the preset table ---------------------------------------------------- */

#define QWEN3_COMMON                                                                        \
  .architecture = "Qwen3ForCausalLM", .model_type = "qwen3", .transformers_version = "4.51.0", \
  .rope_theta = "1000000", .rms_norm_eps = "1e-06", .head_dim = 128, .vocab_size = 151936,   \
  .max_position_embeddings = 40960, .bos_token_id = 151643, .eos_token_id = 151645,          \
  .max_shard_size = 4000000000ULL, .shard_count_digits = 5

static const struct preset presets[] = {
    {
        .name = "qwen3-0.6b", .family = PRESET_QWEN3, QWEN3_COMMON,
        .hidden_size = 1024, .num_layers = 28, .num_heads = 16, .num_kv_heads = 8,
        .intermediate_size = 3072, .max_window_layers = 28,
        .tie_word_embeddings = true, .stores_lm_head = true, .shards = 1,
    },
    {
        .name = "qwen3-4b", .family = PRESET_QWEN3, QWEN3_COMMON,
        .hidden_size = 2560, .num_layers = 36, .num_heads = 32, .num_kv_heads = 8,
        .intermediate_size = 9728, .max_window_layers = 36,
        .tie_word_embeddings = true, .stores_lm_head = false, .shards = 3,
    },
    {
        .name = "qwen3-8b", .family = PRESET_QWEN3, QWEN3_COMMON,
        .hidden_size = 4096, .num_layers = 36, .num_heads = 32, .num_kv_heads = 8,
        .intermediate_size = 12288, .max_window_layers = 36,
        .tie_word_embeddings = false, .stores_lm_head = true, .shards = 5,
    },
    {
        .name = "qwen3-30b-a3b", .family = PRESET_QWEN3_MOE,
        .architecture = "Qwen3MoeForCausalLM", .model_type = "qwen3_moe",
        .transformers_version = "4.51.0", .rope_theta = "1000000.0", .rms_norm_eps = "1e-06",
        .hidden_size = 2048, .num_layers = 48, .num_heads = 32, .num_kv_heads = 4, .head_dim = 128,
        .intermediate_size = 6144, .vocab_size = 151936, .max_position_embeddings = 40960,
        .max_window_layers = 48, .bos_token_id = 151643, .eos_token_id = 151645,
        .tie_word_embeddings = false, .stores_lm_head = true,
        .num_experts = 128, .experts_per_tok = 8, .moe_intermediate_size = 768,
        .decoder_sparse_step = 1,
        .max_shard_size = 4000000000ULL, .shards = 16, .shard_count_digits = 5,
    },
    {
        .name = "deepseek-v3", .family = PRESET_DEEPSEEK_V3,
        .architecture = "DeepseekV3ForCausalLM", .model_type = "deepseek_v3",
        .transformers_version = "4.33.1", .rope_theta = "10000", .rms_norm_eps = "1e-06",
        .hidden_size = 7168, .num_layers = 61, .num_heads = 128, .num_kv_heads = 128,
        .intermediate_size = 18432, .vocab_size = 129280, .max_position_embeddings = 163840,
        .bos_token_id = 0, .eos_token_id = 1,
        .tie_word_embeddings = false, .stores_lm_head = true,
        .num_experts = 256, .experts_per_tok = 8, .moe_intermediate_size = 2048,
        .n_shared_experts = 1, .first_k_dense_replace = 3, .n_group = 8, .topk_group = 4,
        .q_lora_rank = 1536, .kv_lora_rank = 512, .qk_nope_head_dim = 128,
        .qk_rope_head_dim = 64, .v_head_dim = 128, .fp8_block = 128,
        .max_shard_size = 4160000000ULL, .shards = 163, .shard_count_digits = 6,
    },
};

#define NPRESETS (sizeof presets / sizeof presets[0])

size_t preset_count(void) { return NPRESETS; }

const struct preset *preset_at(size_t i) { return i < NPRESETS ? &presets[i] : NULL; }

const struct preset *preset_find(const char *name) {
  for (size_t i = 0; i < NPRESETS; i++)
    if (name != NULL && strcmp(presets[i].name, name) == 0) return &presets[i];
  return NULL;
}

/* ---- building the tensor list -------------------------------------------- */

/*
 * The generators append through a builder whose status is sticky: after the
 * first failure every further append does nothing, and the caller checks
 * the status once at the end.
 */
struct builder {
  struct preset_layout *l;
  const struct preset *p;
  int rc;
};

#define NAME_MAX_LEN 256

/* Formats a tensor name into out: true, or false after failing the builder (a name longer than NAME_MAX_LEN). */
static bool format_name(struct builder *b, char out[NAME_MAX_LEN], const char *fmt, va_list ap) {
  int n = vsnprintf(out, NAME_MAX_LEN, fmt, ap);
  if (n >= 0 && n < NAME_MAX_LEN) return true;
  if (b->rc == 0) b->rc = WEIGHTD_E_INTERNAL;
  return false;
}

/* Appends a tensor named by fmt; ndim is 1 (d0) or 2 (d0, d1). */
static void add(struct builder *b, enum wd_dtype dtype, unsigned ndim, uint64_t d0, uint64_t d1,
                const char *fmt, ...) __attribute__((format(printf, 6, 7)));

static void add(struct builder *b, enum wd_dtype dtype, unsigned ndim, uint64_t d0, uint64_t d1,
                const char *fmt, ...) {
  struct preset_layout *l = b->l;
  if (b->rc < 0) return;
  char name[NAME_MAX_LEN];
  va_list ap;
  va_start(ap, fmt);
  bool named = format_name(b, name, fmt, ap);
  va_end(ap);
  if (!named) return;
  if (l->count == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 1024;
    struct preset_tensor *t = realloc(l->tensors, cap * sizeof *t);
    if (t == NULL) {
      b->rc = WEIGHTD_E_NOMEM;
      return;
    }
    l->tensors = t;
    l->cap = cap;
  }
  struct preset_tensor *t = &l->tensors[l->count];
  memset(t, 0, sizeof *t);
  t->name = strdup(name);
  if (t->name == NULL) {
    b->rc = WEIGHTD_E_NOMEM;
    return;
  }
  t->dtype = dtype;
  t->fill = dtype == WD_DTYPE_F32 ? PRESET_FILL_F32_POSITIVE : PRESET_FILL_BYTES;
  t->ndim = ndim;
  t->shape[0] = d0;
  t->shape[1] = ndim > 1 ? d1 : 0;
  uint64_t elements = ndim > 1 ? d0 * d1 : d0;
  t->nbytes = elements * dtype_bits(dtype) / 8;
  l->count++;
  l->total_bytes += t->nbytes;
}

/* Appends a 1-D norm weight "<prefix>.weight" in BF16. */
static void add_norm(struct builder *b, uint64_t n, const char *prefix, uint32_t layer) {
  add(b, WD_DTYPE_BF16, 1, n, 0, prefix, layer);
}

/*
 * Appends the weight of a linear layer [out, in] named "<fmt>.weight": BF16,
 * or for an FP8 preset F8_E4M3 followed by its F32 "<fmt>.weight_scale_inv"
 * of shape [ceil(out/block), ceil(in/block)].
 */
static void add_linear(struct builder *b, uint64_t out, uint64_t in, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void add_linear(struct builder *b, uint64_t out, uint64_t in, const char *fmt, ...) {
  char prefix[NAME_MAX_LEN];
  va_list ap;
  va_start(ap, fmt);
  bool named = format_name(b, prefix, fmt, ap);
  va_end(ap);
  if (!named) return;
  uint64_t blk = b->p->fp8_block;
  if (blk == 0) {
    add(b, WD_DTYPE_BF16, 2, out, in, "%s.weight", prefix);
    return;
  }
  add(b, WD_DTYPE_F8_E4M3, 2, out, in, "%s.weight", prefix);
  add(b, WD_DTYPE_F32, 2, (out + blk - 1) / blk, (in + blk - 1) / blk, "%s.weight_scale_inv", prefix);
}

/* Appends a gated MLP (gate_proj, up_proj, down_proj) of width `inter` under prefix. */
static void add_mlp(struct builder *b, uint64_t inter, const char *prefix) {
  uint64_t h = b->p->hidden_size;
  add_linear(b, inter, h, "%s.gate_proj", prefix);
  add_linear(b, inter, h, "%s.up_proj", prefix);
  add_linear(b, h, inter, "%s.down_proj", prefix);
}

/* Appends Qwen3 attention: q/k/v/o projections, then the per-head q_norm and k_norm. */
static void add_qwen3_attention(struct builder *b, uint32_t i) {
  const struct preset *p = b->p;
  uint64_t h = p->hidden_size, q = (uint64_t)p->num_heads * p->head_dim;
  uint64_t kv = (uint64_t)p->num_kv_heads * p->head_dim;
  add_linear(b, q, h, "model.layers.%u.self_attn.q_proj", i);
  add_linear(b, kv, h, "model.layers.%u.self_attn.k_proj", i);
  add_linear(b, kv, h, "model.layers.%u.self_attn.v_proj", i);
  add_linear(b, h, q, "model.layers.%u.self_attn.o_proj", i);
  add_norm(b, p->head_dim, "model.layers.%u.self_attn.q_norm.weight", i);
  add_norm(b, p->head_dim, "model.layers.%u.self_attn.k_norm.weight", i);
}

/* Appends the two layer norms that close every decoder layer. */
static void add_layer_norms(struct builder *b, uint32_t i) {
  add_norm(b, b->p->hidden_size, "model.layers.%u.input_layernorm.weight", i);
  add_norm(b, b->p->hidden_size, "model.layers.%u.post_attention_layernorm.weight", i);
}

/* Appends dense Qwen3 layer i (Qwen3DecoderLayer). */
static void layer_qwen3(struct builder *b, uint32_t i) {
  char prefix[64];
  snprintf(prefix, sizeof prefix, "model.layers.%u.mlp", i);
  add_qwen3_attention(b, i);
  add_mlp(b, b->p->intermediate_size, prefix);
  add_layer_norms(b, i);
}

/*
 * Appends Qwen3-MoE layer i (Qwen3MoeDecoderLayer): a sparse block (router
 * mlp.gate, then the experts) on every decoder_sparse_step-th layer, else a
 * dense MLP of intermediate_size.
 */
static void layer_qwen3_moe(struct builder *b, uint32_t i) {
  const struct preset *p = b->p;
  char prefix[64];
  add_qwen3_attention(b, i);
  bool sparse = p->num_experts > 0 && p->decoder_sparse_step > 0 && (i + 1) % p->decoder_sparse_step == 0;
  if (sparse) {
    add(b, WD_DTYPE_BF16, 2, p->num_experts, p->hidden_size, "model.layers.%u.mlp.gate.weight", i);
    for (uint32_t e = 0; e < p->num_experts && b->rc == 0; e++) {
      snprintf(prefix, sizeof prefix, "model.layers.%u.mlp.experts.%u", i, e);
      add_mlp(b, p->moe_intermediate_size, prefix);
    }
  } else {
    snprintf(prefix, sizeof prefix, "model.layers.%u.mlp", i);
    add_mlp(b, p->intermediate_size, prefix);
  }
  add_layer_norms(b, i);
}

/*
 * Appends DeepSeek-V3 layer i (DeepseekV3DecoderLayer): MLA attention, then a
 * dense MLP for the first first_k_dense_replace layers, else the MoE block
 * (experts, the router mlp.gate with its e_score_correction_bias, then the
 * shared experts).
 */
static void layer_deepseek_v3(struct builder *b, uint32_t i) {
  const struct preset *p = b->p;
  uint64_t h = p->hidden_size;
  uint64_t qk_head = (uint64_t)p->qk_nope_head_dim + p->qk_rope_head_dim;
  char prefix[64];
  add_linear(b, p->q_lora_rank, h, "model.layers.%u.self_attn.q_a_proj", i);
  add_norm(b, p->q_lora_rank, "model.layers.%u.self_attn.q_a_layernorm.weight", i);
  add_linear(b, p->num_heads * qk_head, p->q_lora_rank, "model.layers.%u.self_attn.q_b_proj", i);
  add_linear(b, (uint64_t)p->kv_lora_rank + p->qk_rope_head_dim, h,
             "model.layers.%u.self_attn.kv_a_proj_with_mqa", i);
  add_norm(b, p->kv_lora_rank, "model.layers.%u.self_attn.kv_a_layernorm.weight", i);
  add_linear(b, (uint64_t)p->num_heads * (p->qk_nope_head_dim + p->v_head_dim), p->kv_lora_rank,
             "model.layers.%u.self_attn.kv_b_proj", i);
  add_linear(b, h, (uint64_t)p->num_heads * p->v_head_dim, "model.layers.%u.self_attn.o_proj", i);
  if (i < p->first_k_dense_replace) {
    snprintf(prefix, sizeof prefix, "model.layers.%u.mlp", i);
    add_mlp(b, p->intermediate_size, prefix);
  } else {
    for (uint32_t e = 0; e < p->num_experts && b->rc == 0; e++) {
      snprintf(prefix, sizeof prefix, "model.layers.%u.mlp.experts.%u", i, e);
      add_mlp(b, p->moe_intermediate_size, prefix);
    }
    add(b, WD_DTYPE_BF16, 2, p->num_experts, h, "model.layers.%u.mlp.gate.weight", i);
    add(b, WD_DTYPE_F32, 1, p->num_experts, 0, "model.layers.%u.mlp.gate.e_score_correction_bias", i);
    snprintf(prefix, sizeof prefix, "model.layers.%u.mlp.shared_experts", i);
    add_mlp(b, (uint64_t)p->moe_intermediate_size * p->n_shared_experts, prefix);
  }
  add_layer_norms(b, i);
}

/* The per-family layer generators. */
static void (*const family_layer[PRESET_FAMILY_COUNT])(struct builder *, uint32_t) = {
    [PRESET_QWEN3] = layer_qwen3,
    [PRESET_QWEN3_MOE] = layer_qwen3_moe,
    [PRESET_DEEPSEEK_V3] = layer_deepseek_v3,
};

/* ---- shard rules ---------------------------------------------------------- */

/*
 * The save_pretrained rule: a new shard starts when the next tensor would
 * push the open shard past max. A tensor larger than max gets a shard of its
 * own; save_pretrained numbers such a shard before the open one, here it
 * stays in order (no preset has such a tensor). Returns the shard count.
 */
static uint32_t shard_greedy(struct preset_layout *l, uint64_t max) {
  uint32_t shard = 0;
  uint64_t open = 0;
  for (size_t i = 0; i < l->count; i++) {
    uint64_t n = l->tensors[i].nbytes;
    if (open > 0 && (open + n > max || n > max)) {
      shard++;
      open = 0;
    }
    l->tensors[i].shard = shard;
    open += n;
    if (n > max) {
      shard++;
      open = 0;
    }
  }
  return open > 0 ? shard + 1 : shard;
}

/*
 * The rule for a model cut with --layers or --experts: `want` shards of
 * about equal bytes, as described at the top of this file. Returns the
 * shard count.
 */
static uint32_t shard_even(struct preset_layout *l, uint32_t want) {
  size_t n = l->count;
  if (want > n) want = (uint32_t)n;
  if (want == 0) want = 1;
  size_t i = 0;
  uint64_t done = 0;
  for (uint32_t k = 0; k < want && i < n; k++) {
    uint32_t later = want - k - 1;
    uint64_t target = l->total_bytes / want * (k + 1) + l->total_bytes % want * (k + 1) / want;
    do {
      l->tensors[i].shard = k;
      done += l->tensors[i].nbytes;
      i++;
    } while (i < n && (later == 0 || (n - i > later && done < target)));
  }
  return want;
}

/* Cuts l into shards by the rule for its variant and sets every tensor's offset. */
static int layout_shard(struct preset_layout *l, struct wd_error *err) {
  const struct preset *p = l->preset;
  bool full = l->layers == p->num_layers && l->model.num_experts == p->num_experts;
  l->shards = full ? shard_greedy(l, p->max_shard_size) : shard_even(l, p->shards);
  if (full && l->shards != p->shards)
    return err_set(err, WEIGHTD_E_INTERNAL, "preset %s: the shard rule gives %u shards, published %u",
                   p->name, l->shards, p->shards);
  uint64_t off = 0;
  for (size_t i = 0; i < l->count; i++) {
    if (i > 0 && l->tensors[i].shard != l->tensors[i - 1].shard) off = 0;
    l->tensors[i].offset = off;
    off += l->tensors[i].nbytes;
  }
  return 0;
}

/*
 * Fits the router settings of m to its num_experts routed experts. Each
 * token goes to experts_per_tok experts, so there can be no more of those
 * than experts. DeepSeek's grouped router splits the experts into n_group
 * equal groups, scores each group by the sum of its two best experts,
 * keeps the topk_group best groups and picks the token's experts inside
 * them; the published grouping stays while it still works, else there is
 * one group (n_group = topk_group = 1). A single expert still leaves a
 * group of one, which that router cannot score: such a model is a layout
 * to load, not one to run.
 */
static void router_fit(struct preset *m) {
  if (m->experts_per_tok > m->num_experts) m->experts_per_tok = m->num_experts;
  if (m->n_group == 0) return;
  uint32_t per_group = m->num_experts / m->n_group;
  bool works = m->num_experts % m->n_group == 0 && per_group >= 2 &&
               (uint64_t)m->topk_group * per_group >= m->experts_per_tok;
  if (!works) {
    m->n_group = 1;
    m->topk_group = 1;
  }
}

int preset_layout_build(const struct preset *p, const struct preset_variant *v, struct preset_layout *out,
                        struct wd_error *err) {
  memset(out, 0, sizeof *out);
  if (p == NULL || v == NULL) return err_set(err, WEIGHTD_E_INVALID, "no preset or variant");
  if (v->layers < 1 || v->layers > p->num_layers)
    return err_set(err, WEIGHTD_E_INVALID, "preset %s: layers must be 1 to %u", p->name, p->num_layers);
  if (v->experts != 0 && p->num_experts == 0)
    return err_set(err, WEIGHTD_E_INVALID, "preset %s is dense: it has no routed experts", p->name);
  if (v->experts > p->num_experts)
    return err_set(err, WEIGHTD_E_INVALID, "preset %s: experts must be 1 to %u", p->name, p->num_experts);
  out->preset = p;
  out->model = *p;
  if (v->experts != 0) out->model.num_experts = v->experts;
  router_fit(&out->model);
  out->layers = v->layers;
  struct builder b = {.l = out, .p = &out->model, .rc = 0};
  int rc;

  add(&b, WD_DTYPE_BF16, 2, p->vocab_size, p->hidden_size, "model.embed_tokens.weight");
  for (uint32_t i = 0; i < out->layers && b.rc == 0; i++) family_layer[p->family](&b, i);
  add(&b, WD_DTYPE_BF16, 1, p->hidden_size, 0, "model.norm.weight");
  if (p->stores_lm_head) add(&b, WD_DTYPE_BF16, 2, p->vocab_size, p->hidden_size, "lm_head.weight");
  rc = b.rc;
  if (rc < 0) {
    err_set(err, rc, "preset %s: cannot build the tensor list", p->name);
    goto fail;
  }
  rc = layout_shard(out, err);
  if (rc < 0) goto fail;
  return 0;

fail:
  preset_layout_free(out);
  return rc;
}

void preset_layout_free(struct preset_layout *l) {
  if (l == NULL) return;
  for (size_t i = 0; i < l->count; i++) free(l->tensors[i].name);
  free(l->tensors);
  memset(l, 0, sizeof *l);
}

/* ---- config.json ------------------------------------------------------------ */

#define FAM(f) (1u << (f))
#define F_QWEN (FAM(PRESET_QWEN3) | FAM(PRESET_QWEN3_MOE))
#define F_MOE FAM(PRESET_QWEN3_MOE)
#define F_DS FAM(PRESET_DEEPSEEK_V3)
#define F_ALL (F_QWEN | F_DS)

/* How a config row finds its value. */
enum cfg_kind {
  CFG_RAW,     /* the row's JSON text */
  CFG_U32,     /* a uint32_t member of the preset */
  CFG_NUMBER,  /* a const char * member holding JSON number text */
  CFG_STRING,  /* a const char * member, written as a JSON string */
  CFG_BOOL,    /* a bool member */
  CFG_ARCH,    /* the architectures list */
  CFG_LAYERS,  /* the layer count written */
  CFG_FP8,     /* quantization_config from fp8_block */
};

struct cfg_row {
  const char *key;
  unsigned families;
  enum cfg_kind kind;
  size_t member;
  const char *raw;
};

#define M(field) offsetof(struct preset, field)

/* The config.json keys in the sorted order transformers writes them. */
static const struct cfg_row cfg_rows[] = {
    {"architectures", F_ALL, CFG_ARCH, 0, NULL},
    {"attention_bias", F_ALL, CFG_RAW, 0, "false"},
    {"attention_dropout", F_ALL, CFG_RAW, 0, "0.0"},
    {"aux_loss_alpha", F_DS, CFG_RAW, 0, "0.001"},
    {"bos_token_id", F_ALL, CFG_U32, M(bos_token_id), NULL},
    {"decoder_sparse_step", F_MOE, CFG_U32, M(decoder_sparse_step), NULL},
    {"eos_token_id", F_ALL, CFG_U32, M(eos_token_id), NULL},
    {"ep_size", F_DS, CFG_RAW, 0, "1"},
    {"first_k_dense_replace", F_DS, CFG_U32, M(first_k_dense_replace), NULL},
    {"head_dim", F_QWEN, CFG_U32, M(head_dim), NULL},
    {"hidden_act", F_ALL, CFG_RAW, 0, "\"silu\""},
    {"hidden_size", F_ALL, CFG_U32, M(hidden_size), NULL},
    {"initializer_range", F_ALL, CFG_RAW, 0, "0.02"},
    {"intermediate_size", F_ALL, CFG_U32, M(intermediate_size), NULL},
    {"kv_lora_rank", F_DS, CFG_U32, M(kv_lora_rank), NULL},
    {"max_position_embeddings", F_ALL, CFG_U32, M(max_position_embeddings), NULL},
    {"max_window_layers", F_QWEN, CFG_U32, M(max_window_layers), NULL},
    {"mlp_only_layers", F_MOE, CFG_RAW, 0, "[]"},
    {"model_type", F_ALL, CFG_STRING, M(model_type), NULL},
    {"moe_intermediate_size", F_MOE | F_DS, CFG_U32, M(moe_intermediate_size), NULL},
    {"moe_layer_freq", F_DS, CFG_RAW, 0, "1"},
    {"n_group", F_DS, CFG_U32, M(n_group), NULL},
    {"n_routed_experts", F_DS, CFG_U32, M(num_experts), NULL},
    {"n_shared_experts", F_DS, CFG_U32, M(n_shared_experts), NULL},
    {"norm_topk_prob", F_MOE | F_DS, CFG_RAW, 0, "true"},
    {"num_attention_heads", F_ALL, CFG_U32, M(num_heads), NULL},
    {"num_experts", F_MOE, CFG_U32, M(num_experts), NULL},
    {"num_experts_per_tok", F_MOE | F_DS, CFG_U32, M(experts_per_tok), NULL},
    {"num_hidden_layers", F_ALL, CFG_LAYERS, 0, NULL},
    {"num_key_value_heads", F_ALL, CFG_U32, M(num_kv_heads), NULL},
    /* The published DeepSeek-V3 says 1; the MTP layer is not generated, so 0. */
    {"num_nextn_predict_layers", F_DS, CFG_RAW, 0, "0"},
    {"output_router_logits", F_MOE, CFG_RAW, 0, "false"},
    {"pretraining_tp", F_DS, CFG_RAW, 0, "1"},
    {"q_lora_rank", F_DS, CFG_U32, M(q_lora_rank), NULL},
    {"qk_nope_head_dim", F_DS, CFG_U32, M(qk_nope_head_dim), NULL},
    {"qk_rope_head_dim", F_DS, CFG_U32, M(qk_rope_head_dim), NULL},
    {"quantization_config", F_DS, CFG_FP8, 0, NULL},
    {"rms_norm_eps", F_ALL, CFG_NUMBER, M(rms_norm_eps), NULL},
    {"rope_scaling", F_QWEN, CFG_RAW, 0, "null"},
    {"rope_scaling", F_DS, CFG_RAW, 0,
     "{\n    \"beta_fast\": 32,\n    \"beta_slow\": 1,\n    \"factor\": 40,\n    \"mscale\": 1.0,\n"
     "    \"mscale_all_dim\": 1.0,\n    \"original_max_position_embeddings\": 4096,\n"
     "    \"type\": \"yarn\"\n  }"},
    {"rope_theta", F_ALL, CFG_NUMBER, M(rope_theta), NULL},
    {"routed_scaling_factor", F_DS, CFG_RAW, 0, "2.5"},
    {"router_aux_loss_coef", F_MOE, CFG_RAW, 0, "0.001"},
    {"scoring_func", F_DS, CFG_RAW, 0, "\"sigmoid\""},
    {"seq_aux", F_DS, CFG_RAW, 0, "true"},
    {"sliding_window", F_QWEN, CFG_RAW, 0, "null"},
    {"tie_word_embeddings", F_ALL, CFG_BOOL, M(tie_word_embeddings), NULL},
    {"topk_group", F_DS, CFG_U32, M(topk_group), NULL},
    {"topk_method", F_DS, CFG_RAW, 0, "\"noaux_tc\""},
    {"torch_dtype", F_ALL, CFG_RAW, 0, "\"bfloat16\""},
    {"transformers_version", F_ALL, CFG_STRING, M(transformers_version), NULL},
    {"use_cache", F_ALL, CFG_RAW, 0, "true"},
    {"use_sliding_window", F_QWEN, CFG_RAW, 0, "false"},
    {"v_head_dim", F_DS, CFG_U32, M(v_head_dim), NULL},
    {"vocab_size", F_ALL, CFG_U32, M(vocab_size), NULL},
};

#undef M

/* Prints one row's value for model p with `layers` layers. */
static void cfg_value(const struct cfg_row *r, const struct preset *p, uint32_t layers, FILE *f) {
  const char *base = (const char *)p;
  const char *text;
  switch (r->kind) {
  case CFG_RAW: fputs(r->raw, f); break;
  case CFG_U32: fprintf(f, "%u", *(const uint32_t *)(const void *)(base + r->member)); break;
  case CFG_NUMBER:
    memcpy(&text, base + r->member, sizeof text);
    fputs(text, f);
    break;
  case CFG_STRING:
    memcpy(&text, base + r->member, sizeof text);
    fprintf(f, "\"%s\"", text);
    break;
  case CFG_BOOL: fputs(*(const bool *)(const void *)(base + r->member) ? "true" : "false", f); break;
  case CFG_ARCH: fprintf(f, "[\n    \"%s\"\n  ]", p->architecture); break;
  case CFG_LAYERS: fprintf(f, "%u", layers); break;
  case CFG_FP8:
    fprintf(f,
            "{\n    \"activation_scheme\": \"dynamic\",\n    \"fmt\": \"e4m3\",\n"
            "    \"quant_method\": \"fp8\",\n    \"weight_block_size\": [\n      %u,\n      %u\n    ]\n  }",
            p->fp8_block, p->fp8_block);
    break;
  }
}

int preset_config_write(const struct preset_layout *l, FILE *f) {
  const struct preset *p = &l->model;
  bool first = true;
  fputs("{\n", f);
  for (size_t i = 0; i < sizeof cfg_rows / sizeof cfg_rows[0]; i++) {
    const struct cfg_row *r = &cfg_rows[i];
    if (!(r->families & FAM(p->family))) continue;
    fprintf(f, "%s  \"%s\": ", first ? "" : ",\n", r->key);
    cfg_value(r, p, l->layers, f);
    first = false;
  }
  fputs("\n}\n", f);
  return ferror(f) ? WEIGHTD_E_IO : 0;
}
