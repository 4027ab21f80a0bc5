/*
 * test_st_writer.c - the safetensors writer: multi-shard checkpoints read
 * back with the project's strict reader and checkpoint opener, every byte
 * against what the fill callback produced; the index; shard names; failing
 * fills that leave nothing behind; stale files of an earlier run; refused
 * descriptions.
 */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdatomic.h>

#include "checkpoint.h"
#include "fixture.h"
#include "pathutil.h"
#include "safetensors.h"
#include "st_writer.h"
#include "testutil.h"

/* ---- the tensors ------------------------------------------------------------------------ */

static const uint64_t shape_a[] = {10}, shape_b[] = {3, 5}, shape_c[] = {0}, shape_d[] = {100}, shape_e[] = {4},
                      shape_f[] = {2, 3}, shape_g[] = {20}, shape_h[] = {3, 2, 2};

/*
 * Greedy at 40 bytes: a (10) b (30) fill the first file exactly and c (0)
 * still fits; d (100) gets a file of its own; e (16) f (3) g (20) make 39;
 * h (12) would make 51, so it starts file 4.
 */
static const struct stw_tensor tensors[] = {
    {"a.weight", WD_DTYPE_U8, 1, shape_a, 10, 0},
    {"b.weight", WD_DTYPE_BF16, 2, shape_b, 30, 0},
    {"c.empty", WD_DTYPE_F32, 1, shape_c, 0, 0},
    {"d.big", WD_DTYPE_U8, 1, shape_d, 100, 0},
    {"e.weight", WD_DTYPE_F32, 1, shape_e, 16, 0},
    {"f.packed", WD_DTYPE_F4, 2, shape_f, 3, 0},
    {"g.\"quoted\" caf\xc3\xa9", WD_DTYPE_U8, 1, shape_g, 20, 0},
    {"h.weight", WD_DTYPE_I8, 3, shape_h, 12, 0},
};
#define NT (sizeof tensors / sizeof tensors[0])
static const size_t greedy_file[NT] = {0, 0, 0, 1, 2, 2, 2, 3};
static const char *const greedy_names[] = {
    "model-00001-of-00004.safetensors",
    "model-00002-of-00004.safetensors",
    "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors",
};
#define GREEDY_MAX 40
#define CONFIG_TEXT "{\"model_type\": \"test\"}\n"

/* The byte the test's fill callback puts at offset off of tensor i (seeded, so two runs can differ). */
static unsigned char pattern(unsigned seed, size_t i, uint64_t off) {
  uint64_t z = (seed + 1) * 0x9e3779b97f4a7c15ULL ^ (i * 0xbf58476d1ce4e5b9ULL) ^ (off * 0x94d049bb133111ebULL);
  z ^= z >> 29;
  return (unsigned char)(z ^ (z >> 11));
}

/* What the fill callback sees: its seed, where it must fail (tensor fail_at, or none), and counters. */
struct fill_state {
  unsigned seed;
  size_t fail_at;
  atomic_ullong bytes;
  atomic_int out_of_range;
};

static int fill_pattern(void *arg, size_t i, uint64_t off, size_t len, unsigned char *dst, struct wd_error *err) {
  struct fill_state *s = arg;
  if (i >= NT || off + len > tensors[i].nbytes || len == 0) atomic_fetch_add(&s->out_of_range, 1);
  if (i == s->fail_at) return err_set(err, WEIGHTD_E_FAULT, "test: tensor %zu refuses at byte %llu", i,
                                      (unsigned long long)off);
  for (size_t k = 0; k < len; k++) dst[k] = pattern(s->seed, i, off + k);
  atomic_fetch_add(&s->bytes, len);
  return 0;
}

static const struct stw_meta meta[] = {{"format", "pt"}, {"test_key", "test value"}};
static const struct stw_companion config = {"config.json", CONFIG_TEXT, sizeof CONFIG_TEXT - 1};

/* One test's scratch directory, tensor array and fill state. */
struct scratch {
  char *dir;
  struct stw_tensor ts[NT];
  struct fill_state fs;
};

static void scratch_open(struct scratch *s, const char *tag, unsigned seed) {
  memset(s, 0, sizeof *s);
  s->dir = fx_tmpdir(tag);
  s->fs.seed = seed;
  s->fs.fail_at = SIZE_MAX;
  atomic_init(&s->fs.bytes, 0);
  atomic_init(&s->fs.out_of_range, 0);
}

