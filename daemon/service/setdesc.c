/* setdesc.c - the set description's writer and reader (see setdesc.h). */
#include "setdesc.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "tensor_table.h"

_Static_assert(sizeof(SETDESC_MAGIC) - 1 == 8, "the magic is 8 bytes");

/* ---- writing ---------------------------------------------------------------------------- */

struct out {
  unsigned char *buf;
  size_t len, cap;
  bool nomem;
};

static void put(struct out *o, const void *p, size_t n) {
  if (o->nomem) return;
  if (o->cap - o->len < n) {
    size_t cap = o->cap ? o->cap : 4096;
    while (cap - o->len < n) cap *= 2;
    unsigned char *b = realloc(o->buf, cap);
    if (b == NULL) {
      o->nomem = true;
      return;
    }
    o->buf = b;
    o->cap = cap;
  }
  if (n > 0) memcpy(o->buf + o->len, p, n);
  o->len += n;
}

static void put_u32(struct out *o, uint32_t v) { put(o, &v, sizeof v); }
static void put_u64(struct out *o, uint64_t v) { put(o, &v, sizeof v); }

/* A string, checked against its limit (what names it in a message). */
static int put_str(struct out *o, const char *s, size_t max, const char *what, struct wd_error *err) {
  size_t n = s != NULL ? strlen(s) : 0;
  if (n > max) return err_set(err, WEIGHTD_E_INVALID, "%s: %zu bytes (at most %zu)", what, n, max);
  put_u32(o, (uint32_t)n);
  put(o, s, n);
  return 0;
}

static int put_set(struct out *o, const struct setdesc_set *s, uint32_t version, struct wd_error *err) {
  if (s->handle_kind != WD_HANDLE_FD && s->handle_kind != WD_HANDLE_CUDA_VMM)
    return err_set(err, WEIGHTD_E_INVALID, "set %s: %s handles cannot be described", s->id,
                   wd_handle_kind_name((enum wd_handle_kind)s->handle_kind));
  int rc = put_str(o, s->id, SETDESC_ID_MAX, "set id", err);
  if (rc == 0) rc = put_str(o, s->path, SETDESC_STR_MAX, "checkpoint path", err);
  if (rc == 0) rc = put_str(o, s->uuid, SETDESC_STR_MAX, "device UUID", err);
  if (rc != 0) return rc;
  put_u32(o, s->handle_kind);
  put_u64(o, s->slab_bytes);
  put_u64(o, s->alloc_bytes);
  put(o, s->alloc_id, WD_ALLOC_ID_BYTES);
  rc = put_str(o, s->fdname, SETDESC_NAME_MAX, "store name", err);
  if (rc == 0) rc = put_str(o, s->plan_key, PLAN_KEY_MAX, "plan key", err);
  if (rc != 0) return rc;
  static const unsigned char none[SETDESC_ID_BYTES];
  if (version >= 2) {
    put(o, s->has_ids ? s->layout_id : none, SETDESC_ID_BYTES);
    put_u32(o, s->has_ids && s->content_known);
    put(o, s->has_ids && s->content_known ? s->content_id : none, SETDESC_ID_BYTES);
  }
  put_u32(o, (uint32_t)s->nshards);
  for (size_t i = 0; i < s->nshards; i++) {
    const struct setdesc_shard *sh = &s->shards[i];
    if ((rc = put_str(o, sh->name, SETDESC_STR_MAX, "shard name", err)) != 0) return rc;
    put_u64(o, sh->dev);
    put_u64(o, sh->ino);
    put_u64(o, sh->size);
    put_u64(o, (uint64_t)sh->mtime_ns);
  }
  if (version >= 3) {
    if (s->table_fdname == NULL || s->table_fdname[0] == '\0')
      return err_set(err, WEIGHTD_E_INVALID, "set %s: no store name for its tensor table", s->id);
    if ((rc = put_str(o, s->table_fdname, SETDESC_NAME_MAX, "table store name", err)) != 0) return rc;
    put_u64(o, s->table_len);
    put_u64(o, s->table_sum);
    return 0;
  }
  put_u64(o, s->table_len);
  static const unsigned char zeros[8];
  put(o, zeros, (8 - o->len % 8) % 8);
  put(o, s->table, s->table_len);
  return 0;
}

