/*
 * xxh3.h - XXH3-128 (seed 0, the default secret), written from the
 * algorithm's published specification (xxHash's doc/xxhash_spec.md), for
 * code that cannot call libxxhash: the cuda backend's scrub kernels
 * (slab_hash_cuda.cu: the leaves and roots of tensor digests) compile these
 * functions for the device. The host
 * build of the same functions is checked against libxxhash in CI
 * (tests/test_xxh3.c), so the algorithm the kernel runs is tested on every
 * machine; the kernels' own spreading of the work over warps is tested on
 * the GPU host (tests/gpu/test_xxh3_cuda.c).
 *
 * Inputs above 240 bytes are hashed in 1024-byte blocks of 16 stripes of 64
 * bytes. Each of the 8 accumulator lanes is a chain of its own: lane i only
 * ever adds terms of the stripe's words i and i ^ 1 and scrambles itself, so
 * a block's terms for one lane may be summed in any order (additions mod
 * 2^64) before that lane's scramble. xxh3_lane_term and xxh3_lane_scramble
 * are that decomposition; xxh3_128 below uses it one lane at a time, and the
 * kernel uses it with a warp's threads each summing a few stripes of one
 * lane.
 *
 * Digests come out canonical (big-endian high half then low half), the byte
 * order of XXH128_canonical_t and of manifest.h's digests.
 */
#ifndef WD_XXH3_H
#define WD_XXH3_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define XXH3_FN static __host__ __device__ __forceinline__
#else
#define XXH3_FN static inline
#endif

#define XXH3_SECRET_BYTES 192
#define XXH3_STRIPE 64
#define XXH3_STRIPES_PER_BLOCK ((XXH3_SECRET_BYTES - 64) / 8) /* 16 */
#define XXH3_BLOCK (XXH3_STRIPE * XXH3_STRIPES_PER_BLOCK)     /* 1024 */
#define XXH3_LAST_STRIPE_KEY (XXH3_SECRET_BYTES - 71)          /* the last stripe's secret offset */
#define XXH3_SCRAMBLE_KEY (XXH3_SECRET_BYTES - 64)

#define XXH3_P32_1 0x9E3779B1ull
#define XXH3_P32_2 0x85EBCA77ull
#define XXH3_P32_3 0xC2B2AE3Dull
#define XXH3_P64_1 0x9E3779B185EBCA87ull
#define XXH3_P64_2 0xC2B2AE3D27D4EB4Full
#define XXH3_P64_3 0x165667B19E3779F9ull
#define XXH3_P64_4 0x85EBCA77C2B2AE63ull
#define XXH3_P64_5 0x27D4EB2F165667C5ull
#define XXH3_MX1 0x165667919E3779F9ull
#define XXH3_MX2 0x9FB21C651E98DF25ull

/* The default secret, as the specification lists it. */
#define XXH3_SECRET_INIT                                                                                        \
  {0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, \
   0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, \
   0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, \
   0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, \
   0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, \
   0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, \
   0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, \
   0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, \
   0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, \
   0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, \
   0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e}

/* A 128-bit value as two halves. */
struct xxh3_u128 {
  uint64_t lo, hi;
};

/* ---- small operations ---------------------------------------------------------------- */

/* Little-endian reads of any alignment, byte by byte (the compiler merges them where it can). */
XXH3_FN uint32_t xxh3_read32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
XXH3_FN uint64_t xxh3_read64(const unsigned char *p) {
  return (uint64_t)xxh3_read32(p) | (uint64_t)xxh3_read32(p + 4) << 32;
}

XXH3_FN uint32_t xxh3_swap32(uint32_t x) {
  return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
}
XXH3_FN uint64_t xxh3_swap64(uint64_t x) {
  return (uint64_t)xxh3_swap32((uint32_t)x) << 32 | xxh3_swap32((uint32_t)(x >> 32));
}
XXH3_FN uint32_t xxh3_rotl32(uint32_t x, unsigned r) { return (x << r) | (x >> (32 - r)); }
XXH3_FN uint64_t xxh3_rotl64(uint64_t x, unsigned r) { return (x << r) | (x >> (64 - r)); }

/* The full 128-bit product of two 64-bit values. */
XXH3_FN struct xxh3_u128 xxh3_mul128(uint64_t a, uint64_t b) {
  struct xxh3_u128 r;
#ifdef __CUDA_ARCH__
  r.lo = a * b;
  r.hi = __umul64hi(a, b);
#else
  unsigned __int128 p = (unsigned __int128)a * b;
  r.lo = (uint64_t)p;
  r.hi = (uint64_t)(p >> 64);
#endif
  return r;
}

XXH3_FN uint64_t xxh3_fold64(uint64_t a, uint64_t b) {
  struct xxh3_u128 p = xxh3_mul128(a, b);
  return p.lo ^ p.hi;
}

XXH3_FN uint64_t xxh3_avalanche(uint64_t x) {
  x ^= x >> 37;
  x *= XXH3_MX1;
  return x ^ (x >> 32);
}

XXH3_FN uint64_t xxh3_avalanche64(uint64_t x) {
  x ^= x >> 33;
  x *= XXH3_P64_2;
  x ^= x >> 29;
  x *= XXH3_P64_3;
  return x ^ (x >> 32);
}

