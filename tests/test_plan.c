/*
 * test_plan.c - plans built on small synthetic checkpoints: the whole
 * preset, a dense TP=2 rank and an expert-parallel MoE rank (offsets, shapes
 * and gathered bytes against the bytes the fixture wrote), explicit plans
 * (strict fields, normalisation, the key's documented form, its bound),
 * overflow refusals, the family table and SHA-256's standard vectors; the
 * byte ranges a plan reads (every gathered byte inside them, page-aligned,
 * merged) and the staging schedule (each staged_strided mode, slots of odd
 * sizes, the slab it delivers equal to the gathered one, filled with memcpy
 * and with streaming stores) and stream_copy at every alignment.
 *
 * Expected bytes come from the fixture's own pattern (fx_byte at the
 * writer's offsets), expected digests from Python's hashlib and json.dumps
 * over the normal form docs/protocol.md defines.
 */
#include <limits.h>

#include "checkpoint.h"
#include "family.h"
#include "fixture.h"
#include "plan.h"
#include "plan_build.h"
#include "plan_stage.h"
#include "sha256.h"
#include "stream_copy.h"
#include "testutil.h"

/* ---- fixtures ----------------------------------------------------------------------------- */

#define L0 "model.layers.0."

static const struct fx_tensor dense[] = {
    {"model.embed_tokens.weight", "BF16", 2, 120, 16},
    {L0 "input_layernorm.weight", "BF16", 2, 16, 0},
    {L0 "self_attn.q_proj.weight", "BF16", 2, 16, 16},
    {L0 "self_attn.k_proj.weight", "BF16", 2, 8, 16},
    {L0 "self_attn.v_proj.weight", "BF16", 2, 8, 16},
    {L0 "self_attn.o_proj.weight", "BF16", 2, 16, 16},
    {L0 "post_attention_layernorm.weight", "BF16", 2, 16, 0},
    {L0 "mlp.gate_proj.weight", "BF16", 2, 32, 16},
    {L0 "mlp.up_proj.weight", "BF16", 2, 32, 16},
    {L0 "mlp.down_proj.weight", "BF16", 2, 16, 32},
    {"model.norm.weight", "BF16", 2, 16, 0},
    {"lm_head.weight", "BF16", 2, 120, 16},
};
#define NDENSE (sizeof dense / sizeof dense[0])

static const char *const dense_config =
    "{\"model_type\":\"llama\",\"hidden_size\":16,\"num_attention_heads\":4,\"num_key_value_heads\":2}";

#define NEXPERTS 64
#define MOE_FIXED 10
static struct fx_tensor moe[MOE_FIXED + 3 * NEXPERTS];
static char moe_names[3 * NEXPERTS][64];

static const char *const moe_config = "{\"model_type\":\"qwen3_moe\",\"hidden_size\":16,\"num_attention_heads\":4,"
                                      "\"num_key_value_heads\":2,\"num_experts\":64}";

/*
 * The MoE fixture: the dense model's embeddings, norms and attention, a
 * router, and 64 experts of [4, 16] (gate, up) and [16, 4] (down).
 */
static size_t moe_tensors(void) {
  static const char *const projs[3] = {"gate_proj", "up_proj", "down_proj"};
  memcpy(moe, dense, 7 * sizeof *dense); /* embed_tokens to post_attention_layernorm */
  moe[7] = (struct fx_tensor){L0 "mlp.gate.weight", "BF16", 2, NEXPERTS, 16};
  moe[8] = dense[NDENSE - 2]; /* model.norm */
  moe[9] = dense[NDENSE - 1]; /* lm_head */
  for (int e = 0; e < NEXPERTS; e++)
    for (int k = 0; k < 3; k++) {
      char *n = moe_names[3 * e + k];
      snprintf(n, sizeof moe_names[0], L0 "mlp.experts.%d.%s.weight", e, projs[k]);
      moe[MOE_FIXED + 3 * e + k] = (struct fx_tensor){n, "BF16", 2, k == 2 ? 16 : 4, k == 2 ? 4 : 16};
    }
  return MOE_FIXED + 3 * NEXPERTS;
}

/* A model directory: model.safetensors holding ts and config.json, opened, with its data read. */
struct model {
  char *dir;
  struct ckpt *ck;
  const struct fx_tensor *ts;
  size_t n;
  unsigned char *file;
  const unsigned char *data[1];
};

static void model_close(struct model *m);

/* Writes and opens the model; false (after recording a failed check) when that fails. */
static bool model_open(struct model *m, const char *tag, const struct fx_tensor *ts, size_t n, const char *config) {
  memset(m, 0, sizeof *m);
  m->ts = ts;
  m->n = n;
  m->dir = fx_tmpdir(tag);
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model.safetensors", m->dir);
  struct wd_error err = {0};
  bool ok = m->dir != NULL && fx_write_st(p, ts, n) == 0 && fx_write_text(m->dir, "config.json", config) == 0;
  if (ok && ckpt_open(m->dir, NULL, &m->ck, &err) != 0) {
    fprintf(stderr, "%s\n", err.msg);
    ok = false;
  }
  FILE *f = ok ? fopen(p, "rb") : NULL;
  size_t len = ok ? (size_t)m->ck->shards[0].size : 0;
  m->file = ok ? malloc(len) : NULL;
  ok = f != NULL && m->file != NULL && fread(m->file, 1, len, f) == len;
  if (f != NULL) fclose(f);
  if (ok) m->data[0] = m->file + m->ck->shards[0].hdr->data_start;
  CHECK(ok);
  if (!ok) model_close(m);
  return ok;
}

static void model_close(struct model *m) {
  ckpt_free(m->ck);
  free(m->file);
  if (m->dir != NULL) fx_rmtree(m->dir);
  free(m->dir);
}

