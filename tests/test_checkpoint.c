/*
 * test_checkpoint.c - checkpoint directories: index and shards, single file,
 * bare file, path rules, symlinked Hugging Face cache layouts, model roots,
 * replaced shards, and config.json defaults.
 */
#include <limits.h>
#include <time.h>

#include "checkpoint.h"
#include "fixture.h"
#include "pathutil.h"
#include "testutil.h"

static const struct fx_tensor shard1[] = {
    {"model.embed_tokens.weight", "BF16", 2, 64, 16},
    {"model.layers.0.mlp.up_proj.weight", "BF16", 2, 32, 16},
};
static const struct fx_tensor shard2[] = {
    {"model.layers.0.mlp.down_proj.weight", "BF16", 2, 16, 32},
    {"model.norm.weight", "F32", 4, 16, 0},
};

static const char *index_json =
    "{\"metadata\":{\"total_size\":4224},\"weight_map\":{"
    "\"model.embed_tokens.weight\":\"model-00001-of-00002.safetensors\","
    "\"model.layers.0.mlp.up_proj.weight\":\"model-00001-of-00002.safetensors\","
    "\"model.layers.0.mlp.down_proj.weight\":\"model-00002-of-00002.safetensors\","
    "\"model.norm.weight\":\"model-00002-of-00002.safetensors\"}}";

static char *make_two_shard_dir(const char *tag) {
  char *d = fx_tmpdir(tag);
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", d);
  fx_write_st(p, shard1, 2);
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
  fx_write_st(p, shard2, 2);
  fx_write_text(d, "model.safetensors.index.json", index_json);
  return d;
}

static void test_index_directory(void) {
  char *d = make_two_shard_dir("ck-index");
  fx_write_text(d, "config.json",
                "{\"model_type\":\"qwen3\",\"architectures\":[\"Qwen3ForCausalLM\"],"
                "\"hidden_size\":16,\"num_attention_heads\":2,\"num_hidden_layers\":1}");
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ckpt_open(d, NULL, &c, &err), 0);
  if (c == NULL) {
    fprintf(stderr, "%s\n", err.msg);
    fx_rmtree(d);
    free(d);
    return;
  }
  CHECK_EQ_INT(c->layout, CKPT_INDEX);
  CHECK_EQ_INT(c->nshards, 2);
  CHECK_EQ_INT(c->ntensors, 4);
  CHECK_EQ_INT(c->total_bytes, 64 * 16 * 2 + 32 * 16 * 2 + 16 * 32 * 2 + 16 * 4);
  const struct ckpt_ref *r = ckpt_tensor_find(c, "model.layers.0.mlp.down_proj.weight");
  CHECK(r != NULL);
  if (r != NULL) {
    CHECK_STR_CONTAINS(c->shards[r->shard].rel, "model-00002-of-00002");
    CHECK_EQ_INT(r->t->begin, 0);
    CHECK_EQ_INT(r->t->shape[1], 32);
  }
  CHECK(ckpt_tensor_find(c, "model.layers.1.mlp.up_proj.weight") == NULL);
  CHECK(c->config != NULL);
  int64_t v = -1;
  CHECK_EQ_INT(mcfg_get(c->config, MCFG_HIDDEN_SIZE, "test", &v, &err), 0);
  CHECK_EQ_INT(v, 16);
  /* qwen3 defaults: kv heads = attention heads, head_dim 128, untied */
  CHECK_EQ_INT(mcfg_get(c->config, MCFG_NUM_KEY_VALUE_HEADS, "test", &v, &err), 0);
  CHECK_EQ_INT(v, 2);
  CHECK_EQ_INT(mcfg_get(c->config, MCFG_HEAD_DIM, "test", &v, &err), 0);
  CHECK_EQ_INT(v, 128);
  CHECK_EQ_INT(mcfg_get(c->config, MCFG_TIE_WORD_EMBEDDINGS, "test", &v, &err), 0);
  CHECK_EQ_INT(v, 0);
  /* a required field that is missing fails only when asked for, naming it */
  CHECK_EQ_INT(mcfg_get(c->config, MCFG_VOCAB_SIZE, "the vocab-parallel layout", &v, &err),
               WEIGHTD_E_BAD_CONFIG);
  CHECK_STR_CONTAINS(err.msg, "vocab_size");
  CHECK_STR_CONTAINS(err.msg, "vocab-parallel");
  CHECK_EQ_INT(mcfg_get(c->config, MCFG_MOE_INTERMEDIATE_SIZE, "experts", &v, &err),
               WEIGHTD_E_BAD_CONFIG);
  CHECK_EQ_INT(ckpt_check_unchanged(c, &err), 0);
  ckpt_free(c);
  fx_rmtree(d);
  free(d);
}

