/*
 * dtype.h - the element types safetensors knows, with their sizes in bits.
 *
 * The list and the sizes follow the reference implementation (the
 * `safetensors` package, version 0.8.0). Sub-byte types (F4, F6_*) are
 * packed: a tensor's bit count must come out to whole bytes.
 */
#ifndef WD_DTYPE_H
#define WD_DTYPE_H

#include <stddef.h>

/* XX(ENUM, "NAME", bits) */
#define WD_DTYPE_MAP(XX)                \
  XX(BOOL, "BOOL", 8)                   \
  XX(F4, "F4", 4)                       \
  XX(F6_E2M3, "F6_E2M3", 6)             \
  XX(F6_E3M2, "F6_E3M2", 6)             \
  XX(U8, "U8", 8)                       \
  XX(I8, "I8", 8)                       \
  XX(F8_E5M2, "F8_E5M2", 8)             \
  XX(F8_E4M3, "F8_E4M3", 8)             \
  XX(F8_E8M0, "F8_E8M0", 8)             \
  XX(F8_E4M3FNUZ, "F8_E4M3FNUZ", 8)     \
  XX(F8_E5M2FNUZ, "F8_E5M2FNUZ", 8)     \
  XX(I16, "I16", 16)                    \
  XX(U16, "U16", 16)                    \
  XX(F16, "F16", 16)                    \
  XX(BF16, "BF16", 16)                  \
  XX(I32, "I32", 32)                    \
  XX(U32, "U32", 32)                    \
  XX(F32, "F32", 32)                    \
  XX(C64, "C64", 64)                    \
  XX(F64, "F64", 64)                    \
  XX(I64, "I64", 64)                    \
  XX(U64, "U64", 64)

enum wd_dtype {
  WD_DTYPE_INVALID = -1,
#define XX(e, name, bits) WD_DTYPE_##e,
  WD_DTYPE_MAP(XX)
#undef XX
  WD_DTYPE_COUNT
};

/* The dtype named exactly `name` (len bytes, case-sensitive), or WD_DTYPE_INVALID. */
enum wd_dtype dtype_from_name(const char *name, size_t len);
/* The canonical name of a dtype ("?" when out of range). */
const char *dtype_name(enum wd_dtype t);
/* Size of one element in bits (0 when out of range). */
unsigned dtype_bits(enum wd_dtype t);

#endif