/* ---- 0 to 240 bytes ---------------------------------------------------------------- */

XXH3_FN struct xxh3_u128 xxh3_0to16(const unsigned char *p, size_t n, const unsigned char *k) {
  struct xxh3_u128 r;
  if (n == 0) {
    r.lo = xxh3_avalanche64(xxh3_read64(k + 64) ^ xxh3_read64(k + 72));
    r.hi = xxh3_avalanche64(xxh3_read64(k + 80) ^ xxh3_read64(k + 88));
  } else if (n <= 3) {
    uint32_t c = (uint32_t)p[n - 1] | (uint32_t)n << 8 | (uint32_t)p[0] << 16 | (uint32_t)p[n >> 1] << 24;
    uint64_t lo = (uint64_t)(xxh3_read32(k) ^ xxh3_read32(k + 4)) ^ c;
    uint64_t hi = (uint64_t)(xxh3_read32(k + 8) ^ xxh3_read32(k + 12)) ^ xxh3_rotl32(xxh3_swap32(c), 13);
    r.lo = xxh3_avalanche64(lo);
    r.hi = xxh3_avalanche64(hi);
  } else if (n <= 8) {
    uint64_t first = xxh3_read32(p), last = xxh3_read32(p + n - 4);
    uint64_t v = (xxh3_read64(k + 16) ^ xxh3_read64(k + 24)) ^ (first | last << 32);
    struct xxh3_u128 m = xxh3_mul128(v, XXH3_P64_1 + ((uint64_t)n << 2));
    m.hi += m.lo << 1;
    m.lo ^= m.hi >> 3;
    m.lo ^= m.lo >> 35;
    m.lo *= XXH3_MX2;
    m.lo ^= m.lo >> 28;
    r.lo = m.lo;
    r.hi = xxh3_avalanche(m.hi);
  } else {
    uint64_t first = xxh3_read64(p), last = xxh3_read64(p + n - 8);
    uint64_t v1 = (xxh3_read64(k + 32) ^ xxh3_read64(k + 40)) ^ first ^ last;
    uint64_t v2 = (xxh3_read64(k + 48) ^ xxh3_read64(k + 56)) ^ last;
    struct xxh3_u128 m = xxh3_mul128(v1, XXH3_P64_1);
    uint64_t lo = m.lo + ((uint64_t)(n - 1) << 54);
    uint64_t hi = m.hi + (v2 >> 32 << 32) + (uint64_t)(uint32_t)v2 * XXH3_P32_2;
    lo ^= xxh3_swap64(hi);
    struct xxh3_u128 m2 = xxh3_mul128(lo, XXH3_P64_2);
    r.lo = xxh3_avalanche(m2.lo);
    r.hi = xxh3_avalanche(m2.hi + hi * XXH3_P64_2);
  }
  return r;
}

/* mixStep: 16 bytes of input against 16 of the secret (seed 0). */
XXH3_FN uint64_t xxh3_mix16(const unsigned char *p, const unsigned char *k) {
  return xxh3_fold64(xxh3_read64(p) ^ xxh3_read64(k), xxh3_read64(p + 8) ^ xxh3_read64(k + 8));
}

/* mixTwoChunks into acc[0] and acc[1]. */
XXH3_FN void xxh3_mix32(uint64_t acc[2], const unsigned char *a, const unsigned char *b, const unsigned char *k) {
  acc[0] += xxh3_mix16(a, k);
  acc[1] += xxh3_mix16(b, k + 16);
  acc[0] ^= xxh3_read64(b) + xxh3_read64(b + 8);
  acc[1] ^= xxh3_read64(a) + xxh3_read64(a + 8);
}

XXH3_FN struct xxh3_u128 xxh3_17to240(const unsigned char *p, size_t n, const unsigned char *k) {
  uint64_t acc[2] = {(uint64_t)n * XXH3_P64_1, 0};
  if (n <= 128) {
    for (long i = (long)((n - 1) >> 5); i >= 0; i--)
      xxh3_mix32(acc, p + 16 * i, p + n - 16 * i - 16, k + 32 * i);
  } else {
    size_t chunks = n >> 5;
    for (size_t i = 0; i < 4; i++) xxh3_mix32(acc, p + 32 * i, p + 32 * i + 16, k + 32 * i);
    acc[0] = xxh3_avalanche(acc[0]);
    acc[1] = xxh3_avalanche(acc[1]);
    for (size_t i = 4; i < chunks; i++) xxh3_mix32(acc, p + 32 * i, p + 32 * i + 16, k + 32 * (i - 4) + 3);
    xxh3_mix32(acc, p + n - 16, p + n - 32, k + 103);
  }
  struct xxh3_u128 r;
  r.lo = xxh3_avalanche(acc[0] + acc[1]);
  r.hi = 0 - xxh3_avalanche(acc[0] * XXH3_P64_1 + acc[1] * XXH3_P64_4 + (uint64_t)n * XXH3_P64_2);
  return r;
}

/* ---- above 240 bytes: the lanes ------------------------------------------------------ */