static void expect_open_fails(const char *path, const struct ckpt_opts *opts, int code,
                              const char *needle) {
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  int rc = ckpt_open(path, opts, &c, &err);
  CHECK_EQ_INT(rc, code);
  CHECK(c == NULL);
  CHECK_STR_CONTAINS(err.msg, needle);
  ckpt_free(c);
}

static void test_missing_shard(void) {
  char *d = make_two_shard_dir("ck-missing");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
  unlink(p);
  expect_open_fails(d, NULL, WEIGHTD_E_NOT_FOUND, "model-00002-of-00002.safetensors");
  fx_rmtree(d);
  free(d);
}

static void test_tensor_absent_from_shard(void) {
  char *d = make_two_shard_dir("ck-absent");
  fx_write_text(d, "model.safetensors.index.json",
                "{\"weight_map\":{"
                "\"model.embed_tokens.weight\":\"model-00001-of-00002.safetensors\","
                "\"model.layers.0.mlp.up_proj.weight\":\"model-00001-of-00002.safetensors\","
                "\"model.layers.0.mlp.down_proj.weight\":\"model-00002-of-00002.safetensors\","
                "\"model.norm.weight\":\"model-00002-of-00002.safetensors\","
                "\"lm_head.weight\":\"model-00002-of-00002.safetensors\"}}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "'lm_head.weight' is not in its shard");
  fx_rmtree(d);
  free(d);
}

static void test_index_points_to_wrong_shard(void) {
  char *d = make_two_shard_dir("ck-wrong");
  fx_write_text(d, "model.safetensors.index.json",
                "{\"weight_map\":{"
                "\"model.embed_tokens.weight\":\"model-00002-of-00002.safetensors\","
                "\"model.layers.0.mlp.up_proj.weight\":\"model-00001-of-00002.safetensors\","
                "\"model.layers.0.mlp.down_proj.weight\":\"model-00002-of-00002.safetensors\","
                "\"model.norm.weight\":\"model-00002-of-00002.safetensors\"}}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "maps tensor 'model.embed_tokens.weight'");
  fx_rmtree(d);
  free(d);
}

static void test_tensor_missing_from_index(void) {
  char *d = make_two_shard_dir("ck-unindexed");
  fx_write_text(d, "model.safetensors.index.json",
                "{\"weight_map\":{"
                "\"model.embed_tokens.weight\":\"model-00001-of-00002.safetensors\","
                "\"model.layers.0.mlp.up_proj.weight\":\"model-00001-of-00002.safetensors\","
                "\"model.layers.0.mlp.down_proj.weight\":\"model-00002-of-00002.safetensors\"}}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "'model.norm.weight' of shard");
  fx_rmtree(d);
  free(d);
}

static void test_tensor_in_two_shards(void) {
  char *d = make_two_shard_dir("ck-dup");
  char p[PATH_MAX];
  const struct fx_tensor again[] = {
      {"model.layers.0.mlp.down_proj.weight", "BF16", 2, 16, 32},
      {"model.embed_tokens.weight", "BF16", 2, 64, 16},
  };
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
  fx_write_st(p, again, 2);
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "appears in two shards");
  fx_rmtree(d);
  free(d);
}

static void test_traversal_refused(void) {
  static const char *bad[] = {"../model-00001-of-00002.safetensors", "/etc/passwd",
                              "sub/../../x.safetensors", ".."};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char *d = make_two_shard_dir("ck-trav");
    char idx[512];
    snprintf(idx, sizeof idx,
             "{\"weight_map\":{\"model.embed_tokens.weight\":\"%s\","
             "\"model.layers.0.mlp.up_proj.weight\":\"model-00001-of-00002.safetensors\"}}",
             bad[i]);
    fx_write_text(d, "model.safetensors.index.json", idx);
    expect_open_fails(d, NULL, WEIGHTD_E_PATH_DENIED, "must be relative");
    fx_rmtree(d);
    free(d);
  }
  CHECK(path_rel_is_safe("a/b..c/x.safetensors"));
  CHECK(path_rel_is_safe("..hidden"));
  CHECK(!path_rel_is_safe("a/../b"));
  CHECK(!path_rel_is_safe(""));
}

/* snapshots/<rev>/model-0000N -> ../../blobs/<sha>, as the Hugging Face cache lays them out. */
static char *make_hf_cache(char **snapshot_out) {
  char *root = fx_tmpdir("ck-hf");
  char blobs[PATH_MAX], snap[PATH_MAX], p[PATH_MAX], link[PATH_MAX];
  snprintf(blobs, sizeof blobs, "%s/blobs", root);
  snprintf(snap, sizeof snap, "%s/snapshots", root);
  mkdir(blobs, 0755);
  mkdir(snap, 0755);
  snprintf(snap, sizeof snap, "%s/snapshots/0123abcd", root);
  mkdir(snap, 0755);
  snprintf(p, sizeof p, "%s/1111", blobs);
  fx_write_st(p, shard1, 2);
  snprintf(p, sizeof p, "%s/2222", blobs);
  fx_write_st(p, shard2, 2);
  fx_write_text(blobs, "3333", index_json);
  snprintf(link, sizeof link, "%s/model-00001-of-00002.safetensors", snap);
  CHECK_EQ_INT(symlink("../../blobs/1111", link), 0);
  snprintf(link, sizeof link, "%s/model-00002-of-00002.safetensors", snap);
  CHECK_EQ_INT(symlink("../../blobs/2222", link), 0);
  snprintf(link, sizeof link, "%s/model.safetensors.index.json", snap);
  CHECK_EQ_INT(symlink("../../blobs/3333", link), 0);
  *snapshot_out = strdup(snap);
  return root;
}

static void test_hf_cache_symlinks(void) {
  char *snap = NULL;
  char *root = make_hf_cache(&snap);
  char *real_root = realpath(root, NULL);
  const char *roots[] = {real_root};
  struct ckpt_opts opts = {roots, 1};
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ckpt_open(snap, &opts, &c, &err), 0);
  if (c != NULL) {
    CHECK_EQ_INT(c->nshards, 2);
    CHECK_STR_CONTAINS(c->shards[0].real, "/blobs/1111");
    CHECK_EQ_INT(c->ntensors, 4);
  }
  ckpt_free(c);
  /* The snapshot is under the root but its blobs are not: refused. */
  char snaproot[PATH_MAX];
  snprintf(snaproot, sizeof snaproot, "%s/snapshots", real_root);
  const char *roots2[] = {snaproot};
  struct ckpt_opts opts2 = {roots2, 1};
  expect_open_fails(snap, &opts2, WEIGHTD_E_PATH_DENIED, "outside the model roots");
  /* A checkpoint outside every root: refused before any shard is read. */
  const char *roots3[] = {"/nonexistent-root"};
  struct ckpt_opts opts3 = {roots3, 1};
  expect_open_fails(snap, &opts3, WEIGHTD_E_PATH_DENIED, "outside the model roots");
  fx_rmtree(root);
  free(root);
  free(real_root);
  free(snap);
}

