/* tensor_table.c - the binary tensor table: its writer and its validating reader (see tensor_table.h). */
#include "tensor_table.h"

#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the tensor table is read in place: weightd runs on little-endian hosts"
#endif

/* ---- header and record layout ---------------------------------------------------------- */

/* Header field offsets (docs/protocol.md, "The binary tensor table"). */
enum {
  H_MAGIC = 0,          /* 8 bytes "WDTENSOR" */
  H_VERSION = 8,        /* u32 */
  H_HEADER_BYTES = 12,  /* u32 */
  H_CHECKSUM = 16,      /* u64: XXH64 of bytes [24, total) */
  H_TOTAL_BYTES = 24,   /* u64 */
  H_SLAB_BYTES = 32,    /* u64 */
  H_COUNT = 40,         /* u64 */
  H_RECORDS_OFF = 48,   /* u64 */
  H_RECORD_BYTES = 56,  /* u32 */
  H_FLAGS = 60,         /* u32, 0 */
  H_DIMS_OFF = 64,      /* u64 */
  H_NDIMS = 72,         /* u64: int64 entries */
  H_INDEX_OFF = 80,     /* u64 */
  H_STRINGS_OFF = 88,   /* u64 */
  H_STRINGS_BYTES = 96, /* u64 */
  /* 104..127 reserved, zero */
  H_CHECKED_FROM = 24,
};

/* Record field offsets. */
enum {
  R_OFFSET = 0,     /* u64 */
  R_NBYTES = 8,     /* u64 */
  R_DIMS = 16,      /* u64: the first dimension's entry in the dims section */
  R_NDIM = 24,      /* u32 */
  R_NAME_LEN = 28,  /* u32 */
  R_NAME_OFF = 32,  /* u64: in the strings section */
  R_DTYPE = 40,     /* TTAB_DTYPE_BYTES */
  /* 56..63 reserved, zero */
};

static uint64_t rd64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

static uint32_t rd32(const unsigned char *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

static void wr64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static void wr32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }

static uint64_t pad8(uint64_t n) { return (n + 7) & ~(uint64_t)7; }

/* ---- XXH64 -------------------------------------------------------------------------------- */

#define P1 11400714785074694791ULL
#define P2 14029467366897019727ULL
#define P3 1609587929392839161ULL
#define P4 9650029242287828579ULL
#define P5 2870177450012600261ULL

static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t xround(uint64_t acc, uint64_t in) {
  acc += in * P2;
  return rotl(acc, 31) * P1;
}

static uint64_t xmerge(uint64_t acc, uint64_t v) {
  acc ^= xround(0, v);
  return acc * P1 + P4;
}

