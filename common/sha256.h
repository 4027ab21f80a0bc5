/*
 * sha256.h - SHA-256 as FIPS 180-4 specifies it, written here from the
 * standard. A plan's identity key digests long plans with it
 * (docs/protocol.md, "Plans" -> "Identity").
 *
 * Streaming: sha256_init, sha256_update any number of times with any split
 * of the message, sha256_final. Messages up to 2^61 - 1 bytes.
 *
 * HMAC-SHA256 (RFC 2104 with SHA-256, the construction RFC 4231 gives test
 * vectors for) signs requests to object stores (daemon/remote/sigv4.c).
 */
#ifndef WD_SHA256_H
#define WD_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define SHA256_DIGEST_LEN 32
#define SHA256_HEX_LEN 64 /* lowercase hex digits, without the NUL */

struct sha256 {
  uint32_t h[8];           /* the hash value so far */
  uint64_t bytes;          /* message bytes taken in */
  unsigned char block[64]; /* the partial block */
  size_t used;             /* bytes of it filled */
};

void sha256_init(struct sha256 *s);
void sha256_update(struct sha256 *s, const void *data, size_t len);

/* Pads the message, writes its digest and leaves s to be initialised again. */
void sha256_final(struct sha256 *s, unsigned char digest[SHA256_DIGEST_LEN]);

/* Writes digest as SHA256_HEX_LEN lowercase hex digits and a NUL. */
void sha256_hex(const unsigned char digest[SHA256_DIGEST_LEN], char hex[SHA256_HEX_LEN + 1]);

/*
 * Writes HMAC-SHA256(key, msg) to mac. Keys of any length (longer than the
 * 64-byte block are hashed first, as RFC 2104 says). The key's padded
 * copies are wiped before it returns: keys here are secrets.
 */
void sha256_hmac(const void *key, size_t keylen, const void *msg, size_t msglen,
                 unsigned char mac[SHA256_DIGEST_LEN]);

#endif