static void test_single_and_bare_file(void) {
  char *d = fx_tmpdir("ck-single");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model.safetensors", d);
  fx_write_st(p, shard1, 2);
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ckpt_open(d, NULL, &c, &err), 0);
  if (c) {
    CHECK_EQ_INT(c->layout, CKPT_SINGLE);
    CHECK_EQ_INT(c->nshards, 1);
    CHECK(c->config == NULL);
  }
  ckpt_free(c);
  c = NULL;
  CHECK_EQ_INT(ckpt_open(p, NULL, &c, &err), 0);
  if (c) {
    CHECK_EQ_INT(c->layout, CKPT_FILE);
    CHECK_EQ_INT(c->ntensors, 2);
  }
  ckpt_free(c);
  fx_rmtree(d);
  free(d);
}

static void test_empty_dir_and_bad_index(void) {
  char *d = fx_tmpdir("ck-empty");
  expect_open_fails(d, NULL, WEIGHTD_E_NOT_FOUND, "no model.safetensors");
  fx_write_text(d, "model.safetensors.index.json", "{\"weight_map\": [1, 2]}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "'weight_map' must be an object");
  fx_write_text(d, "model.safetensors.index.json", "not json");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "not a JSON object");
  fx_write_text(d, "model.safetensors.index.json", "{\"weight_map\": {\"a\": 5}}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "must be a file name");
  fx_write_text(d, "model.safetensors.index.json", "{\"weight_map\": {}}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "is empty");
  fx_rmtree(d);
  free(d);
  expect_open_fails("/nonexistent/weightd/ckpt", NULL, WEIGHTD_E_NOT_FOUND, "/nonexistent");
}

static void test_bad_shard_named(void) {
  char *d = make_two_shard_dir("ck-badshard");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
  /* Cut the last byte off: the header no longer matches the file. */
  CHECK_EQ_INT(truncate(p, 8 + 0), 0);
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_HEADER, "model-00002-of-00002.safetensors");
  fx_rmtree(d);
  free(d);
}

static void test_bad_config(void) {
  char *d = make_two_shard_dir("ck-badcfg");
  fx_write_text(d, "config.json", "{\"hidden_size\": ");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_CONFIG, "config.json: not valid JSON");
  fx_write_text(d, "config.json", "{\"hidden_size\": 1.5, \"num_attention_heads\": -2}");
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ckpt_open(d, NULL, &c, &err), 0);
  if (c) {
    int64_t v;
    CHECK_EQ_INT(mcfg_get(c->config, MCFG_HIDDEN_SIZE, "x", &v, &err), WEIGHTD_E_BAD_CONFIG);
    CHECK_STR_CONTAINS(err.msg, "'hidden_size' must be a non-negative integer");
  }
  ckpt_free(c);
  fx_rmtree(d);
  free(d);
}

