/*
 * rroots.c - the remote roots: the allow-list and what fetching from it
 * needs (see rroots.h).
 */
#include "remote/rroots.h"

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
  struct rf_client *client;
  struct creds_provider *creds; /* NULL: no s3:// root, or no source configured */
  char region[64];
  struct rck_target target;
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

void rroots_free(struct rroots *rr) {
  if (rr == NULL) return;
  rf_client_free(rr->client);
  creds_provider_free(rr->creds);
  for (size_t i = 0; i < rr->n; i++) {
    rurl_free(&rr->roots[i]);
    free(rr->texts[i]);
  }
  free(rr->roots);
  free(rr->texts);
  free(rr);
}

int rroots_create(const char *const *urls, size_t n, const char *ca_file, struct rroots **out, struct wd_error *err) {
  *out = NULL;
  struct rroots *rr = calloc(1, sizeof *rr);
  if (rr == NULL || (rr->roots = calloc(n ? n : 1, sizeof *rr->roots)) == NULL ||
      (rr->texts = calloc(n ? n : 1, sizeof *rr->texts)) == NULL) {
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
    cfg.ca_file = ca_file;
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
  rr->target.allow_arg = rr;
  rr->target.manifest = true;
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
const char *rroots_creds_source(const struct rroots *rr) {
  return rr->creds != NULL ? creds_source(rr->creds) : "none (unsigned)";
}
struct rf_client *rroots_client(const struct rroots *rr) { return rr != NULL ? rr->client : NULL; }