int setdesc_write(const struct setdesc *d, unsigned char **out, size_t *len, struct wd_error *err) {
  *out = NULL;
  *len = 0;
  uint32_t version = d->version == 0 ? SETDESC_VERSION : d->version;
  if (version < 1 || version > SETDESC_VERSION)
    return err_set(err, WEIGHTD_E_INVALID, "version %u cannot be written", version);
  if (d->nsets > UINT32_MAX || d->nleases > UINT32_MAX)
    return err_set(err, WEIGHTD_E_INVALID, "too many sets or leases to describe");
  struct out o = {0};
  unsigned char header[SETDESC_HEADER_BYTES] = {0};
  put(&o, header, sizeof header);
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < d->nsets; i++) rc = put_set(&o, &d->sets[i], version, err);
  for (size_t i = 0; rc == 0 && i < d->nleases; i++) {
    const struct setdesc_lease *l = &d->leases[i];
    rc = put_str(&o, l->id, SETDESC_ID_MAX, "lease id", err);
    if (rc == 0) rc = put_str(&o, l->set_id, SETDESC_ID_MAX, "lease's set id", err);
    put_u32(&o, l->uid);
    put_u32(&o, (uint32_t)l->pid);
    if (rc == 0) rc = put_str(&o, l->client, SETDESC_CLIENT_MAX, "lease's client name", err);
  }
  if (rc == 0 && o.nomem) rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  if (rc == 0 && o.len > SETDESC_MAX_BYTES)
    rc = err_set(err, WEIGHTD_E_INVALID, "a description of %zu bytes (at most %llu)", o.len,
                 (unsigned long long)SETDESC_MAX_BYTES);
  if (rc != 0) {
    free(o.buf);
    return rc;
  }
  unsigned char *h = o.buf;
  uint32_t hbytes = SETDESC_HEADER_BYTES, nsets = (uint32_t)d->nsets,
           nleases = (uint32_t)d->nleases;
  uint64_t total = o.len, sum = ttab_xxh64(o.buf + SETDESC_HEADER_BYTES, o.len - SETDESC_HEADER_BYTES);
  memcpy(h, SETDESC_MAGIC, 8);
  memcpy(h + 8, &version, 4);
  memcpy(h + 12, &hbytes, 4);
  memcpy(h + 16, &total, 8);
  memcpy(h + 24, &d->generation, 8);
  memcpy(h + 32, &nsets, 4);
  memcpy(h + 36, &nleases, 4);
  memcpy(h + 40, &sum, 8);
  *out = o.buf;
  *len = o.len;
  return 0;
}

/* ---- reading ---------------------------------------------------------------------------- */

/* A cursor over the body; the first failure stops it and names where. */
struct in {
  const unsigned char *buf;
  size_t len, at;
  uint32_t version;
  struct wd_error *err;
  char where[96];
  int rc;
};

static bool take(struct in *c, void *dst, size_t n, const char *what) {
  if (c->rc != 0) return false;
  if (c->len - c->at < n) {
    c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: %s runs past the end (%zu bytes left, %zu needed)", c->where,
                    what, c->len - c->at, n);
    return false;
  }
  if (dst != NULL) memcpy(dst, c->buf + c->at, n);
  c->at += n;
  return true;
}

static uint32_t take_u32(struct in *c, const char *what) {
  uint32_t v = 0;
  take(c, &v, 4, what);
  return v;
}

static uint64_t take_u64(struct in *c, const char *what) {
  uint64_t v = 0;
  take(c, &v, 8, what);
  return v;
}

