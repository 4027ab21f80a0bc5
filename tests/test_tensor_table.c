/*
 * test_tensor_table.c - the binary tensor table (common/tensor_table.h):
 * round trips of 0, 1 and 100,000 tensors, lookups by name, the writer's
 * refusals, and the reader's rejection of corrupt tables: each field broken
 * on purpose (with the checksum recomputed, so that the rule itself is what
 * rejects it), then random corruption and truncation of a valid table, which
 * must be rejected or read without leaving the table's bounds (the sanitizer
 * build catches any read outside).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_table.h"
#include "testutil.h"

/* ---- a generated table ----------------------------------------------------------------- */

struct gen {
  size_t n;
  char **names;
  uint64_t (*shapes)[3];
  unsigned *ndims;
  uint64_t *offsets, *nbytes;
  uint64_t slab;
};

static const char *const DTYPES[] = {"BF16", "F32", "F8_E4M3", "I64", "F8_E5M2FNUZ"};

static void gen_get(void *arg, size_t i, struct ttab_tensor *t) {
  const struct gen *g = arg;
  t->name = g->names[i];
  t->name_len = strlen(g->names[i]);
  t->dtype = DTYPES[i % 5];
  t->ndim = g->ndims[i];
  t->shape = g->shapes[i];
  t->offset = g->offsets[i];
  t->nbytes = g->nbytes[i];
}

/* n tensors with names in an order other than the slab's, 0 to 3 dimensions each. */
static struct gen *gen_new(size_t n) {
  struct gen *g = calloc(1, sizeof *g);
  g->n = n;
  g->names = calloc(n + 1, sizeof *g->names);
  g->shapes = calloc(n + 1, sizeof *g->shapes);
  g->ndims = calloc(n + 1, sizeof *g->ndims);
  g->offsets = calloc(n + 1, sizeof *g->offsets);
  g->nbytes = calloc(n + 1, sizeof *g->nbytes);
  uint64_t off = 0;
  for (size_t i = 0; i < n; i++) {
    char buf[96];
    snprintf(buf, sizeof buf, "model.layers.%zu.mlp.experts.%zu.w%zu.weight", (i * 7919) % (n ? n : 1), i % 13, i);
    g->names[i] = strdup(buf);
    g->ndims[i] = (unsigned)(i % 4);
    for (unsigned d = 0; d < 3; d++) g->shapes[i][d] = (uint64_t)(i % 17 + d + 1);
    g->offsets[i] = off;
    g->nbytes[i] = (uint64_t)(i % 1000) * 2;
    off += (g->nbytes[i] + 255) / 256 * 256;
  }
  g->slab = off + 256;
  return g;
}

static void gen_free(struct gen *g) {
  for (size_t i = 0; i < g->n; i++) free(g->names[i]);
  free(g->names);
  free(g->shapes);
  free(g->ndims);
  free(g->offsets);
  free(g->nbytes);
  free(g);
}

/* Writes g's table into an 8-byte aligned buffer. */
static unsigned char *gen_write(struct gen *g, size_t *len) {
  unsigned char *buf = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(ttab_write(g->n, gen_get, g, g->slab, &buf, len, &err), 0);
  return buf;
}

static void check_round_trip(size_t n) {
  struct gen *g = gen_new(n);
  size_t len = 0;
  unsigned char *buf = gen_write(g, &len);
  struct ttab t;
  struct wd_error err = {0};
  CHECK_EQ_INT(ttab_open(buf, len, &t, &err), 0);
  CHECK_EQ_INT(t.count, n);
  CHECK_EQ_INT(t.slab_bytes, g->slab);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    struct ttab_entry e;
    ttab_get(&t, i, &e);
    bad += strcmp(e.name, g->names[i]) != 0 || e.name_len != strlen(g->names[i]) ||
           strcmp(e.dtype, DTYPES[i % 5]) != 0 || e.ndim != g->ndims[i] || e.offset != g->offsets[i] ||
           e.nbytes != g->nbytes[i];
    for (unsigned d = 0; d < e.ndim; d++) bad += e.shape[d] != (int64_t)g->shapes[i][d];
    bad += ttab_find(&t, g->names[i], strlen(g->names[i])) != (int64_t)i;
  }
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_INT(ttab_find(&t, "nope", 4), -1);
  CHECK_EQ_INT(ttab_find(&t, "", 0), -1);
  if (n > 0) /* a prefix of a name is another name */
    CHECK_EQ_INT(ttab_find(&t, g->names[0], strlen(g->names[0]) - 1), -1);
  free(buf);
  gen_free(g);
}

