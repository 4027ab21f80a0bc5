/*
 * manifest.h - a checkpoint's payload digests: what its bytes must be.
 *
 * The digests. Each shard file is cut into chunks of MF_CHUNK_BYTES from
 * offset 0 (the last one shorter); each chunk's digest is XXH3-128
 * (libxxhash, seed 0) of its bytes, and the file's digest is XXH3-128 of its
 * chunk digests in order. Digests are kept canonical (big-endian, the byte
 * order of XXH128_canonical_t and of Python's xxhash.xxh3_128().digest()).
 *
 * A tensor's digest (the manifest's, a loaded set's per output, what a scrub
 * compares: mf_tensor_digest) is a tree over its bytes as they lie. A tensor
 * of at most MF_LEAF_BYTES is one leaf, and its digest is plain XXH3-128 of
 * its bytes. A longer one is cut into leaves of MF_LEAF_BYTES from its
 * first byte (the last one shorter), and its digest is XXH3-128 of the
 * leaves' canonical digests, concatenated in order. Why a tree: XXH3 is one
 * serial chain per input, so a GPU hashing a 778 MB tensor (Qwen3-4B's
 * embedding) as one input ran at the speed of one warp (1.5 s on an H100);
 * the leaves of a tree are hashed in parallel, one warp each, and the root
 * pass reads 16 bytes per leaf. Tensors up to a leaf (most of a checkpoint's
 * count, all of its small ones) keep the plain digest.
 * The content id is SHA-256 of "weightd-content-v1", the layout id
 * (checkpoint.h), the shard count (8 bytes, little-endian) and every file's
 * digest in the checkpoint's order: the same bytes under the same layout
 * give the same id, on any node.
 *
 * The manifest file. An operator writes it once per checkpoint (`weightctl
 * manifest`) as MF_FILE_NAME beside the index; the daemon reads it at open
 * (with the same confinement and the same check of the client's access as
 * config.json) and checks it against the files' headers: it must name the
 * same layout id, the same files with the same sizes, a chunk digest for
 * every chunk, a digest for every tensor and a file digest and content id
 * that follow from them. Text, JSON, version 2:
 *
 *   {"format": "weightd-manifest", "version": 2, "hash": "xxh3-128",
 *    "chunk_bytes": 4194304, "leaf_bytes": 262144,
 *    "layout_id": "<64 hex>", "content_id": "<64 hex>",
 *    "files": [{"name": "model-00001-of-00002.safetensors", "size": N,
 *               "digest": "<32 hex>", "chunks": ["<32 hex>", ...],
 *               "tensors": ["<32 hex>", ...]}, ...]}
 *
 * Files are in the checkpoint's shard order; a file's tensors in the order
 * of their data offsets (the layout id fixes which tensor each one is).
 * Version 1 (plain XXH3-128 of every tensor, no leaf_bytes) is refused with
 * a message asking for the manifest to be written again (`weightctl
 * manifest`): its tensor digests of long tensors are not this version's.
 *
 * A digester takes one shard's bytes in order from offset 0, in pieces of
 * any size, and fills that file's chunk, tensor and file digests (and its
 * SHA-256 when asked) in the same pass: a reader that copies the bytes
 * anyway digests them without a second pass over memory.
 */
#ifndef WD_MANIFEST_H
#define WD_MANIFEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"
#include "error.h"

#define MF_FILE_NAME "weightd.manifest.json"
#define MF_CHUNK_BYTES (4ull << 20)
#define MF_LEAF_BYTES (256ull << 10) /* a tensor digest's leaf (see above) */
#define MF_VERSION 2
#define MF_DIGEST_BYTES 16
#define MF_SHA256_BYTES 32
/* Manifests are small (35 bytes per chunk and per tensor); anything past this is refused. */
#define MF_MAX_BYTES (256u << 20)