/* A new NUL-terminated copy of a str of at most max bytes; NULL on failure (c->rc says why). */
static char *take_str(struct in *c, size_t max, bool empty_ok, const char *what) {
  uint32_t n = take_u32(c, what);
  if (c->rc != 0) return NULL;
  if (n > max || (n == 0 && !empty_ok)) {
    c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: %s is %u bytes (%s%zu)", c->where, what, n,
                    n == 0 ? "it may not be empty; at most " : "at most ", max);
    return NULL;
  }
  const unsigned char *p = c->buf + c->at;
  if (!take(c, NULL, n, what)) return NULL;
  if (memchr(p, '\0', n) != NULL) {
    c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: %s holds a NUL byte", c->where, what);
    return NULL;
  }
  char *s = malloc((size_t)n + 1);
  if (s == NULL) {
    c->rc = err_set(c->err, WEIGHTD_E_NOMEM, "out of memory");
    return NULL;
  }
  memcpy(s, p, n);
  s[n] = '\0';
  return s;
}

bool setdesc_counter_parse(const char *digits, uint64_t *out) {
  uint64_t v = 0;
  if (digits[0] < '1' || digits[0] > '9') return false;
  for (const char *p = digits; *p != '\0'; p++) {
    if (*p < '0' || *p > '9' || v > (SETDESC_COUNTER_MAX - (uint64_t)(*p - '0')) / 10) return false;
    v = v * 10 + (uint64_t)(*p - '0');
  }
  *out = v;
  return true;
}

/* An id is its kind's letter and a counter ("s12", "l13"); else c->rc says why. */
static bool id_ok(struct in *c, const char *id, char letter, const char *what) {
  uint64_t n;
  char q[100];
  if (id[0] == letter && setdesc_counter_parse(id + 1, &n)) return true;
  c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: %s '%s' is not '%c' and a number from 1 to %llu", c->where, what,
                  err_quote(id, strlen(id), q, sizeof q), letter, SETDESC_COUNTER_MAX);
  return false;
}

/* Store names are what systemd accepts in FDNAME=: printable ASCII without ':'. */
static bool fdname_ok(const char *s) {
  for (; *s != '\0'; s++)
    if (*s < 0x21 || *s > 0x7e || *s == ':') return false;
  return true;
}

static int table_open(const struct setdesc_set *s, const char *where, struct wd_error *err);

