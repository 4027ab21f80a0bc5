/*
 * manifest.c - payload digests and the manifest file (see manifest.h).
 */
#include "manifest.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "json_strict.h"
#include "sha256.h"

/* ---- digests ------------------------------------------------------------------------- */

void mf_digest(const void *p, size_t n, unsigned char out[MF_DIGEST_BYTES]) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(p, n));
  memcpy(out, c.digest, MF_DIGEST_BYTES);
}

int mf_tensor_digest(const void *p, size_t n, unsigned char out[MF_DIGEST_BYTES]) {
  if (n <= MF_LEAF_BYTES) {
    mf_digest(p, n, out);
    return 0;
  }
  size_t leaves = (size_t)((n + MF_LEAF_BYTES - 1) / MF_LEAF_BYTES);
  unsigned char (*d)[MF_DIGEST_BYTES] = malloc(leaves * MF_DIGEST_BYTES);
  if (d == NULL) return WEIGHTD_E_NOMEM;
  const unsigned char *b = p;
  for (size_t i = 0; i < leaves; i++) {
    size_t off = i * (size_t)MF_LEAF_BYTES;
    mf_digest(b + off, n - off < MF_LEAF_BYTES ? n - off : (size_t)MF_LEAF_BYTES, d[i]);
  }
  mf_digest(d, leaves * MF_DIGEST_BYTES, out);
  free(d);
  return 0;
}

void mf_hex(const unsigned char *p, size_t n, char *out) {
  static const char digits[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = digits[p[i] >> 4];
    out[2 * i + 1] = digits[p[i] & 15];
  }
  out[2 * n] = '\0';
}

/* Reads exactly 2n lowercase or uppercase hex digits of s[0..len) into p; 0, or -1. */
static int unhex(const char *s, size_t len, unsigned char *p, size_t n) {
  if (len != 2 * n) return -1;
  for (size_t i = 0; i < 2 * n; i++) {
    char ch = s[i];
    int v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
    if (v < 0) return -1;
    if (i % 2 == 0)
      p[i / 2] = (unsigned char)(v << 4);
    else
      p[i / 2] |= (unsigned char)v;
  }
  return 0;
}

void mf_content_id(const unsigned char layout[CKPT_ID_BYTES], const struct mf_file *files, size_t n,
                   unsigned char out[CKPT_ID_BYTES]) {
  static const char tag[] = "weightd-content-v1";
  struct sha256 h;
  sha256_init(&h);
  sha256_update(&h, tag, sizeof tag - 1);
  sha256_update(&h, layout, CKPT_ID_BYTES);
  unsigned char b[8];
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)n >> (8 * i));
  sha256_update(&h, b, sizeof b);
  for (size_t i = 0; i < n; i++) sha256_update(&h, files[i].digest, MF_DIGEST_BYTES);
  sha256_final(&h, out);
}

void mf_file_finish(struct mf_file *f) {
  mf_digest(f->chunks, (size_t)f->nchunks * MF_DIGEST_BYTES, f->digest);
}

void mf_finish(struct mf_manifest *m) {
  for (size_t i = 0; i < m->nfiles; i++) mf_file_finish(&m->files[i]);
  mf_content_id(m->layout_id, m->files, m->nfiles, m->content_id);
}

void mf_free(struct mf_manifest *m) {
  if (m == NULL) return;
  for (size_t i = 0; i < m->nfiles; i++) {
    free(m->files[i].chunks);
    free(m->files[i].tensors);
  }
  free(m->files);
  free(m);
}

struct mf_manifest *mf_new(const struct ckpt *c) {
  struct mf_manifest *m = calloc(1, sizeof *m);
  if (m == NULL || (m->files = calloc(c->nshards ? c->nshards : 1, sizeof *m->files)) == NULL) {
    free(m);
    return NULL;
  }
  memcpy(m->layout_id, c->layout_id, CKPT_ID_BYTES);
  m->nfiles = c->nshards;
  for (size_t i = 0; i < c->nshards; i++) {
    struct mf_file *f = &m->files[i];
    f->size = c->shards[i].size;
    f->nchunks = (f->size + MF_CHUNK_BYTES - 1) / MF_CHUNK_BYTES;
    f->ntensors = c->shards[i].hdr->ntensors;
    if ((f->chunks = calloc(f->nchunks ? f->nchunks : 1, MF_DIGEST_BYTES)) == NULL ||
        (f->tensors = calloc(f->ntensors ? f->ntensors : 1, MF_DIGEST_BYTES)) == NULL) {
      mf_free(m);
      return NULL;
    }
  }
  return m;
}

/* ---- the digester ------------------------------------------------------------------------ */

