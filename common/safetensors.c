/* safetensors.c - strict safetensors header validation (see safetensors.h). */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json_strict.h"

/* ---- building the header ----------------------------------------------- */

static void tensor_clear(struct st_tensor *t) {
  free(t->name);
  free(t->shape);
  memset(t, 0, sizeof *t);
}

void st_header_free(struct st_header *h) {
  if (h == NULL) return;
  for (size_t i = 0; i < h->ntensors; i++) tensor_clear(&h->tensors[i]);
  free(h->tensors);
  free(h->by_name);
  for (size_t i = 0; i < h->nmeta; i++) {
    free(h->meta[i].key);
    free(h->meta[i].value);
  }
  free(h->meta);
  free(h);
}

static char *dup_bytes(const char *s, size_t n) {
  char *p = malloc(n + 1);
  if (p == NULL) return NULL;
  memcpy(p, s, n);
  p[n] = '\0';
  return p;
}

struct builder {
  const char *label;
  struct st_header *h;
  size_t cap;
  struct wd_error *err;
};

static int tensor_err(struct builder *b, const char *name, size_t name_len, const char *fmt,
                      const char *what) {
  char pn[160];
  char msg[512];
  snprintf(msg, sizeof msg, fmt, what);
  return err_set(b->err, WEIGHTD_E_BAD_TENSOR, "%s: tensor '%s': %s", b->label,
                 err_quote(name, name_len, pn, sizeof pn), msg);
}

static int parse_dtype(struct builder *b, const char *name, size_t nl, const struct sj_node *v,
                       enum wd_dtype *out) {
  const char *s;
  size_t len;
  if (v->type == SJ_STRING) {
    s = v->str;
    len = v->len;
  } else if (v->type == SJ_OBJECT && v->count == 1 && v->child->type == SJ_NULL) {
    /* serde's externally tagged unit variant: {"F32": null} */
    s = v->child->key;
    len = v->child->key_len;
  } else {
    return tensor_err(b, name, nl, "dtype must be a string, not %s", sj_type_name(v->type));
  }
  *out = dtype_from_name(s, len);
  if (*out == WD_DTYPE_INVALID) {
    char pd[64];
    return tensor_err(b, name, nl, "unknown dtype '%s'", err_quote(s, len, pd, sizeof pd));
  }
  return 0;
}

static int parse_shape(struct builder *b, const char *name, size_t nl, const struct sj_node *v,
                       struct st_tensor *t) {
  if (v->type != SJ_ARRAY)
    return tensor_err(b, name, nl, "shape must be an array, not %s", sj_type_name(v->type));
  t->ndim = (unsigned)v->count;
  if (v->count != t->ndim) return tensor_err(b, name, nl, "%s", "shape has too many dimensions");
  t->shape = malloc((v->count ? v->count : 1) * sizeof *t->shape);
  if (t->shape == NULL) return err_set(b->err, WEIGHTD_E_NOMEM, "%s: out of memory", b->label);
  unsigned i = 0;
  for (const struct sj_node *c = v->child; c != NULL; c = c->next, i++) {
    if (!sj_u64(c, &t->shape[i]))
      return tensor_err(b, name, nl,
                        "shape entries must be non-negative integers below 2^64, found %s",
                        c->type == SJ_NUMBER ? "a non-integer or out-of-range number"
                                             : sj_type_name(c->type));
  }
  return 0;
}

static int parse_offsets(struct builder *b, const char *name, size_t nl, const struct sj_node *v,
                         struct st_tensor *t) {
  if (v->type != SJ_ARRAY || v->count != 2)
    return tensor_err(b, name, nl, "data_offsets must be an array of two integers, not %s",
                      v->type == SJ_ARRAY ? "an array of another length" : sj_type_name(v->type));
  if (!sj_u64(v->child, &t->begin) || !sj_u64(v->child->next, &t->end))
    return tensor_err(b, name, nl, "%s",
                      "data_offsets entries must be non-negative integers below 2^64");
  return 0;
}