uint64_t ttab_xxh64(const void *data, size_t len) {
  const unsigned char *p = data, *end = p + len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = 0 - P1;
    const unsigned char *limit = end - 32;
    do {
      v1 = xround(v1, rd64(p));
      v2 = xround(v2, rd64(p + 8));
      v3 = xround(v3, rd64(p + 16));
      v4 = xround(v4, rd64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = xmerge(h, v1);
    h = xmerge(h, v2);
    h = xmerge(h, v3);
    h = xmerge(h, v4);
  } else {
    h = P5;
  }
  h += (uint64_t)len;
  for (; end - p >= 8; p += 8) h = rotl(h ^ xround(0, rd64(p)), 27) * P1 + P4;
  if (end - p >= 4) {
    h = rotl(h ^ (uint64_t)rd32(p) * P1, 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; p++) h = rotl(h ^ *p * P5, 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

/* ---- writing ------------------------------------------------------------------------------ */

/* qsort_r's context for the index: the strings and the records. */
struct sort_ctx {
  const unsigned char *records;
  const char *strings;
};

static int name_cmp(const char *a, size_t la, const char *b, size_t lb) {
  int c = memcmp(a, b, la < lb ? la : lb);
  return c != 0 ? c : (la > lb) - (la < lb);
}

static int index_cmp(const void *x, const void *y, void *arg) {
  const struct sort_ctx *c = arg;
  const unsigned char *a = c->records + (size_t)*(const uint32_t *)x * TTAB_RECORD_BYTES;
  const unsigned char *b = c->records + (size_t)*(const uint32_t *)y * TTAB_RECORD_BYTES;
  return name_cmp(c->strings + rd64(a + R_NAME_OFF), rd32(a + R_NAME_LEN), c->strings + rd64(b + R_NAME_OFF),
                  rd32(b + R_NAME_LEN));
}

int ttab_write(size_t n, ttab_get_fn get, void *arg, uint64_t slab_bytes, unsigned char **out, size_t *len,
               struct wd_error *err) {
  *out = NULL;
  *len = 0;
  if (n > UINT32_MAX) return err_set(err, WEIGHTD_E_INVALID, "%zu tensors: a table holds at most 2^32 - 1", n);
  /* First pass: the sections' sizes. */
  uint64_t ndims = 0, strings = 0;
  struct ttab_tensor t;
  for (size_t i = 0; i < n; i++) {
    get(arg, i, &t);
    if (t.name_len > UINT32_MAX || memchr(t.name, '\0', t.name_len) != NULL)
      return err_set(err, WEIGHTD_E_INVALID, "tensor %zu: its name is too long or holds a NUL", i);
    if (t.dtype == NULL || strlen(t.dtype) >= TTAB_DTYPE_BYTES || t.dtype[0] == '\0')
      return err_set(err, WEIGHTD_E_INVALID, "tensor '%.*s': dtype name empty or longer than %u bytes",
                     (int)(t.name_len > 200 ? 200 : t.name_len), t.name, TTAB_DTYPE_BYTES - 1);
    if (t.offset > slab_bytes || t.nbytes > slab_bytes - t.offset)
      return err_set(err, WEIGHTD_E_INVALID, "tensor '%.*s' lies outside the %llu-byte slab",
                     (int)(t.name_len > 200 ? 200 : t.name_len), t.name, (unsigned long long)slab_bytes);
    for (unsigned d = 0; d < t.ndim; d++)
      if (t.shape[d] > (uint64_t)INT64_MAX)
        return err_set(err, WEIGHTD_E_INVALID, "tensor '%.*s': dimension %u is above 2^63 - 1",
                       (int)(t.name_len > 200 ? 200 : t.name_len), t.name, d);
    ndims += t.ndim;
    strings += t.name_len + 1;
  }
  uint64_t records_off = TTAB_HEADER_BYTES;
  uint64_t dims_off = records_off + (uint64_t)n * TTAB_RECORD_BYTES;
  uint64_t index_off = dims_off + ndims * 8;
  uint64_t strings_off = index_off + pad8((uint64_t)n * 4);
  uint64_t total = strings_off + strings;
  if (total > SIZE_MAX) return err_set(err, WEIGHTD_E_NOMEM, "a table of %llu bytes", (unsigned long long)total);
  unsigned char *b = calloc(1, (size_t)total);
  if (b == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory (a table of %llu bytes)", (unsigned long long)total);
  /* Second pass: records, dimensions, names. */
  uint64_t dim_at = 0, str_at = 0;
  for (size_t i = 0; i < n; i++) {
    get(arg, i, &t);
    unsigned char *r = b + records_off + (uint64_t)i * TTAB_RECORD_BYTES;
    wr64(r + R_OFFSET, t.offset);
    wr64(r + R_NBYTES, t.nbytes);
    wr64(r + R_DIMS, dim_at);
    wr32(r + R_NDIM, t.ndim);
    wr32(r + R_NAME_LEN, (uint32_t)t.name_len);
    wr64(r + R_NAME_OFF, str_at);
    memcpy(r + R_DTYPE, t.dtype, strlen(t.dtype));
    for (unsigned d = 0; d < t.ndim; d++, dim_at++) wr64(b + dims_off + dim_at * 8, t.shape[d]);
    memcpy(b + strings_off + str_at, t.name, t.name_len);
    str_at += t.name_len + 1; /* the NUL is calloc's */
  }
  /* The index: record numbers by name; two equal names would make lookups ambiguous. */
  uint32_t *index = malloc((n ? n : 1) * sizeof *index);
  if (index == NULL) {
    free(b);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  for (size_t i = 0; i < n; i++) index[i] = (uint32_t)i;
  struct sort_ctx sc = {b + records_off, (const char *)b + strings_off};
  qsort_r(index, n, sizeof *index, index_cmp, &sc);
  for (size_t i = 1; i < n; i++)
    if (index_cmp(&index[i - 1], &index[i], &sc) == 0) {
      const unsigned char *r = b + records_off + (size_t)index[i] * TTAB_RECORD_BYTES;
      int rc = err_set(err, WEIGHTD_E_INVALID, "two tensors are called '%.200s'", sc.strings + rd64(r + R_NAME_OFF));
      free(index);
      free(b);
      return rc;
    }
  memcpy(b + index_off, index, n * sizeof *index);
  free(index);
  memcpy(b + H_MAGIC, TTAB_MAGIC, 8);
  wr32(b + H_VERSION, TTAB_VERSION);
  wr32(b + H_HEADER_BYTES, TTAB_HEADER_BYTES);
  wr64(b + H_TOTAL_BYTES, total);
  wr64(b + H_SLAB_BYTES, slab_bytes);
  wr64(b + H_COUNT, n);
  wr64(b + H_RECORDS_OFF, records_off);
  wr32(b + H_RECORD_BYTES, TTAB_RECORD_BYTES);
  wr64(b + H_DIMS_OFF, dims_off);
  wr64(b + H_NDIMS, ndims);
  wr64(b + H_INDEX_OFF, index_off);
  wr64(b + H_STRINGS_OFF, strings_off);
  wr64(b + H_STRINGS_BYTES, strings);
  wr64(b + H_CHECKSUM, ttab_xxh64(b + H_CHECKED_FROM, (size_t)total - H_CHECKED_FROM));
  *out = b;
  *len = (size_t)total;
  return 0;
}

/* ---- reading ------------------------------------------------------------------------------ */

#define BAD(...) err_set(err, WEIGHTD_E_BAD_TABLE, __VA_ARGS__)

/* A dtype field: printable ASCII, not empty, NUL-terminated inside the field, zeros after. */
static int dtype_ok(const unsigned char *f) {
  size_t n = 0;
  while (n < TTAB_DTYPE_BYTES && f[n] != 0) {
    if (f[n] < 0x21 || f[n] > 0x7e) return 0;
    n++;
  }
  if (n == 0 || n == TTAB_DTYPE_BYTES) return 0;
  for (size_t i = n; i < TTAB_DTYPE_BYTES; i++)
    if (f[i] != 0) return 0;
  return 1;
}

static int check_record(const struct ttab *t, uint64_t ndims, uint64_t strings_bytes, uint64_t i,
                        struct wd_error *err) {
  const unsigned char *r = t->records + i * t->record_bytes;
  uint64_t off = rd64(r + R_OFFSET), nbytes = rd64(r + R_NBYTES), dims = rd64(r + R_DIMS);
  uint64_t name_off = rd64(r + R_NAME_OFF);
  uint32_t ndim = rd32(r + R_NDIM), name_len = rd32(r + R_NAME_LEN);
  if (off > t->slab_bytes || nbytes > t->slab_bytes - off)
    return BAD("record %llu: bytes [%llu, +%llu) lie outside the %llu-byte slab", (unsigned long long)i,
               (unsigned long long)off, (unsigned long long)nbytes, (unsigned long long)t->slab_bytes);
  if (dims > ndims || ndim > ndims - dims)
    return BAD("record %llu: its %u dimensions run past the dims section", (unsigned long long)i, ndim);
  for (uint32_t d = 0; d < ndim; d++)
    if (t->dims[dims + d] < 0) return BAD("record %llu: dimension %u is negative", (unsigned long long)i, d);
  if (name_off > strings_bytes || name_len >= strings_bytes - name_off)
    return BAD("record %llu: its name runs past the strings section", (unsigned long long)i);
  const char *name = t->strings + name_off;
  if (name[name_len] != '\0' || memchr(name, '\0', name_len) != NULL)
    return BAD("record %llu: its name is not NUL-terminated where its length says", (unsigned long long)i);
  if (!dtype_ok(r + R_DTYPE)) return BAD("record %llu: its dtype is not a terminated name", (unsigned long long)i);
  return 0;
}

int ttab_open(const void *buf, size_t len, struct ttab *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  const unsigned char *b = buf;
  if (b == NULL || ((uintptr_t)b & 7) != 0) return BAD("the table is not 8-byte aligned in memory");
  if (len < TTAB_HEADER_BYTES) return BAD("%zu bytes: shorter than a header (%u)", len, TTAB_HEADER_BYTES);
  if (memcmp(b + H_MAGIC, TTAB_MAGIC, 8) != 0) return BAD("bad magic (not a weightd tensor table)");
  if (rd32(b + H_VERSION) != TTAB_VERSION)
    return BAD("version %u; this library reads version %u", rd32(b + H_VERSION), TTAB_VERSION);
  uint64_t header = rd32(b + H_HEADER_BYTES), total = rd64(b + H_TOTAL_BYTES);
  if (header < TTAB_HEADER_BYTES || header % 8 != 0 || header > len)
    return BAD("header size %llu", (unsigned long long)header);
  if (total != len)
    return BAD("the header says %llu bytes, the table has %zu", (unsigned long long)total, len);
  if (rd64(b + H_CHECKSUM) != ttab_xxh64(b + H_CHECKED_FROM, len - H_CHECKED_FROM))
    return BAD("checksum mismatch (the table is corrupt)");
  if (rd32(b + H_FLAGS) != 0) return BAD("unknown flags 0x%x", rd32(b + H_FLAGS));
  uint64_t count = rd64(b + H_COUNT), rec_bytes = rd32(b + H_RECORD_BYTES);
  uint64_t records = rd64(b + H_RECORDS_OFF), dims = rd64(b + H_DIMS_OFF), ndims = rd64(b + H_NDIMS);
  uint64_t index = rd64(b + H_INDEX_OFF), strings = rd64(b + H_STRINGS_OFF), sbytes = rd64(b + H_STRINGS_BYTES);
  if (rec_bytes < TTAB_RECORD_BYTES || rec_bytes % 8 != 0)
    return BAD("record size %llu", (unsigned long long)rec_bytes);
  if (count > UINT32_MAX) return BAD("%llu records", (unsigned long long)count);
  /* The sections follow each other in order; each size is bounded by the table's before it is multiplied. */
  if (records != header) return BAD("the records do not follow the header");
  if (count > (len - records) / rec_bytes) return BAD("%llu records run past the table", (unsigned long long)count);
  if (dims != records + count * rec_bytes) return BAD("the dims section does not follow the records");
  if (ndims > (len - dims) / 8) return BAD("%llu dimensions run past the table", (unsigned long long)ndims);
  if (index != dims + ndims * 8) return BAD("the index does not follow the dims section");
  if (pad8(count * 4) > len - index) return BAD("the index runs past the table");
  if (strings != index + pad8(count * 4)) return BAD("the strings section does not follow the index");
  if (sbytes != len - strings) return BAD("the strings section does not end the table");
  for (size_t i = 104; i < header; i++)
    if (b[i] != 0) return BAD("reserved header bytes are not zero");
  out->base = b;
  out->len = len;
  out->count = count;
  out->slab_bytes = rd64(b + H_SLAB_BYTES);
  out->record_bytes = (uint32_t)rec_bytes;
  out->records = b + records;
  out->dims = (const int64_t *)(const void *)(b + dims);
  out->index = (const uint32_t *)(const void *)(b + index);
  out->strings = (const char *)b + strings;
  int rc = 0;
  for (uint64_t i = 0; i < count && rc == 0; i++) rc = check_record(out, ndims, sbytes, i, err);
  /* The index orders the names strictly: every record once, no name twice. */
  for (uint64_t i = 0; i < count && rc == 0; i++) {
    if (out->index[i] >= count) {
      rc = BAD("index entry %llu names record %u of %llu", (unsigned long long)i, out->index[i],
               (unsigned long long)count);
    } else if (i > 0) {
      struct ttab_entry a, z;
      ttab_get(out, out->index[i - 1], &a);
      ttab_get(out, out->index[i], &z);
      if (name_cmp(a.name, a.name_len, z.name, z.name_len) >= 0)
        rc = BAD("index entries %llu and %llu are not in strict name order ('%.200s', '%.200s')",
                 (unsigned long long)i - 1, (unsigned long long)i, a.name, z.name);
    }
  }
  if (rc != 0) memset(out, 0, sizeof *out);
  return rc;
}

void ttab_get(const struct ttab *t, size_t i, struct ttab_entry *out) {
  const unsigned char *r = t->records + i * t->record_bytes;
  out->offset = rd64(r + R_OFFSET);
  out->nbytes = rd64(r + R_NBYTES);
  out->ndim = rd32(r + R_NDIM);
  out->shape = t->dims + rd64(r + R_DIMS);
  out->name_len = rd32(r + R_NAME_LEN);
  out->name = t->strings + rd64(r + R_NAME_OFF);
  out->dtype = (const char *)r + R_DTYPE;
}

int64_t ttab_find(const struct ttab *t, const char *name, size_t len) {
  size_t lo = 0, hi = (size_t)t->count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const unsigned char *r = t->records + (size_t)t->index[mid] * t->record_bytes;
    int c = name_cmp(t->strings + rd64(r + R_NAME_OFF), rd32(r + R_NAME_LEN), name, len);
    if (c == 0) return t->index[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return -1;
}