static void read_set(struct in *c, struct setdesc_set *s, size_t i) {
  snprintf(c->where, sizeof c->where, "set %zu", i);
  if ((s->id = take_str(c, SETDESC_ID_MAX, false, "id")) == NULL || !id_ok(c, s->id, 's', "id")) return;
  snprintf(c->where, sizeof c->where, "set %zu (%s)", i, s->id);
  if ((s->path = take_str(c, SETDESC_STR_MAX, false, "checkpoint path")) == NULL) return;
  if ((s->uuid = take_str(c, SETDESC_STR_MAX, false, "device UUID")) == NULL) return;
  s->handle_kind = take_u32(c, "handle kind");
  s->slab_bytes = take_u64(c, "slab bytes");
  s->alloc_bytes = take_u64(c, "allocation bytes");
  if (!take(c, s->alloc_id, WD_ALLOC_ID_BYTES, "allocation id")) return;
  if (s->handle_kind != WD_HANDLE_FD && s->handle_kind != WD_HANDLE_CUDA_VMM) {
    c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: handle kind %u is not fd or cuda_vmm", c->where, s->handle_kind);
    return;
  }
  if (s->alloc_bytes < s->slab_bytes) {
    c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: allocation of %llu bytes is smaller than its slab of %llu",
                    c->where, (unsigned long long)s->alloc_bytes, (unsigned long long)s->slab_bytes);
    return;
  }
  if ((s->fdname = take_str(c, SETDESC_NAME_MAX, false, "store name")) == NULL) return;
  if (!fdname_ok(s->fdname)) {
    c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: store name '%s' is not printable ASCII without ':'", c->where,
                    s->fdname);
    return;
  }
  if ((s->plan_key = take_str(c, PLAN_KEY_MAX, false, "plan key")) == NULL) return;
  if (c->version >= 2) {
    s->has_ids = true;
    if (!take(c, s->layout_id, SETDESC_ID_BYTES, "layout id")) return;
    uint32_t known = take_u32(c, "content id known");
    if (!take(c, s->content_id, SETDESC_ID_BYTES, "content id")) return;
    static const unsigned char none[SETDESC_ID_BYTES];
    if (known > 1 || (known == 0 && memcmp(s->content_id, none, SETDESC_ID_BYTES) != 0)) {
      c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: content id known is %u with %s id bytes", c->where, known,
                      known > 1 ? "any" : "non-zero");
      return;
    }
    s->content_known = known == 1;
  }
  uint32_t n = take_u32(c, "shard count");
  if (c->rc != 0) return;
  /* Each shard takes at least 36 bytes: a count past what is left is refused before allocating. */
  if (n == 0 || n > (c->len - c->at) / 36) {
    c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: %u shards do not fit the %zu bytes left", c->where, n,
                    c->len - c->at);
    return;
  }
  if ((s->shards = calloc(n, sizeof *s->shards)) == NULL) {
    c->rc = err_set(c->err, WEIGHTD_E_NOMEM, "out of memory");
    return;
  }
  for (uint32_t k = 0; k < n && c->rc == 0; k++) {
    struct setdesc_shard *sh = &s->shards[k];
    s->nshards = k + 1;
    if ((sh->name = take_str(c, SETDESC_STR_MAX, false, "shard name")) == NULL) return;
    sh->dev = take_u64(c, "shard device");
    sh->ino = take_u64(c, "shard inode");
    sh->size = take_u64(c, "shard size");
    sh->mtime_ns = (int64_t)take_u64(c, "shard mtime");
  }
  if (c->version >= 3) {
    if ((s->table_fdname = take_str(c, SETDESC_NAME_MAX, false, "table store name")) == NULL) return;
    if (!fdname_ok(s->table_fdname)) {
      c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: table store name '%s' is not printable ASCII without ':'",
                      c->where, s->table_fdname);
      return;
    }
    s->table_len = (size_t)take_u64(c, "table size");
    s->table_sum = take_u64(c, "table checksum");
    return;
  }
  uint64_t tlen = take_u64(c, "table size");
  size_t pad = (8 - c->at % 8) % 8;
  const unsigned char *zeros = c->buf + c->at;
  if (!take(c, NULL, pad, "padding")) return;
  for (size_t k = 0; k < pad; k++)
    if (zeros[k] != 0) {
      c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: padding before the table is not zero", c->where);
      return;
    }
  if (tlen > c->len - c->at) {
    c->rc = err_set(c->err, WEIGHTD_E_INVALID, "%s: table of %llu bytes runs past the end (%zu left)", c->where,
                    (unsigned long long)tlen, c->len - c->at);
    return;
  }
  s->table = c->buf + c->at;
  s->table_len = (size_t)tlen;
  c->at += (size_t)tlen;
  c->rc = table_open(s, c->where, c->err);
}

/* ttab_open on s's table, whose slab must be the set's. */
static int table_open(const struct setdesc_set *s, const char *where, struct wd_error *err) {
  struct ttab t;
  struct wd_error terr = {0};
  if (ttab_open(s->table, s->table_len, &t, &terr) != 0)
    return err_set(err, WEIGHTD_E_INVALID, "%s: tensor table: %s", where, terr.msg);
  if (t.slab_bytes != s->slab_bytes)
    return err_set(err, WEIGHTD_E_INVALID, "%s: tensor table is for a slab of %llu bytes, the set's is %llu", where,
                   (unsigned long long)t.slab_bytes, (unsigned long long)s->slab_bytes);
  return 0;
}

