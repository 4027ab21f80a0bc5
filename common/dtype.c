/* dtype.c - dtype names and sizes, generated from WD_DTYPE_MAP. */
#include "dtype.h"

#include <string.h>

static const struct {
  const char *name;
  unsigned bits;
} dtype_table[WD_DTYPE_COUNT] = {
#define XX(e, n, b) [WD_DTYPE_##e] = {n, b},
    WD_DTYPE_MAP(XX)
#undef XX
};

enum wd_dtype dtype_from_name(const char *name, size_t len) {
  for (int i = 0; i < WD_DTYPE_COUNT; i++)
    if (strlen(dtype_table[i].name) == len && memcmp(dtype_table[i].name, name, len) == 0)
      return (enum wd_dtype)i;
  return WD_DTYPE_INVALID;
}

const char *dtype_name(enum wd_dtype t) {
  if (t < 0 || t >= WD_DTYPE_COUNT) return "?";
  return dtype_table[t].name;
}

unsigned dtype_bits(enum wd_dtype t) {
  if (t < 0 || t >= WD_DTYPE_COUNT) return 0;
  return dtype_table[t].bits;
}
