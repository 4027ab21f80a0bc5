/* family.c - the table of model families and model types (see family.h). */
#include "family.h"

#include <stdio.h>
#include <string.h>

static const char *const names[FAMILY_COUNT] = {
    [FAMILY_DENSE] = "dense",
    [FAMILY_QWEN3_MOE] = "qwen3_moe",
    [FAMILY_DEEPSEEK_V3] = "deepseek_v3",
};

/* head_dim defaults as the transformers config classes define them. */
static const struct family_model models[] = {
    {"qwen3", FAMILY_DENSE, 128},
    {"qwen2", FAMILY_DENSE, 0},
    {"llama", FAMILY_DENSE, 0},
    {"mistral", FAMILY_DENSE, 0},
    {"qwen3_moe", FAMILY_QWEN3_MOE, 128},
    {"qwen2_moe", FAMILY_QWEN3_MOE, 0},
    {"deepseek_v3", FAMILY_DEEPSEEK_V3, 0},
    {"deepseek_v2", FAMILY_DEEPSEEK_V3, 0},
    {"glm4_moe", FAMILY_DEEPSEEK_V3, 0},
    {"kimi_k2", FAMILY_DEEPSEEK_V3, 0},
};

const struct family_model *family_model_find(const char *model_type) {
  if (model_type == NULL) return NULL;
  for (size_t i = 0; i < sizeof models / sizeof models[0]; i++)
    if (strcmp(models[i].model_type, model_type) == 0) return &models[i];
  return NULL;
}

const char *family_name(enum family f) { return f > FAMILY_NONE && f < FAMILY_COUNT ? names[f] : NULL; }

enum family family_by_name(const char *name) {
  for (int f = FAMILY_NONE + 1; f < FAMILY_COUNT; f++)
    if (strcmp(names[f], name) == 0) return (enum family)f;
  return FAMILY_NONE;
}

void family_names(char *buf, size_t len, const char *sep) {
  size_t o = 0;
  if (len == 0) return;
  buf[0] = '\0';
  for (int f = FAMILY_NONE + 1; f < FAMILY_COUNT && o < len; f++) {
    int n = snprintf(buf + o, len - o, "%s%s", f > FAMILY_NONE + 1 ? sep : "", names[f]);
    if (n < 0) return;
    o += (size_t)n;
  }
}
