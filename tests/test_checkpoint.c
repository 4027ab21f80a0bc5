/*
 * test_checkpoint.c - checkpoint directories: index and shards, single file,
 * bare file, path rules, symlinked Hugging Face cache layouts, model roots,
 * replaced shards, and config.json defaults; confinement of every file (the
 * index and config.json too) with no open that can block (FIFOs), messages
 * that never quote a file outside the roots, the index check's cost when it
 * fails and its remembered verdicts, and the checked sum of shard sizes.
 */
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/wait.h>
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
  fx_write_text(blobs, "4444", "{\"model_type\":\"qwen3\",\"hidden_size\":16}");
  snprintf(link, sizeof link, "%s/config.json", snap);
  CHECK_EQ_INT(symlink("../../blobs/4444", link), 0);
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
    CHECK(c->config != NULL && c->config->model_type != NULL && strcmp(c->config->model_type, "qwen3") == 0);
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
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "model.safetensors.index.json: not valid JSON: at byte 0: expected a value");
  fx_write_text(d, "model.safetensors.index.json", "[1, 2]");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "model.safetensors.index.json: not a JSON object");
  fx_write_text(d, "model.safetensors.index.json", "{\"weight_map\": {\"a\": 5}}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "must be a file name");
  fx_write_text(d, "model.safetensors.index.json", "{\"weight_map\": {}}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, "is empty");
  fx_rmtree(d);
  free(d);
  expect_open_fails("/nonexistent/weightd/ckpt", NULL, WEIGHTD_E_NOT_FOUND, "/nonexistent");
}

/*
 * A truncated index (an interrupted download) says where: the construct the
 * text ends inside and where it ends. Before, every one was "not a JSON
 * object", with no position.
 */
static void test_truncated_index_says_where(void) {
  char *d = fx_tmpdir("ck-truncated");
  static const char whole[] = "{\"metadata\": {\"total_size\": 128},\n \"weight_map\": {\"a\": \"x.safetensors\", "
                              "\"b\": \"y.safetensors\"}}";
  static const struct {
    size_t len;
    const char *want;
  } cuts[] = {
      {70, "at byte 49: unterminated object: the input ends at byte 70"}, /* after "x.safetensors" */
      {72, "at byte 72: unexpected end of input in object"},              /* after the comma */
      {84, "at byte 77: unterminated string: the input ends at byte 84"}, /* inside "y.safe" */
      {3, "at byte 1: unterminated string: the input ends at byte 3"},
  };
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    char text[sizeof whole];
    memcpy(text, whole, cuts[i].len);
    text[cuts[i].len] = '\0';
    fx_write_text(d, "model.safetensors.index.json", text);
    char want[160];
    snprintf(want, sizeof want, "model.safetensors.index.json: not valid JSON: %s", cuts[i].want);
    expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX, want);
  }
  fx_rmtree(d);
  free(d);
}

static void test_bad_shard_named(void) {
  char *d = make_two_shard_dir("ck-badshard");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
  /* Cut the last byte off: the header no longer matches the file. */
  CHECK_EQ_INT(truncate(p, 8 + 0), 0);
  char want[PATH_MAX + 64];
  /* The message names the checkpoint, then the shard. */
  snprintf(want, sizeof want, "%s: model-00002-of-00002.safetensors: ", d);
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_HEADER, want);
  fx_rmtree(d);
  free(d);
}

/*
 * Every refusal names the checkpoint, not only the member at fault: the
 * index, config.json, a non-safetensors shard. A checkpoint that is one file
 * is named once, by the path it was given.
 */