/* One tensor entry: the object form or serde's 3-element array form. */
static int parse_tensor(struct builder *b, const struct sj_node *m, struct st_tensor *t) {
  const char *name = m->key;
  size_t nl = m->key_len;
  const struct sj_node *dt = NULL, *sh = NULL, *off = NULL;
  if (m->type == SJ_OBJECT) {
    for (const struct sj_node *f = m->child; f != NULL; f = f->next) {
      const struct sj_node **slot = NULL;
      if (f->key_len == 5 && memcmp(f->key, "dtype", 5) == 0) slot = &dt;
      else if (f->key_len == 5 && memcmp(f->key, "shape", 5) == 0) slot = &sh;
      else if (f->key_len == 12 && memcmp(f->key, "data_offsets", 12) == 0) slot = &off;
      if (slot == NULL) continue; /* unknown fields are ignored, as in the reference */
      if (*slot != NULL) return tensor_err(b, name, nl, "duplicate field '%s'", f->key);
      *slot = f;
    }
    if (dt == NULL) return tensor_err(b, name, nl, "missing field '%s'", "dtype");
    if (sh == NULL) return tensor_err(b, name, nl, "missing field '%s'", "shape");
    if (off == NULL) return tensor_err(b, name, nl, "missing field '%s'", "data_offsets");
  } else if (m->type == SJ_ARRAY) {
    if (m->count != 3)
      return tensor_err(b, name, nl, "%s",
                        "a tensor given as an array needs exactly [dtype, shape, data_offsets]");
    dt = m->child;
    sh = dt->next;
    off = sh->next;
  } else {
    return tensor_err(b, name, nl, "entry must be an object, not %s", sj_type_name(m->type));
  }
  int rc;
  if ((rc = parse_dtype(b, name, nl, dt, &t->dtype)) != 0) return rc;
  if ((rc = parse_shape(b, name, nl, sh, t)) != 0) return rc;
  return parse_offsets(b, name, nl, off, t);
}

static int drop_duplicate_meta(struct st_header *h);

static int parse_metadata(struct builder *b, const struct sj_node *v) {
  struct st_header *h = b->h;
  if (v->type == SJ_NULL) return 0;
  if (v->type != SJ_OBJECT)
    return err_set(b->err, WEIGHTD_E_BAD_HEADER,
                   "%s: __metadata__ must be a map of strings to strings, not %s", b->label,
                   sj_type_name(v->type));
  h->has_metadata = 1;
  h->meta = calloc(v->count ? v->count : 1, sizeof *h->meta);
  if (h->meta == NULL) return err_set(b->err, WEIGHTD_E_NOMEM, "%s: out of memory", b->label);
  for (const struct sj_node *c = v->child; c != NULL; c = c->next) {
    if (c->type != SJ_STRING) {
      char pk[160];
      return err_set(b->err, WEIGHTD_E_BAD_HEADER,
                     "%s: __metadata__ value of '%s' must be a string, not %s", b->label,
                     err_quote(c->key, c->key_len, pk, sizeof pk), sj_type_name(c->type));
    }
    char *k = dup_bytes(c->key, c->key_len), *val = dup_bytes(c->str, c->len);
    if (k == NULL || val == NULL) {
      free(k);
      free(val);
      return err_set(b->err, WEIGHTD_E_NOMEM, "%s: out of memory", b->label);
    }
    size_t slot = h->nmeta++;
    h->meta[slot].key = k;
    h->meta[slot].key_len = c->key_len;
    h->meta[slot].value_len = c->len;
    h->meta[slot].value = val;
  }
  if (drop_duplicate_meta(h) != 0) return err_set(b->err, WEIGHTD_E_NOMEM, "%s: out of memory", b->label);
  return 0;
}