struct mf_digester {
  const struct st_header *hdr;
  struct mf_file *out;
  uint64_t pos;      /* bytes fed */
  size_t ti;         /* the next tensor (data-offset order) not yet digested whole */
  XXH3_state_t *chunk;
  XXH3_state_t *leaf, *root; /* the tensor being fed: its current leaf, and its leaf digests (a tensor of >1 leaf) */
  bool sha;
  struct sha256 sha256;
};

struct mf_digester *mf_digester_new(const struct ckpt *c, struct mf_manifest *m, uint32_t shard, bool sha256) {
  struct mf_digester *d = calloc(1, sizeof *d);
  if (d == NULL) return NULL;
  d->hdr = c->shards[shard].hdr;
  d->out = &m->files[shard];
  d->sha = sha256;
  if ((d->chunk = XXH3_createState()) == NULL || (d->leaf = XXH3_createState()) == NULL ||
      (d->root = XXH3_createState()) == NULL) {
    XXH3_freeState(d->chunk);
    XXH3_freeState(d->leaf);
    free(d);
    return NULL;
  }
  XXH3_128bits_reset(d->chunk);
  if (sha256) sha256_init(&d->sha256);
  return d;
}

static void state_out(XXH3_state_t *s, unsigned char out[MF_DIGEST_BYTES]) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits_digest(s));
  memcpy(out, c.digest, MF_DIGEST_BYTES);
}

/*
 * File bytes [lo, hi) at p into the tree digest of the tensor being fed
 * (d->ti), which spans [s, e): split where a leaf ends (leaves are counted
 * from s, whatever the pieces), each finished leaf's digest fed to the root
 * of a tensor of more than one leaf; the tensor's digest is written at e.
 */
static void feed_tree(struct mf_digester *d, const unsigned char *p, uint64_t lo, uint64_t hi, uint64_t s, uint64_t e) {
  bool tree = e - s > MF_LEAF_BYTES;
  if (lo == s) {
    XXH3_128bits_reset(d->leaf);
    if (tree) XXH3_128bits_reset(d->root);
  }
  while (lo < hi) {
    uint64_t room = MF_LEAF_BYTES - (lo - s) % MF_LEAF_BYTES, k = hi - lo < room ? hi - lo : room;
    XXH3_128bits_update(d->leaf, p, (size_t)k);
    p += k;
    lo += k;
    if (tree && ((lo - s) % MF_LEAF_BYTES == 0 || lo == e)) {
      unsigned char leaf[MF_DIGEST_BYTES];
      state_out(d->leaf, leaf);
      XXH3_128bits_update(d->root, leaf, sizeof leaf);
      XXH3_128bits_reset(d->leaf);
    }
  }
  if (hi == e) state_out(tree ? d->root : d->leaf, d->out->tensors[d->ti++]);
}

/* The tensors' share of file bytes [a, a + n) at p (none of them past a chunk's end). */
static void feed_tensors(struct mf_digester *d, const unsigned char *p, uint64_t a, uint64_t n) {
  uint64_t b = a + n, base = d->hdr->data_start;
  while (a < b && d->ti < d->hdr->ntensors) {
    const struct st_tensor *t = &d->hdr->tensors[d->ti];
    uint64_t s = base + t->begin, e = base + t->end;
    if (e <= a) { /* empty, or behind: empty ones get their digest at the end */
      d->ti++;
      continue;
    }
    uint64_t lo = a > s ? a : s;
    if (lo >= b) return;
    uint64_t hi = b < e ? b : e;
    feed_tree(d, p + (lo - a), lo, hi, s, e);
    p += hi - a;
    a = hi;
  }
}

void mf_digester_feed(struct mf_digester *d, const unsigned char *p, size_t n) {
  while (n > 0 && d->pos < d->out->size) {
    uint64_t room = MF_CHUNK_BYTES - d->pos % MF_CHUNK_BYTES, left = d->out->size - d->pos;
    uint64_t k = n < room ? n : room;
    if (k > left) k = left;
    XXH3_128bits_update(d->chunk, p, (size_t)k);
    if (d->sha) sha256_update(&d->sha256, p, (size_t)k);
    feed_tensors(d, p, d->pos, k);
    d->pos += k;
    if (d->pos % MF_CHUNK_BYTES == 0 || d->pos == d->out->size) {
      state_out(d->chunk, d->out->chunks[(d->pos - 1) / MF_CHUNK_BYTES]);
      XXH3_128bits_reset(d->chunk);
    }
    p += k;
    n -= (size_t)k;
  }
}