int setdesc_table_check(struct setdesc_set *s, const unsigned char *table, size_t len, struct wd_error *err) {
  if (len != s->table_len)
    return err_set(err, WEIGHTD_E_INVALID, "its stored tensor table has %zu bytes, the description says %zu", len,
                   s->table_len);
  uint64_t sum = ttab_xxh64(table, len);
  if (sum != s->table_sum)
    return err_set(err, WEIGHTD_E_INVALID, "its stored tensor table's checksum is %016llx, the description says %016llx",
                   (unsigned long long)sum, (unsigned long long)s->table_sum);
  s->table = table;
  int rc = table_open(s, "its stored tensor table", err);
  if (rc != 0) s->table = NULL;
  return rc;
}

static void read_lease(struct in *c, struct setdesc_lease *l, size_t i) {
  snprintf(c->where, sizeof c->where, "lease %zu", i);
  if ((l->id = take_str(c, SETDESC_ID_MAX, false, "id")) == NULL || !id_ok(c, l->id, 'l', "id")) return;
  if ((l->set_id = take_str(c, SETDESC_ID_MAX, false, "set id")) == NULL) return;
  l->uid = take_u32(c, "uid");
  l->pid = (int32_t)take_u32(c, "pid");
  l->client = take_str(c, SETDESC_CLIENT_MAX, true, "client name");
}

/* Ids and store names unique, and every lease naming a described set. */
static int check_refs(const struct setdesc *d, struct wd_error *err) {
  for (size_t i = 0; i < d->nsets; i++)
    for (size_t j = 0; j < i; j++) {
      if (strcmp(d->sets[i].id, d->sets[j].id) == 0)
        return err_set(err, WEIGHTD_E_INVALID, "set id %s is given twice", d->sets[i].id);
      if (strcmp(d->sets[i].fdname, d->sets[j].fdname) == 0)
        return err_set(err, WEIGHTD_E_INVALID, "store name %s is given twice", d->sets[i].fdname);
      if (d->sets[i].table_fdname != NULL && d->sets[j].table_fdname != NULL &&
          strcmp(d->sets[i].table_fdname, d->sets[j].table_fdname) == 0)
        return err_set(err, WEIGHTD_E_INVALID, "table store name %s is given twice", d->sets[i].table_fdname);
    }
  for (size_t i = 0; i < d->nsets; i++)
    for (size_t j = 0; j < d->nsets; j++)
      if (d->sets[i].table_fdname != NULL && strcmp(d->sets[i].table_fdname, d->sets[j].fdname) == 0)
        return err_set(err, WEIGHTD_E_INVALID, "store name %s names both a table and a slab", d->sets[j].fdname);
  for (size_t i = 0; i < d->nleases; i++) {
    bool found = false;
    for (size_t j = 0; j < d->nsets && !found; j++) found = strcmp(d->leases[i].set_id, d->sets[j].id) == 0;
    if (!found)
      return err_set(err, WEIGHTD_E_INVALID, "lease %s names set %s, which is not described", d->leases[i].id,
                     d->leases[i].set_id);
    for (size_t j = 0; j < i; j++)
      if (strcmp(d->leases[i].id, d->leases[j].id) == 0)
        return err_set(err, WEIGHTD_E_INVALID, "lease id %s is given twice", d->leases[i].id);
  }
  return 0;
}