static void scratch_close(struct scratch *s) {
  fx_rmtree(s->dir);
  free(s->dir);
}

/* A spec for the tensors in s->dir: greedy at max bytes when max > 0, else the files in file_of. */
static struct stw_spec spec_make(struct scratch *s, const size_t *file_of, uint64_t max) {
  for (size_t i = 0; i < NT; i++) {
    s->ts[i] = tensors[i];
    s->ts[i].file = file_of != NULL ? file_of[i] : 0;
  }
  return (struct stw_spec){
      .dir = s->dir,
      .tensors = s->ts,
      .ntensors = NT,
      .max_file_bytes = max,
      .meta = meta,
      .nmeta = 2,
      .companions = &config,
      .ncompanions = 1,
      .fill = fill_pattern,
      .fill_arg = &s->fs,
      .threads = 3,
      .chunk_bytes = 7, /* jobs cut across tensors and start inside them */
  };
}

/* Creates and runs a writer for spec; the stw_run code (or the stw_create one). */
static int write_spec(const struct stw_spec *spec, struct wd_error *err) {
  struct stw_writer *w = NULL;
  int rc = stw_create(spec, &w, err);
  if (rc == 0) rc = stw_run(w, err);
  stw_free(w);
  return rc;
}

static uint64_t total_bytes(void) {
  uint64_t n = 0;
  for (size_t i = 0; i < NT; i++) n += tensors[i].nbytes;
  return n;
}

/* ---- reading back --------------------------------------------------------------------------- */

/* The directory's entries, sorted, joined by spaces (a new string). */
static char *dir_listing(const char *dir) {
  char *names[64];
  size_t n = 0, len = 1;
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d != NULL && (e = readdir(d)) != NULL && n < 64) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    names[n] = strdup(e->d_name);
    len += strlen(e->d_name) + 1;
    n++;
  }
  if (d != NULL) closedir(d);
  for (size_t i = 1; i < n; i++)
    for (size_t j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
      char *t = names[j];
      names[j] = names[j - 1];
      names[j - 1] = t;
    }
  char *out = calloc(1, len);
  for (size_t i = 0; i < n; i++) {
    if (i > 0) strcat(out, " ");
    strcat(out, names[i]);
    free(names[i]);
  }
  return out;
}

/* Checks that dir holds exactly the entries in want (sorted, space-separated). */
static void check_listing(const char *dir, const char *want) {
  char *l = dir_listing(dir);
  if (strcmp(l, want) != 0) {
    CHECK(strcmp(l, want) == 0);
    fprintf(stderr, "  %s holds: %s\n  expected: %s\n", dir, l, want);
  }
  free(l);
}

/*
 * Checks safetensors file `name` in dir with the strict reader: header
 * padded to 8, metadata, and tensors in[0..n) (with their file-order
 * offsets) holding the pattern of `seed`.
 */
static void check_file(const char *dir, const char *name, const size_t *in, size_t n, unsigned seed) {
  char *path = path_join(dir, name);
  struct st_header *h = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(st_header_read_path(path, name, &h, &err), 0);
  if (h == NULL) {
    fprintf(stderr, "%s: %s\n", name, err.msg);
    free(path);
    return;
  }
  CHECK_EQ_INT(h->header_len % 8, 0);
  CHECK_EQ_INT(h->data_start, 8 + h->header_len);
  CHECK(st_meta_get(h, "format") != NULL && strcmp(st_meta_get(h, "format"), "pt") == 0);
  CHECK(st_meta_get(h, "test_key") != NULL && strcmp(st_meta_get(h, "test_key"), "test value") == 0);
  CHECK_EQ_INT(h->ntensors, n);
  FILE *f = fopen(path, "rb");
  CHECK(f != NULL);
  uint64_t off = 0;
  for (size_t k = 0; k < n && f != NULL; k++) {
    const struct stw_tensor *want = &tensors[in[k]];
    const struct st_tensor *t = st_tensor_find(h, want->name);
    CHECK(t != NULL);
    if (t == NULL) continue;
    CHECK_EQ_INT(t->dtype, want->dtype);
    CHECK_EQ_INT(t->ndim, want->ndim);
    for (unsigned d = 0; d < t->ndim && d < want->ndim; d++) CHECK_EQ_INT(t->shape[d], want->shape[d]);
    CHECK_EQ_INT(t->begin, off);
    CHECK_EQ_INT(t->end, off + want->nbytes);
    unsigned char buf[128];
    CHECK(fseek(f, (long)(h->data_start + t->begin), SEEK_SET) == 0);
    CHECK_EQ_INT(fread(buf, 1, (size_t)want->nbytes, f), want->nbytes);
    size_t bad = 0;
    for (uint64_t b = 0; b < want->nbytes; b++) bad += buf[b] != pattern(seed, in[k], b);
    CHECK_EQ_INT(bad, 0);
    off += want->nbytes;
  }
  CHECK_EQ_INT(h->data_len, off);
  if (f != NULL) fclose(f);
  st_header_free(h);
  free(path);
}

