/* checkpoint.c - checkpoint directories: index, shards, config (see checkpoint.h). */
#include "checkpoint.h"
#include "manifest.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json_strict.h"
#include "pathutil.h"
#include "sha256.h"

#define CKPT_INDEX_NAME "model.safetensors.index.json"
#define CKPT_SINGLE_NAME "model.safetensors"
#define CKPT_CONFIG_NAME "config.json"
/* config.json files are small; anything past this is refused as hostile. */
#define CKPT_CONFIG_MAX_BYTES (16u << 20)

const char *ckpt_layout_name(enum ckpt_layout l) {
  switch (l) {
  case CKPT_INDEX: return "index";
  case CKPT_SINGLE: return "single";
  case CKPT_FILE: return "file";
  }
  return "?";
}

static void shard_clear(struct ckpt_shard *s) {
  free(s->rel);
  free(s->path);
  free(s->real);
  if (s->fd >= 0) close(s->fd);
  st_header_free(s->hdr);
}

void ckpt_free(struct ckpt *c) {
  if (c == NULL) return;
  for (size_t i = 0; i < c->nshards; i++) shard_clear(&c->shards[i]);
  free(c->shards);
  free(c->by_name);
  free(c->path);
  free(c->dir);
  mcfg_free(c->config);
  mf_free(c->manifest);
  free(c);
}

/*
 * A timestamp as one number, for identity comparisons only. Unsigned
 * arithmetic: a file's owner may set any time (years past 2262 overflow
 * signed nanoseconds), and equal times must still give equal numbers.
 */
static int64_t stamp_ns(const struct timespec *ts) {
  return (int64_t)((uint64_t)ts->tv_sec * 1000000000u + (uint64_t)ts->tv_nsec);
}

static int64_t mtime_ns(const struct stat *sb) { return stamp_ns(&sb->st_mtim); }

/* ---- names ----------------------------------------------------------------- */

/* Names compare by all their bytes: JSON lets a name hold U+0000. */
static int cmp_bytes(const char *a, size_t al, const char *b, size_t bl) {
  int c = memcmp(a, b, al < bl ? al : bl);
  if (c != 0) return c;
  return al < bl ? -1 : al > bl;
}

static int cmp_name(const struct st_tensor *x, const char *name, size_t len) {
  return cmp_bytes(x->name, x->name_len, name, len);
}

static int cmp_refs(const void *a, const void *b) {
  const struct ckpt_ref *x = a, *y = b;
  int c = cmp_name(x->t, y->t->name, y->t->name_len);
  if (c != 0) return c;
  return x->shard < y->shard ? -1 : x->shard > y->shard;
}

const struct ckpt_ref *ckpt_tensor_find(const struct ckpt *c, const char *name) {
  size_t lo = 0, hi = c->ntensors, len = strlen(name);
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int r = cmp_name(c->by_name[mid].t, name, len);
    if (r == 0) return &c->by_name[mid];
    if (r < 0) lo = mid + 1;
    else hi = mid;
  }
  return NULL;
}

/* ---- the index ------------------------------------------------------------- */

void ckpt_index_free(struct ckpt_index *ix) {
  if (ix == NULL) return;
  free(ix->entries);
  free(ix->files);
  cJSON_Delete(ix->json);
  free(ix);
}

static int cmp_entries(const void *a, const void *b) {
  const struct ckpt_index_entry *x = a, *y = b;
  return cmp_bytes(x->name, x->name_len, y->name, y->name_len);
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The distinct shard file of a path that is known to be among files (sorted). */
static uint32_t file_of(const struct ckpt_index *ix, const char *path) {
  size_t lo = 0, hi = ix->nfiles;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int r = strcmp(ix->files[mid], path);
    if (r == 0) return (uint32_t)mid;
    if (r < 0) lo = mid + 1;
    else hi = mid;
  }
  return UINT32_MAX;
}

/*
 * Why the index's text is not a JSON object, with the position: cJSON says
 * only that it failed, so the strict parser finds where ("at byte 15:
 * unterminated object: the input ends at byte 37" for a truncated file).
 */
