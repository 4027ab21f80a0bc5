/*
 * fixture.h - small on-disk fixtures for C tests: scratch directories and
 * safetensors files written from a list of tensors with patterned bytes.
 */
#ifndef WD_FIXTURE_H
#define WD_FIXTURE_H

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct fx_tensor {
  const char *name;
  const char *dtype; /* 1, 2 or 4 bytes per element: U8, BF16, F32 ... */
  unsigned elem_bytes;
  uint64_t rows, cols; /* shape [rows, cols]; cols 0 means shape [rows] */
};

/* A fresh scratch directory under $WD_TEST_TMP (or /tmp); the caller frees it. */
static inline char *fx_tmpdir(const char *tag) {
  const char *base = getenv("WD_TEST_TMP");
  char buf[PATH_MAX];
  if (base == NULL || base[0] == '\0') base = "/tmp";
  mkdir(base, 0755);
  snprintf(buf, sizeof buf, "%s/%s-XXXXXX", base, tag);
  if (mkdtemp(buf) == NULL) return NULL;
  return strdup(buf);
}

static inline int fx_rm_entry(const char *p, const struct stat *sb, int f, struct FTW *ftw) {
  (void)sb;
  (void)f;
  (void)ftw;
  return remove(p);
}

static inline void fx_rmtree(const char *dir) { nftw(dir, fx_rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* The byte a fixture file holds at data offset off of tensor number idx. */
static inline unsigned char fx_byte(unsigned idx, uint64_t off) {
  return (unsigned char)(((off * 131u) ^ (idx * 17u + 1u)) & 0xFF) | 1u;
}

/*
 * A valid safetensors file holding ts[0..n), in memory: *out (malloc'd) gets
 * the 8-byte prefix, the header and the data (fx_byte patterns), *len its
 * length. Returns 0 or -1.
 */
static inline int fx_st_bytes(const struct fx_tensor *ts, size_t n, unsigned char **out, size_t *len_out) {
  size_t cap = 256 + n * 256, len = 0;
  char *h = malloc(cap);
  if (h == NULL) return -1;
  uint64_t off = 0;
  len += (size_t)snprintf(h + len, cap - len, "{\"__metadata__\":{\"format\":\"pt\"}");
  for (size_t i = 0; i < n; i++) {
    uint64_t elems = ts[i].cols ? ts[i].rows * ts[i].cols : ts[i].rows;
    uint64_t bytes = elems * ts[i].elem_bytes;
    if (ts[i].cols)
      len += (size_t)snprintf(h + len, cap - len,
                              ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%llu,%llu],\"data_offsets\":[%llu,%llu]}",
                              ts[i].name, ts[i].dtype, (unsigned long long)ts[i].rows,
                              (unsigned long long)ts[i].cols, (unsigned long long)off,
                              (unsigned long long)(off + bytes));
    else
      len += (size_t)snprintf(h + len, cap - len,
                              ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%llu],\"data_offsets\":[%llu,%llu]}",
                              ts[i].name, ts[i].dtype, (unsigned long long)ts[i].rows,
                              (unsigned long long)off, (unsigned long long)(off + bytes));
    off += bytes;
  }
  len += (size_t)snprintf(h + len, cap - len, "}");
  while ((8 + len) % 8 != 0) h[len++] = ' ';
  unsigned char *f = malloc(8 + len + off);
  if (f == NULL) {
    free(h);
    return -1;
  }
  for (int i = 0; i < 8; i++) f[i] = (unsigned char)(((uint64_t)len >> (8 * i)) & 0xFF);
  memcpy(f + 8, h, len);
  free(h);
  uint64_t pos = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t elems = ts[i].cols ? ts[i].rows * ts[i].cols : ts[i].rows;
    uint64_t bytes = elems * ts[i].elem_bytes;
    for (uint64_t b = 0; b < bytes; b++) f[8 + len + pos + b] = fx_byte((unsigned)i, pos + b);
    pos += bytes;
  }
  *out = f;
  *len_out = 8 + len + (size_t)off;
  return 0;
}

/* Writes a valid safetensors file holding ts[0..n). Returns 0 or -1. */
static inline int fx_write_st(const char *path, const struct fx_tensor *ts, size_t n) {
  unsigned char *bytes;
  size_t len;
  if (fx_st_bytes(ts, n, &bytes, &len) != 0) return -1;
  FILE *f = fopen(path, "wb");
  int ok = f != NULL && fwrite(bytes, 1, len, f) == len;
  if (f != NULL && fclose(f) != 0) ok = 0;
  free(bytes);
  return ok ? 0 : -1;
}

/* Writes text to dir/name. Returns 0 or -1. */
static inline int fx_write_text(const char *dir, const char *name, const char *text) {
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "w");
  if (f == NULL) return -1;
  int ok = fputs(text, f) >= 0;
  return fclose(f) == 0 && ok ? 0 : -1;
}

#endif