/*
 * Checks the greedy 4-file checkpoint of `seed` in dir: nothing else in dir,
 * every file through the reader, ckpt_open, the index and config.json.
 */
static void check_greedy_checkpoint(const char *dir, unsigned seed) {
  check_listing(dir, "config.json model-00001-of-00004.safetensors model-00002-of-00004.safetensors "
                     "model-00003-of-00004.safetensors model-00004-of-00004.safetensors " STW_INDEX_NAME);
  for (size_t k = 0; k < 4; k++) {
    size_t in[NT], n = 0;
    for (size_t i = 0; i < NT; i++)
      if (greedy_file[i] == k) in[n++] = i;
    check_file(dir, greedy_names[k], in, n, seed);
  }
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ckpt_open(dir, NULL, &c, &err), 0);
  if (c == NULL) {
    fprintf(stderr, "ckpt_open: %s\n", err.msg);
    return;
  }
  CHECK_EQ_INT(c->layout, CKPT_INDEX);
  CHECK_EQ_INT(c->nshards, 4);
  CHECK_EQ_INT(c->ntensors, NT);
  CHECK_EQ_INT(c->total_bytes, total_bytes());
  for (size_t i = 0; i < NT; i++) {
    const struct ckpt_ref *r = ckpt_tensor_find(c, tensors[i].name);
    CHECK(r != NULL);
    if (r != NULL) CHECK(strcmp(c->shards[r->shard].rel, greedy_names[greedy_file[i]]) == 0);
  }
  ckpt_free(c);

  char *path = path_join(dir, STW_INDEX_NAME), *text = NULL;
  size_t len = 0;
  CHECK_EQ_INT(path_read_file(path, 1 << 20, &text, &len), 0);
  cJSON *idx = text != NULL ? cJSON_Parse(text) : NULL;
  CHECK(idx != NULL);
  const cJSON *total = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(idx, "metadata"), "total_size");
  CHECK(cJSON_IsNumber(total) && (uint64_t)total->valuedouble == total_bytes());
  const cJSON *map = cJSON_GetObjectItemCaseSensitive(idx, "weight_map");
  CHECK_EQ_INT(cJSON_GetArraySize(map), NT);
  const char *prev = "";
  for (const cJSON *e = map ? map->child : NULL; e != NULL; e = e->next) {
    CHECK(strcmp(prev, e->string) < 0); /* sorted keys */
    prev = e->string;
    size_t i = 0;
    while (i < NT && strcmp(tensors[i].name, e->string) != 0) i++;
    CHECK(i < NT);
    if (i < NT) CHECK(cJSON_IsString(e) && strcmp(e->valuestring, greedy_names[greedy_file[i]]) == 0);
  }
  CHECK_STR_CONTAINS(text, "\"g.\\\"quoted\\\" caf\xc3\xa9\": \"model-00003-of-00004.safetensors\"");
  cJSON_Delete(idx);
  free(text);
  free(path);
  path = path_join(dir, "config.json");
  text = NULL;
  CHECK_EQ_INT(path_read_file(path, 1 << 20, &text, &len), 0);
  CHECK(text != NULL && strcmp(text, CONFIG_TEXT) == 0);
  free(text);
  free(path);
}

/* ---- tests ----------------------------------------------------------------------------------- */

