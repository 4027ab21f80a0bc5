/*
 * presets.h - the published checkpoint layouts that `weightctl
 * mkcheckpoint` reproduces.
 *
 * A preset is one row of a table: the model's architecture parameters, the
 * config.json values that differ between models, and the rule that cuts its
 * tensors into shard files. From a preset and a variant (how many layers
 * and, for a mixture of experts, how many routed experts to keep),
 * preset_layout_build() produces the tensor list in the PyTorch state-dict
 * order that Hugging Face uses (names, dtypes, shapes, sizes), assigns each
 * tensor to a shard and gives it its offset inside that shard's data.
 *
 * Nothing here touches files except preset_config_write(), which prints the
 * model's config.json to a stream the caller opened.
 */
#ifndef WD_PRESETS_H
#define WD_PRESETS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "dtype.h"
#include "error.h"

/* The model families, each with its own per-layer tensor generator. */
enum preset_family {
  PRESET_QWEN3,       /* dense Qwen3 (Qwen3ForCausalLM) */
  PRESET_QWEN3_MOE,   /* Qwen3 mixture of experts (Qwen3MoeForCausalLM) */
  PRESET_DEEPSEEK_V3, /* DeepSeek-V3: MLA attention, MoE, FP8 block-quantized */
  PRESET_FAMILY_COUNT
};

/*
 * One published model. Fields a family does not use are 0. Numbers that
 * config.json spells in a particular way (rope_theta, rms_norm_eps) are kept
 * as the JSON text the published file holds.
 */
struct preset {
  const char *name;
  enum preset_family family;
  const char *architecture;
  const char *model_type;
  const char *transformers_version;
  const char *rope_theta;   /* JSON number text */
  const char *rms_norm_eps; /* JSON number text */
  uint32_t hidden_size;
  uint32_t num_layers;
  uint32_t num_heads;
  uint32_t num_kv_heads;
  uint32_t head_dim; /* 0 where config.json has no head_dim (DeepSeek) */
  uint32_t intermediate_size;
  uint32_t vocab_size;
  uint32_t max_position_embeddings;
  uint32_t max_window_layers;
  uint32_t bos_token_id;
  uint32_t eos_token_id;
  bool tie_word_embeddings;
  /* Whether the published files carry lm_head.weight (Qwen3-0.6B does, tied or not). */
  bool stores_lm_head;
  /* Mixture of experts. */
  uint32_t num_experts;
  uint32_t experts_per_tok;
  uint32_t moe_intermediate_size;
  uint32_t n_shared_experts;
  uint32_t first_k_dense_replace;
  uint32_t decoder_sparse_step;
  uint32_t n_group;
  uint32_t topk_group;
  /* Multi-head latent attention (DeepSeek). */
  uint32_t q_lora_rank;
  uint32_t kv_lora_rank;
  uint32_t qk_nope_head_dim;
  uint32_t qk_rope_head_dim;
  uint32_t v_head_dim;
  /* FP8 block quantization: the block edge, 0 when weights are BF16. */
  uint32_t fp8_block;
  /* Sharding: the greedy limit in bytes, the published shard count, and
   * the digits of the count in shard names ("of-00003" vs "of-000163"). */
  uint64_t max_shard_size;
  uint32_t shards;
  unsigned shard_count_digits;
};

/* How a tensor's bytes are made: seeded random bytes, or finite positive F32 values. */
enum preset_fill { PRESET_FILL_BYTES, PRESET_FILL_F32_POSITIVE };

/* One tensor of a layout. offset is relative to the start of its shard's data. */
struct preset_tensor {
  char *name;
  enum wd_dtype dtype;
  enum preset_fill fill;
  unsigned ndim;
  uint64_t shape[2];
  uint64_t nbytes;
  uint32_t shard;
  uint64_t offset;
};

/*
 * Which part of a preset to generate: its first `layers` layers (1 to
 * num_layers) and, in every MoE layer, its first `experts` routed experts
 * (1 to num_experts; 0 keeps the published count, the only value a dense
 * preset takes). Shared experts are always kept.
 */
struct preset_variant {
  uint32_t layers;
  uint32_t experts;
};

/*
 * A generated layout: tensors in state-dict order, shard by shard. `model`
 * is the preset as generated: num_experts is the variant's expert count,
 * and experts_per_tok, n_group and topk_group are fitted to it (see
 * preset_layout_build()); every other field equals the preset's.
 */
struct preset_layout {
  const struct preset *preset;
  struct preset model;
  uint32_t layers;
  struct preset_tensor *tensors;
  size_t count;
  size_t cap;
  uint64_t total_bytes;
  uint32_t shards;
};

/* The number of presets in the table. */
size_t preset_count(void);

/* The i-th preset of the table, or NULL when i is out of range. */
const struct preset *preset_at(size_t i);

/* The preset named exactly `name`, or NULL. */
const struct preset *preset_find(const char *name);

/*
 * Builds the layout of variant v of preset p and assigns shards. With fewer
 * experts than published, the router settings of the generated config
 * follow: num_experts_per_tok becomes min(published, experts), and a
 * DeepSeek model keeps its n_group and topk_group only while the grouped
 * router still works with them (n_group divides the experts, every group
 * holds at least 2, the topk_group chosen groups hold at least
 * num_experts_per_tok); otherwise both become 1. Returns 0,
 * WEIGHTD_E_INVALID for a layer or expert count out of range,
 * WEIGHTD_E_NOMEM, or WEIGHTD_E_INTERNAL when the full model does not come
 * out with the published shard count. On failure *out is empty and needs no
 * preset_layout_free().
 */
int preset_layout_build(const struct preset *p, const struct preset_variant *v, struct preset_layout *out,
                        struct wd_error *err);

/* Frees what a layout holds and empties it; NULL-safe. */
void preset_layout_free(struct preset_layout *l);

/*
 * Prints the config.json of layout l (its model's values, with
 * num_hidden_layers = l->layers) in the layout transformers writes (sorted
 * keys, two-space indent, final newline). Returns 0, or WEIGHTD_E_IO when
 * the stream reports an error.
 */
int preset_config_write(const struct preset_layout *l, FILE *f);

#endif
