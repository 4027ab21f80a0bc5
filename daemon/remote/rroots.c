/*
 * rroots.c - the remote roots: the allow-list and what fetching from it
 * needs (see rroots.h).
 */
#include "remote/rroots.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "remote/creds.h"
#include "remote/fetch.h"

struct rroots {
  size_t n;
  struct rurl *roots;
  char **texts;
  char **tokens; /* per root: its bearer token (http(s) roots with one), or NULL; wiped when freed */
  struct rf_client *client;
  struct creds_provider *creds; /* NULL: no s3:// root, or no source configured */
  char region[64];
  struct rck_target target;
  atomic_bool stopping; /* rroots_stop: the target's cancel */
};

static void creds_log(void *arg, enum log_level level, const char *line) {
  (void)arg;
  log_msg(level, "remote credentials: %s", line);
}

/* A redirect's target as a URL, within an http(s) root. */
static bool redirect_allowed(void *arg, const struct rf_endpoint *to, const char *path) {
  const struct rroots *rr = arg;
  char text[RURL_TEXT_MAX];
  bool v6 = strchr(to->host, ':') != NULL;
  int k = snprintf(text, sizeof text, v6 ? "%s://[%s]:%d%s" : "%s://%s:%d%s", to->tls ? "https" : "http", to->host,
                   to->port, path);
  if (k < 0 || (size_t)k >= sizeof text) return false;
  struct rurl u;
  struct wd_error e;
  bool ok = rurl_parse(text, &u, &e) == 0;
  if (ok) {
    ok = false;
    for (size_t i = 0; i < rr->n && !ok; i++) ok = rr->roots[i].scheme != RURL_S3 && rurl_within(&rr->roots[i], &u);
  }
  rurl_free(&u);
  return ok;
}

/* The token of the longest root holding u, or NULL when that root has none. */
static const char *bearer_for(void *arg, const struct rurl *u) {
  const struct rroots *rr = arg;
  const char *best = NULL;
  size_t best_len = 0;
  bool found = false;
  for (size_t i = 0; i < rr->n; i++)
    if (rurl_within(&rr->roots[i], u) && (!found || strlen(rr->roots[i].key) > best_len)) {
      found = true;
      best = rr->tokens[i];
      best_len = strlen(rr->roots[i].key);
    }
  return best;
}