static void test_round_trip_0(void) { check_round_trip(0); }
static void test_round_trip_1(void) { check_round_trip(1); }
static void test_round_trip_100k(void) { check_round_trip(100000); }

/* XXH64's published values. */
static void test_checksum_vectors(void) {
  CHECK(ttab_xxh64("", 0) == 0xef46db3751d8e999ULL);
  CHECK(ttab_xxh64("a", 1) == 0xd24ec4f1a98c6e5bULL);
  CHECK(ttab_xxh64("abc", 3) == 0x44bc2cf5ad770999ULL);
}

/* ---- the writer's refusals ----------------------------------------------------------------- */

static void test_writer_refuses(void) {
  struct gen *g = gen_new(3);
  unsigned char *buf;
  size_t len;
  struct wd_error err = {0};
  free(g->names[2]);
  g->names[2] = strdup(g->names[0]);
  buf = NULL;
  CHECK_EQ_INT(ttab_write(g->n, gen_get, g, g->slab, &buf, &len, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "two tensors are called");
  free(buf);
  free(g->names[2]);
  g->names[2] = strdup("other");
  g->nbytes[1] = g->slab + 1;
  buf = NULL;
  CHECK_EQ_INT(ttab_write(g->n, gen_get, g, g->slab, &buf, &len, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "outside the");
  free(buf);
  gen_free(g);
}

/* ---- corrupt tables ------------------------------------------------------------------------ */

static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static uint64_t get64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

static void reseal(unsigned char *buf, size_t len) { put64(buf + 16, ttab_xxh64(buf + 24, len - 24)); }

/* Breaks one thing of a fresh table (resealed unless keep_sum) and expects BAD_TABLE with `why`. */
static void expect_bad(void (*breakit)(unsigned char *b, size_t len), int keep_sum, const char *why) {
  struct gen *g = gen_new(5);
  size_t len;
  unsigned char *buf = gen_write(g, &len);
  breakit(buf, len);
  if (!keep_sum) reseal(buf, len);
  struct ttab t;
  struct wd_error err = {0};
  CHECK_EQ_INT(ttab_open(buf, len, &t, &err), WEIGHTD_E_BAD_TABLE);
  CHECK_STR_CONTAINS(err.msg, why);
  free(buf);
  gen_free(g);
}

static const size_t REC = TTAB_HEADER_BYTES; /* record 0 */

static void b_magic(unsigned char *b, size_t l) { (void)l, b[0] = 'X'; }
static void b_version(unsigned char *b, size_t l) { (void)l, put32(b + 8, 2); }
static void b_flip(unsigned char *b, size_t l) { b[l - 1] ^= 1; }
static void b_total(unsigned char *b, size_t l) { put64(b + 24, l + 8); }
static void b_count(unsigned char *b, size_t l) { (void)l, put64(b + 40, 1000000); }
static void b_offset(unsigned char *b, size_t l) { (void)l, put64(b + REC + TTAB_RECORD_BYTES, get64(b + 32)); }
static void b_nbytes(unsigned char *b, size_t l) { (void)l, put64(b + REC + TTAB_RECORD_BYTES + 8, UINT64_MAX); }
static void b_name_off(unsigned char *b, size_t l) { (void)l, put64(b + REC + 32, get64(b + 96)); }
static void b_name_len(unsigned char *b, size_t l) { (void)l, put32(b + REC + 28, 3); }
static void b_ndim(unsigned char *b, size_t l) { (void)l, put32(b + REC + 3 * TTAB_RECORD_BYTES + 24, 1u << 30); }
static void b_dtype(unsigned char *b, size_t l) { (void)l, memset(b + REC + 40, 'A', TTAB_DTYPE_BYTES); }
static void b_dim_negative(unsigned char *b, size_t l) { (void)l, put64(b + get64(b + 64), (uint64_t)-1); }
static void b_index_range(unsigned char *b, size_t l) { (void)l, put32(b + get64(b + 80), 77); }
static void b_index_dup(unsigned char *b, size_t l) {
  (void)l;
  unsigned char *ix = b + get64(b + 80);
  memcpy(ix + 4, ix, 4);
}
static void b_name_nul(unsigned char *b, size_t l) { (void)l, b[get64(b + 88) + 2] = 0; }
static void b_reserved(unsigned char *b, size_t l) { (void)l, b[110] = 1; }
static void b_strings(unsigned char *b, size_t l) { (void)l, put64(b + 96, get64(b + 96) - 1); }

static void test_corrupt_rejected(void) {
  expect_bad(b_magic, 0, "bad magic");
  expect_bad(b_version, 0, "version 2");
  expect_bad(b_flip, 1, "checksum");
  expect_bad(b_total, 0, "the header says");
  expect_bad(b_count, 0, "records run past");
  expect_bad(b_offset, 0, "outside the");
  expect_bad(b_nbytes, 0, "outside the");
  expect_bad(b_name_off, 0, "past the strings section");
  expect_bad(b_name_len, 0, "not NUL-terminated");
  expect_bad(b_ndim, 0, "dims section");
  expect_bad(b_dtype, 0, "dtype");
  expect_bad(b_dim_negative, 0, "negative");
  expect_bad(b_index_range, 0, "names record 77");
  expect_bad(b_index_dup, 0, "strict name order");
  expect_bad(b_name_nul, 0, "not NUL-terminated");
  expect_bad(b_reserved, 0, "reserved");
  expect_bad(b_strings, 0, "strings section");
}

static void test_truncated_rejected(void) {
  struct gen *g = gen_new(20);
  size_t len;
  unsigned char *buf = gen_write(g, &len);
  struct ttab t;
  struct wd_error err = {0};
  for (size_t cut = 0; cut < len; cut += cut < 200 ? 1 : 37) {
    unsigned char *copy = malloc(cut ? cut : 1);
    memcpy(copy, buf, cut);
    if (ttab_open(copy, cut, &t, &err) != WEIGHTD_E_BAD_TABLE) {
      CHECK(!"a truncated table was accepted");
      fprintf(stderr, "  at %zu of %zu bytes\n", cut, len);
      free(copy);
      break;
    }
    free(copy);
  }
  CHECK_EQ_INT(ttab_open(buf + 1, len - 1, &t, &err), WEIGHTD_E_BAD_TABLE); /* unaligned */
  free(buf);
  gen_free(g);
}

/*
 * Random corruption, resealed half the time so that the structural checks
 * see it: whatever is accepted must be readable in full without leaving the
 * table (ASan would say), and its lookups must find each name's own record.
 */
static void test_random_corruption(void) {
  struct gen *g = gen_new(50);
  size_t len;
  unsigned char *good = gen_write(g, &len);
  unsigned char *buf = malloc(len);
  uint64_t x = 0x9e3779b97f4a7c15ULL;
  size_t accepted = 0, rejected = 0;
  for (int round = 0; round < 20000; round++) {
    memcpy(buf, good, len);
    int flips = 1 + round % 4;
    for (int k = 0; k < flips; k++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      size_t at = (size_t)(x % len);
      if (round % 3 == 0 && at < TTAB_HEADER_BYTES) at = 24 + at % 80; /* the header's numbers, often */
      buf[at] = (unsigned char)(x >> 32);
    }
    if (round % 2) reseal(buf, len);
    struct ttab t;
    struct wd_error err = {0};
    if (ttab_open(buf, len, &t, &err) != 0) {
      rejected++;
      continue;
    }
    accepted++;
    for (size_t i = 0; i < t.count; i++) {
      struct ttab_entry e;
      ttab_get(&t, i, &e);
      size_t sum = strlen(e.name) + strlen(e.dtype);
      for (unsigned d = 0; d < e.ndim; d++) sum += (size_t)e.shape[d];
      (void)sum;
      CHECK(e.offset + e.nbytes <= t.slab_bytes);
      CHECK_EQ_INT(ttab_find(&t, e.name, e.name_len), (int64_t)i);
    }
  }
  fprintf(stderr, "  random corruption: %zu rejected, %zu accepted (bytes that no rule covers)\n", rejected,
          accepted);
  CHECK(rejected > 10000);
  free(buf);
  free(good);
  gen_free(g);
}

int main(void) {
  RUN(test_checksum_vectors);
  RUN(test_round_trip_0);
  RUN(test_round_trip_1);
  RUN(test_round_trip_100k);
  RUN(test_writer_refuses);
  RUN(test_corrupt_rejected);
  RUN(test_truncated_rejected);
  RUN(test_random_corruption);
  return tu_finish();
}