static void test_errors_name_the_checkpoint(void) {
  char *d = make_two_shard_dir("ck-named");
  char p[PATH_MAX], want[PATH_MAX + 128];
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", d);
  fx_write_text(d, "model-00001-of-00002.safetensors", "PK\x03\x04 a zip, not safetensors");
  CHECK_EQ_INT(ckpt_open(d, NULL, &c, &err), WEIGHTD_E_BAD_HEADER);
  snprintf(want, sizeof want, "%s: model-00001-of-00002.safetensors: not a safetensors file", d);
  CHECK(strncmp(err.msg, want, strlen(want)) == 0);
  if (strncmp(err.msg, want, strlen(want)) != 0) fprintf(stderr, "  got: %s\n", err.msg);
  CHECK_EQ_INT(ckpt_open(p, NULL, &c, &err), WEIGHTD_E_BAD_HEADER);
  snprintf(want, sizeof want, "%s: not a safetensors file", p);
  CHECK(strncmp(err.msg, want, strlen(want)) == 0);
  if (strncmp(err.msg, want, strlen(want)) != 0) fprintf(stderr, "  got: %s\n", err.msg);
  fx_rmtree(d);
  free(d);
  d = make_two_shard_dir("ck-named-index");
  fx_write_text(d, "model.safetensors.index.json", "{\"weight_map\": ");
  CHECK_EQ_INT(ckpt_open(d, NULL, &c, &err), WEIGHTD_E_BAD_INDEX);
  snprintf(want, sizeof want, "%s: model.safetensors.index.json: not valid JSON: at byte 15: ", d);
  CHECK(strncmp(err.msg, want, strlen(want)) == 0);
  if (strncmp(err.msg, want, strlen(want)) != 0) fprintf(stderr, "  got: %s\n", err.msg);
  fx_rmtree(d);
  free(d);
  CHECK(c == NULL);
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
    char want[PATH_MAX + 64];
    snprintf(want, sizeof want, "%s: model-00002-of-00002.safetensors: shard was replaced", d);
    CHECK_STR_CONTAINS(err.msg, want);
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


/* ---- confinement, FIFOs and messages ------------------------------------------------ */

/* What a child runs: the code of a call, with its message in *err. */
typedef int (*child_fn)(const void *arg, struct wd_error *err);

/*
 * Runs fn in a child process and waits at most `seconds` for it: returns 1
 * with its code and message in *err, or 0 when it had not answered (it is
 * killed). A call that blocks fails the test instead of hanging it.
 */
static int within(child_fn fn, const void *arg, int seconds, struct wd_error *err) {
  int p[2];
  if (pipe(p) != 0) return 0;
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    struct wd_error e = {0};
    e.code = fn(arg, &e);
    ssize_t w = write(p[1], &e, sizeof e);
    _exit(w == (ssize_t)sizeof e ? 0 : 1);
  }
  close(p[1]);
  struct pollfd pfd = {.fd = p[0], .events = POLLIN};
  int ready = pid > 0 && poll(&pfd, 1, seconds * 1000) == 1;
  ready = ready && read(p[0], err, sizeof *err) == (ssize_t)sizeof *err;
  close(p[0]);
  if (pid > 0) {
    if (!ready) kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
  }
  return ready;
}

struct open_args {
  const char *path;
  const struct ckpt_opts *opts;
};

static int child_open(const void *arg, struct wd_error *err) {
  const struct open_args *a = arg;
  struct ckpt *c = NULL;
  int rc = ckpt_open(a->path, a->opts, &c, err);
  ckpt_free(c);
  return rc;
}

static int open_within(const char *path, const struct ckpt_opts *opts, int seconds, struct wd_error *err) {
  struct open_args a = {path, opts};
  return within(child_open, &a, seconds, err);
}

static int child_read_file(const void *arg, struct wd_error *err) {
  char *text = NULL;
  size_t len;
  int rc = path_read_file(arg, 1024, &text, &len);
  free(text);
  return err_set(err, rc, "read");
}

/* A model root with a directory `m` under it and a directory `outside` beside it. */
struct confined {
  char *base;
  char root[PATH_MAX], m[PATH_MAX], outside[PATH_MAX];
  const char *roots[1];
  struct ckpt_opts opts;
};