/* Reads the token in `file` for root i: one line, trailing whitespace dropped; never echoed in errors. */
static int read_token(struct rroots *rr, size_t i, const char *file, struct wd_error *err) {
  enum { TOKEN_MAX = 8192 };
  FILE *f = fopen(file, "re");
  if (f == NULL)
    return err_set(err, errno == EACCES ? WEIGHTD_E_PERMISSION : WEIGHTD_E_INVALID, "remote root %s: token file %s: %s",
                   rr->texts[i], file, strerror(errno));
  char *buf = malloc(TOKEN_MAX + 1);
  size_t n = buf != NULL ? fread(buf, 1, TOKEN_MAX + 1, f) : 0;
  bool bad_read = ferror(f);
  fclose(f);
  int rc = 0;
  if (buf == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  if (bad_read) rc = err_set(err, WEIGHTD_E_IO, "remote root %s: token file %s: cannot be read", rr->texts[i], file);
  else if (n > TOKEN_MAX)
    rc = err_set(err, WEIGHTD_E_INVALID, "remote root %s: token file %s: longer than %d bytes", rr->texts[i], file,
                 TOKEN_MAX);
  while (rc == 0 && n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t')) n--;
  for (size_t k = 0; rc == 0 && k < n; k++)
    if ((unsigned char)buf[k] < 0x21 || (unsigned char)buf[k] > 0x7e)
      rc = err_set(err, WEIGHTD_E_INVALID,
                   "remote root %s: token file %s: the token must be one line of printable ASCII without spaces "
                   "(byte %zu is not)", rr->texts[i], file, k);
  if (rc == 0 && n == 0) rc = err_set(err, WEIGHTD_E_INVALID, "remote root %s: token file %s is empty", rr->texts[i], file);
  if (rc != 0) {
    explicit_bzero(buf, TOKEN_MAX + 1);
    free(buf);
    return rc;
  }
  buf[n] = '\0';
  rr->tokens[i] = buf;
  return 0;
}

/* Each entry ROOT=FILE: ROOT one of the http(s) roots (as given or formatted), its token read from FILE. */
static int read_tokens(struct rroots *rr, const char *const *entries, size_t n, struct wd_error *err) {
  for (size_t k = 0; k < n; k++) {
    const char *eq = strrchr(entries[k], '=');
    if (eq == NULL || eq == entries[k] || eq[1] == '\0')
      return err_set(err, WEIGHTD_E_INVALID, "remote_bearer_token_files entry %zu: not ROOT=FILE", k);
    struct rurl u;
    char text[RURL_TEXT_MAX];
    snprintf(text, sizeof text, "%.*s", (int)(eq - entries[k]), entries[k]);
    int rc = rurl_parse(text, &u, err);
    if (rc != 0) {
      rurl_free(&u);
      return err_prefix(err, "remote_bearer_token_files entry %zu", k);
    }
    size_t i = rr->n;
    for (size_t j = 0; j < rr->n; j++) {
      const struct rurl *r = &rr->roots[j];
      if (r->scheme == u.scheme && r->scheme != RURL_S3 && strcmp(r->host, u.host) == 0 && r->port == u.port &&
          strcmp(r->key, u.key) == 0)
        i = j;
    }
    rurl_free(&u);
    if (i == rr->n)
      return err_set(err, WEIGHTD_E_INVALID,
                     "remote_bearer_token_files entry %zu: %s is not one of the http(s) remote roots", k, text);
    if (rr->tokens[i] != NULL)
      return err_set(err, WEIGHTD_E_INVALID, "remote_bearer_token_files: %s has two token files", rr->texts[i]);
    if ((rc = read_token(rr, i, eq + 1, err)) != 0) return rc;
  }
  return 0;
}

void rroots_free(struct rroots *rr) {
  if (rr == NULL) return;
  rf_client_free(rr->client);
  creds_provider_free(rr->creds);
  for (size_t i = 0; i < rr->n; i++) {
    rurl_free(&rr->roots[i]);
    free(rr->texts[i]);
    if (rr->tokens[i] != NULL) {
      explicit_bzero(rr->tokens[i], strlen(rr->tokens[i]));
      free(rr->tokens[i]);
    }
  }
  free(rr->roots);
  free(rr->texts);
  free(rr->tokens);
  free(rr);
}

int rroots_create(const struct rroots_opts *o, struct rroots **out, struct wd_error *err) {
  *out = NULL;
  const char *const *urls = o->urls;
  size_t n = o->n;
  struct rroots *rr = calloc(1, sizeof *rr);
  if (rr == NULL || (rr->roots = calloc(n ? n : 1, sizeof *rr->roots)) == NULL ||
      (rr->texts = calloc(n ? n : 1, sizeof *rr->texts)) == NULL ||
      (rr->tokens = calloc(n ? n : 1, sizeof *rr->tokens)) == NULL) {
    rroots_free(rr);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  int rc = 0;
  bool s3 = false;
  for (size_t i = 0; i < n && rc == 0; i++) {
    rr->n = i + 1;
    rc = rurl_parse(urls[i], &rr->roots[i], err);
    if (rc != 0) {
      err_prefix(err, "remote root");
      break;
    }
    if ((rr->texts[i] = rurl_format(&rr->roots[i])) == NULL) rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    s3 |= rr->roots[i].scheme == RURL_S3;
  }
  if (rc == 0) rc = read_tokens(rr, o->token_files, o->ntoken_files, err);
  if (rc == 0 && s3) {
    struct creds_env e;
    creds_env_from_environ(&e);
    struct creds_hooks hooks = {.log = creds_log};
    struct wd_error ce = {0};
    rc = creds_provider_create(&e, &hooks, &rr->creds, &ce);
    if (rc == WEIGHTD_E_NOT_FOUND) {
      log_msg(LOG_INFO, "remote roots: no AWS credentials are configured (%s): s3:// requests go unsigned", ce.msg);
      rr->creds = NULL;
      rc = 0;
    } else if (rc != 0) {
      *err = ce;
      err_prefix(err, "remote roots: AWS credentials");
    }
    const char *region = rr->creds != NULL ? creds_region(rr->creds) : NULL;
    if (region == NULL) region = e.region;
    snprintf(rr->region, sizeof rr->region, "%s", region != NULL && region[0] ? region : "us-east-1");
    if (rc == 0)
      rc = rck_s3_endpoint_from_env(rr->region, &rr->target.s3_endpoint, &rr->target.s3_path_style, err);
  }
  if (rc == 0) {
    struct rf_config cfg;
    rf_config_defaults(&cfg);
    cfg.ca_file = o->ca_file;
    rc = rf_client_create(&cfg, &rr->client, err);
  }
  if (rc != 0) {
    rroots_free(rr);
    return rc;
  }
  rr->target.client = rr->client;
  rr->target.s3_region = rr->region;
  rr->target.creds = rr->creds;
  rr->target.allow_redirect = redirect_allowed;
  rr->target.bearer_for = bearer_for;
  rr->target.allow_arg = rr;
  rr->target.manifest = true;
  atomic_init(&rr->stopping, false);
  rr->target.cancel = &rr->stopping;
  *out = rr;
  return 0;
}

bool rroots_allows(const struct rroots *rr, const struct rurl *u) {
  for (size_t i = 0; rr != NULL && i < rr->n; i++)
    if (rurl_within(&rr->roots[i], u)) return true;
  return false;
}

const struct rck_target *rroots_target(const struct rroots *rr) { return &rr->target; }
size_t rroots_count(const struct rroots *rr) { return rr != NULL ? rr->n : 0; }
const char *rroots_text(const struct rroots *rr, size_t i) { return rr->texts[i]; }
void rroots_stop(struct rroots *rr) {
  if (rr != NULL) atomic_store(&rr->stopping, true);
}

bool rroots_has_token(const struct rroots *rr, size_t i) { return rr->tokens[i] != NULL; }
const char *rroots_creds_source(const struct rroots *rr) {
  return rr->creds != NULL ? creds_source(rr->creds) : "none (unsigned)";
}
struct rf_client *rroots_client(const struct rroots *rr) { return rr != NULL ? rr->client : NULL; }
