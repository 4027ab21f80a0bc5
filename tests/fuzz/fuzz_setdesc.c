/*
 * fuzz_setdesc.c - libFuzzer target: the set description's reader
 * (setdesc_read) on arbitrary bytes, and the writer on what it accepts.
 *
 * Half the inputs (by a bit of their own) get the header's length and
 * checksum rewritten first, so that mutations reach the body's checks.
 *
 * Oracles besides the sanitizers: every refusal is INVALID (or NOMEM) and
 * says why; an accepted description written again is the same bytes (one
 * writer, one reader, agreeing), its leases name described sets, and its
 * ids and generation are counters the daemon can take over without wrapping.
 *
 * Built by tests/fuzz/CMakeLists.txt as the target "setdesc" (WD_FUZZ_TARGETS).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "service/setdesc.h"
#include "tensor_table.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* The reader wants 8-byte alignment, as a mapping gives it. */
  uint64_t *buf = malloc(size ? size : 1);
  if (buf == NULL) return 0;
  memcpy(buf, data, size);
  unsigned char *b = (unsigned char *)buf;
  if (size >= SETDESC_HEADER_BYTES && ((data[size / 2] ^ size) & 1)) {
    uint64_t total = size, sum = ttab_xxh64(b + SETDESC_HEADER_BYTES, size - SETDESC_HEADER_BYTES);
    memcpy(b + 16, &total, 8);
    memcpy(b + 40, &sum, 8);
  }
  struct setdesc d;
  struct wd_error err = {0};
  int rc = setdesc_read(buf, size, &d, &err);
  if (rc != 0) {
    if ((err.code != WEIGHTD_E_INVALID && err.code != WEIGHTD_E_NOMEM) || err.msg[0] == '\0') abort();
    if (d.sets != NULL || d.leases != NULL) abort();
    free(buf);
    return 0;
  }
  unsigned char *again = NULL;
  size_t len = 0;
  if (setdesc_write(&d, &again, &len, &err) != 0) abort();
  if (len != size || memcmp(again, b, size) != 0) abort();
  uint64_t n;
  if (d.generation < 1 || d.generation > SETDESC_COUNTER_MAX) abort();
  for (size_t i = 0; i < d.nsets; i++)
    if (d.sets[i].id[0] != 's' || !setdesc_counter_parse(d.sets[i].id + 1, &n)) abort();
  for (size_t i = 0; i < d.nleases; i++) {
    if (d.leases[i].id[0] != 'l' || !setdesc_counter_parse(d.leases[i].id + 1, &n)) abort();
    int found = 0;
    for (size_t j = 0; j < d.nsets; j++) found |= strcmp(d.leases[i].set_id, d.sets[j].id) == 0;
    if (!found) abort();
  }
  free(again);
  setdesc_free(&d);
  free(buf);
  return 0;
}