/* Builds the plan of spec text (NULL: no spec) on m; returns plan_build's code. */
static int build(const struct model *m, const char *spec, struct plan **p, struct wd_error *err) {
  cJSON *j = spec != NULL ? cJSON_Parse(spec) : NULL;
  if (spec != NULL && j == NULL) {
    fprintf(stderr, "test spec is not JSON: %s\n", spec);
    return -1;
  }
  err_clear(err);
  int rc = plan_build(m->ck, j, p, err);
  cJSON_Delete(j);
  return rc;
}

/* Fixture tensor i's data offset, as the writer laid the tensors end to end. */
static uint64_t fx_begin(const struct model *m, size_t i) {
  uint64_t off = 0;
  for (size_t k = 0; k < i; k++) off += (m->ts[k].cols ? m->ts[k].rows * m->ts[k].cols : m->ts[k].rows) * m->ts[k].elem_bytes;
  return off;
}

static size_t fx_index(const struct model *m, const char *name) {
  for (size_t i = 0; i < m->n; i++)
    if (strcmp(m->ts[i].name, name) == 0) return i;
  fprintf(stderr, "no fixture tensor '%s'\n", name);
  exit(1);
}

/*
 * Appends rows [a, b) of dimension dim (0 or 1) of fixture tensor `name`
 * (viewed as [rows, cols], cols 1 for a vector) to want.
 */
static size_t want_slice(const struct model *m, const char *name, unsigned dim, uint64_t a, uint64_t b,
                         unsigned char *want) {
  size_t i = fx_index(m, name), n = 0;
  const struct fx_tensor *t = &m->ts[i];
  uint64_t cols = t->cols ? t->cols : 1, e = t->elem_bytes, base = fx_begin(m, i);
  for (uint64_t r = dim == 0 ? a : 0; r < (dim == 0 ? b : t->rows); r++)
    for (uint64_t c = dim == 0 ? 0 : a; c < (dim == 0 ? cols : b); c++)
      for (uint64_t k = 0; k < e; k++) want[n++] = fx_byte((unsigned)i, base + (r * cols + c) * e + k);
  return n;
}

/* The gathered slab of p. */
static unsigned char *gather_all(const struct model *m, const struct plan *p) {
  unsigned char *slab = malloc(p->slab_bytes ? p->slab_bytes : 1);
  memset(slab, 0xEE, p->slab_bytes);
  plan_gather(p, m->data, 0, p->slab_bytes, slab);
  return slab;
}

static const struct plan_output *output(const struct plan *p, const char *name) {
  for (size_t i = 0; i < p->noutputs; i++)
    if (strcmp(p->outputs[i].name, name) == 0) return &p->outputs[i];
  return NULL;
}

/* ---- SHA-256 and the family table -------------------------------------------------------------- */

static void check_sha(const char *msg, size_t len, size_t repeat, const char *want) {
  struct sha256 s;
  unsigned char d[SHA256_DIGEST_LEN];
  char hex[SHA256_HEX_LEN + 1];
  sha256_init(&s);
  for (size_t i = 0; i < repeat; i++) sha256_update(&s, msg, len);
  sha256_final(&s, d);
  sha256_hex(d, hex);
  CHECK_STR_CONTAINS(hex, want);
}