static void test_replaced_shard_detected(void) {
  char *d = make_two_shard_dir("ck-stale");
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ckpt_open(d, NULL, &c, &err), 0);
  char p[PATH_MAX], tmp[PATH_MAX];
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
  snprintf(tmp, sizeof tmp, "%s/replacement", d);
  fx_write_st(tmp, shard2, 2);
  CHECK_EQ_INT(rename(tmp, p), 0); /* same content, new inode */
  if (c) {
    CHECK_EQ_INT(ckpt_check_unchanged(c, &err), WEIGHTD_E_STALE);
    CHECK_STR_CONTAINS(err.msg, "model-00002-of-00002.safetensors: shard was replaced");
  }
  ckpt_free(c);
  c = NULL;
  CHECK_EQ_INT(ckpt_open(d, NULL, &c, &err), 0);
  /* Rewritten in place: same inode, new mtime. */
  struct timespec ts[2] = {{0, UTIME_OMIT}, {12345, 0}};
  CHECK_EQ_INT(utimensat(AT_FDCWD, p, ts, 0), 0);
  if (c) {
    CHECK_EQ_INT(ckpt_check_unchanged(c, &err), WEIGHTD_E_STALE);
    CHECK_STR_CONTAINS(err.msg, "rewritten");
  }
  ckpt_free(c);
  fx_rmtree(d);
  free(d);
}

int main(void) {
  RUN(test_index_directory);
  RUN(test_missing_shard);
  RUN(test_tensor_absent_from_shard);
  RUN(test_index_points_to_wrong_shard);
  RUN(test_tensor_missing_from_index);
  RUN(test_tensor_in_two_shards);
  RUN(test_traversal_refused);
  RUN(test_hf_cache_symlinks);
  RUN(test_single_and_bare_file);
  RUN(test_empty_dir_and_bad_index);
  RUN(test_bad_shard_named);
  RUN(test_bad_config);
  RUN(test_replaced_shard_detected);
  return tu_finish();
}
