/*
 * test_xxh3.c - daemon/backend/xxh3.h, the XXH3-128 the scrub kernel runs,
 * built for the host and compared with libxxhash (the library the daemon
 * digests files and host slabs with) on every case of xxh3_cases.h: edge
 * lengths at every alignment and random ones. Their canonical forms must
 * match manifest.h's digests byte for byte. Then mf_tensor_digest, the
 * tree the scrub kernels compute, against the tree composed here from
 * libxxhash calls, on the tree cases (leaf edges, several leaves, a few
 * MiB).
 */
#include "testutil.h"

#include <xxhash.h>

#include "manifest.h"
#include "tree_oracle.h"
#include "xxh3.h"
#include "xxh3_cases.h"

static unsigned char *buf;

static void test_every_case_matches_libxxhash(void) {
  static const unsigned char secret[XXH3_SECRET_BYTES] = XXH3_SECRET_INIT;
  size_t n = xxh3_case_count(), bad = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t off, len;
    xxh3_case(i, &off, &len);
    XXH128_hash_t want = XXH3_128bits(buf + off, (size_t)len);
    struct xxh3_u128 got = xxh3_128_with(buf + off, len, secret);
    if (want.low64 != got.lo || want.high64 != got.hi) {
      if (bad++ < 10) fprintf(stderr, "length %" PRIu64 " at offset %" PRIu64 " differs\n", len, off);
    }
  }
  CHECK(bad == 0);
}

static void test_canonical_is_the_manifest_digest(void) {
  static const unsigned char secret[XXH3_SECRET_BYTES] = XXH3_SECRET_INIT;
  unsigned char a[16], b[16];
  for (uint64_t len = 0; len < 3000; len += 97) {
    xxh3_canonical(xxh3_128_with(buf + 5, len, secret), a);
    mf_digest(buf + 5, (size_t)len, b);
    CHECK(memcmp(a, b, 16) == 0);
  }
}

static void test_tensor_digest_is_the_tree(void) {
  CHECK(MF_LEAF_BYTES == TREE_ORACLE_LEAF); /* the definition the oracle is written from */
  size_t n = xxh3_tree_case_count(), bad = 0, trees = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t off, len;
    xxh3_tree_case(i, &off, &len);
    unsigned char want[16], got[16], plain[16];
    CHECK_EQ_INT(tree_oracle(buf + off, len, want), 0);
    CHECK_EQ_INT(mf_tensor_digest(buf + off, (size_t)len, got), 0);
    if (memcmp(want, got, 16) != 0 && bad++ < 10)
      fprintf(stderr, "tree of length %" PRIu64 " at offset %" PRIu64 " differs\n", len, off);
    /* Up to a leaf it is the plain digest; past one it is not (a tree that hashed plainly would pass the above on short cases only). */
    mf_digest(buf + off, (size_t)len, plain);
    CHECK((memcmp(plain, got, 16) == 0) == (len <= MF_LEAF_BYTES));
    trees += len > MF_LEAF_BYTES;
  }
  CHECK(bad == 0);
  CHECK(trees >= 4 * 5);
}

/* Each leaf of a tree counts: a byte flipped in the first, a middle or the short last leaf changes the digest. */
static void test_tensor_digest_sees_every_leaf(void) {
  uint64_t len = 3 * MF_LEAF_BYTES + 17;
  unsigned char d0[16], d[16];
  CHECK_EQ_INT(mf_tensor_digest(buf, (size_t)len, d0), 0);
  uint64_t at[] = {0, MF_LEAF_BYTES - 1, MF_LEAF_BYTES, 2 * MF_LEAF_BYTES + 5, len - 1};
  for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
    buf[at[i]] ^= 0x40;
    CHECK_EQ_INT(mf_tensor_digest(buf, (size_t)len, d), 0);
    buf[at[i]] ^= 0x40;
    CHECK(memcmp(d, d0, 16) != 0);
  }
}

/* A flipped bit anywhere in a long input changes the digest (the test would pass on a constant otherwise). */
static void test_a_flipped_bit_changes_it(void) {
  static const unsigned char secret[XXH3_SECRET_BYTES] = XXH3_SECRET_INIT;
  uint64_t len = 3 * XXH3_BLOCK + 100;
  struct xxh3_u128 h0 = xxh3_128_with(buf, len, secret);
  for (uint64_t at = 0; at < len; at += 331) {
    buf[at] ^= 0x10;
    struct xxh3_u128 h = xxh3_128_with(buf, len, secret);
    buf[at] ^= 0x10;
    CHECK(h.lo != h0.lo && h.hi != h0.hi);
  }
}

int main(void) {
  buf = malloc(XXH3_BUF_BYTES);
  if (buf == NULL) return 1;
  xxh3_case_fill(buf);
  RUN(test_every_case_matches_libxxhash);
  RUN(test_canonical_is_the_manifest_digest);
  RUN(test_a_flipped_bit_changes_it);
  RUN(test_tensor_digest_is_the_tree);
  RUN(test_tensor_digest_sees_every_leaf);
  free(buf);
  return tu_finish();
}
