/*
 * fuzz_header.c - libFuzzer target: the safetensors header validator
 * (st_header_parse) on a whole file image, and the accessors a valid header
 * serves (name lookup, shape formatting, metadata).
 *
 * Oracles besides the sanitizers: a valid header's tensors are contiguous
 * from 0, each within the data section, and the data section ends at the
 * end of the input; every tensor is found by its name.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct st_header *h = NULL;
  struct wd_error err = {0};
  if (st_header_parse(data, size, size, "fuzz.safetensors", &h, &err) != 0) {
    if (err.code == 0 || err.msg[0] == '\0') abort(); /* every refusal says why */
    return 0;
  }
  uint64_t pos = 0;
  for (size_t i = 0; i < h->ntensors; i++) {
    const struct st_tensor *t = &h->tensors[i];
    if (t->begin != pos || t->end < t->begin) abort();
    pos = t->end;
    char shape[128];
    st_shape_format(t->shape, t->ndim, shape, sizeof shape);
    (void)st_tensor_elements(t);
    /* Lookup by name: names holding U+0000 cannot be asked for by a C string. */
    if (memchr(t->name, '\0', t->name_len) == NULL && st_tensor_find(h, t->name) != t) abort();
  }
  if (h->data_len != pos || h->data_start + h->data_len != size) abort();
  (void)st_meta_get(h, "format");
  st_header_free(h);
  return 0;
}
