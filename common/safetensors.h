/*
 * safetensors.h - a strict reader for one safetensors file.
 *
 * The verdict on a file is the reference implementation's (the `safetensors`
 * package, version 0.8.0): an 8-byte little-endian header length n, at most
 * 100,000,000 and within the file; n bytes of UTF-8 JSON (whitespace padding
 * allowed); an object whose "__metadata__" member, if present, is null or a
 * string-to-string map, and whose other members are tensors
 * {"dtype", "shape", "data_offsets"} (or the 3-element array form serde also
 * accepts); data_offsets contiguous from 0 once sorted; each tensor's byte
 * count = elements x dtype bits / 8 exactly; file length = 8 + n + data.
 * Where a name appears twice the last entry counts, as in the reference.
 *
 * One deliberate difference: sums are overflow-checked everywhere, so a header
 * whose offsets only add up after wrapping around 2^64 is refused.
 */
#ifndef WD_SAFETENSORS_H
#define WD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "error.h"

#define ST_MAX_HEADER_LEN 100000000ull
#define ST_PREFIX_LEN 8ull

struct st_tensor {
  char *name; /* NUL-terminated; name_len counts any embedded NUL (JSON allows \u0000) */
  size_t name_len;
  enum wd_dtype dtype;
  unsigned ndim;
  uint64_t *shape;
  uint64_t begin, end; /* byte range within the data section */
};

struct st_meta {
  char *key; /* NUL-terminated; the lengths count any embedded NUL */
  size_t key_len;
  char *value;
  size_t value_len;
};

struct st_header {
  uint64_t header_len; /* n: the JSON's length */
  uint64_t data_start; /* 8 + n: where the data section starts in the file */
  uint64_t data_len;   /* bytes of tensor data */
  size_t ntensors;
  struct st_tensor *tensors; /* sorted by data offset */
  size_t *by_name;           /* tensor indexes sorted by name */
  int has_metadata;          /* "__metadata__" present and not null */
  size_t nmeta;
  struct st_meta *meta;
};

/*
 * Validates a header. buf holds the file's first buflen bytes (at least the
 * 8-byte prefix and the JSON, when the file has them); file_len is the whole
 * file's length. label names the file in error messages. On success *out is
 * a new header the caller frees with st_header_free.
 */
int st_header_parse(const unsigned char *buf, size_t buflen, uint64_t file_len, const char *label,
                    struct st_header **out, struct wd_error *err);

/*
 * Where a header's bytes come from: read exactly len bytes at file offset
 * off into buf, 0 or an error naming the file. A local file (pread) or a
 * remote object (range GETs) alike, so that one validator with one set of
 * limits judges every header.
 */
struct st_reader {
  int (*read)(void *arg, uint64_t off, void *buf, size_t len, struct wd_error *err);
  void *arg;
};

/*
 * Reads and validates the header of a file of file_len bytes through rd:
 * the 8-byte prefix first, then (once its length is within the limits) the
 * JSON. *out as st_header_parse gives it.
 */
int st_header_read(const struct st_reader *rd, uint64_t file_len, const char *label, struct st_header **out,
                   struct wd_error *err);

/* Reads and validates the header of the open file fd (with pread). */
int st_header_read_fd(int fd, const char *label, struct st_header **out, struct wd_error *err);

/* Opens path, validates its header and closes it again. */
int st_header_read_path(const char *path, const char *label, struct st_header **out,
                        struct wd_error *err);

/* The tensor named name, or NULL. */
const struct st_tensor *st_tensor_find(const struct st_header *h, const char *name);

/* The value of __metadata__[key], or NULL. */
const char *st_meta_get(const struct st_header *h, const char *key);

/* Number of elements of a tensor (shape product; validated not to overflow). */
uint64_t st_tensor_elements(const struct st_tensor *t);

/* Formats a shape as "[a, b, c]" into buf. */
void st_shape_format(const uint64_t *shape, unsigned ndim, char *buf, size_t buflen);

void st_header_free(struct st_header *h);

#endif
