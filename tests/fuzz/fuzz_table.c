/*
 * fuzz_table.c - libFuzzer target: the binary tensor table's reader
 * (ttab_open) on arbitrary bytes, and the writer on what it accepts.
 *
 * Half the inputs (by a bit of their own) get their checksum recomputed
 * first, so that mutations reach the structural checks behind it.
 *
 * Oracles besides the sanitizers: every refusal says why; an accepted
 * table's tensors lie in its slab and each is found by its own name; and
 * writing the accepted tensors again gives a table that opens to the same
 * tensors (one writer, one reader, agreeing).
 *
 * Built by tests/fuzz/CMakeLists.txt as the target "table" (WD_FUZZ_TARGETS).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_table.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void get(void *arg, size_t i, struct ttab_tensor *out) {
  const struct ttab *t = arg;
  struct ttab_entry e;
  ttab_get(t, i, &e);
  out->name = e.name;
  out->name_len = e.name_len;
  out->dtype = e.dtype;
  out->ndim = e.ndim;
  out->shape = (const uint64_t *)(const void *)e.shape; /* non-negative, checked by ttab_open */
  out->offset = e.offset;
  out->nbytes = e.nbytes;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* The reader wants 8-byte alignment, as a mapping gives it. */
  uint64_t *buf = malloc(size ? size : 1);
  if (buf == NULL) return 0;
  memcpy(buf, data, size);
  if (size >= 24 && ((data[size / 2] ^ size) & 1)) {
    uint64_t sum = ttab_xxh64((const unsigned char *)buf + 24, size - 24);
    memcpy((unsigned char *)buf + 16, &sum, 8);
  }
  struct ttab t;
  struct wd_error err = {0};
  if (ttab_open(buf, size, &t, &err) != 0) {
    if (err.code != WEIGHTD_E_BAD_TABLE || err.msg[0] == '\0') abort();
    free(buf);
    return 0;
  }
  for (size_t i = 0; i < t.count; i++) {
    struct ttab_entry e;
    ttab_get(&t, i, &e);
    if (e.offset > t.slab_bytes || e.nbytes > t.slab_bytes - e.offset) abort();
    if (strlen(e.name) != e.name_len || strlen(e.dtype) >= TTAB_DTYPE_BYTES) abort();
    if (ttab_find(&t, e.name, e.name_len) != (int64_t)i) abort();
  }
  unsigned char *again = NULL;
  size_t len = 0;
  if (ttab_write(t.count, get, &t, t.slab_bytes, &again, &len, &err) != 0) abort();
  struct ttab u;
  if (ttab_open(again, len, &u, &err) != 0 || u.count != t.count || u.slab_bytes != t.slab_bytes) abort();
  for (size_t i = 0; i < t.count; i++) {
    struct ttab_entry a, b;
    ttab_get(&t, i, &a);
    ttab_get(&u, i, &b);
    if (a.name_len != b.name_len || memcmp(a.name, b.name, a.name_len) != 0 || strcmp(a.dtype, b.dtype) != 0 ||
        a.ndim != b.ndim || a.offset != b.offset || a.nbytes != b.nbytes ||
        (a.ndim && memcmp(a.shape, b.shape, a.ndim * sizeof *a.shape) != 0))
      abort();
  }
  free(again);
  free(buf);
  return 0;
}