static void test_sha256_vectors(void) {
  check_sha("", 0, 1, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  check_sha("abc", 3, 1, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const char *m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  check_sha(m448, strlen(m448), 1, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  check_sha("a", 1, 1000000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  /* The same million bytes in uneven pieces straddling the 64-byte blocks. */
  char a[1000];
  memset(a, 'a', sizeof a);
  check_sha(a, 1000, 1000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  check_sha(a, 55, 1, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  check_sha(a, 56, 1, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
}

static void test_family_table(void) {
  static const struct {
    const char *model_type;
    enum family family;
    int64_t head_dim;
  } want[] = {{"qwen3", FAMILY_DENSE, 128},     {"llama", FAMILY_DENSE, 0},           {"mistral", FAMILY_DENSE, 0},
              {"qwen2", FAMILY_DENSE, 0},       {"qwen3_moe", FAMILY_QWEN3_MOE, 128}, {"qwen2_moe", FAMILY_QWEN3_MOE, 0},
              {"glm4_moe", FAMILY_DEEPSEEK_V3, 0}, {"kimi_k2", FAMILY_DEEPSEEK_V3, 0}, {"deepseek_v2", FAMILY_DEEPSEEK_V3, 0}};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const struct family_model *m = family_model_find(want[i].model_type);
    CHECK(m != NULL);
    if (m == NULL) continue;
    CHECK_EQ_INT(m->family, want[i].family);
    CHECK_EQ_INT(m->head_dim, want[i].head_dim);
  }
  CHECK(family_model_find("gpt2") == NULL && family_model_find(NULL) == NULL);
  CHECK_EQ_INT(family_by_name("deepseek_v3"), FAMILY_DEEPSEEK_V3);
  CHECK_EQ_INT(family_by_name("auto"), FAMILY_NONE);
  CHECK(strcmp(family_name(FAMILY_QWEN3_MOE), "qwen3_moe") == 0 && family_name(FAMILY_NONE) == NULL);
  char names[64];
  family_names(names, sizeof names, ", ");
  CHECK(strcmp(names, "dense, qwen3_moe, deepseek_v3") == 0);
}

/* ---- presets -------------------------------------------------------------------------------- */

static void test_whole(void) {
  struct model m;
  struct plan *p = NULL;
  struct wd_error err;
  if (!model_open(&m, "plan-whole", dense, NDENSE, dense_config)) return;
  CHECK_EQ_INT(build(&m, NULL, &p, &err), 0);
  if (p != NULL) {
    CHECK(strcmp(p->key, "{\"preset\":\"whole\"}") == 0);
    CHECK_EQ_INT(p->noutputs, NDENSE);
    CHECK_EQ_INT(p->payload_bytes, m.ck->total_bytes);
    unsigned char *slab = gather_all(&m, p), want[8192];
    uint64_t off = 0;
    for (size_t i = 0; i < NDENSE; i++) { /* file order, each whole at the next aligned offset */
      const struct plan_output *o = &p->outputs[i];
      CHECK(strcmp(o->name, dense[i].name) == 0);
      CHECK_EQ_INT(o->offset, off);
      size_t n = want_slice(&m, dense[i].name, 0, 0, dense[i].rows, want);
      CHECK_EQ_INT(o->nbytes, n);
      CHECK(memcmp(slab + o->offset, want, n) == 0);
      off += (n + 255) / 256 * 256;
    }
    CHECK_EQ_INT(p->slab_bytes, off);
    free(slab);
  }
  plan_free(p);
  /* {} and {"preset": "whole"} are the same plan; whole takes no layout field. */
  CHECK_EQ_INT(build(&m, "{}", &p, &err), 0);
  if (p != NULL) CHECK(strcmp(p->key, "{\"preset\":\"whole\"}") == 0);
  plan_free(p);
  CHECK_EQ_INT(build(&m, "{\"preset\":\"whole\",\"tp_size\":1}", &p, &err), WEIGHTD_E_BAD_PLAN);
  CHECK_STR_CONTAINS(err.msg, "plan: preset 'whole' takes no 'tp_size'");
  model_close(&m);
}

/* One expected output of the dense TP=2 rank 1: rows [a, b) of dimension dim of src, then zero rows. */
struct want_out {
  const char *name, *src;
  uint64_t rows, cols, offset;
  unsigned dim;
  uint64_t a, b, zero_rows;
};

static void test_dense_tp2(void) {
  static const struct want_out want[] = {
      {L0 "input_layernorm.weight", L0 "input_layernorm.weight", 16, 0, 0, 0, 0, 16, 0},
      {L0 "self_attn.q_proj.weight", L0 "self_attn.q_proj.weight", 8, 16, 256, 0, 8, 16, 0},
      {L0 "self_attn.k_proj.weight", L0 "self_attn.k_proj.weight", 4, 16, 512, 0, 4, 8, 0},
      {L0 "self_attn.v_proj.weight", L0 "self_attn.v_proj.weight", 4, 16, 768, 0, 4, 8, 0},
      {L0 "self_attn.o_proj.weight", L0 "self_attn.o_proj.weight", 16, 8, 1024, 1, 8, 16, 0},
      {L0 "post_attention_layernorm.weight", L0 "post_attention_layernorm.weight", 16, 0, 1280, 0, 0, 16, 0},
      {L0 "mlp.gate_proj.weight", L0 "mlp.gate_proj.weight", 16, 16, 1536, 0, 16, 32, 0},
      {L0 "mlp.up_proj.weight", L0 "mlp.up_proj.weight", 16, 16, 2048, 0, 16, 32, 0},
      {L0 "mlp.down_proj.weight", L0 "mlp.down_proj.weight", 16, 16, 2560, 1, 16, 32, 0},
      /* vocabulary 120 padded to 128: rank 1 has rows [64, 120) and 8 zero rows */
      {"model.embed_tokens.weight", "model.embed_tokens.weight", 64, 16, 3072, 0, 64, 120, 8},
      {"model.norm.weight", "model.norm.weight", 16, 0, 5120, 0, 0, 16, 0},
      {"lm_head.weight", "lm_head.weight", 64, 16, 5376, 0, 64, 120, 8},
  };
  struct model m;
  struct plan *p = NULL;
  struct wd_error err;
  if (!model_open(&m, "plan-dense", dense, NDENSE, dense_config)) return;
  CHECK_EQ_INT(build(&m, "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}", &p, &err), 0);
  if (p == NULL) {
    fprintf(stderr, "%s\n", err.msg);
    model_close(&m);
    return;
  }
  CHECK(strcmp(p->key, "{\"preset\":\"dense\",\"tp_size\":2,\"tp_rank\":1,\"ep_size\":1,\"ep_rank\":0,\"fuse\":false}") == 0);
  CHECK_EQ_INT(p->noutputs, sizeof want / sizeof want[0]);
  CHECK_EQ_INT(p->payload_bytes, 6496);
  CHECK_EQ_INT(p->slab_bytes, 7424);
  unsigned char *slab = gather_all(&m, p), buf[4096];
  for (size_t i = 0; i < p->noutputs && i < sizeof want / sizeof want[0]; i++) {
    const struct want_out *w = &want[i];
    const struct plan_output *o = &p->outputs[i];
    CHECK_STR_CONTAINS(o->name, w->name);
    CHECK_EQ_INT(o->ndim, w->cols ? 2 : 1);
    CHECK_EQ_INT(o->shape[0], w->rows);
    if (w->cols) CHECK_EQ_INT(o->shape[1], w->cols);
    CHECK_EQ_INT(o->offset, w->offset);
    size_t n = want_slice(&m, w->src, w->dim, w->a, w->b, buf);
    memset(buf + n, 0, w->zero_rows * w->cols * 2);
    n += w->zero_rows * w->cols * 2;
    CHECK_EQ_INT(o->nbytes, n);
    if (memcmp(slab + o->offset, buf, n) != 0) CHECK(!"gathered bytes differ from the source rows");
    for (uint64_t g = o->offset + n; g < (i + 1 < p->noutputs ? p->outputs[i + 1].offset : p->slab_bytes); g++)
      if (slab[g] != 0) {
        CHECK(!"an alignment gap is not zero");
        break;
      }
  }
  /* A window that starts and ends inside outputs gathers the same bytes. */
  unsigned char win[1000];
  plan_gather(p, m.data, 700, 1700, win);
  CHECK(memcmp(win, slab + 700, sizeof win) == 0);
  free(slab);
  plan_free(p);
  model_close(&m);
}

static void test_moe_ep2(void) {
  struct model m;
  struct plan *p = NULL;
  struct wd_error err;
  if (!model_open(&m, "plan-moe", moe, moe_tensors(), moe_config)) return;
  CHECK_EQ_INT(build(&m, "{\"preset\":\"auto\",\"ep_size\":2,\"ep_rank\":1,\"fuse\":true}", &p, &err), 0);
  if (p != NULL) {
    CHECK(strcmp(p->key, "{\"preset\":\"qwen3_moe\",\"tp_size\":1,\"tp_rank\":0,\"ep_size\":2,\"ep_rank\":1,\"fuse\":true}") == 0);
    CHECK_EQ_INT(p->noutputs, 10); /* norms, qkv, o, router, w13, w2, embed, norm, head */
    const struct plan_output *w13 = output(p, L0 "mlp.experts.w13_weight"), *w2 = output(p, L0 "mlp.experts.w2_weight");
    CHECK(w13 != NULL && w2 != NULL && output(p, L0 "mlp.experts.0.gate_proj.weight") == NULL);
    unsigned char *slab = gather_all(&m, p), want[256];
    if (w13 != NULL && w2 != NULL) {
      CHECK(w13->ndim == 3 && w13->shape[0] == 32 && w13->shape[1] == 8 && w13->shape[2] == 16);
      CHECK(w2->ndim == 3 && w2->shape[0] == 32 && w2->shape[1] == 16 && w2->shape[2] == 4);
      for (int j = 0; j < 32; j++) { /* local expert j is expert 32 + j: its gate rows, then its up rows */
        char g[64], u[64], d[64];
        snprintf(g, sizeof g, L0 "mlp.experts.%d.gate_proj.weight", 32 + j);
        snprintf(u, sizeof u, L0 "mlp.experts.%d.up_proj.weight", 32 + j);
        snprintf(d, sizeof d, L0 "mlp.experts.%d.down_proj.weight", 32 + j);
        size_t n = want_slice(&m, g, 0, 0, 4, want);
        n += want_slice(&m, u, 0, 0, 4, want + n);
        CHECK(n == 256 && memcmp(slab + w13->offset + (uint64_t)j * 256, want, n) == 0);
        n = want_slice(&m, d, 0, 0, 16, want);
        CHECK(n == 128 && memcmp(slab + w2->offset + (uint64_t)j * 128, want, n) == 0);
      }
    }
    free(slab);
  }
  plan_free(p);
  /* A long expert list is digested in the key (the digest of "[0,1,...,63]"), whatever its order. */
  char spec[1024];
  int o = snprintf(spec, sizeof spec, "{\"preset\":\"qwen3_moe\",\"ep_size\":2,\"experts\":[");
  for (int e = NEXPERTS - 1; e >= 0; e--) o += snprintf(spec + o, sizeof spec - (size_t)o, "%d%s", e, e ? "," : "]}");
  CHECK_EQ_INT(build(&m, spec, &p, &err), 0);
  if (p != NULL) {
    CHECK(strcmp(p->key, "{\"preset\":\"qwen3_moe\",\"tp_size\":1,\"tp_rank\":0,\"ep_size\":2,\"ep_rank\":0,"
                         "\"fuse\":false,\"experts\":{\"count\":64,\"sha256\":"
                         "\"a49d88051b2d2e5d1255d4f806a7569cda9b33a650a908566197031349ad8db4\"}}") == 0);
    CHECK(strlen(p->key) <= PLAN_KEY_MAX);
  }
  plan_free(p);
  /* A short one stays a list, sorted. */
  CHECK_EQ_INT(build(&m, "{\"preset\":\"auto\",\"ep_size\":4,\"experts\":[9,3,5]}", &p, &err), 0);
  if (p != NULL) CHECK_STR_CONTAINS(p->key, "\"ep_rank\":0,\"fuse\":false,\"experts\":[3,5,9]}");
  plan_free(p);
  model_close(&m);
}

/* ---- explicit plans ---------------------------------------------------------------------------- */

#define Q L0 "self_attn.q_proj.weight"

static void test_explicit_key(void) {
  struct model m;
  struct plan *a = NULL, *b = NULL;
  struct wd_error err;
  if (!model_open(&m, "plan-explicit", dense, NDENSE, dense_config)) return;
  /* Two writings of one plan: field order, defaults given or left out, a whole tensor named either way. */
  CHECK_EQ_INT(build(&m,
                     "{\"outputs\":[{\"name\":\"x\",\"dtype\":\"BF16\",\"shape\":[8,16],"
                     "\"pieces\":[{\"tensor\":\"" Q "\",\"dim\":0,\"start\":8,\"end\":16}]},"
                     "{\"name\":\"pad\\t\\\"q\\\"\\\\\\u00e9\\u001f\\/\",\"dtype\":\"BF16\",\"shape\":[3,16],"
                     "\"pieces\":[{\"tensor\":\"model.norm.weight\"},{\"zeros\":2}]}]}",
                     &a, &err),
               0);
  CHECK_EQ_INT(build(&m,
                     "{\"outputs\":[{\"pieces\":[{\"end\":16,\"start\":8,\"tensor\":\"" Q "\"}],"
                     "\"shape\":[8,16],\"dtype\":\"BF16\",\"name\":\"x\"},"
                     "{\"shape\":[3,16],\"name\":\"pad\\t\\\"q\\\"\\\\\\u00e9\\u001f/\",\"dtype\":\"BF16\","
                     "\"pieces\":[{\"end\":16,\"tensor\":\"model.norm.weight\",\"start\":0,\"dim\":0},{\"zeros\":2}]}]}",
                     &b, &err),
               0);
  if (a != NULL && b != NULL) {
    /* The digest of the outputs' normal form, computed with Python's json.dumps and hashlib. */
    CHECK(strcmp(a->key, "{\"outputs\":2,\"sha256\":\"54ba92f266e5190407f3ee93e73c239c45683e506d60cc423340c24850b9027b\"}") == 0);
    CHECK(strcmp(a->key, b->key) == 0);
    CHECK_EQ_INT(a->outputs[1].nbytes, 96);
    unsigned char *slab = gather_all(&m, a), want[96] = {0};
    want_slice(&m, "model.norm.weight", 0, 0, 16, want);
    CHECK(memcmp(slab + a->outputs[1].offset, want, 96) == 0);
    free(slab);
  }
  plan_free(a);
  plan_free(b);
  /* Another slice is another plan. */
  CHECK_EQ_INT(build(&m,
                     "{\"outputs\":[{\"name\":\"x\",\"dtype\":\"BF16\",\"shape\":[8,16],"
                     "\"pieces\":[{\"tensor\":\"" Q "\",\"start\":0,\"end\":8}]}]}",
                     &a, &err),
               0);
  if (a != NULL) CHECK(strncmp(a->key, "{\"outputs\":1,\"sha256\":\"", 23) == 0 && strlen(a->key) == 23 + 64 + 2);
  plan_free(a);
  model_close(&m);
}

/* Builds spec on m and expects BAD_PLAN with a message containing needle. */
static void refused(const struct model *m, const char *spec, const char *needle) {
  struct plan *p = NULL;
  struct wd_error err;
  CHECK_EQ_INT(build(m, spec, &p, &err), WEIGHTD_E_BAD_PLAN);
  CHECK(p == NULL);
  CHECK_STR_CONTAINS(err.msg, needle);
  plan_free(p);
}

static void test_strict_fields(void) {
  struct model m;
  if (!model_open(&m, "plan-strict", dense, NDENSE, dense_config)) return;
  refused(&m, "{\"preset\":\"dense\",\"tp_szie\":2}", "plan: unknown field 'tp_szie'");
  refused(&m, "{\"preset\":\"dense\",\"tp_size\":2,\"tp_size\":2,\"tp_rank\":0}", "plan: field 'tp_size' is given twice");
  refused(&m, "{\"preset\":\"dense\",\"fuse\":1}", "plan: 'fuse' must be true or false");
  refused(&m, "{\"preset\":\"nope\"}", "unknown plan preset 'nope' (whole, auto, dense, qwen3_moe, deepseek_v3)");
  const char *good = "{\"name\":\"o\",\"dtype\":\"BF16\",\"shape\":[16],\"pieces\":[{\"tensor\":\"model.norm.weight\"}]}";
  char spec[1024];
  snprintf(spec, sizeof spec, "{\"outputs\":[%s,%s,%s,{\"name\":\"p\",\"x\":1}]}", good, good, good);
  refused(&m, spec, "plan.outputs[3]: unknown field 'x'");
  snprintf(spec, sizeof spec, "{\"outputs\":[%s],\"fuse\":false}", good);
  refused(&m, spec, "plan: an explicit plan ('outputs') takes no 'fuse'");
  refused(&m, "{\"outputs\":[{\"name\":\"o\",\"dtype\":\"BF16\",\"shape\":[16],"
              "\"pieces\":[{\"zeros\":8},{\"tensor\":\"model.norm.weight\",\"step\":2}]}]}",
          "plan.outputs[0].pieces[1]: unknown field 'step'");
  refused(&m, "{\"outputs\":[{\"name\":\"o\",\"dtype\":\"BF16\",\"shape\":[16],"
              "\"pieces\":[{\"zeros\":16,\"tensor\":\"model.norm.weight\"}]}]}",
          "plan.outputs[0].pieces[0]: a 'zeros' piece takes no 'tensor'");
  refused(&m, "{\"outputs\":[{\"name\":\"o\",\"dtype\":\"BF16\",\"shape\":[16]}]}",
          "plan.outputs[0]: needs 'name', 'dtype', 'shape' and 'pieces'");
  /* Names repeated across outputs, and pieces that do not fill their output. */
  snprintf(spec, sizeof spec, "{\"outputs\":[%s,%s]}", good, good);
  refused(&m, spec, "plan lists output 'o' twice");
  refused(&m, "{\"outputs\":[{\"name\":\"o\",\"dtype\":\"BF16\",\"shape\":[17],\"pieces\":[{\"tensor\":\"model.norm.weight\"}]}]}",
          "output 'o': its pieces hold 32 bytes but its shape needs 34");
  model_close(&m);
}

/* 100,000 outputs of one zero byte each: the key stays a few dozen bytes. */
static void test_key_bounded(void) {
  struct model m;
  if (!model_open(&m, "plan-big", dense, NDENSE, dense_config)) return;
  cJSON *spec = cJSON_CreateObject(), *outs = cJSON_AddArrayToObject(spec, "outputs");
  for (int i = 0; i < 100000; i++) {
    char name[32];
    snprintf(name, sizeof name, "o%d", i);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", name);
    cJSON_AddStringToObject(o, "dtype", "U8");
    cJSON_AddItemToObject(o, "shape", cJSON_CreateIntArray((const int[]){1}, 1));
    cJSON *pc = cJSON_CreateObject();
    cJSON_AddNumberToObject(pc, "zeros", 1);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "pieces"), pc);
    cJSON_AddItemToArray(outs, o);
  }
  struct plan *p = NULL;
  struct wd_error err;
  CHECK_EQ_INT(plan_build(m.ck, spec, &p, &err), 0);
  if (p != NULL) {
    CHECK_EQ_INT(p->noutputs, 100000);
    CHECK_EQ_INT(p->slab_bytes, 100000ull * 256);
    CHECK(strncmp(p->key, "{\"outputs\":100000,\"sha256\":\"", 28) == 0);
    CHECK_EQ_INT(strlen(p->key), 28 + 64 + 2);
  }
  plan_free(p);
  cJSON_Delete(spec);
  model_close(&m);
}

/* ---- checked arithmetic ------------------------------------------------------------------------ */

static void test_overflow_refused(void) {
  struct model m;
  if (!model_open(&m, "plan-overflow", dense, NDENSE, dense_config)) return;
  /* 16 outputs of 2^60 zero bytes and a real tensor: the slab would wrap around 2^64 to 256 bytes. */
  char spec[4096];
  int o = snprintf(spec, sizeof spec, "{\"outputs\":[");
  for (int i = 0; i < 16; i++)
    o += snprintf(spec + o, sizeof spec - (size_t)o,
                  "{\"name\":\"z%d\",\"dtype\":\"U8\",\"shape\":[1073741824,1073741824],\"pieces\":[{\"zeros\":1073741824}]},", i);
  snprintf(spec + o, sizeof spec - (size_t)o,
           "{\"name\":\"n\",\"dtype\":\"BF16\",\"shape\":[16],\"pieces\":[{\"tensor\":\"model.norm.weight\"}]}]}");
  refused(&m, spec, "the plan's outputs add up to more than 2^64 bytes (at output 'z15')");
  /* A dim of 2^32 is not dimension 0; any dim past the tensor's is refused before it is narrowed. */
  refused(&m, "{\"outputs\":[{\"name\":\"q\",\"dtype\":\"BF16\",\"shape\":[16,16],"
              "\"pieces\":[{\"tensor\":\"" Q "\",\"dim\":4294967296,\"start\":0,\"end\":16}]}]}",
          "tensor '" Q "' has 2 dimensions, no dimension 4294967296");
  refused(&m, "{\"outputs\":[{\"name\":\"q\",\"dtype\":\"BF16\",\"shape\":[16,16],"
              "\"pieces\":[{\"tensor\":\"" Q "\",\"dim\":4294967296}]}]}",
          "no dimension 4294967296");
  refused(&m, "{\"outputs\":[{\"name\":\"q\",\"dtype\":\"BF16\",\"shape\":[16,16],\"pieces\":[{\"tensor\":\"" Q "\",\"dim\":2}]}]}",
          "no dimension 2");
  /* An empty output whose row size overflows: its zero rows cannot be sized. */
  refused(&m, "{\"outputs\":[{\"name\":\"e\",\"dtype\":\"U8\",\"shape\":[0,1099511627776,1099511627776],"
              "\"pieces\":[{\"zeros\":0}]}]}",
          "output 'e': 0 zero rows exceed the output");
  /* A shape whose size overflows. */
  refused(&m, "{\"outputs\":[{\"name\":\"s\",\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"pieces\":[]}]}",
          "output 's': its size overflows 64 bits");
  model_close(&m);
}


/* ---- the byte ranges a plan reads ------------------------------------------------------------ */

/* The file's bytes with everything outside the ranges set to 0xA5. */
static unsigned char *poison_outside(const struct model *m, const struct plan_range *r, size_t n) {
  size_t len = (size_t)m->ck->shards[0].size;
  unsigned char *f = malloc(len);
  memset(f, 0xA5, len);
  for (size_t i = 0; i < n; i++) {
    CHECK_EQ_INT(r[i].shard, 0);
    CHECK(r[i].off + r[i].len <= len);
    memcpy(f + r[i].off, m->file + r[i].off, (size_t)r[i].len);
  }
  return f;
}

static void test_ranges(void) {
  struct model m;
  struct plan *p = NULL;
  struct wd_error err;
  if (!model_open(&m, "plan-ranges", dense, NDENSE, dense_config)) return;
  CHECK_EQ_INT(build(&m, "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}", &p, &err), 0);
  if (p == NULL) {
    model_close(&m);
    return;
  }
  uint64_t size = m.ck->shards[0].size;
  static const uint64_t pages[] = {16, 64, 256, 4096};
  for (size_t k = 0; k < sizeof pages / sizeof pages[0]; k++) {
    uint64_t page = pages[k];
    struct plan_range *r = NULL;
    size_t n = 0;
    CHECK_EQ_INT(plan_ranges(p, m.ck, page, 0, &r, &n, &err), 0);
    CHECK(n > 0);
    /* Sorted, disjoint and not touching (they would have merged), page-aligned, cut at the file's end. */
    for (size_t i = 0; i < n; i++) {
      CHECK_EQ_INT(r[i].off % page, 0);
      CHECK(r[i].len > 0);
      CHECK((r[i].off + r[i].len) % page == 0 || r[i].off + r[i].len == size);
      if (i > 0) CHECK(r[i].off > r[i - 1].off + r[i - 1].len);
    }
    /* Every byte the plan gathers lies inside them: poison the rest, gather the same slab. */
    unsigned char *clean = gather_all(&m, p), *f = poison_outside(&m, r, n), *slab = malloc(p->slab_bytes);
    const unsigned char *data[1] = {f + m.ck->shards[0].hdr->data_start};
    plan_gather(p, data, 0, p->slab_bytes, slab);
    CHECK(memcmp(clean, slab, p->slab_bytes) == 0);
    /* And each range holds a byte the plan reads in its first and last page (no page too many). */
    for (size_t i = 0; i < n; i++) {
      bool first = false, last = false;
      uint64_t a = r[i].off, b = r[i].off + r[i].len;
      for (size_t o = 0; o < p->noutputs; o++)
        for (size_t j = 0; j < p->outputs[o].npieces; j++) {
          const struct plan_piece *pc = &p->outputs[o].pieces[j];
          if (pc->src == NULL) continue;
          uint64_t base = m.ck->shards[0].hdr->data_start + pc->src->t->begin + pc->src_offset;
          for (uint64_t row = 0; row < pc->height; row++) {
            uint64_t x = base + row * pc->src_pitch, y = x + pc->width;
            first |= x < a + page && y > a;
            last |= x < b && y > (b - 1) / page * page;
          }
        }
      CHECK(first && last);
    }
    if (page == 16) { /* TP=2 rank 1 skips the first halves of q/k/v/gate/up: several ranges */
      CHECK(n >= 4);
      CHECK(plan_ranges_bytes(r, n) < size);
    }
    free(clean);
    free(f);
    free(slab);
    /* A gap as large as the file merges everything into one range. */
    struct plan_range *one = NULL;
    size_t n1 = 0;
    CHECK_EQ_INT(plan_ranges(p, m.ck, page, size, &one, &n1, &err), 0);
    CHECK_EQ_INT(n1, 1);
    if (n1 == 1) {
      CHECK_EQ_INT(one[0].off, r[0].off);
      CHECK_EQ_INT(one[0].off + one[0].len, r[n - 1].off + r[n - 1].len);
    }
    free(one);
    free(r);
  }
  plan_free(p);
  /* The whole plan reads the whole data section: one range from the header's page to the end. */
  CHECK_EQ_INT(build(&m, NULL, &p, &err), 0);
  struct plan_range *r = NULL;
  size_t n = 0;
  if (p != NULL) CHECK_EQ_INT(plan_ranges(p, m.ck, 64, 0, &r, &n, &err), 0);
  CHECK_EQ_INT(n, 1);
  if (n == 1) {
    CHECK_EQ_INT(r[0].off, m.ck->shards[0].hdr->data_start / 64 * 64);
    CHECK_EQ_INT(r[0].off + r[0].len, size);
  }
  free(r);
  plan_free(p);
  model_close(&m);
}

/* ---- the staging schedule ------------------------------------------------------------------- */

/*
 * Runs the schedule as the pipeline does, on the CPU: each window filled into
 * a slot (poisoned first, so a byte it fails to write shows), then its
 * transfers copied into the slab (plain, or the 2D copy of whole rows).
 */
static unsigned char *run_schedule(const struct model *m, const struct plan *p, const struct plan_stage *s) {
  unsigned char *slab = malloc(p->slab_bytes ? p->slab_bytes : 1), *slot = malloc(s->slot_bytes);
  memset(slab, 0xEE, p->slab_bytes);
  uint64_t pos = 0; /* windows deliver consecutive slab ranges, in order (the ready watermark relies on it) */
  for (size_t w = 0; w < s->nwindows; w++) {
    const struct plan_window *win = &s->windows[w];
    CHECK(win->used > 0 && win->used <= s->slot_bytes && win->count > 0);
    memset(slot, 0x5A, s->slot_bytes);
    /* In two parts, as two fill tasks would; every other window with streaming stores. */
    uint64_t mid = win->used / 3;
    plan_copy_fn copy = w % 2 ? stream_copy : memcpy;
    plan_stage_fill(s, p, m->data, w, 0, mid, slot, copy);
    plan_stage_fill(s, p, m->data, w, mid, win->used, slot + mid, copy);
    stream_copy_fence();
    uint64_t delivered = 0;
    for (size_t i = win->first; i < win->first + win->count; i++) {
      const struct plan_xfer *x = &s->xfers[i];
      CHECK(x->at + x->len <= win->used);
      CHECK_EQ_INT(x->dst, pos);
      CHECK((x->kind == PLAN_XFER_IMAGE) == (x->pc == NULL));
      pos += x->kind != PLAN_XFER_ROWS ? x->len : x->rows * x->pc->width;
      if (x->kind != PLAN_XFER_ROWS) {
        memcpy(slab + x->dst, slot + x->at, (size_t)x->len);
        delivered += x->len;
      } else {
        for (uint64_t r = 0; r < x->rows; r++)
          memcpy(slab + x->dst + r * x->pc->width, slot + x->at + r * x->pc->src_pitch, (size_t)x->pc->width);
        CHECK_EQ_INT(x->len, (x->rows - 1) * x->pc->src_pitch + x->pc->width);
        delivered += x->rows * x->pc->width;
      }
    }
    CHECK_EQ_INT(delivered, win->slab_bytes);
  }
  CHECK_EQ_INT(pos, p->slab_bytes);
  free(slot);
  return slab;
}

/* stream_copy copies exactly the bytes memcpy would, at every alignment of either end, and no byte more. */
static void test_stream_copy(void) {
  static const size_t sizes[] = {0, 1, 63, 64, 65, 255, 256, 257, 300, 1000, 4096, 4097, 9728, 70001};
  enum { GUARD = 128, MAX = 70001, ROOM = 70144 + 2 * GUARD + 64 }; /* ROOM: a multiple of 64 */
  unsigned char *src = aligned_alloc(64, ROOM), *dst = aligned_alloc(64, ROOM);
  CHECK(src != NULL && dst != NULL);
  if (src == NULL || dst == NULL) {
    free(src);
    free(dst);
    return;
  }
  for (size_t i = 0; i < ROOM; i++) src[i] = (unsigned char)(i * 131 + (i >> 8) * 7 + 1);
  int bad = 0;
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
    for (size_t da = 0; da < 64; da++) /* dst + GUARD is 64-byte aligned: every offset within a line */
      for (size_t sa = 0; sa < 4; sa++) {
        size_t n = sizes[k];
        memset(dst, 0xEE, ROOM);
        unsigned char *d = dst + GUARD + da;
        if (stream_copy(d, src + sa, n) != d) bad++;
        stream_copy_fence();
        if (memcmp(d, src + sa, n) != 0) bad++;
        for (size_t g = 0; g < GUARD; g++)
          if (d[-1 - (ptrdiff_t)g] != 0xEE || d[n + g] != 0xEE) {
            bad++;
            break;
          }
      }
  CHECK_EQ_INT(bad, 0);
  free(src);
  free(dst);
}

static void test_stage(void) {
  struct model m;
  struct plan *p = NULL;
  struct wd_error err;
  if (!model_open(&m, "plan-stage", dense, NDENSE, dense_config)) return;
  /* o_proj and down_proj are column slices: rows of 16 bytes, 32 apart. */
  CHECK_EQ_INT(build(&m, "{\"preset\":\"auto\",\"tp_size\":2,\"tp_rank\":1}", &p, &err), 0);
  if (p == NULL) {
    model_close(&m);
    return;
  }
  unsigned char *want = gather_all(&m, p);
  static const uint64_t slots[] = {32, 100, 256, 1000, 4096, 1 << 20};
  static const enum plan_strided modes[] = {PLAN_STRIDED_GATHER, PLAN_STRIDED_ROWS, PLAN_STRIDED_AUTO};
  for (size_t k = 0; k < sizeof slots / sizeof slots[0]; k++)
    for (size_t j = 0; j < 3; j++) {
      struct plan_stage *s = NULL;
      CHECK_EQ_INT(plan_stage_build(p, NULL, slots[k], modes[j], 1, &s, &err), 0);
      if (s == NULL) continue;
      uint64_t total = 0;
      for (size_t w = 0; w < s->nwindows; w++) total += s->windows[w].slab_bytes;
      CHECK_EQ_INT(total, p->slab_bytes);
      if (modes[j] == PLAN_STRIDED_ROWS && slots[k] < 64) {
        CHECK_EQ_INT(s->rows_pieces, 1); /* down_proj's rows (64 bytes) do not fit a slot: gathered */
      } else if (modes[j] == PLAN_STRIDED_ROWS) {
        CHECK_EQ_INT(s->rows_pieces, 2);
        CHECK(s->staged_bytes > p->slab_bytes); /* the other halves of the rows travel to the slot too */
      } else {
        /* gather, and auto for rows this small: the slab image, window w = slab bytes [w S, (w + 1) S) */
        CHECK_EQ_INT(s->rows_pieces, 0);
        CHECK_EQ_INT(s->nwindows, (p->slab_bytes + slots[k] - 1) / slots[k]);
        for (size_t w = 0; w < s->nwindows; w++) {
          CHECK_EQ_INT(s->windows[w].count, 1);
          CHECK_EQ_INT(s->xfers[s->windows[w].first].dst, w * slots[k]);
        }
        CHECK_EQ_INT(s->staged_bytes, p->slab_bytes);
      }
      unsigned char *got = run_schedule(&m, p, s);
      if (memcmp(got, want, p->slab_bytes) != 0) {
        fprintf(stderr, "slot %llu, mode %zu: the staged slab differs from the gathered one\n",
                (unsigned long long)slots[k], j);
        CHECK(0);
      }
      free(got);
      plan_stage_free(s);
    }
  /*
   * Aligned schedules (a source that reads into aligned slots): every piece
   * that has a source is a span or whole rows, at a slot offset congruent to
   * its file offset, and the whole aligned blocks around it hold no other
   * transfer's bytes; the slab comes out the same.
   */
  static const uint64_t aslots[] = {8192, 12288, 65536};
  static const uint64_t aligns[] = {512, 4096};
  for (size_t k = 0; k < 3; k++)
    for (size_t a = 0; a < 2; a++) {
      uint64_t A = aligns[a];
      if (aslots[k] < 2 * A) continue;
      struct plan_stage *s = NULL;
      CHECK_EQ_INT(plan_stage_build(p, m.ck, aslots[k], PLAN_STRIDED_GATHER, A, &s, &err), 0);
      if (s == NULL) continue;
      CHECK_EQ_INT(s->align, A);
      size_t spans = 0, rows = 0;
      for (size_t w = 0; w < s->nwindows; w++) {
        const struct plan_window *win = &s->windows[w];
        for (size_t i = win->first; i < win->first + win->count; i++) {
          const struct plan_xfer *x = &s->xfers[i];
          if (x->kind == PLAN_XFER_IMAGE) {
            CHECK(x->pc == NULL || x->pc->src == NULL); /* only gaps and zeros */
            continue;
          }
          spans += x->kind == PLAN_XFER_SPAN;
          rows += x->kind == PLAN_XFER_ROWS;
          uint64_t file = m.ck->shards[0].hdr->data_start + x->pc->src->t->begin + x->pc->src_offset +
                          (x->kind == PLAN_XFER_ROWS ? x->row0 * x->pc->src_pitch : x->src);
          CHECK_EQ_INT(x->at % A, file % A);
          uint64_t lo = x->at / A * A, hi = (x->at + x->len + A - 1) / A * A;
          CHECK(hi <= s->slot_bytes);
          for (size_t j = win->first; j < win->first + win->count; j++) {
            const struct plan_xfer *y = &s->xfers[j];
            if (j == i) continue;
            /* No other transfer's bytes in its blocks, whatever order fill tasks write them in. */
            CHECK(y->at + y->len <= lo || y->at >= hi);
          }
        }
      }
      CHECK(spans > 0 && rows > 0); /* the column slices went as whole rows, the rest as spans */
      unsigned char *got = run_schedule(&m, p, s);
      CHECK(memcmp(got, want, p->slab_bytes) == 0);
      free(got);
      plan_stage_free(s);
    }
  /* The rule: auto takes short strided rows at twice their width once the piece is large enough. */
  struct ckpt_ref ref = {0};
  struct plan_piece pc = {.src = &ref, .width = 2048, .src_pitch = 4096, .height = 512};
  CHECK(plan_piece_rows(&pc, PLAN_STRIDED_AUTO, 64u << 20));
  pc.height = 511; /* under 1 MiB */
  CHECK(!plan_piece_rows(&pc, PLAN_STRIDED_AUTO, 64u << 20));
  pc.height = 4096;
  pc.src_pitch = 8192; /* TP=4 */
  CHECK(!plan_piece_rows(&pc, PLAN_STRIDED_AUTO, 64u << 20));
  CHECK(plan_piece_rows(&pc, PLAN_STRIDED_ROWS, 64u << 20));
  CHECK(!plan_piece_rows(&pc, PLAN_STRIDED_ROWS, 4096)); /* a row does not fit a slot */
  CHECK(!plan_piece_rows(&pc, PLAN_STRIDED_GATHER, 64u << 20));
  pc.width = 4096;
  pc.src_pitch = 8192;
  CHECK(!plan_piece_rows(&pc, PLAN_STRIDED_AUTO, 64u << 20)); /* 4 KiB rows: gathered */
  free(want);
  plan_free(p);
  model_close(&m);
}

int main(void) {
  RUN(test_sha256_vectors);
  RUN(test_family_table);
  RUN(test_whole);
  RUN(test_dense_tp2);
  RUN(test_moe_ep2);
  RUN(test_explicit_key);
  RUN(test_strict_fields);
  RUN(test_key_bounded);
  RUN(test_overflow_refused);
  RUN(test_ranges);
  RUN(test_stream_copy);
  RUN(test_stage);
  return tu_finish();
}