static int index_not_json(const char *text, size_t len, const cJSON *root, struct wd_error *err) {
  if (root != NULL) return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: not a JSON object", CKPT_INDEX_NAME);
  size_t bad = 0;
  if (!sj_utf8_valid((const unsigned char *)text, len, &bad))
    return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: not valid JSON: at byte %zu: not UTF-8", CKPT_INDEX_NAME, bad);
  struct sj_doc doc = {0};
  char why[320] = "";
  int rc = sj_parse(text, len, SJ_DEFAULT_MAX_DEPTH, &doc, why, sizeof why);
  sj_doc_free(&doc);
  if (rc == -2) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: not valid JSON%s%s", CKPT_INDEX_NAME, rc != 0 ? ": " : "",
                 rc != 0 ? why : "");
}

int ckpt_index_parse(const char *text, size_t len, struct ckpt_index **out, struct wd_error *err) {
  *out = NULL;
  char qn[160], qv[160];
  struct ckpt_index *ix = calloc(1, sizeof *ix);
  if (ix == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  int rc = 0;
  cJSON *root = cJSON_ParseWithLength(text, len);
  ix->json = root;
  if (root == NULL || !cJSON_IsObject(root)) {
    rc = index_not_json(text, len, root, err);
    goto fail;
  }
  const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
  if (!cJSON_IsObject(map)) {
    rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: 'weight_map' must be an object", CKPT_INDEX_NAME);
    goto fail;
  }
  size_t n = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, map) n++;
  if (n == 0) {
    rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: 'weight_map' is empty", CKPT_INDEX_NAME);
    goto fail;
  }
  ix->entries = calloc(n, sizeof *ix->entries);
  ix->files = calloc(n, sizeof *ix->files);
  if (ix->entries == NULL || ix->files == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  cJSON_ArrayForEach(e, map) {
    const char *name = e->string ? e->string : "";
    if (!cJSON_IsString(e)) {
      rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: weight_map['%s'] must be a file name", CKPT_INDEX_NAME,
                   err_quote(name, strlen(name), qn, sizeof qn));
      goto fail;
    }
    if (!path_rel_is_safe(e->valuestring)) {
      rc = err_set(err, WEIGHTD_E_PATH_DENIED,
                   "%s: weight_map['%s'] = '%s': shard paths must be relative with no '..' component",
                   CKPT_INDEX_NAME, err_quote(name, strlen(name), qn, sizeof qn),
                   err_quote(e->valuestring, strlen(e->valuestring), qv, sizeof qv));
      goto fail;
    }
    ix->entries[ix->nentries] = (struct ckpt_index_entry){name, strlen(name), e->valuestring, 0};
    ix->files[ix->nentries++] = e->valuestring;
  }
  qsort(ix->entries, n, sizeof *ix->entries, cmp_entries);
  for (size_t i = 0; i + 1 < n; i++)
    if (cmp_entries(&ix->entries[i], &ix->entries[i + 1]) == 0) {
      rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: weight_map lists tensor '%s' more than once", CKPT_INDEX_NAME,
                   err_quote(ix->entries[i].name, ix->entries[i].name_len, qn, sizeof qn));
      goto fail;
    }
  qsort(ix->files, n, sizeof *ix->files, cmp_str);
  for (size_t i = 0; i < n; i++)
    if (ix->nfiles == 0 || strcmp(ix->files[ix->nfiles - 1], ix->files[i]) != 0) ix->files[ix->nfiles++] = ix->files[i];
  if (ix->nfiles > UINT32_MAX) {
    rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: more than %u shard files", CKPT_INDEX_NAME, UINT32_MAX);
    goto fail;
  }
  for (size_t i = 0; i < n; i++) ix->entries[i].file = file_of(ix, ix->entries[i].path);
  *out = ix;
  return 0;
fail:
  ckpt_index_free(ix);
  return rc;
}

/* ---- whose access ---------------------------------------------------------- */

/* The client's check of a file or directory (nothing when the open is made for no client in particular). */
static int access_check(const struct ckpt_opts *o, const char *path, unsigned want, const struct stat *st,
                        struct wd_error *err) {
  if (o == NULL || o->access == NULL) return 0;
  return acc_check_path(o->access, path, want, st, err);
}

/* ---- shards ---------------------------------------------------------------- */

static void shard_identity(struct ckpt_shard *s, const struct stat *st) {
  s->dev = st->st_dev;
  s->ino = st->st_ino;
  s->size = (uint64_t)st->st_size;
  s->mtime_ns = mtime_ns(st);
  s->ctime_ns = stamp_ns(&st->st_ctim);
}

/*
 * A shard as messages name it: the checkpoint's path when the checkpoint is
 * that one file, else the shard's name (which ckpt_err_name puts after
 * the checkpoint's path).
 */