/* Lane i's initial accumulator. */
XXH3_FN uint64_t xxh3_lane_init(unsigned i) {
  const uint64_t init[8] = {XXH3_P32_3, XXH3_P64_1, XXH3_P64_2, XXH3_P64_3,
                            XXH3_P64_4, XXH3_P32_2, XXH3_P64_5, XXH3_P32_1};
  return init[i & 7];
}

/*
 * What one stripe adds to lane i's accumulator: the stripe's word i ^ 1
 * (`mate`), and the product of the halves of word i (`own`) xor the secret
 * word `key` (the secret at the stripe's offset, word i).
 */
XXH3_FN uint64_t xxh3_lane_term(uint64_t own, uint64_t mate, uint64_t key) {
  uint64_t v = own ^ key;
  return mate + (v & 0xffffffffull) * (v >> 32);
}

/* Lane i's scramble after a full block (key: word i of the secret's last 64 bytes). */
XXH3_FN uint64_t xxh3_lane_scramble(uint64_t acc, uint64_t key) {
  acc ^= acc >> 47;
  acc ^= key;
  return acc * XXH3_P32_1;
}

/* The digest from the 8 lanes' final accumulators and the input's length. */
XXH3_FN struct xxh3_u128 xxh3_merge(const uint64_t acc[8], uint64_t n, const unsigned char *k) {
  uint64_t lo = n * XXH3_P64_1, hi = ~(n * XXH3_P64_2);
  for (unsigned i = 0; i < 4; i++) {
    lo += xxh3_fold64(acc[2 * i] ^ xxh3_read64(k + 11 + 16 * i), acc[2 * i + 1] ^ xxh3_read64(k + 19 + 16 * i));
    hi += xxh3_fold64(acc[2 * i] ^ xxh3_read64(k + XXH3_SECRET_BYTES - 75 + 16 * i),
                      acc[2 * i + 1] ^ xxh3_read64(k + XXH3_SECRET_BYTES - 67 + 16 * i));
  }
  struct xxh3_u128 r = {xxh3_avalanche(lo), xxh3_avalanche(hi)};
  return r;
}

/* Blocks the long path scrambles after (the last block, full or not, is not scrambled). */
XXH3_FN uint64_t xxh3_full_blocks(uint64_t n) { return (n - 1) / XXH3_BLOCK; }

/* Lane `lane`'s accumulator over all of p[0..n) (n > 240), one stripe after another. */
XXH3_FN uint64_t xxh3_lane_run(const unsigned char *p, uint64_t n, unsigned lane, const unsigned char *k) {
  uint64_t acc = xxh3_lane_init(lane);
  uint64_t blocks = xxh3_full_blocks(n);
  for (uint64_t b = 0; b < blocks; b++) {
    const unsigned char *blk = p + b * XXH3_BLOCK;
    for (unsigned s = 0; s < XXH3_STRIPES_PER_BLOCK; s++)
      acc += xxh3_lane_term(xxh3_read64(blk + 64 * s + 8 * lane), xxh3_read64(blk + 64 * s + 8 * (lane ^ 1)),
                            xxh3_read64(k + 8 * s + 8 * lane));
    acc = xxh3_lane_scramble(acc, xxh3_read64(k + XXH3_SCRAMBLE_KEY + 8 * lane));
  }
  const unsigned char *last = p + blocks * XXH3_BLOCK;
  uint64_t stripes = (n - blocks * XXH3_BLOCK - 1) / XXH3_STRIPE;
  for (uint64_t s = 0; s < stripes; s++)
    acc += xxh3_lane_term(xxh3_read64(last + 64 * s + 8 * lane), xxh3_read64(last + 64 * s + 8 * (lane ^ 1)),
                          xxh3_read64(k + 8 * s + 8 * lane));
  const unsigned char *end = p + n - XXH3_STRIPE;
  acc += xxh3_lane_term(xxh3_read64(end + 8 * lane), xxh3_read64(end + 8 * (lane ^ 1)),
                        xxh3_read64(k + XXH3_LAST_STRIPE_KEY + 8 * lane));
  return acc;
}

/* ---- the whole function -------------------------------------------------------------- */

/* XXH3-128 of p[0..n) with secret k (XXH3_SECRET_INIT), as two halves. */
XXH3_FN struct xxh3_u128 xxh3_128_with(const unsigned char *p, uint64_t n, const unsigned char *k) {
  if (n <= 16) return xxh3_0to16(p, (size_t)n, k);
  if (n <= 240) return xxh3_17to240(p, (size_t)n, k);
  uint64_t acc[8];
  for (unsigned i = 0; i < 8; i++) acc[i] = xxh3_lane_run(p, n, i, k);
  return xxh3_merge(acc, n, k);
}

/* h in canonical form: big-endian high half, then big-endian low half. */
XXH3_FN void xxh3_canonical(struct xxh3_u128 h, unsigned char out[16]) {
  for (unsigned i = 0; i < 8; i++) {
    out[i] = (unsigned char)(h.hi >> (56 - 8 * i));
    out[8 + i] = (unsigned char)(h.lo >> (56 - 8 * i));
  }
}

#endif
