/* checkpoint.c - checkpoint directories: index, shards, config (see checkpoint.h). */
#include "checkpoint.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pathutil.h"

#define CKPT_INDEX_NAME "model.safetensors.index.json"
#define CKPT_SINGLE_NAME "model.safetensors"
#define CKPT_CONFIG_NAME "config.json"
/* The largest published indexes are a few MiB; refuse absurd ones. */
#define CKPT_INDEX_MAX_BYTES (256u << 20)

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
  free(c);
}

static int64_t mtime_ns(const struct stat *sb) {
  return (int64_t)sb->st_mtim.tv_sec * 1000000000 + sb->st_mtim.tv_nsec;
}

/* ---- shards ---------------------------------------------------------------- */

/*
 * Opens one shard, checks where it really lives (through /proc/self/fd, so
 * that a symlink swapped after the check cannot redirect us), and validates
 * its header.
 */
static int shard_open(struct ckpt *c, struct ckpt_shard *s, const struct ckpt_opts *opts,
                      struct wd_error *err) {
  s->path = path_join(c->dir, s->rel);
  if (s->path == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  s->fd = open(s->path, O_RDONLY | O_CLOEXEC);
  if (s->fd < 0)
    return err_set(err, errno == ENOENT ? WEIGHTD_E_NOT_FOUND : WEIGHTD_E_IO,
                   "%s: shard cannot be opened: %s", s->rel, strerror(errno));
  char link[64], real[PATH_MAX];
  snprintf(link, sizeof link, "/proc/self/fd/%d", s->fd);
  ssize_t n = readlink(link, real, sizeof real - 1);
  if (n < 0) return err_set(err, WEIGHTD_E_IO, "%s: cannot resolve: %s", s->rel, strerror(errno));
  real[n] = '\0';
  if ((s->real = strdup(real)) == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  if (opts != NULL && opts->nroots > 0 && !path_under_roots(real, opts->model_roots, opts->nroots))
    return err_set(err, WEIGHTD_E_PATH_DENIED, "%s: resolves to %s, outside the model roots",
                   s->rel, real);
  struct stat sb;
  if (fstat(s->fd, &sb) != 0) return err_set(err, WEIGHTD_E_IO, "%s: %s", s->rel, strerror(errno));
  if (!S_ISREG(sb.st_mode)) return err_set(err, WEIGHTD_E_INVALID, "%s: not a regular file", s->rel);
  s->dev = sb.st_dev;
  s->ino = sb.st_ino;
  s->size = (uint64_t)sb.st_size;
  s->mtime_ns = mtime_ns(&sb);
  return st_header_read_fd(s->fd, s->rel, &s->hdr, err);
}

/* Names compare by all their bytes: JSON lets a name hold U+0000. */
static int cmp_name(const struct st_tensor *x, const char *name, size_t len) {
  size_t n = x->name_len < len ? x->name_len : len;
  int c = memcmp(x->name, name, n);
  if (c != 0) return c;
  return x->name_len < len ? -1 : x->name_len > len;
}

static int cmp_refs(const void *a, const void *b) {
  const struct ckpt_ref *x = a, *y = b;
  int c = cmp_name(x->t, y->t->name, y->t->name_len);
  if (c != 0) return c;
  return x->shard < y->shard ? -1 : x->shard > y->shard;
}

/* Builds the name index over all shards; a name in two shards is an error. */
static int build_name_index(struct ckpt *c, struct wd_error *err) {
  size_t n = 0;
  for (size_t i = 0; i < c->nshards; i++) n += c->shards[i].hdr->ntensors;
  c->by_name = malloc((n ? n : 1) * sizeof *c->by_name);
  if (c->by_name == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  size_t k = 0;
  c->total_bytes = 0;
  for (size_t i = 0; i < c->nshards; i++) {
    const struct st_header *h = c->shards[i].hdr;
    for (size_t j = 0; j < h->ntensors; j++) c->by_name[k++] = (struct ckpt_ref){&h->tensors[j], (uint32_t)i};
    c->total_bytes += h->data_len;
  }
  c->ntensors = n;
  qsort(c->by_name, n, sizeof *c->by_name, cmp_refs);
  for (size_t i = 0; i + 1 < n; i++)
    if (cmp_name(c->by_name[i].t, c->by_name[i + 1].t->name, c->by_name[i + 1].t->name_len) == 0)
      return err_set(err, WEIGHTD_E_BAD_INDEX, "tensor '%s' appears in two shards: %s and %s",
                     c->by_name[i].t->name, c->shards[c->by_name[i].shard].rel,
                     c->shards[c->by_name[i + 1].shard].rel);
  return 0;
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

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Reads weight_map, checks its paths as text and creates one shard per distinct file. */
static int read_index(struct ckpt *c, const char *index_path, cJSON **map_out, struct wd_error *err) {
  char *text = NULL;
  size_t len;
  int r = path_read_file(index_path, CKPT_INDEX_MAX_BYTES, &text, &len);
  if (r != 0)
    return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: cannot read: %s", CKPT_INDEX_NAME, strerror(-r));
  cJSON *root = cJSON_ParseWithLength(text, len);
  free(text);
  int rc = 0;
  char **files = NULL;
  if (root == NULL || !cJSON_IsObject(root)) {
    rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: not a JSON object", CKPT_INDEX_NAME);
    goto fail;
  }
  cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
  if (!cJSON_IsObject(map)) {
    rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: 'weight_map' must be an object", CKPT_INDEX_NAME);
    goto fail;
  }
  size_t n = (size_t)cJSON_GetArraySize(map), nf = 0;
  if (n == 0) {
    rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: 'weight_map' is empty", CKPT_INDEX_NAME);
    goto fail;
  }
  files = malloc(n * sizeof *files);
  if (files == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  const cJSON *e;
  cJSON_ArrayForEach(e, map) {
    if (!cJSON_IsString(e)) {
      rc = err_set(err, WEIGHTD_E_BAD_INDEX, "%s: weight_map['%s'] must be a file name",
                   CKPT_INDEX_NAME, e->string);
      goto fail;
    }
    if (!path_rel_is_safe(e->valuestring)) {
      rc = err_set(err, WEIGHTD_E_PATH_DENIED,
                   "%s: weight_map['%s'] = '%s': shard paths must be relative with no '..' "
                   "component",
                   CKPT_INDEX_NAME, e->string, e->valuestring);
      goto fail;
    }
    files[nf++] = e->valuestring;
  }
  qsort(files, nf, sizeof *files, cmp_str);
  size_t distinct = 0;
  for (size_t i = 0; i < nf; i++)
    if (distinct == 0 || strcmp(files[distinct - 1], files[i]) != 0) files[distinct++] = files[i];
  c->shards = calloc(distinct, sizeof *c->shards);
  if (c->shards == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  for (size_t i = 0; i < distinct; i++) {
    c->shards[i].fd = -1;
    if ((c->shards[i].rel = strdup(files[i])) == NULL) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
    c->nshards++;
  }
  free(files);
  *map_out = root;
  return 0;
fail:
  free(files);
  cJSON_Delete(root);
  return rc;
}

/* Every index entry names the shard its tensor is in, and every tensor is indexed. */
static int check_index(const struct ckpt *c, const cJSON *root, struct wd_error *err) {
  const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
  size_t entries = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, map) {
    entries++;
    const struct ckpt_ref *r = ckpt_tensor_find(c, e->string);
    if (r == NULL)
      return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: tensor '%s' is not in its shard %s",
                     CKPT_INDEX_NAME, e->string, e->valuestring);
    if (strcmp(c->shards[r->shard].rel, e->valuestring) != 0)
      return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: maps tensor '%s' to %s but it is in %s",
                     CKPT_INDEX_NAME, e->string, e->valuestring, c->shards[r->shard].rel);
  }
  if (entries == c->ntensors) return 0;
  /* More tensors than entries: a repeated entry, or a tensor the index leaves out. */
  for (size_t i = 0; i < c->ntensors; i++)
    if (cJSON_GetObjectItemCaseSensitive(map, c->by_name[i].t->name) == NULL)
      return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: tensor '%s' of shard %s is missing from weight_map",
                     CKPT_INDEX_NAME, c->by_name[i].t->name, c->shards[c->by_name[i].shard].rel);
  return err_set(err, WEIGHTD_E_BAD_INDEX, "%s: weight_map lists a tensor more than once",
                 CKPT_INDEX_NAME);
}

/* ---- opening --------------------------------------------------------------- */

static int exists_regular(const char *dir, const char *name) {
  char *p = path_join(dir, name);
  struct stat sb;
  int ok = p != NULL && stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
  free(p);
  return ok;
}

int ckpt_open(const char *path, const struct ckpt_opts *opts, struct ckpt **out,
              struct wd_error *err) {
  *out = NULL;
  int rc = 0;
  cJSON *index = NULL;
  char *resolved = NULL;
  struct ckpt *c = calloc(1, sizeof *c);
  if (c == NULL || (c->path = strdup(path)) == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  struct stat sb;
  if (stat(path, &sb) != 0) {
    rc = err_set(err, errno == ENOENT ? WEIGHTD_E_NOT_FOUND : WEIGHTD_E_IO, "%s: %s", path,
                 strerror(errno));
    goto fail;
  }
  resolved = realpath(path, NULL);
  if (resolved == NULL) {
    rc = err_set(err, WEIGHTD_E_IO, "%s: cannot resolve: %s", path, strerror(errno));
    goto fail;
  }
  if (opts != NULL && opts->nroots > 0 && !path_under_roots(resolved, opts->model_roots, opts->nroots)) {
    rc = err_set(err, WEIGHTD_E_PATH_DENIED, "%s: resolves to %s, outside the model roots", path,
                 resolved);
    goto fail;
  }
  if (S_ISREG(sb.st_mode)) {
    /* The file keeps the name it was given (a Hugging Face cache link, say); its
     * directory is resolved, and shard_open resolves the file itself. */
    c->layout = CKPT_FILE;
    char *given_dir = path_dirname(path);
    c->dir = given_dir ? realpath(given_dir, NULL) : NULL;
    free(given_dir);
    free(resolved);
    resolved = NULL;
    c->shards = calloc(1, sizeof *c->shards);
    if (c->dir == NULL || c->shards == NULL) {
      rc = err_set(err, c->shards ? WEIGHTD_E_IO : WEIGHTD_E_NOMEM, "%s: cannot resolve its directory", path);
      goto fail;
    }
    const char *base = strrchr(path, '/');
    c->shards[0].fd = -1;
    c->shards[0].rel = strdup(base ? base + 1 : path);
    c->nshards = 1;
    if (c->shards[0].rel == NULL) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
  } else if (S_ISDIR(sb.st_mode)) {
    c->dir = resolved;
    resolved = NULL;
    if (exists_regular(c->dir, CKPT_SINGLE_NAME)) {
      c->layout = CKPT_SINGLE;
      c->shards = calloc(1, sizeof *c->shards);
      if (c->shards == NULL || (c->shards[0].rel = strdup(CKPT_SINGLE_NAME)) == NULL) {
        rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
        goto fail;
      }
      c->shards[0].fd = -1;
      c->nshards = 1;
    } else if (exists_regular(c->dir, CKPT_INDEX_NAME)) {
      c->layout = CKPT_INDEX;
      char *ip = path_join(c->dir, CKPT_INDEX_NAME);
      if (ip == NULL) {
        rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
        goto fail;
      }
      rc = read_index(c, ip, &index, err);
      free(ip);
      if (rc != 0) goto fail;
    } else {
      rc = err_set(err, WEIGHTD_E_NOT_FOUND, "%s: no %s or %s in the directory", path,
                   CKPT_SINGLE_NAME, CKPT_INDEX_NAME);
      goto fail;
    }
  } else {
    rc = err_set(err, WEIGHTD_E_INVALID, "%s: neither a file nor a directory", path);
    goto fail;
  }
  for (size_t i = 0; i < c->nshards; i++)
    if ((rc = shard_open(c, &c->shards[i], opts, err)) != 0) goto fail;
  if ((rc = build_name_index(c, err)) != 0) goto fail;
  if (index != NULL && (rc = check_index(c, index, err)) != 0) goto fail;
  if (c->layout != CKPT_FILE && exists_regular(c->dir, CKPT_CONFIG_NAME)) {
    char *cp = path_join(c->dir, CKPT_CONFIG_NAME);
    if (cp == NULL) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
    rc = mcfg_load(cp, CKPT_CONFIG_NAME, &c->config, err);
    free(cp);
    if (rc != 0) goto fail;
  }
  cJSON_Delete(index);
  *out = c;
  return 0;
fail:
  cJSON_Delete(index);
  free(resolved);
  ckpt_free(c);
  return rc;
}

int ckpt_check_unchanged(const struct ckpt *c, struct wd_error *err) {
  for (size_t i = 0; i < c->nshards; i++) {
    const struct ckpt_shard *s = &c->shards[i];
    struct stat sb;
    if (stat(s->path, &sb) != 0)
      return err_set(err, WEIGHTD_E_STALE, "%s: shard is gone since it was opened: %s", s->rel,
                     strerror(errno));
    if (sb.st_dev != s->dev || sb.st_ino != s->ino)
      return err_set(err, WEIGHTD_E_STALE, "%s: shard was replaced since it was opened", s->rel);
    if ((uint64_t)sb.st_size != s->size || mtime_ns(&sb) != s->mtime_ns)
      return err_set(err, WEIGHTD_E_STALE, "%s: shard was rewritten since it was opened", s->rel);
  }
  return 0;
}