struct mf_file {
  uint64_t size;
  uint64_t nchunks;                         /* ceil(size / MF_CHUNK_BYTES) */
  unsigned char (*chunks)[MF_DIGEST_BYTES]; /* per chunk */
  size_t ntensors;
  unsigned char (*tensors)[MF_DIGEST_BYTES]; /* per tensor of the shard's header, in data-offset order (trees) */
  unsigned char digest[MF_DIGEST_BYTES];     /* of the chunk digests, in order */
  bool has_sha256;                       /* a digester asked for it (never in the manifest file) */
  unsigned char sha256[MF_SHA256_BYTES]; /* the whole file's SHA-256 */
};

struct mf_manifest {
  unsigned char layout_id[CKPT_ID_BYTES];
  unsigned char content_id[CKPT_ID_BYTES];
  size_t nfiles;
  struct mf_file *files; /* the checkpoint's shards, in order */
};

/* An empty manifest for c's shards (sizes, chunk and tensor counts set, digests zero), or NULL when out of memory. */
struct mf_manifest *mf_new(const struct ckpt *c);
void mf_free(struct mf_manifest *m); /* NULL-safe */

/* The XXH3-128 digest of p[0..n), canonical: a chunk's, and a file's of its chunk digests. */
void mf_digest(const void *p, size_t n, unsigned char out[MF_DIGEST_BYTES]);

/*
 * The tensor digest (the tree above) of the n bytes at p, canonical: 0, or
 * NOMEM when the leaf digests of a range longer than MF_LEAF_BYTES find no
 * memory (16 bytes per leaf). A range of at most MF_LEAF_BYTES never fails.
 */
int mf_tensor_digest(const void *p, size_t n, unsigned char out[MF_DIGEST_BYTES]);

/* Sets f's digest from its chunk digests. */
void mf_file_finish(struct mf_file *f);
/* Sets every file's digest from its chunk digests, then the content id from the file digests. */
void mf_finish(struct mf_manifest *m);

/* The content id of a layout and its files' digests (see above). */
void mf_content_id(const unsigned char layout[CKPT_ID_BYTES], const struct mf_file *files, size_t n,
                   unsigned char out[CKPT_ID_BYTES]);

/* ---- the file ------------------------------------------------------------------------ */

/* m as manifest text (malloc'd, NUL-terminated; *len without the NUL), or NULL when out of memory. */
char *mf_write(const struct mf_manifest *m, const struct ckpt *c, size_t *len);

/*
 * Parses manifest text and checks it against c (see above): 0 with *out, or
 * BAD_CHECKSUM naming `label` (the manifest's name) and what is wrong
 * ("chunk_bytes is 1048576, not 4194304"; "version is 1, not 2 ... write it
 * again with `weightctl manifest`"; "describes another layout";
 * "model-00002.safetensors: size 12 in the manifest, 4096 on disk").
 */
int mf_parse(const char *text, size_t len, const struct ckpt *c, const char *label, struct mf_manifest **out,
             struct wd_error *err);

/* ---- digesting a shard as its bytes pass ------------------------------------------- */

struct mf_digester;

/* A digester of shard `shard` of c into m->files[shard] (sha256: also the file's SHA-256); NULL when out of memory. */
struct mf_digester *mf_digester_new(const struct ckpt *c, struct mf_manifest *m, uint32_t shard, bool sha256);
/* The next n bytes of the file, in order from offset 0 (leaves are cut from each tensor's start, not the pieces'). */
void mf_digester_feed(struct mf_digester *d, const unsigned char *p, size_t n);
/* 0 when every byte of the file was fed (the digests are then set), else INVALID; frees d (NULL-safe). */
int mf_digester_end(struct mf_digester *d);

/* ---- comparing ---------------------------------------------------------------------- */

/*
 * Calls diff for every chunk of shard `shard` whose digest in `got`
 * differs from `want`'s, with the chunk's index; returns how many differ.
 * Both describe c.
 */
uint64_t mf_chunks_differ(const struct mf_manifest *want, const struct mf_manifest *got, uint32_t shard,
                          void (*diff)(void *arg, uint64_t chunk), void *arg);

/* Hex digits of n bytes (lowercase, NUL-terminated: out holds 2n + 1). */
void mf_hex(const unsigned char *p, size_t n, char *out);

#endif