int mf_digester_end(struct mf_digester *d) {
  if (d == NULL) return 0;
  int rc = d->pos == d->out->size ? 0 : WEIGHTD_E_INVALID;
  if (rc == 0) {
    for (size_t i = 0; i < d->hdr->ntensors; i++) /* empty tensors: the digest of no bytes (one leaf: no failure) */
      if (d->hdr->tensors[i].begin == d->hdr->tensors[i].end) (void)mf_tensor_digest(NULL, 0, d->out->tensors[i]);
    mf_file_finish(d->out);
    if (d->sha) {
      sha256_final(&d->sha256, d->out->sha256);
      d->out->has_sha256 = true;
    }
  }
  XXH3_freeState(d->chunk);
  XXH3_freeState(d->leaf);
  XXH3_freeState(d->root);
  free(d);
  return rc;
}

uint64_t mf_chunks_differ(const struct mf_manifest *want, const struct mf_manifest *got, uint32_t shard,
                          void (*diff)(void *arg, uint64_t chunk), void *arg) {
  const struct mf_file *w = &want->files[shard], *g = &got->files[shard];
  uint64_t n = 0;
  for (uint64_t i = 0; i < w->nchunks && i < g->nchunks; i++)
    if (memcmp(w->chunks[i], g->chunks[i], MF_DIGEST_BYTES) != 0) {
      n++;
      if (diff != NULL) diff(arg, i);
    }
  return n;
}

/* ---- writing -------------------------------------------------------------------------------- */

static cJSON *hex_array(const unsigned char (*d)[MF_DIGEST_BYTES], uint64_t n) {
  cJSON *a = cJSON_CreateArray();
  char hex[2 * MF_DIGEST_BYTES + 1];
  for (uint64_t i = 0; a != NULL && i < n; i++) {
    mf_hex(d[i], MF_DIGEST_BYTES, hex);
    cJSON *s = cJSON_CreateString(hex);
    if (s == NULL || !cJSON_AddItemToArray(a, s)) {
      cJSON_Delete(s);
      cJSON_Delete(a);
      return NULL;
    }
  }
  return a;
}

static bool add_hex(cJSON *o, const char *key, const unsigned char *p, size_t n) {
  char hex[2 * CKPT_ID_BYTES + 1];
  mf_hex(p, n, hex);
  return cJSON_AddStringToObject(o, key, hex) != NULL;
}

char *mf_write(const struct mf_manifest *m, const struct ckpt *c, size_t *len) {
  cJSON *root = cJSON_CreateObject(), *files = NULL;
  bool ok = root != NULL && cJSON_AddStringToObject(root, "format", "weightd-manifest") != NULL &&
            cJSON_AddNumberToObject(root, "version", MF_VERSION) != NULL &&
            cJSON_AddStringToObject(root, "hash", "xxh3-128") != NULL &&
            cJSON_AddNumberToObject(root, "chunk_bytes", (double)MF_CHUNK_BYTES) != NULL &&
            cJSON_AddNumberToObject(root, "leaf_bytes", (double)MF_LEAF_BYTES) != NULL &&
            add_hex(root, "layout_id", m->layout_id, CKPT_ID_BYTES) &&
            add_hex(root, "content_id", m->content_id, CKPT_ID_BYTES) &&
            (files = cJSON_AddArrayToObject(root, "files")) != NULL;
  for (size_t i = 0; ok && i < m->nfiles; i++) {
    const struct mf_file *f = &m->files[i];
    cJSON *o = cJSON_CreateObject(), *a;
    ok = o != NULL && cJSON_AddItemToArray(files, o);
    if (!ok) {
      cJSON_Delete(o);
      break;
    }
    char size[24];
    snprintf(size, sizeof size, "%llu", (unsigned long long)f->size);
    ok = cJSON_AddStringToObject(o, "name", c->shards[i].rel) != NULL &&
         cJSON_AddItemToObject(o, "size", cJSON_CreateRaw(size)) && add_hex(o, "digest", f->digest, MF_DIGEST_BYTES);
    for (int k = 0; ok && k < 2; k++) {
      a = k == 0 ? hex_array((const unsigned char(*)[MF_DIGEST_BYTES])f->chunks, f->nchunks)
                 : hex_array((const unsigned char(*)[MF_DIGEST_BYTES])f->tensors, f->ntensors);
      ok = a != NULL && cJSON_AddItemToObject(o, k == 0 ? "chunks" : "tensors", a);
      if (!ok) cJSON_Delete(a);
    }
  }
  char *text = ok ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  if (text != NULL) {
    size_t n = strlen(text);
    char *t = realloc(text, n + 2); /* ends with a newline, as text files do */
    if (t == NULL) {
      free(text);
      return NULL;
    }
    t[n] = '\n';
    t[n + 1] = '\0';
    text = t;
    *len = n + 1;
  }
  return text;
}

