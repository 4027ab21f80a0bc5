/*
 * family.h - the model families weightd knows, and which config.json
 * model_type belongs to which: one table for the plan presets (a family's
 * layer rules, the "auto" preset) and for config.json's family defaults.
 *
 * A family is a layout: "dense" (qwen3, qwen2, llama, mistral), "qwen3_moe"
 * (qwen3_moe, qwen2_moe) and "deepseek_v3" (deepseek_v3, deepseek_v2,
 * glm4_moe, kimi_k2). The names are the presets' names on the wire.
 */
#ifndef WD_FAMILY_H
#define WD_FAMILY_H

#include <stddef.h>
#include <stdint.h>

enum family {
  FAMILY_NONE, /* no family: an unknown model_type or name */
  FAMILY_DENSE,
  FAMILY_QWEN3_MOE,
  FAMILY_DEEPSEEK_V3,
  FAMILY_COUNT
};

/* A config.json model_type and what it implies. */
struct family_model {
  const char *model_type;
  enum family family;
  int64_t head_dim; /* config.json's head_dim when absent; 0: hidden_size / num_attention_heads */
};

/* The entry for model_type, or NULL (model_type NULL or not in the table). */
const struct family_model *family_model_find(const char *model_type);

/* The family's name ("dense", ...), or NULL for FAMILY_NONE. */
const char *family_name(enum family f);

/* The family named name, or FAMILY_NONE. */
enum family family_by_name(const char *name);

/* Writes the family names, in table order and separated by sep, for messages. */
void family_names(char *buf, size_t len, const char *sep);

#endif