static void confined_make(struct confined *t, const char *tag) {
  char p[PATH_MAX];
  t->base = fx_tmpdir(tag);
  snprintf(p, sizeof p, "%s/root", t->base);
  mkdir(p, 0755);
  CHECK(realpath(p, t->root) != NULL);
  snprintf(t->m, sizeof t->m, "%s/m", t->root);
  mkdir(t->m, 0755);
  snprintf(p, sizeof p, "%s/outside", t->base);
  mkdir(p, 0755);
  CHECK(realpath(p, t->outside) != NULL);
  t->roots[0] = t->root;
  t->opts = (struct ckpt_opts){t->roots, 1, NULL};
}

static void confined_free(struct confined *t) {
  fx_rmtree(t->base);
  free(t->base);
}

static void link_into(const char *target, const char *dir, const char *name) {
  char l[PATH_MAX];
  snprintf(l, sizeof l, "%s/%s", dir, name);
  unlink(l);
  CHECK_EQ_INT(symlink(target, l), 0);
}

/*
 * An index naming a FIFO as a shard: refused at once as not a regular file
 * (the old reader opened it first and blocked for ever); a shard linked to a
 * FIFO outside the roots: refused as outside, and never opened.
 */
static void test_fifo_shards_do_not_block(void) {
  struct confined t;
  confined_make(&t, "ck-fifo");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", t.m);
  fx_write_st(p, shard1, 2);
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", t.m);
  CHECK_EQ_INT(mkfifo(p, 0600), 0);
  fx_write_text(t.m, "model.safetensors.index.json", index_json);
  struct wd_error err = {0};
  CHECK(open_within(t.m, &t.opts, 5, &err));
  CHECK_EQ_INT(err.code, WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "model-00002-of-00002.safetensors: not a regular file");

  unlink(p);
  char fifo[PATH_MAX];
  snprintf(fifo, sizeof fifo, "%s/fifo", t.outside);
  CHECK_EQ_INT(mkfifo(fifo, 0600), 0);
  link_into(fifo, t.m, "model-00002-of-00002.safetensors");
  memset(&err, 0, sizeof err);
  CHECK(open_within(t.m, &t.opts, 5, &err));
  CHECK_EQ_INT(err.code, WEIGHTD_E_PATH_DENIED);
  CHECK_STR_CONTAINS(err.msg, "model-00002-of-00002.safetensors: leads outside the model roots");
  CHECK(strstr(err.msg, t.outside) == NULL);
  /* Without roots the FIFO is reached, and still not opened. */
  memset(&err, 0, sizeof err);
  CHECK(open_within(t.m, NULL, 5, &err));
  CHECK_EQ_INT(err.code, WEIGHTD_E_INVALID);
  /* Daemon-side small files (the configuration) are read without blocking too. */
  memset(&err, 0, sizeof err);
  CHECK(within(child_read_file, fifo, 5, &err));
  CHECK_EQ_INT(err.code, -EINVAL);
  confined_free(&t);
}

/*
 * config.json and the index linked to files outside the roots: refused,
 * naming the file and the rule, never their contents, and with the same
 * answer whether the target exists or not. The old reader followed both
 * links: the config's contents decided the verdict ("not valid JSON"), and
 * an index's weight_map entries were quoted back.
 */
