/* modelcfg.c - reading config.json and applying family defaults (see modelcfg.h). */
#include "modelcfg.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "family.h"

static const struct {
  const char *key;
  const char *alt;
} fields[MCFG_NFIELDS] = {
#define XX(e, k, a) [MCFG_##e] = {k, a},
    MCFG_FIELD_MAP(XX)
#undef XX
};

const char *mcfg_field_key(enum mcfg_field f) {
  return f >= 0 && f < MCFG_NFIELDS ? fields[f].key : "?";
}

void mcfg_free(struct mcfg *c) {
  if (c == NULL) return;
  free(c->label);
  free(c->model_type);
  free(c->architecture);
  free(c->quant_method);
  free(c);
}

/* Reads an integer or boolean field; a float with a fraction or a negative number is "bad". */
static void read_field(struct mcfg *c, const cJSON *root, enum mcfg_field f) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, fields[f].key);
  if ((v == NULL || cJSON_IsNull(v)) && fields[f].alt != NULL)
    v = cJSON_GetObjectItemCaseSensitive(root, fields[f].alt);
  if (v == NULL || cJSON_IsNull(v)) return;
  if (cJSON_IsBool(v)) {
    c->value[f] = cJSON_IsTrue(v) ? 1 : 0;
    c->present[f] = 1;
    return;
  }
  if (cJSON_IsNumber(v)) {
    double d = v->valuedouble;
    if (d >= 0 && d <= 9007199254740992.0 && floor(d) == d) {
      c->value[f] = (int64_t)d;
      c->present[f] = 1;
      return;
    }
  }
  c->bad[f] = 1;
}

int mcfg_parse(const char *text, size_t len, const char *label, struct mcfg **out,
               struct wd_error *err) {
  *out = NULL;
  int rc = 0;
  cJSON *root = cJSON_ParseWithLength(text, len);
  struct mcfg *c = calloc(1, sizeof *c);
  if (c == NULL || (c->label = strdup(label)) == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
    goto fail;
  }
  if (root == NULL) {
    rc = err_set(err, WEIGHTD_E_BAD_CONFIG, "%s: not valid JSON", label);
    goto fail;
  }
  if (!cJSON_IsObject(root)) {
    rc = err_set(err, WEIGHTD_E_BAD_CONFIG, "%s: must be a JSON object", label);
    goto fail;
  }
  const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
  if (cJSON_IsString(mt) && (c->model_type = strdup(mt->valuestring)) == NULL) goto oom;
  const cJSON *arch = cJSON_GetObjectItemCaseSensitive(root, "architectures");
  const cJSON *a0 = cJSON_IsArray(arch) ? cJSON_GetArrayItem(arch, 0) : NULL;
  if (cJSON_IsString(a0) && (c->architecture = strdup(a0->valuestring)) == NULL) goto oom;
  for (int f = 0; f < MCFG_NFIELDS; f++) read_field(c, root, (enum mcfg_field)f);
  const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
  if (cJSON_IsObject(q)) {
    c->has_quant = 1;
    const cJSON *qm = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    if (cJSON_IsString(qm) && (c->quant_method = strdup(qm->valuestring)) == NULL) goto oom;
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(q, "weight_block_size");
    if (cJSON_IsArray(bs) && cJSON_GetArraySize(bs) == 2) {
      for (int i = 0; i < 2; i++) {
        const cJSON *e = cJSON_GetArrayItem(bs, i);
        double d = cJSON_IsNumber(e) ? e->valuedouble : -1;
        if (d < 1 || d > 1e9 || floor(d) != d) {
          rc = err_set(err, WEIGHTD_E_BAD_CONFIG,
                       "%s: quantization_config.weight_block_size must be two positive integers",
                       label);
          goto fail;
        }
        c->weight_block_size[i] = (int64_t)d;
      }
    }
  }
  cJSON_Delete(root);
  *out = c;
  return 0;
oom:
  rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
fail:
  cJSON_Delete(root);
  mcfg_free(c);
  return rc;
}

/*
 * Family defaults, as the transformers config classes define them. Returns
 * 1 and sets *v when the field has a default for this config.
 */
static int field_default(const struct mcfg *c, enum mcfg_field f, int64_t *v) {
  const struct family_model *m = family_model_find(c->model_type);
  switch (f) {
  case MCFG_NUM_KEY_VALUE_HEADS:
    if (!c->present[MCFG_NUM_ATTENTION_HEADS]) return 0;
    *v = c->value[MCFG_NUM_ATTENTION_HEADS];
    return 1;
  case MCFG_HEAD_DIM:
    if (m != NULL && m->head_dim > 0) {
      *v = m->head_dim;
      return 1;
    }
    if (!c->present[MCFG_HIDDEN_SIZE] || !c->present[MCFG_NUM_ATTENTION_HEADS] ||
        c->value[MCFG_NUM_ATTENTION_HEADS] == 0)
      return 0;
    *v = c->value[MCFG_HIDDEN_SIZE] / c->value[MCFG_NUM_ATTENTION_HEADS];
    return 1;
  case MCFG_NUM_EXPERTS:
    if (m == NULL || m->family != FAMILY_DENSE) return 0;
    *v = 0;
    return 1;
  case MCFG_TIE_WORD_EMBEDDINGS:
  case MCFG_N_SHARED_EXPERTS:
  case MCFG_SHARED_EXPERT_INTERMEDIATE_SIZE:
  case MCFG_FIRST_K_DENSE_REPLACE:
  case MCFG_Q_LORA_RANK:
    *v = 0;
    return 1;
  case MCFG_DECODER_SPARSE_STEP:
    *v = 1;
    return 1;
  default:
    return 0;
  }
}

int mcfg_get(const struct mcfg *c, enum mcfg_field f, const char *purpose, int64_t *out,
             struct wd_error *err) {
  if (f < 0 || f >= MCFG_NFIELDS) return err_set(err, WEIGHTD_E_INVALID, "unknown config field");
  const char *label = c ? c->label : "config.json";
  if (c != NULL && c->bad[f])
    return err_set(err, WEIGHTD_E_BAD_CONFIG, "%s: '%s' must be a non-negative integer (needed by %s)",
                   label, fields[f].key, purpose);
  if (c != NULL && c->present[f]) {
    *out = c->value[f];
    return 0;
  }
  if (c != NULL && field_default(c, f, out)) return 0;
  if (c == NULL)
    return err_set(err, WEIGHTD_E_BAD_CONFIG, "config.json is missing; '%s' is needed by %s",
                   fields[f].key, purpose);
  return err_set(err, WEIGHTD_E_BAD_CONFIG, "%s: required field '%s' is missing (needed by %s)",
                 label, fields[f].key, purpose);
}