/* ---- reading ---------------------------------------------------------------------------------- */

static const struct sj_node *member(const struct sj_node *o, const char *key) {
  size_t kl = strlen(key);
  for (const struct sj_node *n = o->child; n != NULL; n = n->next)
    if (n->key_len == kl && memcmp(n->key, key, kl) == 0) return n;
  return NULL;
}

static bool is_str(const struct sj_node *n, const char *s) {
  return n != NULL && n->type == SJ_STRING && n->len == strlen(s) && memcmp(n->str, s, n->len) == 0;
}

/* The hex string member `key` of o as n bytes: 0, or -1. */
static int hex_member(const struct sj_node *o, const char *key, unsigned char *p, size_t n) {
  const struct sj_node *v = member(o, key);
  return v != NULL && v->type == SJ_STRING ? unhex(v->str, v->len, p, n) : -1;
}

/* An array of count hex digests into d: 0, or -1. */
static int hex_list(const struct sj_node *a, unsigned char (*d)[MF_DIGEST_BYTES], uint64_t count) {
  if (a == NULL || a->type != SJ_ARRAY || a->count != count) return -1;
  uint64_t i = 0;
  for (const struct sj_node *n = a->child; n != NULL; n = n->next, i++)
    if (n->type != SJ_STRING || unhex(n->str, n->len, d[i], MF_DIGEST_BYTES) != 0) return -1;
  return 0;
}

/*
 * The first member of o whose key another member repeats, or NULL: a
 * manifest says each thing once. Its objects have a handful of keys; one of
 * more than 16 is refused as o itself (returned), before the quadratic look.
 */
static const struct sj_node *repeated_key(const struct sj_node *o) {
  if (o->count > 16) return o;
  for (const struct sj_node *a = o->child; a != NULL; a = a->next)
    for (const struct sj_node *b = a->next; b != NULL; b = b->next)
      if (a->key_len == b->key_len && memcmp(a->key, b->key, a->key_len) == 0) return a;
  return NULL;
}

static int check_file(const struct sj_node *o, const struct ckpt *c, size_t i, struct mf_file *f, const char *label,
                      struct wd_error *err) {
  const struct ckpt_shard *s = &c->shards[i];
  if (o->type != SJ_OBJECT || repeated_key(o) != NULL)
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: files[%zu] is not an object with each key once", label, i);
  if (!is_str(member(o, "name"), s->rel))
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: files[%zu] does not name %s (the checkpoint's shard %zu)", label,
                   i, s->rel, i);
  uint64_t size;
  const struct sj_node *sz = member(o, "size");
  if (sz == NULL || sz->type != SJ_NUMBER || !sj_u64(sz, &size))
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: %s: no size", label, s->rel);
  if (size != f->size)
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: %s: size %llu in the manifest, %llu on disk", label, s->rel,
                   (unsigned long long)size, (unsigned long long)f->size);
  if (hex_list(member(o, "chunks"), f->chunks, f->nchunks) != 0)
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: %s: \"chunks\" is not %llu digests of 32 hex digits", label,
                   s->rel, (unsigned long long)f->nchunks);
  if (hex_list(member(o, "tensors"), f->tensors, f->ntensors) != 0)
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: %s: \"tensors\" is not %zu digests of 32 hex digits", label,
                   s->rel, f->ntensors);
  unsigned char digest[MF_DIGEST_BYTES];
  if (hex_member(o, "digest", digest, sizeof digest) != 0)
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: %s: no digest", label, s->rel);
  mf_file_finish(f);
  if (memcmp(digest, f->digest, MF_DIGEST_BYTES) != 0)
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: %s: the digest does not follow from the chunk digests", label,
                   s->rel);
  return 0;
}

/*
 * The longest text a manifest of c can be: its fixed fields, and per file its
 * name (escaped, at worst 6 bytes a byte), size and digest, and 35 bytes per
 * chunk and tensor digest; all of it twice over, for whitespace. A longer
 * text is refused before it is parsed, whose tree costs some 40 bytes per
 * input byte.
 */
static uint64_t longest_text(const struct ckpt *c) {
  uint64_t n = 1024;
  for (size_t i = 0; i < c->nshards; i++) {
    uint64_t nchunks = (c->shards[i].size + MF_CHUNK_BYTES - 1) / MF_CHUNK_BYTES;
    n += 6 * (uint64_t)strlen(c->shards[i].rel) + 256 + 35 * (nchunks + c->shards[i].hdr->ntensors);
  }
  return 2 * n;
}