static void test_config_and_index_confined(void) {
  struct confined t;
  confined_make(&t, "ck-leak");
  char p[PATH_MAX], secret[PATH_MAX], missing[PATH_MAX];
  snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", t.m);
  fx_write_st(p, shard1, 2);
  snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", t.m);
  fx_write_st(p, shard2, 2);
  fx_write_text(t.m, "model.safetensors.index.json", index_json);
  fx_write_text(t.outside, "secret", "root:SECRET-HASH-1234:19000:0:99999:7:::\n");
  fx_write_text(t.outside, "secret.json",
                "{\"model_type\":\"SECRET-TYPE\",\"weight_map\":{\"SECRET-NAME\":\"../SECRET-FILE\"}}");
  snprintf(missing, sizeof missing, "%s/does-not-exist", t.outside);
  static const char *const names[] = {"config.json", "model.safetensors.index.json"};
  static const char *const targets[] = {"secret", "secret.json", NULL};
  for (size_t n = 0; n < 2; n++) {
    char first[WD_ERROR_MSG_MAX] = "";
    for (size_t k = 0; k < 3; k++) {
      if (targets[k] != NULL) snprintf(secret, sizeof secret, "%s/%s", t.outside, targets[k]);
      link_into(targets[k] != NULL ? secret : missing, t.m, names[n]);
      struct ckpt *c = NULL;
      struct wd_error err = {0};
      CHECK_EQ_INT(ckpt_open(t.m, &t.opts, &c, &err), WEIGHTD_E_PATH_DENIED);
      CHECK(c == NULL);
      ckpt_free(c);
      CHECK_STR_CONTAINS(err.msg, names[n]);
      CHECK_STR_CONTAINS(err.msg, "outside the model roots");
      CHECK(strstr(err.msg, "SECRET") == NULL);
      CHECK(strstr(err.msg, t.outside) == NULL);
      if (k == 0) snprintf(first, sizeof first, "%s", err.msg);
      else CHECK(strcmp(first, err.msg) == 0); /* no answer tells what exists outside */
    }
    char l[PATH_MAX];
    snprintf(l, sizeof l, "%s/%s", t.m, names[n]);
    unlink(l);
    if (n == 1) fx_write_text(t.m, "model.safetensors.index.json", index_json);
  }
  confined_free(&t);
}

/* The resolver: realpath's answer inside the roots, one answer for everything outside them. */
static void test_path_resolve(void) {
  struct confined t;
  confined_make(&t, "ck-resolve");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/file", t.m);
  fx_write_text(t.m, "file", "x");
  link_into("file", t.m, "rel");
  link_into("./sub/../rel", t.m, "chain");
  link_into("loop-b", t.m, "loop-a");
  link_into("loop-a", t.m, "loop-b");
  link_into("gone", t.m, "dangling");
  link_into(t.outside, t.m, "out");
  link_into("../../outside/nothing", t.m, "out-missing");
  snprintf(p, sizeof p, "%s/sub", t.m);
  mkdir(p, 0755);
  const struct path_roots roots = {t.roots, 1};
  static const char *const same[] = {"file", "rel", "chain", "sub/../file", "./sub/./../rel", "sub/"};
  for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
    char q[PATH_MAX], want[PATH_MAX];
    snprintf(q, sizeof q, "%s/%s", t.m, same[i]);
    struct path_resolved r = {0};
    struct wd_error err = {0};
    CHECK_EQ_INT(path_resolve(q, &roots, "q", &r, &err), 0);
    CHECK(realpath(q, want) != NULL);
    CHECK(r.real != NULL && strcmp(r.real, want) == 0);
    free(r.real);
  }
  struct {
    const char *rel;
    int code;
  } bad[] = {{"loop-a", WEIGHTD_E_IO}, {"dangling", WEIGHTD_E_NOT_FOUND}, {"nope/x", WEIGHTD_E_NOT_FOUND},
             {"file/x", WEIGHTD_E_IO}, {"file/", WEIGHTD_E_IO}, {"out", WEIGHTD_E_PATH_DENIED},
             {"out/anything", WEIGHTD_E_PATH_DENIED}, {"out-missing", WEIGHTD_E_PATH_DENIED},
             {"../../outside", WEIGHTD_E_PATH_DENIED}, {"../../nothing/here", WEIGHTD_E_PATH_DENIED}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char q[PATH_MAX];
    snprintf(q, sizeof q, "%s/%s", t.m, bad[i].rel);
    struct path_resolved r = {0};
    struct wd_error err = {0};
    CHECK_EQ_INT(path_resolve(q, &roots, "q", &r, &err), bad[i].code);
    CHECK(r.real == NULL);
    if (bad[i].code == WEIGHTD_E_PATH_DENIED) CHECK(strcmp(err.msg, "q: leads outside the model roots") == 0);
  }
  /* No roots: no confinement. */
  char q[PATH_MAX];
  snprintf(q, sizeof q, "%s/out", t.m);
  struct path_resolved r = {0};
  CHECK_EQ_INT(path_resolve(q, NULL, "q", &r, NULL), 0);
  CHECK(r.real != NULL && strcmp(r.real, t.outside) == 0);
  free(r.real);
  confined_free(&t);
}

