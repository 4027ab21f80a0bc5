/*
 * modelcfg.h - the fields of a Hugging Face config.json that layouts need.
 *
 * config.json is read once when a checkpoint is opened (by the checkpoint
 * reader, confined to the model roots like every file); a missing file or
 * field is not an error then. A layout asks for the fields it needs with
 * mcfg_get, which applies the model family's default for an optional field
 * and fails with a message naming the field for a required one.
 */
#ifndef WD_MODELCFG_H
#define WD_MODELCFG_H

#include <stdint.h>

#include "error.h"

/* XX(ENUM, "json key", "alternative key or NULL", default rule) -- see modelcfg.c */
#define MCFG_FIELD_MAP(XX)                                                \
  XX(HIDDEN_SIZE, "hidden_size", NULL)                                    \
  XX(NUM_HIDDEN_LAYERS, "num_hidden_layers", NULL)                        \
  XX(NUM_ATTENTION_HEADS, "num_attention_heads", NULL)                    \
  XX(NUM_KEY_VALUE_HEADS, "num_key_value_heads", NULL)                    \
  XX(HEAD_DIM, "head_dim", NULL)                                          \
  XX(INTERMEDIATE_SIZE, "intermediate_size", NULL)                        \
  XX(VOCAB_SIZE, "vocab_size", NULL)                                      \
  XX(TIE_WORD_EMBEDDINGS, "tie_word_embeddings", NULL)                    \
  XX(NUM_EXPERTS, "num_experts", "n_routed_experts")                      \
  XX(NUM_EXPERTS_PER_TOK, "num_experts_per_tok", NULL)                    \
  XX(MOE_INTERMEDIATE_SIZE, "moe_intermediate_size", NULL)                \
  XX(N_SHARED_EXPERTS, "n_shared_experts", NULL)                          \
  XX(SHARED_EXPERT_INTERMEDIATE_SIZE, "shared_expert_intermediate_size", NULL) \
  XX(FIRST_K_DENSE_REPLACE, "first_k_dense_replace", NULL)                \
  XX(DECODER_SPARSE_STEP, "decoder_sparse_step", NULL)                    \
  XX(Q_LORA_RANK, "q_lora_rank", NULL)                                    \
  XX(KV_LORA_RANK, "kv_lora_rank", NULL)                                  \
  XX(QK_NOPE_HEAD_DIM, "qk_nope_head_dim", NULL)                          \
  XX(QK_ROPE_HEAD_DIM, "qk_rope_head_dim", NULL)                          \
  XX(V_HEAD_DIM, "v_head_dim", NULL)

enum mcfg_field {
#define XX(e, key, alt) MCFG_##e,
  MCFG_FIELD_MAP(XX)
#undef XX
  MCFG_NFIELDS
};

struct mcfg {
  char *label;        /* the file, for messages */
  char *model_type;   /* NULL when absent */
  char *architecture; /* architectures[0], NULL when absent */
  int64_t value[MCFG_NFIELDS];
  unsigned char present[MCFG_NFIELDS]; /* 1 when the file gave a valid value */
  char bad[MCFG_NFIELDS];              /* 1 when the file gave a value of the wrong kind */
  int has_quant;                       /* quantization_config present */
  char *quant_method;                  /* quantization_config.quant_method */
  int64_t weight_block_size[2];        /* [n, k]; 0 when absent */
};

/* Parses config.json text. Only malformed JSON or a non-object fails here. */
int mcfg_parse(const char *text, size_t len, const char *label, struct mcfg **out,
               struct wd_error *err);

/*
 * The value of field f: the file's value, else the family default (see
 * docs/architecture.md), else WEIGHTD_E_BAD_CONFIG naming the field and
 * `purpose` (what needed it, e.g. "the tensor-parallel layout").
 */
int mcfg_get(const struct mcfg *c, enum mcfg_field f, const char *purpose, int64_t *out,
             struct wd_error *err);

/* The JSON key of a field. */
const char *mcfg_field_key(enum mcfg_field f);

void mcfg_free(struct mcfg *c);

#endif
