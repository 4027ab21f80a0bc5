/*
 * tree_oracle.h - the tensor digest written out from its definition in
 * manifest.h with libxxhash calls, independent of mf_tensor_digest: the
 * oracle that tests/test_xxh3.c and tests/test_manifest.c hold it (and the
 * digester's per-tensor digests) to. Its leaf size is written here as a
 * number, not taken from MF_LEAF_BYTES, so that a change of either shows.
 */
#ifndef WD_TREE_ORACLE_H
#define WD_TREE_ORACLE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define TREE_ORACLE_LEAF (256u * 1024u)

/*
 * The canonical XXH3-128 of p[0..n) when n is at most one leaf; else that of
 * the canonical XXH3-128 digests of its leaves (from p, the last one
 * shorter) concatenated in order. 0, or -1 when out of memory.
 */
static inline int tree_oracle(const unsigned char *p, uint64_t n, unsigned char out[16]) {
  XXH128_canonical_t c;
  if (n <= TREE_ORACLE_LEAF) {
    XXH128_canonicalFromHash(&c, XXH3_128bits(p, (size_t)n));
    memcpy(out, c.digest, 16);
    return 0;
  }
  uint64_t leaves = (n + TREE_ORACLE_LEAF - 1) / TREE_ORACLE_LEAF;
  unsigned char *cat = malloc((size_t)leaves * 16);
  if (cat == NULL) return -1;
  for (uint64_t i = 0; i < leaves; i++) {
    uint64_t a = i * TREE_ORACLE_LEAF, k = n - a < TREE_ORACLE_LEAF ? n - a : TREE_ORACLE_LEAF;
    XXH128_canonicalFromHash(&c, XXH3_128bits(p + a, (size_t)k));
    memcpy(cat + 16 * i, c.digest, 16);
  }
  XXH128_canonicalFromHash(&c, XXH3_128bits(cat, (size_t)leaves * 16));
  memcpy(out, c.digest, 16);
  free(cat);
  return 0;
}

#endif