/* ---- the index check -------------------------------------------------------------------- */

/* A tensor listed twice while another is left out: the counts agree, the index does not. */
static void test_index_duplicate_hides_omission(void) {
  char *d = make_two_shard_dir("ck-dupomit");
  fx_write_text(d, "model.safetensors.index.json",
                "{\"weight_map\":{"
                "\"model.embed_tokens.weight\":\"model-00001-of-00002.safetensors\","
                "\"model.layers.0.mlp.up_proj.weight\":\"model-00001-of-00002.safetensors\","
                "\"model.layers.0.mlp.down_proj.weight\":\"model-00002-of-00002.safetensors\","
                "\"model.layers.0.mlp.down_proj.weight\":\"model-00002-of-00002.safetensors\"}}");
  expect_open_fails(d, NULL, WEIGHTD_E_BAD_INDEX,
                    "weight_map lists tensor 'model.layers.0.mlp.down_proj.weight' more than once");
  fx_rmtree(d);
  free(d);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define BIG_N 40000
static struct fx_tensor big_ts[BIG_N];
static char big_names[BIG_N][24];

/* One shard of BIG_N one-byte tensors and an index of them, but for the last (when omit_last). */
static char *make_big(const char *tag, bool omit_last) {
  char *d = fx_tmpdir(tag);
  char p[PATH_MAX];
  for (size_t i = 0; i < BIG_N; i++) {
    snprintf(big_names[i], sizeof big_names[i], "t.%06zu", i);
    big_ts[i] = (struct fx_tensor){big_names[i], "U8", 1, 1, 0};
  }
  snprintf(p, sizeof p, "%s/model-00001-of-00001.safetensors", d);
  CHECK_EQ_INT(fx_write_st(p, big_ts, BIG_N), 0);
  size_t cap = (size_t)BIG_N * 64 + 64, len = 0;
  char *idx = malloc(cap);
  len += (size_t)snprintf(idx, cap, "{\"weight_map\":{");
  for (size_t i = 0; i < BIG_N - (omit_last ? 1 : 0); i++)
    len += (size_t)snprintf(idx + len, cap - len, "%s\"%s\":\"model-00001-of-00001.safetensors\"", i ? "," : "",
                            big_names[i]);
  snprintf(idx + len, cap - len, "}}");
  fx_write_text(d, "model.safetensors.index.json", idx);
  free(idx);
  return d;
}

/*
 * An index that leaves out one of 40,000 tensors is refused naming the
 * tensor (the old check was quadratic: seconds; the times are printed), and a
 * repeated open of the unchanged files answers from the remembered verdict
 * (counted) without reading a header; a touched index is checked afresh.
 */
static void test_index_check_cost_and_verdicts(void) {
  char *good = make_big("ck-big-good", false), *bad = make_big("ck-big-bad", true);
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  double t0 = now_s();
  CHECK_EQ_INT(ckpt_open(good, NULL, &c, &err), 0);
  double t_good = now_s() - t0;
  ckpt_free(c);
  c = NULL;
  struct ckpt_verdicts *v = ckpt_verdicts_create(4);
  CHECK(v != NULL);
  struct ckpt_opts opts = {NULL, 0, v};
  t0 = now_s();
  CHECK_EQ_INT(ckpt_open(bad, &opts, &c, &err), WEIGHTD_E_BAD_INDEX);
  double t_bad = now_s() - t0;
  CHECK_STR_CONTAINS(err.msg, "'t.039999' of shard model-00001-of-00001.safetensors is missing from weight_map");
  /* The times are printed, not asserted: a threshold on them fails on a loaded machine (it did). */
  printf("  40,000 tensors: good open %.3f s, open with the index check failing %.3f s\n", t_good, t_bad);
  CHECK_EQ_INT(ckpt_verdicts_hits(v), 0);
  char first[WD_ERROR_MSG_MAX];
  snprintf(first, sizeof first, "%s", err.msg);
  t0 = now_s();
  CHECK_EQ_INT(ckpt_open(bad, &opts, &c, &err), WEIGHTD_E_BAD_INDEX);
  double t_again = now_s() - t0;
  CHECK_EQ_INT(ckpt_verdicts_hits(v), 1);
  CHECK(strcmp(err.msg, first) == 0);
  printf("  the same bad open again, from the remembered verdict: %.3f s\n", t_again);
  /* Touched (its ctime moves even when mtime is put back): checked again, not answered from memory. */
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model.safetensors.index.json", bad);
  struct stat sb;
  CHECK_EQ_INT(stat(p, &sb), 0);
  struct timespec ts[2] = {sb.st_atim, sb.st_mtim};
  CHECK_EQ_INT(utimensat(AT_FDCWD, p, ts, 0), 0);
  CHECK_EQ_INT(ckpt_open(bad, &opts, &c, &err), WEIGHTD_E_BAD_INDEX);
  CHECK_EQ_INT(ckpt_verdicts_hits(v), 1);
  /* Fixed: opens. */
  snprintf(p, sizeof p, "%s/model.safetensors.index.json", good);
  char q[PATH_MAX];
  snprintf(q, sizeof q, "%s/model.safetensors.index.json", bad);
  CHECK_EQ_INT(rename(p, q), 0);
  CHECK_EQ_INT(ckpt_open(bad, &opts, &c, &err), 0);
  ckpt_free(c);
  ckpt_verdicts_free(v);
  fx_rmtree(good);
  fx_rmtree(bad);
  free(good);
  free(bad);
}

/* The verdict memory is bounded: past its capacity the oldest verdict is forgotten. */
static void test_verdicts_bounded(void) {
  struct ckpt_verdicts *v = ckpt_verdicts_create(2);
  struct ckpt_opts opts = {NULL, 0, v};
  char *d[3];
  for (int i = 0; i < 3; i++) {
    d[i] = make_two_shard_dir("ck-verdict");
    fx_write_text(d[i], "model.safetensors.index.json",
                  "{\"weight_map\":{\"model.embed_tokens.weight\":\"model-00001-of-00002.safetensors\","
                  "\"model.norm.weight\":\"model-00002-of-00002.safetensors\"}}");
  }
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  for (int i = 0; i < 3; i++) CHECK_EQ_INT(ckpt_open(d[i], &opts, &c, &err), WEIGHTD_E_BAD_INDEX);
  CHECK_EQ_INT(ckpt_verdicts_hits(v), 0);
  CHECK_EQ_INT(ckpt_open(d[2], &opts, &c, &err), WEIGHTD_E_BAD_INDEX);
  CHECK_EQ_INT(ckpt_open(d[1], &opts, &c, &err), WEIGHTD_E_BAD_INDEX);
  CHECK_EQ_INT(ckpt_verdicts_hits(v), 2);
  CHECK_EQ_INT(ckpt_open(d[0], &opts, &c, &err), WEIGHTD_E_BAD_INDEX); /* forgotten: checked again */
  CHECK_EQ_INT(ckpt_verdicts_hits(v), 2);
  CHECK_STR_CONTAINS(err.msg, "is missing from weight_map");
  for (int i = 0; i < 3; i++) {
    fx_rmtree(d[i]);
    free(d[i]);
  }
  ckpt_verdicts_free(v);
}

/*
 * Shards whose data sizes add up past 2^64 - 1 (sparse files of 2^63 - 1
 * bytes on tmpfs): refused. The old reader wrapped the sum.
 */
static void test_total_size_overflow(void) {
  char tmpl[] = "/dev/shm/wd-ck-huge-XXXXXX";
  if (mkdtemp(tmpl) == NULL) {
    printf("note: test_total_size_overflow skipped: no /dev/shm\n");
    return;
  }
  const uint64_t size = (uint64_t)INT64_MAX;
  char idx[1024];
  size_t il = (size_t)snprintf(idx, sizeof idx, "{\"weight_map\":{");
  bool ok = true;
  for (int i = 0; i < 3 && ok; i++) {
    char p[PATH_MAX], h[512];
    snprintf(p, sizeof p, "%s/s%d.safetensors", tmpl, i);
    /* Four U8 tensors (a tensor's size in bits must fit 64 bits) filling the data after a 512-byte header. */
    uint64_t data = size - 8 - 512, quarter = data / 4, at = 0;
    int hl = snprintf(h, sizeof h, "{");
    for (int k = 0; k < 4; k++) {
      uint64_t n = k < 3 ? quarter : data - 3 * quarter;
      hl += snprintf(h + hl, sizeof h - (size_t)hl, "%s\"w%d.%d\":{\"dtype\":\"U8\",\"shape\":[%llu],\"data_offsets\":[%llu,%llu]}",
                     k ? "," : "", i, k, (unsigned long long)n, (unsigned long long)at, (unsigned long long)(at + n));
      at += n;
    }
    hl += snprintf(h + hl, sizeof h - (size_t)hl, "}");
    while (hl < 512) h[hl++] = ' ';
    unsigned char prefix[8] = {0, 2}; /* 512, little-endian */
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ok = fd >= 0 && write(fd, prefix, 8) == 8 && write(fd, h, 512) == 512 && ftruncate(fd, (off_t)size) == 0;
    if (fd >= 0) close(fd);
    for (int k = 0; k < 4; k++)
      il += (size_t)snprintf(idx + il, sizeof idx - il, "%s\"w%d.%d\":\"s%d.safetensors\"", i + k ? "," : "", i, k, i);
  }
  snprintf(idx + il, sizeof idx - il, "}}");
  if (!ok) {
    printf("note: test_total_size_overflow skipped: /dev/shm holds no file of 2^63 - 1 bytes\n");
  } else {
    fx_write_text(tmpl, "model.safetensors.index.json", idx);
    expect_open_fails(tmpl, NULL, WEIGHTD_E_BAD_SIZE, "more than 2^64 - 1 bytes of tensor data");
  }
  fx_rmtree(tmpl);
}

/*
 * A shard dated past 2262 (its owner may set any time; ext4 keeps years up to
 * 2446): its identity is still exact, with no signed overflow (the old reader's
 * nanosecond sum overflowed, which UBSan reports).
 */
static void test_far_future_mtime(void) {
  char *d = make_two_shard_dir("ck-future");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", d);
  struct timespec ts[2] = {{0, UTIME_OMIT}, {13569465600, 999999999}}; /* 2400-01-01 */
  CHECK_EQ_INT(utimensat(AT_FDCWD, p, ts, 0), 0);
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ckpt_open(d, NULL, &c, &err), 0);
  if (c != NULL) {
    CHECK_EQ_INT(ckpt_check_unchanged(c, &err), 0);
    ts[1].tv_nsec = 999999998;
    CHECK_EQ_INT(utimensat(AT_FDCWD, p, ts, 0), 0);
    CHECK_EQ_INT(ckpt_check_unchanged(c, &err), WEIGHTD_E_STALE);
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
  RUN(test_truncated_index_says_where);
  RUN(test_errors_name_the_checkpoint);
  RUN(test_bad_shard_named);
  RUN(test_bad_config);
  RUN(test_replaced_shard_detected);
  RUN(test_fifo_shards_do_not_block);
  RUN(test_config_and_index_confined);
  RUN(test_path_resolve);
  RUN(test_index_duplicate_hides_omission);
  RUN(test_index_check_cost_and_verdicts);
  RUN(test_verdicts_bounded);
  RUN(test_total_size_overflow);
  RUN(test_far_future_mtime);
  return tu_finish();
}
