/*
 * xxh3_cases.h - the inputs both XXH3-128 tests hash (tests/test_xxh3.c on
 * the host build of daemon/backend/xxh3.h, tests/gpu/test_xxh3_cuda.c on the
 * kernel): every length at the algorithm's case boundaries (0, 1-3, 4-8,
 * 9-16, 17-128, 129-240, stripes of 64 and blocks of 1024 bytes, the 4 MiB
 * chunks manifests use) one below, at and one above, and random lengths, at
 * offsets of every alignment, in one buffer of random bytes. The tree cases
 * are the lengths at the edges of manifest.h's tensor digest (one leaf of
 * MF_LEAF_BYTES, one byte more, several leaves and a short last one) and
 * random lengths of a few MiB, for mf_tensor_digest and the kernels that
 * must equal it.
 */
#ifndef WD_XXH3_CASES_H
#define WD_XXH3_CASES_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "manifest.h"

static const uint64_t XXH3_EDGE_LENGTHS[] = {
    0,    1,    2,    3,    4,    5,    7,    8,    9,    15,   16,   17,   31,    32,    33,    63,    64,
    65,   127,  128,  129,  239,  240,  241,  255,  256,  257,  1023, 1024, 1025,  1087,  1088,  1089,  2047,
    2048, 2049, 4095, 4096, 4097, 65535, 65536, 65537, (4u << 20) - 1, 4u << 20, (4u << 20) + 1,
};
#define XXH3_NEDGE (sizeof XXH3_EDGE_LENGTHS / sizeof XXH3_EDGE_LENGTHS[0])
#define XXH3_NRANDOM 200
#define XXH3_BUF_BYTES ((24u << 20) + 64) /* room for a tree whose root hashes over 1 KiB of leaf digests */

/* A deterministic generator (xorshift64*), so a failure reproduces. */
static inline uint64_t xxh3_case_rand(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1Dull;
}

/* Fills buf (XXH3_BUF_BYTES) with random bytes. */
static inline void xxh3_case_fill(unsigned char *buf) {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < XXH3_BUF_BYTES; i++) buf[i] = (unsigned char)(xxh3_case_rand(&s) >> 56);
}

/*
 * Case i of xxh3_case_count(): (offset, length) into the buffer. Edge
 * lengths come at offsets 0, 1, 3 and 7 each; random ones at random offsets.
 */
static inline size_t xxh3_case_count(void) { return 4 * XXH3_NEDGE + XXH3_NRANDOM; }

/* Edge case i of lengths[0..n) at offsets 0, 1, 3 and 7 each: true, with (offset, length); false past them. */
static inline bool xxh3_edge_case(const uint64_t *lengths, size_t n, size_t i, uint64_t *off, uint64_t *len) {
  static const uint64_t offs[4] = {0, 1, 3, 7};
  if (i >= 4 * n) return false;
  *len = lengths[i / 4];
  *off = offs[i % 4];
  return true;
}

static inline void xxh3_case(size_t i, uint64_t *off, uint64_t *len) {
  if (xxh3_edge_case(XXH3_EDGE_LENGTHS, XXH3_NEDGE, i, off, len)) return;
  uint64_t s = 0xD1B54A32D192ED03ull + i;
  uint64_t r = xxh3_case_rand(&s);
  *len = r % 3 == 0 ? xxh3_case_rand(&s) % (6u << 20) : xxh3_case_rand(&s) % 5000;
  *off = xxh3_case_rand(&s) % (XXH3_BUF_BYTES - *len + 1);
}

/* ---- tensor digests (trees) ---------------------------------------------------------------- */

static const uint64_t XXH3_TREE_LENGTHS[] = {
    0, 1, 240, 241, MF_LEAF_BYTES - 1, MF_LEAF_BYTES, MF_LEAF_BYTES + 1, 2 * MF_LEAF_BYTES,
    3 * MF_LEAF_BYTES + 17, 32 * MF_LEAF_BYTES, 32 * MF_LEAF_BYTES - 241,
    80 * MF_LEAF_BYTES - 9, /* a root over 1,280 bytes of leaf digests: past one 1 KiB block of XXH3 */
};
#define XXH3_NTREE_EDGE (sizeof XXH3_TREE_LENGTHS / sizeof XXH3_TREE_LENGTHS[0])
#define XXH3_NTREE_RANDOM 24

/*
 * Tree case i of xxh3_tree_case_count(): (offset, length) into the buffer.
 * Edge lengths come at offsets 0, 1, 3 and 7 each; random ones (up to
 * 7 MiB) at random offsets.
 */
static inline size_t xxh3_tree_case_count(void) { return 4 * XXH3_NTREE_EDGE + XXH3_NTREE_RANDOM; }
static inline void xxh3_tree_case(size_t i, uint64_t *off, uint64_t *len) {
  if (xxh3_edge_case(XXH3_TREE_LENGTHS, XXH3_NTREE_EDGE, i, off, len)) return;
  uint64_t s = 0x8CB92BA72F3D8DD7ull + i;
  *len = xxh3_case_rand(&s) % (7u << 20);
  *off = xxh3_case_rand(&s) % (XXH3_BUF_BYTES - *len + 1);
}

#endif