static const char *shard_label(const struct ckpt *c, const struct ckpt_shard *s, char *buf, size_t len) {
  const char *name = c->layout == CKPT_FILE ? c->path : s->rel;
  return err_quote(name, strlen(name), buf, len);
}

int ckpt_err_name(struct wd_error *err, const char *path) {
  if (err == NULL) return WEIGHTD_E_INTERNAL;
  char label[320];
  err_quote(path, strlen(path), label, sizeof label);
  size_t n = strlen(label);
  if (strncmp(err->msg, label, n) == 0 && err->msg[n] == ':') return err->code;
  return err_prefix(err, "%s", label);
}

/*
 * Opens one shard confined to the roots (path_open_confined: resolved and
 * checked first, never blocking, never through a swapped symlink), checks
 * that the client may read it, and records its identity.
 */
static int shard_open(struct ckpt *c, struct ckpt_shard *s, const struct path_roots *roots,
                      const struct ckpt_opts *opts, struct wd_error *err) {
  char label[320];
  shard_label(c, s, label, sizeof label);
  s->path = path_join(c->dir, s->rel);
  if (s->path == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  struct path_resolved r;
  int rc = path_open_confined(s->path, roots, label, &s->fd, &r, err);
  if (rc != 0) return opts != NULL && opts->access != NULL ? acc_check_failure(opts->access, s->path, rc, err) : rc;
  s->real = r.real;
  shard_identity(s, &r.st);
  return access_check(opts, s->path, ACC_READ, &r.st, err);
}

/* ---- the name table and the index check ------------------------------------ */

int ckpt_tables_build(struct ckpt *c, const struct ckpt_index *ix, struct wd_error *err) {
  char qn[160], qa[160], qb[160];
  size_t n = 0;
  uint64_t total = 0;
  if (c->nshards > UINT32_MAX) return err_set(err, WEIGHTD_E_BAD_INDEX, "more than %u shards", UINT32_MAX);
  for (size_t i = 0; i < c->nshards; i++) {
    const struct st_header *h = c->shards[i].hdr;
    if (__builtin_add_overflow(n, h->ntensors, &n))
      return err_set(err, WEIGHTD_E_BAD_SIZE, "the shards hold more tensors than can be counted");
    if (__builtin_add_overflow(total, h->data_len, &total))
      return err_set(err, WEIGHTD_E_BAD_SIZE, "the shards hold more than 2^64 - 1 bytes of tensor data");
  }
  if (n > SIZE_MAX / sizeof *c->by_name) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  free(c->by_name);
  c->by_name = malloc((n ? n : 1) * sizeof *c->by_name);
  c->ntensors = 0;
  if (c->by_name == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  size_t k = 0;
  for (size_t i = 0; i < c->nshards; i++) {
    const struct st_header *h = c->shards[i].hdr;
    for (size_t j = 0; j < h->ntensors; j++) c->by_name[k++] = (struct ckpt_ref){&h->tensors[j], (uint32_t)i};
  }
  c->ntensors = n;
  c->total_bytes = total;
  qsort(c->by_name, n, sizeof *c->by_name, cmp_refs);
  for (size_t i = 0; i + 1 < n; i++) {
    const struct ckpt_ref *a = &c->by_name[i], *b = &c->by_name[i + 1];
    if (cmp_name(a->t, b->t->name, b->t->name_len) == 0)
      return err_set(err, WEIGHTD_E_BAD_INDEX, "tensor '%s' appears in two shards: %s and %s",
                     err_quote(a->t->name, a->t->name_len, qn, sizeof qn),
                     err_quote(c->shards[a->shard].rel, strlen(c->shards[a->shard].rel), qa, sizeof qa),
                     err_quote(c->shards[b->shard].rel, strlen(c->shards[b->shard].rel), qb, sizeof qb));
  }
  if (ix == NULL) return 0;
  /* Both lists are sorted by name (entries have no name twice, tensors neither): one merge walk. */
  size_t i = 0, j = 0;
  while (i < ix->nentries || j < n) {
    const struct ckpt_index_entry *e = i < ix->nentries ? &ix->entries[i] : NULL;
    const struct ckpt_ref *r = j < n ? &c->by_name[j] : NULL;
    int order = e == NULL ? 1 : r == NULL ? -1 : -cmp_name(r->t, e->name, e->name_len);
    if (order < 0)
      return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: tensor '%s' is not in its shard %s", CKPT_INDEX_NAME,
                     err_quote(e->name, e->name_len, qn, sizeof qn), err_quote(e->path, strlen(e->path), qa, sizeof qa));
    const char *in = c->shards[r->shard].rel;
    if (order > 0)
      return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: tensor '%s' of shard %s is missing from weight_map",
                     CKPT_INDEX_NAME, err_quote(r->t->name, r->t->name_len, qn, sizeof qn),
                     err_quote(in, strlen(in), qa, sizeof qa));
    if (strcmp(in, e->path) != 0)
      return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: maps tensor '%s' to %s but it is in %s", CKPT_INDEX_NAME,
                     err_quote(e->name, e->name_len, qn, sizeof qn), err_quote(e->path, strlen(e->path), qa, sizeof qa),
                     err_quote(in, strlen(in), qb, sizeof qb));
    i++;
    j++;
  }
  return 0;
}

