/*
 * fuzz_plan.c - libFuzzer target: plan_build and plan_gather on small
 * in-memory checkpoints. Input: one byte that picks the checkpoint (a dense
 * llama, a qwen3_moe with 8 experts, or an FP8 dense model with block
 * scales), then the plan object as JSON, optionally followed by a NUL and a
 * config.json that replaces the checkpoint's own (so that head counts, expert
 * counts and block sizes are fuzzed too).
 *
 * Oracles besides the sanitizers: outputs lie in the slab, 256-byte aligned,
 * in order and without overlap, each the sum of its pieces' bytes; the
 * gather of any window equals that window of the whole slab's gather.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fuzz_ckpt.h"
#include "plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The largest slab gathered; bigger plans are only built. */
#define GATHER_MAX (4u << 20)

/* The models' sizes: hidden 16, 4 query heads and 2 key/value heads of 4, MLP 32, vocabulary 120. */
#define H 16
#define V 120
#define NEXPERTS 8
#define BLOCK 8 /* the FP8 model's weight_block_size */
#define MAX_TENSORS 64

static const char *const configs[] = {
    "{\"model_type\":\"llama\",\"hidden_size\":16,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
    "\"vocab_size\":120}",
    "{\"model_type\":\"qwen3_moe\",\"hidden_size\":16,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
    "\"num_experts\":8,\"head_dim\":4,\"vocab_size\":120}",
    "{\"model_type\":\"qwen3\",\"hidden_size\":16,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
    "\"head_dim\":4,\"vocab_size\":120,\"quantization_config\":{\"quant_method\":\"fp8\","
    "\"weight_block_size\":[8,8]}}",
};

/* One model's tensor list, with room for the names it makes up. */
struct model_spec {
  struct fx_tensor t[MAX_TENSORS];
  char names[MAX_TENSORS][64];
  size_t n;
};

/* Appends a tensor [rows, cols] (cols 0: [rows]) named by the format. */
static void add(struct model_spec *m, const char *dtype, unsigned bytes, uint64_t rows, uint64_t cols,
                const char *fmt, const char *a, int e) {
  char *name = m->names[m->n];
  snprintf(name, sizeof m->names[0], fmt, a, e);
  m->t[m->n++] = (struct fx_tensor){name, dtype, bytes, rows, cols};
}

/* A linear weight: BF16, or F8_E4M3 with its F32 block scales when fp8. */
static void linear(struct model_spec *m, bool fp8, uint64_t rows, uint64_t cols, const char *fmt, const char *a,
                   int e) {
  add(m, fp8 ? "F8_E4M3" : "BF16", fp8 ? 1 : 2, rows, cols, fmt, a, e);
  if (fp8) {
    char scale[80];
    snprintf(scale, sizeof scale, "%s_scale_inv", m->t[m->n - 1].name);
    add(m, "F32", 4, (rows + BLOCK - 1) / BLOCK, (cols + BLOCK - 1) / BLOCK, "%s", scale, 0);
  }
}