static void test_greedy_shards(void) {
  struct scratch s;
  scratch_open(&s, "stw-greedy", 1);
  struct stw_spec spec = spec_make(&s, NULL, GREEDY_MAX);
  struct stw_writer *w = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(stw_create(&spec, &w, &err), 0);
  if (w == NULL) {
    fprintf(stderr, "%s\n", err.msg);
    scratch_close(&s);
    return;
  }
  CHECK_EQ_INT(stw_file_count(w), 4);
  for (size_t k = 0; k < 4; k++) CHECK(strcmp(stw_file_name(w, k), greedy_names[k]) == 0);
  CHECK(stw_file_name(w, 4) == NULL);
  const char *const *tmp = stw_tmp_paths(w);
  size_t ntmp = 0;
  while (tmp[ntmp] != NULL) ntmp++;
  CHECK_EQ_INT(ntmp, 6); /* 4 shards, config.json, the index */
  CHECK_STR_CONTAINS(tmp[0], "/model-00001-of-00004.safetensors.tmp");
  CHECK_STR_CONTAINS(tmp[5], "/" STW_INDEX_NAME ".tmp");
  uint64_t done = 1, total = 0;
  stw_progress_get(w, &done, &total);
  CHECK_EQ_INT(done, 0);
  CHECK_EQ_INT(total, total_bytes());
  CHECK_EQ_INT(stw_run(w, &err), 0);
  stw_progress_get(w, &done, &total);
  CHECK_EQ_INT(done, total_bytes());
  CHECK_EQ_INT(stw_run(w, &err), WEIGHTD_E_INVALID);
  stw_free(w);
  CHECK_EQ_INT(atomic_load(&s.fs.bytes), total_bytes());
  CHECK_EQ_INT(atomic_load(&s.fs.out_of_range), 0);
  check_greedy_checkpoint(s.dir, 1);
  scratch_close(&s);
}

static void test_given_files(void) {
  struct scratch s;
  scratch_open(&s, "stw-given", 2);
  static const size_t two[NT] = {0, 0, 0, 0, 0, 1, 1, 1};
  struct stw_spec spec = spec_make(&s, two, 0);
  spec.name_digits = 6;
  spec.threads = 1;
  spec.chunk_bytes = 0;
  struct wd_error err = {0};
  CHECK_EQ_INT(write_spec(&spec, &err), 0);
  static const size_t in0[] = {0, 1, 2, 3, 4}, in1[] = {5, 6, 7};
  check_file(s.dir, "model-00001-of-000002.safetensors", in0, 5, 2);
  check_file(s.dir, "model-00002-of-000002.safetensors", in1, 3, 2);
  struct ckpt *c = NULL;
  CHECK_EQ_INT(ckpt_open(s.dir, NULL, &c, &err), 0);
  if (c != NULL) CHECK_EQ_INT(c->nshards, 2);
  ckpt_free(c);

  /* All in file 0: one model.safetensors and no index; the earlier run's files go. */
  static const size_t one[NT] = {0};
  spec = spec_make(&s, one, 0);
  spec.ncompanions = 0;
  CHECK_EQ_INT(write_spec(&spec, &err), 0);
  check_listing(s.dir, "model.safetensors");
  static const size_t all[] = {0, 1, 2, 3, 4, 5, 6, 7};
  check_file(s.dir, "model.safetensors", all, NT, 2);
  c = NULL;
  CHECK_EQ_INT(ckpt_open(s.dir, NULL, &c, &err), 0);
  if (c != NULL) CHECK_EQ_INT(c->layout, CKPT_SINGLE);
  ckpt_free(c);
  scratch_close(&s);
}

static void test_failing_fill_leaves_nothing(void) {
  struct scratch s;
  scratch_open(&s, "stw-fail", 3);
  s.fs.fail_at = 6;
  struct stw_spec spec = spec_make(&s, NULL, GREEDY_MAX);
  struct wd_error err = {0};
  CHECK_EQ_INT(write_spec(&spec, &err), WEIGHTD_E_FAULT);
  CHECK_STR_CONTAINS(err.msg, "test: tensor 6 refuses at byte");
  check_listing(s.dir, "");

  /* Over a complete earlier checkpoint: that one stays as it was. */
  s.fs.fail_at = SIZE_MAX;
  CHECK_EQ_INT(write_spec(&spec, &err), 0);
  static const size_t one[NT] = {0};
  spec = spec_make(&s, one, 0);
  s.fs.seed = 4;
  s.fs.fail_at = 0;
  CHECK_EQ_INT(write_spec(&spec, &err), WEIGHTD_E_FAULT);
  check_greedy_checkpoint(s.dir, 3);
  scratch_close(&s);
}