/* ---- remembered verdicts --------------------------------------------------- */

struct verdict {
  unsigned char key[SHA256_DIGEST_LEN];
  struct wd_error err;
};

struct ckpt_verdicts {
  pthread_mutex_t lock;
  size_t cap, n, next; /* next: the slot the next verdict overwrites once full */
  uint64_t hits;
  struct verdict *v;
};

struct ckpt_verdicts *ckpt_verdicts_create(size_t capacity) {
  struct ckpt_verdicts *v = calloc(1, sizeof *v);
  if (v == NULL || capacity == 0 || (v->v = calloc(capacity, sizeof *v->v)) == NULL) {
    free(v);
    return NULL;
  }
  v->cap = capacity;
  pthread_mutex_init(&v->lock, NULL);
  return v;
}

void ckpt_verdicts_free(struct ckpt_verdicts *v) {
  if (v == NULL) return;
  pthread_mutex_destroy(&v->lock);
  free(v->v);
  free(v);
}

uint64_t ckpt_verdicts_hits(struct ckpt_verdicts *v) {
  if (v == NULL) return 0;
  pthread_mutex_lock(&v->lock);
  uint64_t h = v->hits;
  pthread_mutex_unlock(&v->lock);
  return h;
}

static void key_add_identity(struct sha256 *h, uint64_t dev, uint64_t ino, uint64_t size, int64_t mtime,
                             int64_t ctime) {
  uint64_t w[5] = {dev, ino, size, (uint64_t)mtime, (uint64_t)ctime};
  sha256_update(h, w, sizeof w);
}

/* The identity of an index checkpoint's files: the index, then each shard in order. */
static void verdict_key(const struct stat *index_st, const struct ckpt *c, unsigned char key[SHA256_DIGEST_LEN]) {
  struct sha256 h;
  sha256_init(&h);
  key_add_identity(&h, (uint64_t)index_st->st_dev, (uint64_t)index_st->st_ino, (uint64_t)index_st->st_size,
                   mtime_ns(index_st), stamp_ns(&index_st->st_ctim));
  uint64_t n = c->nshards;
  sha256_update(&h, &n, sizeof n);
  for (size_t i = 0; i < c->nshards; i++) {
    const struct ckpt_shard *s = &c->shards[i];
    key_add_identity(&h, (uint64_t)s->dev, (uint64_t)s->ino, s->size, s->mtime_ns, s->ctime_ns);
  }
  sha256_final(&h, key);
}

/* Copies a remembered verdict for key into err: its code, or 0 when there is none. */
static int verdict_find(struct ckpt_verdicts *v, const unsigned char *key, struct wd_error *err) {
  int rc = 0;
  pthread_mutex_lock(&v->lock);
  for (size_t i = 0; i < v->n && rc == 0; i++)
    if (memcmp(v->v[i].key, key, SHA256_DIGEST_LEN) == 0) {
      rc = v->v[i].err.code;
      if (err != NULL) *err = v->v[i].err;
      v->hits++;
    }
  pthread_mutex_unlock(&v->lock);
  return rc;
}

static void verdict_remember(struct ckpt_verdicts *v, const unsigned char *key, const struct wd_error *err) {
  pthread_mutex_lock(&v->lock);
  size_t slot = v->n < v->cap ? v->n++ : v->next;
  if (slot == v->next) v->next = (v->next + 1) % v->cap;
  memcpy(v->v[slot].key, key, SHA256_DIGEST_LEN);
  v->v[slot].err = *err;
  pthread_mutex_unlock(&v->lock);
}

/* ---- opening --------------------------------------------------------------- */

