/*
 * sha256.c - SHA-256 (FIPS 180-4, sections 4.1.2, 4.2.2, 5.1.1, 5.3.3 and
 * 6.2), and HMAC over it (RFC 2104). See sha256.h.
 */
#include "sha256.h"

#include <string.h>

/* 4.2.2: the first 32 bits of the fractional parts of the cube roots of the first 64 primes. */
static const uint32_t k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

/* 5.3.3: the first 32 bits of the fractional parts of the square roots of the first 8 primes. */
static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

static uint32_t rotr(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

/* 4.1.2 */
static uint32_t ch(uint32_t x, uint32_t y, uint32_t z) { return (x & y) ^ (~x & z); }
static uint32_t maj(uint32_t x, uint32_t y, uint32_t z) { return (x & y) ^ (x & z) ^ (y & z); }
static uint32_t big_sigma0(uint32_t x) { return rotr(x, 2) ^ rotr(x, 13) ^ rotr(x, 22); }
static uint32_t big_sigma1(uint32_t x) { return rotr(x, 6) ^ rotr(x, 11) ^ rotr(x, 25); }
static uint32_t small_sigma0(uint32_t x) { return rotr(x, 7) ^ rotr(x, 18) ^ (x >> 3); }
static uint32_t small_sigma1(uint32_t x) { return rotr(x, 17) ^ rotr(x, 19) ^ (x >> 10); }

/* 6.2.2: one 512-bit block into the hash value. */
static void compress(uint32_t h[8], const unsigned char *m) {
  uint32_t w[64];
  for (int t = 0; t < 16; t++)
    w[t] = (uint32_t)m[4 * t] << 24 | (uint32_t)m[4 * t + 1] << 16 | (uint32_t)m[4 * t + 2] << 8 | m[4 * t + 3];
  for (int t = 16; t < 64; t++) w[t] = small_sigma1(w[t - 2]) + w[t - 7] + small_sigma0(w[t - 15]) + w[t - 16];
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
  for (int t = 0; t < 64; t++) {
    uint32_t t1 = hh + big_sigma1(e) + ch(e, f, g) + k[t] + w[t];
    uint32_t t2 = big_sigma0(a) + maj(a, b, c);
    hh = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += hh;
}

void sha256_init(struct sha256 *s) {
  memcpy(s->h, h0, sizeof h0);
  s->bytes = 0;
  s->used = 0;
}

void sha256_update(struct sha256 *s, const void *data, size_t len) {
  const unsigned char *p = data;
  s->bytes += len;
  while (len > 0) {
    size_t n = sizeof s->block - s->used < len ? sizeof s->block - s->used : len;
    memcpy(s->block + s->used, p, n);
    s->used += n;
    p += n;
    len -= n;
    if (s->used == sizeof s->block) {
      compress(s->h, s->block);
      s->used = 0;
    }
  }
}

/* 5.1.1: a 1 bit, zeros to 448 bits mod 512, then the message length in bits, big-endian. */
void sha256_final(struct sha256 *s, unsigned char digest[SHA256_DIGEST_LEN]) {
  uint64_t bits = s->bytes * 8;
  s->block[s->used++] = 0x80;
  if (s->used > 56) {
    memset(s->block + s->used, 0, sizeof s->block - s->used);
    compress(s->h, s->block);
    s->used = 0;
  }
  memset(s->block + s->used, 0, 56 - s->used);
  for (int i = 0; i < 8; i++) s->block[56 + i] = (unsigned char)(bits >> (56 - 8 * i));
  compress(s->h, s->block);
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 4; j++) digest[4 * i + j] = (unsigned char)(s->h[i] >> (24 - 8 * j));
  sha256_init(s);
}

void sha256_hex(const unsigned char digest[SHA256_DIGEST_LEN], char hex[SHA256_HEX_LEN + 1]) {
  static const char digits[] = "0123456789abcdef";
  for (int i = 0; i < SHA256_DIGEST_LEN; i++) {
    hex[2 * i] = digits[digest[i] >> 4];
    hex[2 * i + 1] = digits[digest[i] & 15];
  }
  hex[SHA256_HEX_LEN] = '\0';
}

/* RFC 2104, section 2: H(K ^ opad, H(K ^ ipad, text)), with B = 64 and K zero-padded to B. */
void sha256_hmac(const void *key, size_t keylen, const void *msg, size_t msglen,
                 unsigned char mac[SHA256_DIGEST_LEN]) {
  unsigned char kb[64] = {0}, pad[64], inner[SHA256_DIGEST_LEN];
  struct sha256 s;
  if (keylen > sizeof kb) {
    sha256_init(&s);
    sha256_update(&s, key, keylen);
    sha256_final(&s, kb);
  } else if (keylen > 0) {
    memcpy(kb, key, keylen);
  }
  for (size_t i = 0; i < sizeof pad; i++) pad[i] = kb[i] ^ 0x36;
  sha256_init(&s);
  sha256_update(&s, pad, sizeof pad);
  sha256_update(&s, msg, msglen);
  sha256_final(&s, inner);
  for (size_t i = 0; i < sizeof pad; i++) pad[i] = kb[i] ^ 0x5c;
  sha256_init(&s);
  sha256_update(&s, pad, sizeof pad);
  sha256_update(&s, inner, sizeof inner);
  sha256_final(&s, mac);
  explicit_bzero(kb, sizeof kb);
  explicit_bzero(pad, sizeof pad);
  explicit_bzero(inner, sizeof inner);
  explicit_bzero(&s, sizeof s);
}