int mf_parse(const char *text, size_t len, const struct ckpt *c, const char *label, struct mf_manifest **out,
             struct wd_error *err) {
  *out = NULL;
  uint64_t longest = longest_text(c);
  if (len > longest)
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: %zu bytes, more than a manifest of these files can be (%llu)",
                   label, len, (unsigned long long)longest);
  if (!sj_utf8_valid((const unsigned char *)text, len, NULL))
    return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: not UTF-8 text", label);
  struct sj_doc doc = {0};
  char why[160];
  int r = sj_parse(text, len, 8, &doc, why, sizeof why);
  if (r == -2) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  if (r != 0) return err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: not JSON: %s", label, why);
  struct mf_manifest *m = mf_new(c);
  int rc = 0;
  const struct sj_node *root = doc.root, *v;
  uint64_t u;
  unsigned char id[CKPT_ID_BYTES];
  if (m == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  } else if (root->type != SJ_OBJECT || !is_str(member(root, "format"), "weightd-manifest")) {
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: not a weightd manifest (no \"format\": \"weightd-manifest\")", label);
  } else if ((v = repeated_key(root)) != NULL) {
    char q[64];
    rc = v == root ? err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: more keys than a manifest has", label)
                   : err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: \"%s\" is given twice", label,
                             err_quote(v->key, v->key_len, q, sizeof q));
  } else if ((v = member(root, "version")) == NULL || v->type != SJ_NUMBER || !sj_u64(v, &u) || u != MF_VERSION) {
    bool v1 = v != NULL && v->type == SJ_NUMBER && sj_u64(v, &u) && u == 1;
    rc = v1 ? err_set(err, WEIGHTD_E_BAD_CHECKSUM,
                      "%s: version is 1, not %d: its tensor digests are plain XXH3-128, which this version replaced "
                      "by a tree of %llu-byte leaves; write it again with `weightctl manifest`",
                      label, MF_VERSION, (unsigned long long)MF_LEAF_BYTES)
            : err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: version is %.*s, not %d (the only one this reader knows)", label,
                      v != NULL && v->type == SJ_NUMBER ? (int)(v->len > 20 ? 20 : v->len) : 7,
                      v != NULL && v->type == SJ_NUMBER ? v->str : "missing", MF_VERSION);
  } else if (!is_str(member(root, "hash"), "xxh3-128")) {
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: hash is not \"xxh3-128\"", label);
  } else if ((v = member(root, "chunk_bytes")) == NULL || v->type != SJ_NUMBER || !sj_u64(v, &u) ||
             u != MF_CHUNK_BYTES) {
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: chunk_bytes is %.*s, not %llu", label,
                 v != NULL && v->type == SJ_NUMBER ? (int)(v->len > 20 ? 20 : v->len) : 7,
                 v != NULL && v->type == SJ_NUMBER ? v->str : "missing", (unsigned long long)MF_CHUNK_BYTES);
  } else if ((v = member(root, "leaf_bytes")) == NULL || v->type != SJ_NUMBER || !sj_u64(v, &u) ||
             u != MF_LEAF_BYTES) {
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: leaf_bytes is %.*s, not %llu", label,
                 v != NULL && v->type == SJ_NUMBER ? (int)(v->len > 20 ? 20 : v->len) : 7,
                 v != NULL && v->type == SJ_NUMBER ? v->str : "missing", (unsigned long long)MF_LEAF_BYTES);
  } else if (hex_member(root, "layout_id", id, sizeof id) != 0) {
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: no layout_id", label);
  } else if (memcmp(id, c->layout_id, CKPT_ID_BYTES) != 0) {
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM,
                 "%s: describes another layout (its layout_id is not this checkpoint's: made for other files?)", label);
  } else if ((v = member(root, "files")) == NULL || v->type != SJ_ARRAY || v->count != c->nshards) {
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: \"files\" is not an array of the checkpoint's %zu shard(s)", label,
                 c->nshards);
  } else {
    size_t i = 0;
    for (const struct sj_node *f = v->child; rc == 0 && f != NULL; f = f->next, i++)
      rc = check_file(f, c, i, &m->files[i], label, err);
    if (rc == 0) {
      mf_content_id(m->layout_id, m->files, m->nfiles, m->content_id);
      if (hex_member(root, "content_id", id, sizeof id) != 0 || memcmp(id, m->content_id, CKPT_ID_BYTES) != 0)
        rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: the content_id does not follow from the file digests", label);
    }
  }
  sj_doc_free(&doc);
  if (rc != 0) {
    mf_free(m);
    return rc;
  }
  *out = m;
  return 0;
}
