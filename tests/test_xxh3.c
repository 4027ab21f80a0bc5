/*
 * test_xxh3.c - daemon/backend/xxh3.h, the XXH3-128 the scrub kernel runs,
 * built for the host and compared with libxxhash (the library the daemon
 * digests files and host slabs with) on every case of xxh3_cases.h: edge
 * lengths at every alignment and random ones. Their canonical forms must
 * match manifest.h's digests byte for byte.
 */
#include "testutil.h"

#include <xxhash.h>

#include "manifest.h"
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
  free(buf);
  return tu_finish();
}