static void test_rerun_removes_stale(void) {
  struct scratch s;
  scratch_open(&s, "stw-stale", 5);
  struct stw_spec spec = spec_make(&s, NULL, 16);
  struct wd_error err = {0};
  CHECK_EQ_INT(write_spec(&spec, &err), 0);
  char *l = dir_listing(s.dir);
  CHECK_STR_CONTAINS(l, "model-00008-of-00008.safetensors"); /* a | b | c | d | e | f | g | h */
  free(l);
  CHECK_EQ_INT(fx_write_text(s.dir, "model-00007-of-00009.safetensors.tmp", "left by a crash"), 0);
  CHECK_EQ_INT(fx_write_text(s.dir, "model.safetensors", "a single file of another run"), 0);

  s.fs.seed = 6;
  spec = spec_make(&s, NULL, GREEDY_MAX);
  CHECK_EQ_INT(write_spec(&spec, &err), 0);
  check_greedy_checkpoint(s.dir, 6);
  scratch_close(&s);
}

static void test_dir_find_foreign(void) {
  struct scratch s;
  scratch_open(&s, "stw-dir", 0);
  char name[64] = "";
  struct wd_error err = {0};
  static const char *const own[] = {"config.json", "model.safetensors", STW_INDEX_NAME,
                                    "model-00001-of-00002.safetensors.tmp", "model-00003-of-000163.safetensors"};
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) fx_write_text(s.dir, own[i], "x");
  CHECK_EQ_INT(stw_dir_find_foreign(s.dir, name, sizeof name, &err), 0);
  fx_write_text(s.dir, "model-1-of-2.safetensors", "x");
  CHECK_EQ_INT(stw_dir_find_foreign(s.dir, name, sizeof name, &err), 1);
  CHECK(strcmp(name, "model-1-of-2.safetensors") == 0);
  char *p = path_join(s.dir, "model-1-of-2.safetensors");
  unlink(p);
  free(p);
  fx_write_text(s.dir, "notes.txt", "x");
  CHECK_EQ_INT(stw_dir_find_foreign(s.dir, name, sizeof name, &err), 1);
  CHECK(strcmp(name, "notes.txt") == 0);
  p = path_join(s.dir, "missing");
  CHECK_EQ_INT(stw_dir_find_foreign(p, name, sizeof name, &err), WEIGHTD_E_IO);
  CHECK_STR_CONTAINS(err.msg, "missing");
  free(p);
  scratch_close(&s);
}

static void test_refused_specs(void) {
  struct scratch s;
  scratch_open(&s, "stw-refused", 7);
  struct stw_writer *w = NULL;
  struct wd_error err = {0};
  struct stw_spec spec = spec_make(&s, NULL, GREEDY_MAX);
  s.ts[4].name = "b.weight";
  CHECK_EQ_INT(stw_create(&spec, &w, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "two tensors named 'b.weight'");

  spec = spec_make(&s, NULL, GREEDY_MAX);
  s.ts[1].nbytes = 31;
  CHECK_EQ_INT(stw_create(&spec, &w, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "b.weight");

  static const size_t skips[NT] = {0, 0, 2, 2, 2, 2, 2, 2};
  spec = spec_make(&s, skips, 0);
  CHECK_EQ_INT(stw_create(&spec, &w, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "c.empty");

  static const struct stw_companion notes = {"notes.txt", "x", 1};
  spec = spec_make(&s, NULL, GREEDY_MAX);
  spec.companions = &notes;
  CHECK_EQ_INT(stw_create(&spec, &w, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "notes.txt");

  /* A header over safetensors' 100,000,000-byte limit. */
  char *huge = malloc(ST_MAX_HEADER_LEN);
  if (huge != NULL) {
    memset(huge, 'n', ST_MAX_HEADER_LEN - 1);
    huge[ST_MAX_HEADER_LEN - 1] = '\0';
    spec = spec_make(&s, NULL, GREEDY_MAX);
    s.ts[7].name = huge;
    CHECK_EQ_INT(stw_create(&spec, &w, &err), WEIGHTD_E_LIMIT);
    CHECK_STR_CONTAINS(err.msg, "over safetensors' limit");
    free(huge);
  }
  CHECK(w == NULL);
  check_listing(s.dir, ""); /* stw_create touches no file */
  scratch_close(&s);
}

int main(void) {
  RUN(test_greedy_shards);
  RUN(test_given_files);
  RUN(test_failing_fill_leaves_nothing);
  RUN(test_rerun_removes_stale);
  RUN(test_dir_find_foreign);
  RUN(test_refused_specs);
  return tu_finish();
}