/*
 * Opens dir/name confined to the roots when it is a regular file the client
 * may read: 1 with *fd and *res, 0 when there is none (missing, or not a
 * regular file), or a failure (outside the roots, changed while opened,
 * unreadable, not the client's to read).
 */
static int open_member(const char *dir, const char *name, const struct path_roots *roots,
                       const struct ckpt_opts *opts, int *fd, struct path_resolved *res, struct wd_error *err) {
  char *p = path_join(dir, name);
  if (p == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  struct wd_error e;
  int rc = path_open_confined(p, roots, name, fd, res, &e);
  /* What the daemon's own resolution met behind a directory the client may not search is that refusal. */
  if (rc != 0 && opts != NULL && opts->access != NULL) rc = acc_check_failure(opts->access, p, rc, &e);
  if (rc == 0 && (rc = access_check(opts, p, ACC_READ, &res->st, &e)) != 0) {
    close(*fd);
    *fd = -1;
    free(res->real);
    res->real = NULL;
    if (err != NULL) *err = e;
    free(p);
    return rc;
  }
  free(p);
  if (rc == 0) return 1;
  if (rc == WEIGHTD_E_NOT_FOUND || rc == WEIGHTD_E_INVALID) return 0;
  if (err != NULL) *err = e;
  return rc;
}

/* Reads the index from its open descriptor and makes one shard per distinct file. */
static int read_index(struct ckpt *c, int fd, struct ckpt_index **out, struct wd_error *err) {
  char *text = NULL;
  size_t len;
  int r = path_read_fd(fd, CKPT_INDEX_MAX_BYTES, &text, &len);
  if (r != 0)
    return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: cannot read: %s", CKPT_INDEX_NAME,
                   r == -EFBIG ? "larger than 256 MiB" : strerror(-r));
  int rc = ckpt_index_parse(text, len, out, err);
  free(text);
  if (rc != 0) return rc;
  const struct ckpt_index *ix = *out;
  c->shards = calloc(ix->nfiles, sizeof *c->shards);
  if (c->shards == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (size_t i = 0; i < ix->nfiles; i++) {
    c->shards[i].fd = -1;
    if ((c->shards[i].rel = strdup(ix->files[i])) == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    c->nshards++;
  }
  return 0;
}

/*
 * Reads dir/name, a small file of the directory beside the shards, when it is
 * there: 1 with *text (malloc'd) and *len and its identity in *id, 0 when
 * there is none, or a failure (too_big: the code for one over max bytes,
 * named as max_text).
 */
static int read_member(const struct ckpt *c, const char *name, size_t max, int too_big, const char *max_text,
                       const struct path_roots *roots, const struct ckpt_opts *opts, struct ckpt_member_id *id,
                       char **text, size_t *len, struct wd_error *err) {
  int fd;
  struct path_resolved res;
  int rc = open_member(c->dir, name, roots, opts, &fd, &res, err);
  if (rc <= 0) return rc;
  free(res.real);
  *id = (struct ckpt_member_id){true, res.st.st_dev, res.st.st_ino};
  int r = path_read_fd(fd, max, text, len);
  close(fd);
  if (r != 0)
    return err_set(err, r == -EFBIG ? too_big : WEIGHTD_E_IO, "%s: cannot read: %s", name,
                   r == -EFBIG ? max_text : strerror(-r));
  return 1;
}

static int read_config(struct ckpt *c, const struct path_roots *roots, const struct ckpt_opts *opts,
                       struct wd_error *err) {
  char *text = NULL;
  size_t len;
  int rc = read_member(c, CKPT_CONFIG_NAME, CKPT_CONFIG_MAX_BYTES, WEIGHTD_E_BAD_CONFIG, "larger than 16 MiB", roots,
                       opts, &c->config_id, &text, &len, err);
  if (rc <= 0) return rc;
  rc = mcfg_parse(text, len, CKPT_CONFIG_NAME, &c->config, err);
  free(text);
  return rc;
}

/* The manifest beside the index, when there is one (manifest.h): read and checked against c's headers. */
static int read_manifest(struct ckpt *c, const struct path_roots *roots, const struct ckpt_opts *opts,
                         struct wd_error *err) {
  char *text = NULL;
  size_t len;
  int rc = read_member(c, MF_FILE_NAME, MF_MAX_BYTES, WEIGHTD_E_BAD_CHECKSUM, "larger than 256 MiB", roots, opts,
                       &c->manifest_id, &text, &len, err);
  if (rc <= 0) return rc;
  rc = mf_parse(text, len, c, MF_FILE_NAME, &c->manifest, err);
  free(text);
  return rc;
}

/* Lays out a directory: model.safetensors, else the index and its shards. */
static int open_directory(struct ckpt *c, const struct path_roots *roots, const struct ckpt_opts *opts,
                          struct ckpt_index **ix, struct stat *index_st, struct wd_error *err) {
  int fd;
  struct path_resolved res;
  /* The client may look names up in the directory before any is looked up for it. */
  int rc = access_check(opts, c->dir, ACC_EXEC, NULL, err);
  if (rc != 0) return rc;
  rc = open_member(c->dir, CKPT_SINGLE_NAME, roots, opts, &fd, &res, err);
  if (rc < 0) return rc;
  if (rc == 1) {
    c->layout = CKPT_SINGLE;
    if ((c->shards = calloc(1, sizeof *c->shards)) == NULL) {
      close(fd);
      free(res.real);
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    }
    struct ckpt_shard *s = &c->shards[0];
    c->nshards = 1;
    s->fd = fd; /* ckpt_free closes and frees what the shard holds from here on */
    s->real = res.real;
    shard_identity(s, &res.st);
    if ((s->rel = strdup(CKPT_SINGLE_NAME)) == NULL || (s->path = path_join(c->dir, CKPT_SINGLE_NAME)) == NULL)
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    return 0;
  }
  rc = open_member(c->dir, CKPT_INDEX_NAME, roots, opts, &fd, &res, err);
  if (rc < 0) return rc;
  if (rc == 0)
    return err_set(err, WEIGHTD_E_NOT_FOUND, "%s: no %s or %s in the directory", c->path, CKPT_SINGLE_NAME,
                   CKPT_INDEX_NAME);
  c->layout = CKPT_INDEX;
  free(res.real);
  *index_st = res.st;
  c->index_id = (struct ckpt_member_id){true, res.st.st_dev, res.st.st_ino};
  rc = read_index(c, fd, ix, err);
  close(fd);
  return rc;
}

int ckpt_open(const char *path, const struct ckpt_opts *opts, struct ckpt **out,
              struct wd_error *err) {
  *out = NULL;
  const struct path_roots roots = {opts ? opts->model_roots : NULL, opts ? opts->nroots : 0};
  struct ckpt_verdicts *verdicts = opts ? opts->verdicts : NULL;
  struct ckpt_index *ix = NULL;
  struct stat index_st = {0};
  struct path_resolved top = {0};
  char label[320];
  err_quote(path, strlen(path), label, sizeof label);
  int rc = 0;
  struct ckpt *c = calloc(1, sizeof *c);
  if (c == NULL || (c->path = strdup(path)) == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  if ((rc = path_resolve(path, &roots, label, &top, err)) != 0) goto fail;
  if (S_ISREG(top.st.st_mode)) {
    /* The file keeps the name it was given (a Hugging Face cache link, say); its
     * directory is resolved, and the shard is opened confined like any other. */
    c->layout = CKPT_FILE;
    char *given_dir = path_dirname(path);
    struct path_resolved d = {0};
    if (given_dir == NULL) rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    else rc = path_resolve(given_dir, NULL, label, &d, err);
    free(given_dir);
    if (rc != 0) goto fail;
    c->dir = d.real;
    const char *base = strrchr(path, '/');
    c->shards = calloc(1, sizeof *c->shards);
    if (c->shards == NULL || (c->shards[0].rel = strdup(base ? base + 1 : path)) == NULL) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
    c->shards[0].fd = -1;
    c->nshards = 1;
  } else if (S_ISDIR(top.st.st_mode)) {
    c->dir = top.real;
    top.real = NULL;
    if ((rc = open_directory(c, &roots, opts, &ix, &index_st, err)) != 0) goto fail;
  } else {
    rc = err_set(err, WEIGHTD_E_INVALID, "%s: neither a file nor a directory", label);
    goto fail;
  }
  for (size_t i = 0; i < c->nshards; i++)
    if (c->shards[i].fd < 0 && (rc = shard_open(c, &c->shards[i], &roots, opts, err)) != 0) goto fail;
  unsigned char key[SHA256_DIGEST_LEN] = {0};
  if (ix != NULL && verdicts != NULL) {
    verdict_key(&index_st, c, key);
    if ((rc = verdict_find(verdicts, key, err)) != 0) {
      if (opts->remembered != NULL) *opts->remembered = true;
      goto fail;
    }
  }
  for (size_t i = 0; i < c->nshards; i++) {
    char sl[320];
    shard_label(c, &c->shards[i], sl, sizeof sl);
    if ((rc = st_header_read_fd(c->shards[i].fd, sl, &c->shards[i].hdr, err)) != 0) goto fail;
  }
  if ((rc = ckpt_tables_build(c, ix, err)) != 0) {
    if (ix != NULL && verdicts != NULL && (rc == WEIGHTD_E_BAD_INDEX || rc == WEIGHTD_E_BAD_SIZE))
      verdict_remember(verdicts, key, err);
    goto fail;
  }
  if (c->layout != CKPT_FILE && (rc = read_config(c, &roots, opts, err)) != 0) goto fail;
  if (ckpt_layout_id(c, c->layout_id) != 0) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  if (c->layout != CKPT_FILE && opts != NULL && opts->manifest && (rc = read_manifest(c, &roots, opts, err)) != 0)
    goto fail;
  ckpt_index_free(ix);
  free(top.real);
  *out = c;
  return 0;
fail:
  ckpt_err_name(err, path);
  ckpt_index_free(ix);
  free(top.real);
  ckpt_free(c);
  return rc;
}

/* ---- checkpoints read through a fetcher (remote objects) -------------------------------------- */

struct fetched_reader {
  const struct ckpt_fetch *f;
  uint32_t shard;
};

static int fetched_read(void *arg, uint64_t off, void *buf, size_t len, struct wd_error *err) {
  const struct fetched_reader *r = arg;
  return r->f->read(r->f->arg, r->shard, off, buf, len, err);
}

/* A small file through the fetcher: 1 with *text, 0 when there is none, or a failure (too_big for one past max). */
static int fetched_small(const struct ckpt_fetch *f, const char *name, size_t max, int too_big, char **text,
                         size_t *len, struct wd_error *err) {
  int rc = f->small(f->arg, name, max, text, len, err);
  if (rc == WEIGHTD_E_LIMIT) return err_set(err, too_big, "%s: larger than %zu MiB", name, max >> 20);
  return rc;
}

int ckpt_open_fetched(const char *name, enum ckpt_layout layout, const char *file_name, const struct ckpt_fetch *f,
                      bool manifest, struct ckpt **out, struct wd_error *err) {
  *out = NULL;
  struct ckpt_index *ix = NULL;
  char *text = NULL;
  size_t len = 0;
  int rc = 0;
  struct ckpt *c = calloc(1, sizeof *c);
  if (c == NULL || (c->path = strdup(name)) == NULL || (c->dir = strdup(name)) == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  c->layout = layout;
  if (layout == CKPT_INDEX) {
    if ((rc = fetched_small(f, CKPT_INDEX_NAME, CKPT_INDEX_MAX_BYTES, WEIGHTD_E_BAD_INDEX, &text, &len, err)) <= 0) {
      if (rc == 0) rc = err_set(err, WEIGHTD_E_NOT_FOUND, "no %s", CKPT_INDEX_NAME);
      goto fail;
    }
    rc = ckpt_index_parse(text, len, &ix, err);
    free(text);
    text = NULL;
    if (rc != 0) goto fail;
    if ((c->shards = calloc(ix->nfiles, sizeof *c->shards)) == NULL) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
    for (size_t i = 0; i < ix->nfiles; i++, c->nshards++) {
      c->shards[i].fd = -1;
      if ((c->shards[i].rel = strdup(ix->files[i])) == NULL) {
        rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
        goto fail;
      }
    }
  } else {
    if ((c->shards = calloc(1, sizeof *c->shards)) == NULL ||
        (c->shards[0].rel = strdup(layout == CKPT_SINGLE ? CKPT_SINGLE_NAME : file_name)) == NULL) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
    c->shards[0].fd = -1;
    c->nshards = 1;
  }
  for (size_t i = 0; i < c->nshards; i++) {
    struct ckpt_shard *s = &c->shards[i];
    char sl[320];
    if ((s->path = path_join(name, s->rel)) == NULL) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
    shard_label(c, s, sl, sizeof sl);
    if ((rc = f->size(f->arg, (uint32_t)i, s->rel, &s->size, err)) != 0) goto fail;
    struct fetched_reader fr = {f, (uint32_t)i};
    struct st_reader rd = {fetched_read, &fr};
    if ((rc = st_header_read(&rd, s->size, sl, &s->hdr, err)) != 0) goto fail;
  }
  if ((rc = ckpt_tables_build(c, ix, err)) != 0) goto fail;
  if (layout != CKPT_FILE) {
    rc = fetched_small(f, CKPT_CONFIG_NAME, CKPT_CONFIG_MAX_BYTES, WEIGHTD_E_BAD_CONFIG, &text, &len, err);
    if (rc < 0) goto fail;
    if (rc == 1 && (rc = mcfg_parse(text, len, CKPT_CONFIG_NAME, &c->config, err)) != 0) goto fail;
    free(text);
    text = NULL;
  }
  if (ckpt_layout_id(c, c->layout_id) != 0) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  if (layout != CKPT_FILE && manifest) {
    rc = fetched_small(f, MF_FILE_NAME, MF_MAX_BYTES, WEIGHTD_E_BAD_CHECKSUM, &text, &len, err);
    if (rc < 0) goto fail;
    if (rc == 1 && (rc = mf_parse(text, len, c, MF_FILE_NAME, &c->manifest, err)) != 0) goto fail;
  }
  free(text);
  ckpt_index_free(ix);
  *out = c;
  return 0;
fail:
  free(text);
  ckpt_err_name(err, name);
  ckpt_index_free(ix);
  ckpt_free(c);
  return rc;
}

int ckpt_check_unchanged(const struct ckpt *c, struct wd_error *err) {
  char sl[320];
  for (size_t i = 0; i < c->nshards; i++) {
    const struct ckpt_shard *s = &c->shards[i];
    struct stat sb;
    shard_label(c, s, sl, sizeof sl);
    if (stat(s->path, &sb) != 0)
      err_set(err, WEIGHTD_E_STALE, "%s: shard is gone since it was opened: %s", sl, strerror(errno));
    else if (sb.st_dev != s->dev || sb.st_ino != s->ino)
      err_set(err, WEIGHTD_E_STALE, "%s: shard was replaced since it was opened", sl);
    else if ((uint64_t)sb.st_size != s->size || mtime_ns(&sb) != s->mtime_ns)
      err_set(err, WEIGHTD_E_STALE, "%s: shard was rewritten since it was opened", sl);
    else
      continue;
    return err != NULL ? ckpt_err_name(err, c->path) : WEIGHTD_E_STALE;
  }
  return 0;
}

/*
 * A file of the directory the open read (the index, config.json, the manifest): readable
 * by k's caller now and, with same_files, still the file read (id).
 */
static int member_access(const struct ckpt *c, const char *name, const struct ckpt_member_id *id,
                         struct acc_check *k, bool same_files, struct wd_error *err) {
  char *p = path_join(c->dir, name);
  if (p == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  struct stat was = {.st_dev = id->dev, .st_ino = id->ino};
  int rc = acc_check_path(k, p, ACC_READ, same_files ? &was : NULL, err);
  free(p);
  if (rc == WEIGHTD_E_NOT_FOUND && same_files)
    rc = err_set(err, WEIGHTD_E_STALE, "%s: %s is gone since it was opened", k->label, name);
  return rc;
}

int ckpt_access_check(const struct ckpt *c, struct acc_check *k, bool same_files, struct wd_error *err) {
  int rc = c->layout == CKPT_FILE ? 0 : acc_check_path(k, c->dir, ACC_EXEC, NULL, err);
  if (rc == 0 && c->layout == CKPT_INDEX) rc = member_access(c, CKPT_INDEX_NAME, &c->index_id, k, same_files, err);
  for (size_t i = 0; rc == 0 && i < c->nshards; i++) {
    const struct ckpt_shard *s = &c->shards[i];
    struct stat was = {.st_dev = s->dev, .st_ino = s->ino};
    rc = acc_check_path(k, s->path, ACC_READ, same_files ? &was : NULL, err);
    char q[160];
    if (rc == WEIGHTD_E_NOT_FOUND && same_files)
      rc = err_set(err, WEIGHTD_E_STALE, "%s: shard %s is gone since it was opened", k->label,
                   err_quote(s->rel, strlen(s->rel), q, sizeof q));
  }
  if (rc == 0 && c->config != NULL) rc = member_access(c, CKPT_CONFIG_NAME, &c->config_id, k, same_files, err);
  if (rc == 0 && c->manifest != NULL) rc = member_access(c, MF_FILE_NAME, &c->manifest_id, k, same_files, err);
  return rc;
}
