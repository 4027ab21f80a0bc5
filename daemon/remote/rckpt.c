/*
 * rckpt.c - remote checkpoints: a URL's objects located and signed, the
 * checkpoint read through ckpt_open_fetched (see rckpt.h).
 */
#include "remote/rckpt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "remote/sigv4.h"

#define RCK_PATH_MAX (3 * RURL_KEY_MAX + 80) /* an encoded key, with its bucket */

/* ---- where an object is ------------------------------------------------------------------- */

static void endpoint_of_host(const char *host, int port, bool tls, struct rf_endpoint *ep) {
  size_t n = strlen(host);
  if (n >= 2 && host[0] == '[' && host[n - 1] == ']') /* IPv6: the engine wants it bare */
    snprintf(ep->host, sizeof ep->host, "%.*s", (int)(n - 2), host + 1);
  else
    snprintf(ep->host, sizeof ep->host, "%s", host);
  ep->port = port;
  ep->tls = tls;
}

int rck_s3_endpoint_from_env(const char *region, struct rf_endpoint *ep, bool *path_style, struct wd_error *err) {
  const char *names[] = {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"};
  for (size_t i = 0; i < 2; i++) {
    const char *v = getenv(names[i]);
    if (v == NULL || v[0] == '\0') continue;
    struct rurl u;
    int rc = rurl_parse(v, &u, err);
    if (rc == 0 && (u.scheme == RURL_S3 || u.key[0] != '\0'))
      rc = err_set(err, WEIGHTD_E_INVALID, "%s: an http(s) URL of the endpoint, without a path", names[i]);
    if (rc == 0) {
      endpoint_of_host(u.host, u.port, u.scheme == RURL_HTTPS, ep);
      *path_style = true;
    } else {
      err_prefix(err, "%s", names[i]);
    }
    rurl_free(&u);
    return rc;
  }
  char host[RF_HOST_MAX];
  snprintf(host, sizeof host, "s3.%s.amazonaws.com", region != NULL && region[0] ? region : "us-east-1");
  endpoint_of_host(host, 443, true, ep);
  *path_style = false;
  return 0;
}

/* The location of the object with key `key` under r's URL (path into buf, which outlives loc). */
static int locate(const struct rck *r, const struct rurl *u, struct rf_location *loc, char *buf, size_t len,
                  char *name, size_t namelen, struct wd_error *err) {
  char enc[RCK_PATH_MAX];
  if (sigv4_uri_encode(u->key, true, enc, sizeof enc) >= sizeof enc)
    return err_set(err, WEIGHTD_E_INVALID, "%s: the key is too long", r->name);
  memset(loc, 0, sizeof *loc);
  if (u->scheme == RURL_S3) {
    loc->ep = r->t->s3_endpoint;
    if (r->t->s3_path_style) {
      snprintf(buf, len, "/%s/%s", u->bucket, enc);
    } else {
      char host[RF_HOST_MAX];
      snprintf(host, sizeof host, "%s.%s", u->bucket, r->t->s3_endpoint.host);
      snprintf(loc->ep.host, sizeof loc->ep.host, "%s", host);
      snprintf(buf, len, "/%s", enc);
    }
  } else {
    endpoint_of_host(u->host, u->port, u->scheme == RURL_HTTPS, &loc->ep);
    snprintf(buf, len, "/%s", enc);
  }
  char *text = rurl_format(u);
  snprintf(name, namelen, "%s", text != NULL ? text : "?");
  free(text);
  loc->path = buf;
  loc->name = name;
  return 0;
}

/* ---- SigV4 for s3:// URLs ---------------------------------------------------------------- */

static int s3_headers(void *arg, const char *method, const struct rf_endpoint *ep, const char *path, const char *query,
                      char ***lines, size_t *n, struct wd_error *err) {
  const struct rck *r = arg;
  char host[RF_HOST_MAX + 16];
  bool def = (ep->tls && ep->port == 443) || (!ep->tls && ep->port == 80);
  bool v6 = strchr(ep->host, ':') != NULL;
  if (def) snprintf(host, sizeof host, v6 ? "[%s]" : "%s", ep->host);
  else snprintf(host, sizeof host, v6 ? "[%s]:%d" : "%s:%d", ep->host, ep->port);
  struct s3_creds c;
  int rc = creds_get(r->t->creds, &c, err);
  if (rc != 0) return rc;
  const char *region = r->t->s3_region != NULL ? r->t->s3_region : creds_region(r->t->creds);
  struct sigv4_req q = {.method = method, .host = host, .path = path, .query = query ? query : "",
                        .payload_sha256 = SIGV4_UNSIGNED_PAYLOAD, .region = region ? region : "us-east-1",
                        .service = "s3", .now = time(NULL)};
  rc = sigv4_headers(&q, &c, lines, n, err);
  creds_clear(&c);
  return rc;
}

/* ---- a bearer token for http(s) URLs ------------------------------------------------------ */

static int bearer_headers(void *arg, const char *method, const struct rf_endpoint *ep, const char *path,
                          const char *query, char ***lines, size_t *n, struct wd_error *err) {
  (void)method, (void)ep, (void)path, (void)query;
  const struct rck *r = arg;
  static const char prefix[] = "Authorization: Bearer ";
  size_t len = sizeof prefix + strlen(r->bearer);
  char **v = malloc(sizeof *v);
  char *line = v != NULL ? malloc(len) : NULL;
  if (line == NULL) {
    free(v);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  snprintf(line, len, "%s%s", prefix, r->bearer);
  v[0] = line;
  *lines = v;
  *n = 1;
  return 0;
}

/* The caller's redirect policy (none: no redirect is followed). */
static bool redirect_ok(void *arg, const struct rf_endpoint *to, const char *path) {
  const struct rck *r = arg;
  return r->t->allow_redirect != NULL && r->t->allow_redirect(r->t->allow_arg, to, path);
}

/* ---- the fetcher ---------------------------------------------------------------------------- */

/* The object rel under r's directory: stat it into *o. */
static int stat_member(struct rck *r, const char *rel, struct rf_object *o, struct wd_error *err) {
  struct rurl u = {0};
  int rc = rurl_join(&r->url, rel, &u, err);
  char path[RCK_PATH_MAX], name[RURL_TEXT_MAX + 8];
  struct rf_location loc;
  if (rc == 0) rc = locate(r, &u, &loc, path, sizeof path, name, sizeof name, err);
  if (rc == 0) rc = rf_stat(r->t->client, &r->auth, &loc, r->t->cancel, o, err);
  rurl_free(&u);
  return rc;
}

static int fetch_small(void *arg, const char *fname, size_t max, char **text, size_t *len, struct wd_error *err) {
  struct rck *r = arg;
  struct rf_object o = {0};
  int rc = stat_member(r, fname, &o, err);
  /* AWS answers a missing key 403, not 404, to a caller without s3:ListBucket: an optional file refused so is absent. */
  bool optional = strcmp(fname, "model.safetensors.index.json") != 0;
  if (rc == WEIGHTD_E_NOT_FOUND || (optional && rc == WEIGHTD_E_PERMISSION)) {
    memset(err, 0, sizeof *err);
    rf_object_clear(&o);
    return 0;
  }
  if (rc == 0 && o.size > max) rc = WEIGHTD_E_LIMIT;
  char *buf = rc == 0 ? malloc(o.size + 1) : NULL;
  if (rc == 0 && buf == NULL) rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  size_t n = (size_t)o.size;
  if (rc == 0 && n > 0) rc = rf_read(r->t->client, &r->auth, &o, 0, n, buf, r->t->cancel, err);
  rf_object_clear(&o);
  if (rc != 0) {
    free(buf);
    return rc;
  }
  buf[n] = '\0';
  *text = buf;
  *len = n;
  return 1;
}

static int fetch_size(void *arg, uint32_t shard, const char *rel, uint64_t *size, struct wd_error *err) {
  struct rck *r = arg;
  if (shard >= r->nobjs) { /* shards come in order: one more object */
    struct rf_object *o = realloc(r->objs, (shard + 1) * sizeof *o);
    if (o == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    memset(o + r->nobjs, 0, (shard + 1 - r->nobjs) * sizeof *o);
    r->objs = o;
    r->nobjs = shard + 1;
  }
  int rc = stat_member(r, rel, &r->objs[shard], err);
  const struct rf_object *o = &r->objs[shard];
  if (rc == 0 && o->etag[0] == '\0' && o->last_modified[0] == '\0')
    rc = err_set(err, WEIGHTD_E_UNSUPPORTED,
                 "%s: %s: the server gives no ETag or Last-Modified for it, so a change during a load could not be "
                 "told from the object opened", r->name, rel);
  if (rc == 0) *size = o->size;
  return rc;
}

static int fetch_read(void *arg, uint32_t shard, uint64_t off, void *buf, size_t len, struct wd_error *err) {
  return rck_read(arg, shard, off, len, buf, NULL, err);
}

/* ---- the checkpoint ---------------------------------------------------------------------- */

void rck_close(struct rck *r) {
  if (r == NULL) return;
  for (size_t i = 0; i < r->nobjs; i++) rf_object_clear(&r->objs[i]);
  free(r->objs);
  ckpt_free(r->ck);
  rurl_free(&r->url);
  free(r->name);
  free(r);
}

int rck_open(const struct rck_target *t, const char *url_text, struct rck **out, struct wd_error *err) {
  *out = NULL;
  struct rck *r = calloc(1, sizeof *r);
  if (r == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  r->t = t;
  int rc = rurl_parse(url_text, &r->url, err);
  if (rc != 0) goto fail;
  if ((r->name = rurl_format(&r->url)) == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto fail;
  }
  r->auth.allow_redirect = redirect_ok;
  r->auth.arg = r;
  if (r->url.scheme == RURL_S3 && t->creds != NULL) r->auth.headers = s3_headers;
  if (r->url.scheme != RURL_S3 && t->bearer_for != NULL && (r->bearer = t->bearer_for(t->allow_arg, &r->url)) != NULL)
    r->auth.headers = bearer_headers;

  enum ckpt_layout layout = CKPT_INDEX;
  char *file = NULL;
  size_t kl = strlen(r->url.key);
  if (kl > 12 && strcmp(r->url.key + kl - 12, ".safetensors") == 0) {
    /* One file: the directory is its parent. */
    layout = CKPT_FILE;
    char *slash = strrchr(r->url.key, '/');
    file = strdup(slash ? slash + 1 : r->url.key);
    if (file == NULL) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
      goto fail;
    }
    if (slash) *slash = '\0';
    else r->url.key[0] = '\0';
  }
  if (layout == CKPT_INDEX) { /* model.safetensors, else an index: the order local directories are read in */
    struct rf_object o = {0};
    struct wd_error e = {0};
    int s = stat_member(r, "model.safetensors", &o, &e);
    rf_object_clear(&o);
    if (s == 0) layout = CKPT_SINGLE;
    else if (s != WEIGHTD_E_NOT_FOUND && s != WEIGHTD_E_PERMISSION) { /* 403: see fetch_small */
      *err = e;
      rc = s;
      free(file);
      goto fail;
    }
  }
  struct ckpt_fetch f = {fetch_small, fetch_size, fetch_read, r};
  rc = ckpt_open_fetched(r->name, layout, file, &f, t->manifest, &r->ck, err);
  free(file);
  if (rc != 0) goto fail;
  *out = r;
  return 0;
fail:
  rck_close(r);
  return rc;
}

int rck_read(const struct rck *r, uint32_t shard, uint64_t off, uint64_t len, void *dst, const atomic_bool *cancel,
             struct wd_error *err) {
  if (shard >= r->nobjs || r->objs[shard].path == NULL)
    return err_set(err, WEIGHTD_E_INTERNAL, "%s: shard %u was not opened", r->name, (unsigned)shard);
  return rf_read(r->t->client, &r->auth, &r->objs[shard], off, len, dst, cancel != NULL ? cancel : r->t->cancel, err);
}

int rck_readv(const struct rck *r, uint32_t shard, const struct rf_extent *ext, size_t n, const atomic_bool *cancel,
              struct wd_error *err) {
  if (shard >= r->nobjs || r->objs[shard].path == NULL)
    return err_set(err, WEIGHTD_E_INTERNAL, "%s: shard %u was not opened", r->name, (unsigned)shard);
  return rf_readv(r->t->client, &r->auth, &r->objs[shard], ext, n, cancel != NULL ? cancel : r->t->cancel, err);
}

int rck_unchanged(const struct rck *r, struct wd_error *err) {
  for (size_t i = 0; r->ck != NULL && i < r->ck->nshards; i++) {
    struct rf_object now = {0};
    int rc = stat_member((struct rck *)r, r->ck->shards[i].rel, &now, err);
    const struct rf_object *was = &r->objs[i];
    bool same = rc == 0 && now.size == was->size && strcmp(now.etag, was->etag) == 0 &&
                (was->etag[0] != '\0' || strcmp(now.last_modified, was->last_modified) == 0);
    rf_object_clear(&now);
    if (rc != 0 && rc != WEIGHTD_E_NOT_FOUND) return rc;
    if (!same) return err_set(err, WEIGHTD_E_STALE, "%s: %s changed since it was opened", r->name, r->ck->shards[i].rel);
  }
  return 0;
}