static int cmp_offsets(const void *a, const void *b) {
  const struct st_tensor *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

/* A name with its position, for sorting without a global context. */
struct key_ref {
  const char *s;
  size_t len;
  size_t idx;
};

static int cmp_keys(const void *a, const void *b) {
  const struct key_ref *x = a, *y = b;
  size_t n = x->len < y->len ? x->len : y->len;
  int c = memcmp(x->s, y->s, n);
  if (c != 0) return c;
  if (x->len != y->len) return x->len < y->len ? -1 : 1;
  return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/*
 * Drops all but the last tensor of each name, as the reference does (its
 * HashMap keeps the last insert). O(n log n), so hostile headers stay cheap.
 */
static int drop_duplicate_tensors(struct st_header *h) {
  size_t n = h->ntensors;
  struct key_ref *k = malloc((n ? n : 1) * sizeof *k);
  if (k == NULL) return -1;
  for (size_t i = 0; i < n; i++) k[i] = (struct key_ref){h->tensors[i].name, h->tensors[i].name_len, i};
  qsort(k, n, sizeof *k, cmp_keys);
  for (size_t i = 0; i + 1 < n; i++)
    if (k[i].len == k[i + 1].len && memcmp(k[i].s, k[i + 1].s, k[i].len) == 0)
      tensor_clear(&h->tensors[k[i].idx]); /* name == NULL marks it dropped */
  free(k);
  size_t o = 0;
  for (size_t i = 0; i < n; i++)
    if (h->tensors[i].name != NULL) h->tensors[o++] = h->tensors[i];
  h->ntensors = o;
  return 0;
}

/* The name index: tensor positions sorted by name, for binary search. */
static int index_names(struct st_header *h) {
  size_t n = h->ntensors;
  struct key_ref *k = malloc((n ? n : 1) * sizeof *k);
  h->by_name = malloc((n ? n : 1) * sizeof *h->by_name);
  if (k == NULL || h->by_name == NULL) {
    free(k);
    return -1;
  }
  for (size_t i = 0; i < n; i++) k[i] = (struct key_ref){h->tensors[i].name, h->tensors[i].name_len, i};
  qsort(k, n, sizeof *k, cmp_keys);
  for (size_t i = 0; i < n; i++) h->by_name[i] = k[i].idx;
  free(k);
  return 0;
}

/* Keeps the last value of each repeated __metadata__ key, in O(n log n). */
static int drop_duplicate_meta(struct st_header *h) {
  size_t n = h->nmeta;
  struct key_ref *k = malloc((n ? n : 1) * sizeof *k);
  if (k == NULL) return -1;
  for (size_t i = 0; i < n; i++) k[i] = (struct key_ref){h->meta[i].key, h->meta[i].key_len, i};
  qsort(k, n, sizeof *k, cmp_keys);
  for (size_t i = 0; i + 1 < n; i++)
    if (k[i].len == k[i + 1].len && memcmp(k[i].s, k[i + 1].s, k[i].len) == 0) {
      free(h->meta[k[i].idx].key);
      free(h->meta[k[i].idx].value);
      h->meta[k[i].idx].key = NULL;
    }
  free(k);
  size_t o = 0;
  for (size_t i = 0; i < n; i++)
    if (h->meta[i].key != NULL) h->meta[o++] = h->meta[i];
  h->nmeta = o;
  return 0;
}

/* The offsets, sizes and file length rules, once all entries are read. */
static int check_layout(struct builder *b, uint64_t file_len) {
  struct st_header *h = b->h;
  qsort(h->tensors, h->ntensors, sizeof *h->tensors, cmp_offsets);
  uint64_t pos = 0;
  char pn[160], pm[160];
  for (size_t i = 0; i < h->ntensors; i++) {
    struct st_tensor *t = &h->tensors[i];
    const char *tn = err_quote(t->name, t->name_len, pn, sizeof pn);
    if (t->begin != pos || t->end < t->begin) {
      if (t->end < t->begin)
        return err_set(b->err, WEIGHTD_E_BAD_TENSOR,
                       "%s: tensor '%s': data_offsets [%llu,%llu) end before they begin",
                       b->label, tn, (unsigned long long)t->begin, (unsigned long long)t->end);
      if (t->begin > pos)
        return err_set(b->err, WEIGHTD_E_BAD_TENSOR,
                       "%s: tensor '%s': data_offsets [%llu,%llu) leave a gap after byte %llu",
                       b->label, tn, (unsigned long long)t->begin, (unsigned long long)t->end,
                       (unsigned long long)pos);
      const struct st_tensor *prev = &h->tensors[i - 1];
      return err_set(b->err, WEIGHTD_E_BAD_TENSOR,
                     "%s: tensor '%s': data_offsets [%llu,%llu) overlap '%s' [%llu,%llu)", b->label,
                     tn, (unsigned long long)t->begin, (unsigned long long)t->end,
                     err_quote(prev->name, prev->name_len, pm, sizeof pm),
                     (unsigned long long)prev->begin, (unsigned long long)prev->end);
    }
    pos = t->end;
    uint64_t elems = 1;
    for (unsigned d = 0; d < t->ndim; d++) {
      if (__builtin_mul_overflow(elems, t->shape[d], &elems))
        return err_set(b->err, WEIGHTD_E_BAD_TENSOR,
                       "%s: tensor '%s': element count of the shape overflows 64 bits", b->label,
                       tn);
    }
    uint64_t bits;
    if (__builtin_mul_overflow(elems, (uint64_t)dtype_bits(t->dtype), &bits))
      return err_set(b->err, WEIGHTD_E_BAD_TENSOR,
                     "%s: tensor '%s': size in bits of the shape overflows 64 bits", b->label, tn);
    if (bits % 8 != 0)
      return err_set(b->err, WEIGHTD_E_BAD_TENSOR,
                     "%s: tensor '%s': %llu elements of %s (%u bits each) are not a whole number "
                     "of bytes",
                     b->label, tn, (unsigned long long)elems, dtype_name(t->dtype),
                     dtype_bits(t->dtype));
    if (t->end - t->begin != bits / 8) {
      char ps[128];
      st_shape_format(t->shape, t->ndim, ps, sizeof ps);
      return err_set(b->err, WEIGHTD_E_BAD_TENSOR,
                     "%s: tensor '%s': data_offsets [%llu,%llu) hold %llu bytes but %s %s needs "
                     "%llu",
                     b->label, tn, (unsigned long long)t->begin, (unsigned long long)t->end,
                     (unsigned long long)(t->end - t->begin), dtype_name(t->dtype), ps,
                     (unsigned long long)(bits / 8));
    }
  }
  h->data_len = pos;
  uint64_t want;
  if (__builtin_add_overflow(h->data_start, pos, &want) || want != file_len)
    return err_set(b->err, WEIGHTD_E_BAD_SIZE,
                   "%s: file is %llu bytes but its header describes %llu + %llu bytes of data",
                   b->label, (unsigned long long)file_len, (unsigned long long)h->data_start,
                   (unsigned long long)pos);
  return 0;
}

/* ---- entry points ------------------------------------------------------ */

static int check_prefix(const unsigned char *buf, size_t buflen, uint64_t file_len,
                        const char *label, uint64_t *n_out, struct wd_error *err) {
  if (file_len < ST_PREFIX_LEN || buflen < ST_PREFIX_LEN)
    return err_set(err, WEIGHTD_E_BAD_HEADER,
                   "%s: file is %llu bytes, too short for the 8-byte header length", label,
                   (unsigned long long)file_len);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | buf[i];
  /* Past the limit is what any other kind of file gives (text, a zip, GGUF): said so, without its bytes. */
  if (n > ST_MAX_HEADER_LEN)
    return err_set(err, WEIGHTD_E_BAD_HEADER,
                   "%s: not a safetensors file (a safetensors file starts with the length of its JSON "
                   "header, at most %llu bytes; this one's first 8 bytes are no such length)", label,
                   ST_MAX_HEADER_LEN);
  if (n > file_len - ST_PREFIX_LEN)
    return err_set(err, WEIGHTD_E_BAD_HEADER,
                   "%s: header length %llu runs past the end of the %llu-byte file", label,
                   (unsigned long long)n, (unsigned long long)file_len);
  *n_out = n;
  return 0;
}

int st_header_parse(const unsigned char *buf, size_t buflen, uint64_t file_len, const char *label,
                    struct st_header **out, struct wd_error *err) {
  *out = NULL;
  uint64_t n;
  int rc = check_prefix(buf, buflen, file_len, label, &n, err);
  if (rc != 0) return rc;
  if (buflen - ST_PREFIX_LEN < n)
    return err_set(err, WEIGHTD_E_INVALID, "%s: buffer holds only part of the header", label);
  const unsigned char *json = buf + ST_PREFIX_LEN;
  size_t bad_at;
  if (!sj_utf8_valid(json, (size_t)n, &bad_at))
    return err_set(err, WEIGHTD_E_BAD_HEADER, "%s: header is not valid UTF-8 (at byte %zu)", label,
                   bad_at);

  struct sj_doc doc = {0};
  char why[320];
  int prc = sj_parse((const char *)json, (size_t)n, SJ_DEFAULT_MAX_DEPTH, &doc, why, sizeof why);
  if (prc == -2) return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory parsing header", label);
  if (prc != 0) return err_set(err, WEIGHTD_E_BAD_HEADER, "%s: header is not valid JSON: %s", label, why);

  struct builder b = {.label = label, .err = err};
  b.h = calloc(1, sizeof *b.h);
  if (b.h == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
    goto fail;
  }
  b.h->header_len = n;
  b.h->data_start = ST_PREFIX_LEN + n;
  const struct sj_node *root = doc.root;
  if (root->type != SJ_OBJECT) {
    rc = err_set(err, WEIGHTD_E_BAD_HEADER, "%s: header must be a JSON object, not %s", label,
                 sj_type_name(root->type));
    goto fail;
  }
  b.cap = root->count ? root->count : 1;
  b.h->tensors = calloc(b.cap, sizeof *b.h->tensors);
  if (b.h->tensors == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
    goto fail;
  }
  int seen_meta = 0;
  for (const struct sj_node *m = root->child; m != NULL; m = m->next) {
    if (m->key_len == 12 && memcmp(m->key, "__metadata__", 12) == 0) {
      if (seen_meta) {
        rc = err_set(err, WEIGHTD_E_BAD_HEADER, "%s: duplicate field '__metadata__'", label);
        goto fail;
      }
      seen_meta = 1;
      if ((rc = parse_metadata(&b, m)) != 0) goto fail;
      continue;
    }
    struct st_tensor t = {0};
    if ((rc = parse_tensor(&b, m, &t)) != 0) {
      tensor_clear(&t);
      goto fail;
    }
    t.name = dup_bytes(m->key, m->key_len);
    t.name_len = m->key_len;
    if (t.name == NULL) {
      tensor_clear(&t);
      rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
      goto fail;
    }
    b.h->tensors[b.h->ntensors++] = t;
  }
  if (drop_duplicate_tensors(b.h) != 0) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
    goto fail;
  }
  if ((rc = check_layout(&b, file_len)) != 0) goto fail;
  if (index_names(b.h) != 0) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
    goto fail;
  }
  sj_doc_free(&doc);
  *out = b.h;
  return 0;
fail:
  sj_doc_free(&doc);
  st_header_free(b.h);
  return rc;
}