int setdesc_read(const void *buf, size_t len, struct setdesc *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  const unsigned char *b = buf;
  if (len < SETDESC_HEADER_BYTES)
    return err_set(err, WEIGHTD_E_INVALID, "%zu bytes: shorter than the %u-byte header", len, SETDESC_HEADER_BYTES);
  if (memcmp(b, SETDESC_MAGIC, 8) != 0) return err_set(err, WEIGHTD_E_INVALID, "bad magic: not a set description");
  uint32_t version, hbytes, nsets, nleases;
  uint64_t total, sum;
  memcpy(&version, b + 8, 4);
  memcpy(&hbytes, b + 12, 4);
  memcpy(&total, b + 16, 8);
  memcpy(&out->generation, b + 24, 8);
  memcpy(&nsets, b + 32, 4);
  memcpy(&nleases, b + 36, 4);
  memcpy(&sum, b + 40, 8);
  if (version < 1 || version > SETDESC_VERSION)
    return err_set(err, WEIGHTD_E_INVALID, "version %u (this daemon reads versions 1 to %u)", version, SETDESC_VERSION);
  if (hbytes != SETDESC_HEADER_BYTES)
    return err_set(err, WEIGHTD_E_INVALID, "header of %u bytes (version %u has %u)", hbytes, version,
                   SETDESC_HEADER_BYTES);
  out->version = version;
  if (out->generation == 0 || out->generation > SETDESC_COUNTER_MAX)
    return err_set(err, WEIGHTD_E_INVALID, "generation %llu is not a number from 1 to %llu",
                   (unsigned long long)out->generation, SETDESC_COUNTER_MAX);
  if (total != len || len > SETDESC_MAX_BYTES)
    return err_set(err, WEIGHTD_E_INVALID, "the header says %llu bytes, the description has %zu (at most %llu)",
                   (unsigned long long)total, len, (unsigned long long)SETDESC_MAX_BYTES);
  if (((uintptr_t)buf & 7u) != 0) return err_set(err, WEIGHTD_E_INVALID, "description not 8-byte aligned in memory");
  uint64_t actual = ttab_xxh64(b + SETDESC_HEADER_BYTES, len - SETDESC_HEADER_BYTES);
  if (actual != sum)
    return err_set(err, WEIGHTD_E_INVALID, "checksum %016llx, the bytes give %016llx", (unsigned long long)sum,
                   (unsigned long long)actual);
  /* Every set takes at least 100 bytes and every lease 18: counts past that are refused before allocating. */
  size_t body = len - SETDESC_HEADER_BYTES;
  if (nsets > body / 100 || nleases > body / 18)
    return err_set(err, WEIGHTD_E_INVALID, "%u sets and %u leases do not fit %zu bytes", nsets, nleases, body);
  struct in c = {.buf = b, .len = len, .at = SETDESC_HEADER_BYTES, .err = err, .version = version};
  out->sets = nsets ? calloc(nsets, sizeof *out->sets) : NULL;
  out->leases = nleases ? calloc(nleases, sizeof *out->leases) : NULL;
  if ((nsets && out->sets == NULL) || (nleases && out->leases == NULL)) {
    setdesc_free(out);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  for (size_t i = 0; i < nsets && c.rc == 0; i++) {
    out->nsets = i + 1;
    read_set(&c, &out->sets[i], i);
  }
  for (size_t i = 0; i < nleases && c.rc == 0; i++) {
    out->nleases = i + 1;
    read_lease(&c, &out->leases[i], i);
  }
  int rc = c.rc;
  if (rc == 0 && c.at != len)
    rc = err_set(err, WEIGHTD_E_INVALID, "%zu bytes follow the last lease", len - c.at);
  if (rc == 0) rc = check_refs(out, err);
  if (rc != 0) setdesc_free(out);
  return rc;
}

void setdesc_free(struct setdesc *d) {
  if (d == NULL) return;
  for (size_t i = 0; i < d->nsets; i++) {
    struct setdesc_set *s = &d->sets[i];
    free(s->id);
    free(s->path);
    free(s->uuid);
    free(s->fdname);
    free(s->plan_key);
    free(s->table_fdname);
    for (size_t k = 0; k < s->nshards; k++) free(s->shards[k].name);
    free(s->shards);
  }
  for (size_t i = 0; i < d->nleases; i++) {
    free(d->leases[i].id);
    free(d->leases[i].set_id);
    free(d->leases[i].client);
  }
  free(d->sets);
  free(d->leases);
  memset(d, 0, sizeof *d);
}
