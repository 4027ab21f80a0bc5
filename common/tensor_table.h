/*
 * tensor_table.h - a resident set's tensor table in binary form: one writer
 * (the daemon, once per set) and one reader (libweightd, and the daemon when
 * it reads a set description back), for a table of any size that a client
 * maps and reads in place, with no parsing per attach.
 *
 * The format (version 1) is specified in docs/protocol.md ("The binary
 * tensor table"). In short, all integers little-endian, every section in
 * this order and each starting where the one before ends:
 *
 *   header   TTAB_HEADER_BYTES: magic "WDTENSOR", version, sizes and
 *            offsets of the sections, the slab's size, the tensor count and
 *            a checksum (XXH64, seed 0, of every byte after the checksum)
 *   records  count fixed-size records in slab order: offset, nbytes, the
 *            first of its dimensions in the dims section and how many,
 *            the name's offset and length in the strings section, dtype
 *   dims     every record's shape, int64 each, record after record
 *   index    count uint32 record numbers ordered by name (bytewise), padded
 *            to 8 bytes: names are found by binary search
 *   strings  the names, each followed by a NUL
 *
 * Shapes have any number of dimensions (they live in their own section). The
 * reader trusts nothing: ttab_open checks the magic, the version, the sizes
 * and offsets of every section, the checksum, and every record (dimensions
 * and names inside their sections, names NUL-terminated with no NUL inside,
 * dtypes printable and terminated, offset + nbytes within the slab) and the
 * index (a permutation that orders the names strictly, so names are unique)
 * before anything is read; it is safe on arbitrary bytes. A corrupt table
 * is WEIGHTD_E_BAD_TABLE with the rule it breaks.
 *
 * The reader hands out pointers into the table (names, dtypes, shapes), so
 * the table must stay mapped while they are used. weightd runs on
 * little-endian hosts only (checked at compile time), which is what lets a
 * shape be read in place as int64_t.
 */
#ifndef WD_TENSOR_TABLE_H
#define WD_TENSOR_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define TTAB_MAGIC "WDTENSOR" /* 8 bytes, no NUL */
#define TTAB_VERSION 1u
#define TTAB_HEADER_BYTES 128u
#define TTAB_RECORD_BYTES 64u
#define TTAB_DTYPE_BYTES 16u /* a dtype name and at least one NUL */

/* One tensor as the writer is given it. */
struct ttab_tensor {
  const char *name;
  size_t name_len; /* bytes, without a NUL; the name must hold none */
  const char *dtype; /* NUL-terminated, shorter than TTAB_DTYPE_BYTES */
  unsigned ndim;
  const uint64_t *shape;
  uint64_t offset, nbytes; /* in the slab */
};

/* Fills out with tensor i (in slab order) for the writer. */
typedef void (*ttab_get_fn)(void *arg, size_t i, struct ttab_tensor *out);

/*
 * Writes the table of n tensors of a slab of slab_bytes into a new buffer
 * (*out, free it; *len its size). Fails with WEIGHTD_E_INVALID naming the
 * tensor when one cannot be written (a name with a NUL or given twice, a
 * dtype too long, a dimension above 2^63 - 1, a tensor outside the slab),
 * WEIGHTD_E_NOMEM.
 */
int ttab_write(size_t n, ttab_get_fn get, void *arg, uint64_t slab_bytes, unsigned char **out, size_t *len,
               struct wd_error *err);

/* An opened table: views into the caller's buffer, which must outlive it. */
struct ttab {
  const unsigned char *base;
  size_t len;
  uint64_t count;
  uint64_t slab_bytes;
  uint32_t record_bytes;
  const unsigned char *records;
  const int64_t *dims;
  const uint32_t *index;
  const char *strings;
};

/* One tensor read from a table; pointers into the table. */
struct ttab_entry {
  const char *name; /* NUL-terminated */
  size_t name_len;
  const char *dtype; /* NUL-terminated */
  unsigned ndim;
  const int64_t *shape;
  uint64_t offset, nbytes;
};

/*
 * Validates len bytes at buf (8-byte aligned) as a table and opens it.
 * 0, or WEIGHTD_E_BAD_TABLE with what is wrong ("record 12: name runs past
 * the strings section").
 */
int ttab_open(const void *buf, size_t len, struct ttab *out, struct wd_error *err);

/* Tensor i (< t->count), in slab order. */
void ttab_get(const struct ttab *t, size_t i, struct ttab_entry *out);

/* Finds the tensor called name (len bytes): its number in slab order, or -1. */
int64_t ttab_find(const struct ttab *t, const char *name, size_t len);

/* The table's checksum: XXH64 with seed 0 of len bytes (exposed for tests). */
uint64_t ttab_xxh64(const void *p, size_t len);

#endif