/* One layer of a llama-like model; experts > 0 gives it a router and experts instead of a dense MLP. */
static void model_make(struct model_spec *m, bool fp8, int experts) {
  static const char *const attn[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  static const uint64_t attn_rows[] = {H, H / 2, H / 2, H};
  m->n = 0;
  add(m, "BF16", 2, V, H, "model.embed_tokens.weight%s", "", 0);
  add(m, "BF16", 2, H, 0, "model.layers.0.%s.weight", "input_layernorm", 0);
  for (int i = 0; i < 4; i++) linear(m, fp8, attn_rows[i], H, "model.layers.0.self_attn.%s.weight", attn[i], 0);
  add(m, "BF16", 2, H, 0, "model.layers.0.%s.weight", "post_attention_layernorm", 0);
  if (experts == 0) {
    linear(m, fp8, 2 * H, H, "model.layers.0.mlp.%s.weight", "gate_proj", 0);
    linear(m, fp8, 2 * H, H, "model.layers.0.mlp.%s.weight", "up_proj", 0);
    linear(m, fp8, H, 2 * H, "model.layers.0.mlp.%s.weight", "down_proj", 0);
  } else {
    add(m, "BF16", 2, (uint64_t)experts, H, "model.layers.0.mlp.%s.weight", "gate", 0);
    for (int e = 0; e < experts; e++) {
      linear(m, fp8, 4, H, "model.layers.0.mlp.experts.%s%d.gate_proj.weight", "", e);
      linear(m, fp8, 4, H, "model.layers.0.mlp.experts.%s%d.up_proj.weight", "", e);
      linear(m, fp8, H, 4, "model.layers.0.mlp.experts.%s%d.down_proj.weight", "", e);
    }
  }
  add(m, "BF16", 2, H, 0, "model.norm.weight%s", "", 0);
  add(m, "BF16", 2, V, H, "lm_head.weight%s", "", 0);
}

static struct model_spec specs[3];
static struct fz_ckpt models[3];

static void make_models(void) {
  model_make(&specs[0], false, 0);
  model_make(&specs[1], false, NEXPERTS);
  model_make(&specs[2], true, 0);
  const char *const rel[] = {"model.safetensors"};
  for (int m = 0; m < 3; m++) {
    struct wd_error err = {0};
    const struct fx_tensor *set = specs[m].t;
    if (fz_make(&models[m], 1, rel, &set, &specs[m].n, NULL, &err) != 0) fz_die("model", err.msg);
  }
}

/* Checks p's layout against its own outputs and gathers it (when small) in two ways that must agree. */
static void check_plan(const struct plan *p, const unsigned char *const *data) {
  uint64_t end = 0, payload = 0;
  for (size_t i = 0; i < p->noutputs; i++) {
    const struct plan_output *o = &p->outputs[i];
    if (o->offset % PLAN_ALIGN != 0 || o->offset < end || o->offset + o->nbytes > p->slab_bytes) abort();
    uint64_t sum = 0;
    for (size_t k = 0; k < o->npieces; k++) sum += o->pieces[k].width * o->pieces[k].height;
    if (sum != o->nbytes) abort();
    end = o->offset + o->nbytes;
    payload += o->nbytes;
  }
  if (payload != p->payload_bytes) abort();
  if (p->slab_bytes == 0 || p->slab_bytes > GATHER_MAX) return;
  size_t n = (size_t)p->slab_bytes;
  unsigned char *whole = malloc(n), *part = malloc(n);
  if (whole == NULL || part == NULL) abort();
  plan_gather(p, data, 0, n, whole);
  uint64_t lo = n / 3, hi = n - n / 5;
  plan_gather(p, data, lo, hi, part);
  if (memcmp(whole + lo, part, (size_t)(hi - lo)) != 0) abort();
  free(whole);
  free(part);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (models[0].c == NULL) make_models();
  if (size < 1) return 0;
  struct fz_ckpt *m = &models[data[0] % 3];
  const char *spec_text = (const char *)data + 1;
  size_t spec_len = size - 1;
  const char *cfg_text = configs[data[0] % 3];
  size_t cfg_len = strlen(cfg_text);
  const char *nul = memchr(spec_text, '\0', spec_len);
  if (nul != NULL) {
    cfg_text = nul + 1;
    cfg_len = spec_len - (size_t)(nul + 1 - spec_text);
    spec_len = (size_t)(nul - spec_text);
  }
  struct wd_error err = {0};
  struct mcfg *cfg = NULL;
  if (mcfg_parse(cfg_text, cfg_len, "config.json", &cfg, &err) != 0) return 0;
  cJSON *spec = NULL;
  if (spec_len > 0 && (spec = cJSON_ParseWithLength(spec_text, spec_len)) == NULL) {
    mcfg_free(cfg);
    return 0;
  }
  m->c->config = cfg;
  struct plan *p = NULL;
  if (plan_build(m->c, spec, &p, &err) == 0) {
    check_plan(p, m->data);
    cJSON *d = plan_describe(p), *t = plan_table(p);
    cJSON_Delete(d);
    cJSON_Delete(t);
    plan_free(p);
  } else if (err.msg[0] == '\0') {
    abort();
  }
  m->c->config = NULL;
  mcfg_free(cfg);
  cJSON_Delete(spec);
  return 0;
}