int st_header_read(const struct st_reader *rd, uint64_t file_len, const char *label, struct st_header **out,
                   struct wd_error *err) {
  *out = NULL;
  unsigned char prefix[ST_PREFIX_LEN];
  size_t got = file_len < sizeof prefix ? (size_t)file_len : sizeof prefix;
  int rc = got > 0 ? rd->read(rd->arg, 0, prefix, got, err) : 0;
  if (rc != 0) return rc;
  uint64_t n;
  if ((rc = check_prefix(prefix, got, file_len, label, &n, err)) != 0) return rc;
  size_t total = (size_t)(ST_PREFIX_LEN + n);
  unsigned char *buf = malloc(total ? total : 1);
  if (buf == NULL) return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory for header", label);
  memcpy(buf, prefix, ST_PREFIX_LEN);
  rc = total > ST_PREFIX_LEN ? rd->read(rd->arg, ST_PREFIX_LEN, buf + ST_PREFIX_LEN, total - ST_PREFIX_LEN, err) : 0;
  if (rc == 0) rc = st_header_parse(buf, total, file_len, label, out, err);
  free(buf);
  return rc;
}

struct fd_reader {
  int fd;
  const char *label;
};

/* Exactly len bytes from off with pread: 0, IO for a failed read, BAD_HEADER when the file ends first. */
static int fd_read(void *arg, uint64_t off, void *buf, size_t len, struct wd_error *err) {
  const struct fd_reader *f = arg;
  size_t got = 0;
  while (got < len) {
    ssize_t r = pread(f->fd, (unsigned char *)buf + got, len - got, (off_t)(off + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return err_set(err, WEIGHTD_E_IO, "%s: read failed: %s", f->label, strerror(errno));
    if (r == 0) return err_set(err, WEIGHTD_E_BAD_HEADER, "%s: file shrank while its header was read", f->label);
    got += (size_t)r;
  }
  return 0;
}

int st_header_read_fd(int fd, const char *label, struct st_header **out, struct wd_error *err) {
  *out = NULL;
  struct stat sb;
  if (fstat(fd, &sb) != 0)
    return err_set(err, WEIGHTD_E_IO, "%s: cannot stat: %s", label, strerror(errno));
  if (!S_ISREG(sb.st_mode))
    return err_set(err, WEIGHTD_E_INVALID, "%s: not a regular file", label);
  struct fd_reader f = {fd, label};
  struct st_reader rd = {fd_read, &f};
  return st_header_read(&rd, (uint64_t)sb.st_size, label, out, err);
}

int st_header_read_path(const char *path, const char *label, struct st_header **out,
                        struct wd_error *err) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return err_set(err, errno == ENOENT ? WEIGHTD_E_NOT_FOUND : WEIGHTD_E_IO,
                             "%s: cannot open: %s", label, strerror(errno));
  int rc = st_header_read_fd(fd, label, out, err);
  close(fd);
  return rc;
}

const struct st_tensor *st_tensor_find(const struct st_header *h, const char *name) {
  size_t nl = strlen(name);
  size_t lo = 0, hi = h->ntensors;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const struct st_tensor *t = &h->tensors[h->by_name[mid]];
    size_t n = t->name_len < nl ? t->name_len : nl;
    int c = memcmp(t->name, name, n);
    if (c == 0) c = t->name_len < nl ? -1 : t->name_len > nl;
    if (c == 0) return t;
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return NULL;
}

const char *st_meta_get(const struct st_header *h, const char *key) {
  size_t kl = strlen(key);
  for (size_t i = 0; i < h->nmeta; i++)
    if (h->meta[i].key_len == kl && memcmp(h->meta[i].key, key, kl) == 0) return h->meta[i].value;
  return NULL;
}

uint64_t st_tensor_elements(const struct st_tensor *t) {
  uint64_t e = 1;
  for (unsigned d = 0; d < t->ndim; d++) e *= t->shape[d];
  return e;
}

void st_shape_format(const uint64_t *shape, unsigned ndim, char *buf, size_t buflen) {
  size_t o = 0;
  o += (size_t)snprintf(buf, buflen, "[");
  for (unsigned d = 0; d < ndim && o < buflen; d++)
    o += (size_t)snprintf(buf + o, buflen - o, "%s%llu", d ? ", " : "",
                          (unsigned long long)shape[d]);
  if (o < buflen) snprintf(buf + o, buflen - o, "]");
}
