/*
 * creds.c - the credentials chain: which source, and keeping temporary
 * credentials fresh (see creds.h).
 *
 * DESIGN: any thread may call creds_get (the fetch engine's, fill and
 * control threads); a provider's mutex guards its current credentials, the
 * time before which a failed refresh is not tried again and that failure.
 * A refresh (a blocking STS or metadata request) runs under the mutex, so
 * that concurrent callers wait for one refresh instead of each making their
 * own. Everything else in a provider is written once, at create.
 */
#include "creds.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "creds_internal.h"
#include "url.h"

enum source_kind { SRC_STATIC, SRC_WEB_IDENTITY, SRC_IMDS };

struct creds_provider {
  enum source_kind kind;
  char *source; /* creds_source's text */
  char *region; /* NULL when none is named */
  struct creds_hooks hooks;
  /* web identity */
  char *role_arn, *token_file, *session_name, *sts_url;
  unsigned duration_s;
  /* instance metadata */
  char *imds_url;
  /* the shared files looked at */
  char *config_path, *credentials_path;

  pthread_mutex_t lock;
  struct s3_creds cur;   /* guarded by lock; static sources: set at create */
  bool have;             /* guarded by lock */
  int64_t retry_at_ms;   /* guarded by lock: no fetch before this, after a failure */
  struct wd_error last;  /* guarded by lock: that failure */
};

/* ---- credentials ------------------------------------------------------------------ */

void creds_clear(struct s3_creds *c) {
  if (c == NULL) return;
  if (c->token != NULL) {
    explicit_bzero(c->token, strlen(c->token));
    free(c->token);
  }
  explicit_bzero(c, sizeof *c);
}

static int creds_copy(struct s3_creds *dst, const struct s3_creds *src) {
  *dst = *src;
  dst->token = NULL;
  if (src->token != NULL && (dst->token = strdup(src->token)) == NULL) {
    creds_clear(dst);
    return WEIGHTD_E_NOMEM;
  }
  return 0;
}

/* ---- the environment -------------------------------------------------------------- */

static const char *env(const char *name) {
  const char *v = getenv(name);
  return v != NULL && v[0] != '\0' ? v : NULL;
}

static const char *env2(const char *a, const char *b) { return env(a) ? env(a) : env(b); }

int creds_env_from_environ(struct creds_env *e) {
  memset(e, 0, sizeof *e);
  e->access_key_id = env("AWS_ACCESS_KEY_ID");
  e->secret_access_key = env("AWS_SECRET_ACCESS_KEY");
  e->session_token = env("AWS_SESSION_TOKEN");
  e->profile = env("AWS_PROFILE");
  e->shared_credentials_file = env("AWS_SHARED_CREDENTIALS_FILE");
  e->config_file = env("AWS_CONFIG_FILE");
  e->web_identity_token_file = env("AWS_WEB_IDENTITY_TOKEN_FILE");
  e->role_arn = env("AWS_ROLE_ARN");
  e->role_session_name = env("AWS_ROLE_SESSION_NAME");
  e->region = env2("AWS_REGION", "AWS_DEFAULT_REGION");
  e->sts_endpoint = env2("AWS_ENDPOINT_URL_STS", "AWS_ENDPOINT_URL");
  e->imds_endpoint = env("AWS_EC2_METADATA_SERVICE_ENDPOINT");
  const char *mode = env("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE");
  if (e->imds_endpoint == NULL && mode != NULL && strcasecmp(mode, "IPv6") == 0)
    e->imds_endpoint = "http://[fd00:ec2::254]";
  const char *off = env("AWS_EC2_METADATA_DISABLED");
  e->imds_disabled = off != NULL && strcasecmp(off, "true") == 0;
  e->home = env("HOME");
  return 0;
}

static const char *nz(const char *s) { return s != NULL && s[0] != '\0' ? s : NULL; }

/* ---- building a provider ----------------------------------------------------------- */

static char *fmt_dup(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static char *fmt_dup(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  if (vasprintf(&s, fmt, ap) < 0) s = NULL;
  va_end(ap);
  return s;
}

static int nomem(struct wd_error *err) { return err_set(err, WEIGHTD_E_NOMEM, "AWS credentials: out of memory"); }

/* A name of letters, digits and '-' (a region: "us-east-1"). */
static bool region_valid(const char *r) {
  size_t n = strlen(r);
  if (n == 0 || n > 64) return false;
  for (const char *p = r; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '-'))
      return false;
  return true;
}

/* A profile name as the shared files can hold one: no whitespace, no control bytes. */
static bool profile_name_valid(const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++)
    if (*p <= 0x20 || *p == 0x7f) return false;
  return strlen(s) <= 256;
}

/* STS's rule for RoleSessionName: 2 to 64 of [A-Za-z0-9+=,.@_-]. */
static bool session_name_valid(const char *s) {
  size_t n = strlen(s);
  if (n < 2 || n > 64) return false;
  for (const char *p = s; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || strchr("+=,.@_-", *p)))
      return false;
  return true;
}

/* An endpoint variable's value as a base URL ending in '/'. */
static int endpoint_url(const char *text, const char *what, char **out, struct wd_error *err) {
  struct rurl u;
  int rc = rurl_parse(text, &u, err);
  if (rc == 0 && u.scheme == RURL_S3) rc = err_set(err, WEIGHTD_E_INVALID, "%s: not an http:// or https:// URL", what);
  else if (rc != 0) err_prefix(err, "%s", what);
  char *s = rc == 0 ? rurl_format(&u) : NULL;
  if (rc == 0 && s == NULL) rc = nomem(err);
  if (s != NULL && s[strlen(s) - 1] != '/') {
    char *t = fmt_dup("%s/", s);
    free(s);
    if ((s = t) == NULL) rc = nomem(err);
  }
  rurl_free(&u);
  *out = s;
  return rc;
}

static int set_static(struct creds_provider *p, const char *key, const char *secret, const char *token,
                      const char *where, struct wd_error *err) {
  if (strlen(key) >= CREDS_KEY_MAX || strlen(secret) >= CREDS_KEY_MAX)
    return err_set(err, WEIGHTD_E_INVALID, "%s: an access key id or secret key longer than %d bytes", where,
                   CREDS_KEY_MAX - 1);
  p->kind = SRC_STATIC;
  memcpy(p->cur.access_key, key, strlen(key) + 1);
  memcpy(p->cur.secret_key, secret, strlen(secret) + 1);
  if (token != NULL && (p->cur.token = strdup(token)) == NULL) return nomem(err);
  p->have = true;
  return 0;
}

static int set_web_identity(struct creds_provider *p, const struct creds_env *e, const char *role_arn,
                            const char *token_file, const char *session_name, struct wd_error *err) {
  p->kind = SRC_WEB_IDENTITY;
  p->duration_s = e->duration_s;
  int rc = 0;
  if (nz(e->sts_endpoint)) {
    rc = endpoint_url(e->sts_endpoint, "AWS_ENDPOINT_URL_STS", &p->sts_url, err);
  } else if (p->region != NULL) {
    p->sts_url = fmt_dup("https://sts.%s.amazonaws.com/", p->region);
  } else {
    p->sts_url = strdup("https://sts.amazonaws.com/");
  }
  if (rc != 0) return rc;
  char q[160];
  if (session_name != NULL && !session_name_valid(session_name))
    return err_set(err, WEIGHTD_E_INVALID, "role session name '%s': not 2 to 64 of A-Z a-z 0-9 + = , . @ _ -",
                   err_quote(session_name, strlen(session_name), q, sizeof q));
  char gen[40];
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  snprintf(gen, sizeof gen, "weightd-%lld", (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
  p->role_arn = strdup(role_arn);
  p->token_file = strdup(token_file);
  p->session_name = strdup(session_name ? session_name : gen);
  if (p->sts_url == NULL || p->role_arn == NULL || p->token_file == NULL || p->session_name == NULL) return nomem(err);
  return 0;
}

/* 1: the environment's keys. Returns 1 when they are the source, 0 when absent. */
static int chain_env(struct creds_provider *p, const struct creds_env *e, struct wd_error *err) {
  const char *k = nz(e->access_key_id), *s = nz(e->secret_access_key);
  if (k == NULL && s == NULL) return 0;
  if (k == NULL || s == NULL)
    return err_set(err, WEIGHTD_E_INVALID, "AWS credentials: %s is set but %s is not",
                   k ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY", k ? "AWS_SECRET_ACCESS_KEY" : "AWS_ACCESS_KEY_ID");
  int rc = set_static(p, k, s, nz(e->session_token), "AWS_ACCESS_KEY_ID", err);
  if (rc == 0 && (p->source = strdup("environment")) == NULL) rc = nomem(err);
  return rc != 0 ? rc : 1;
}

/* 2: web identity from the environment. */
static int chain_web_identity(struct creds_provider *p, const struct creds_env *e, struct wd_error *err) {
  const char *f = nz(e->web_identity_token_file), *r = nz(e->role_arn);
  if (f == NULL && r == NULL) return 0;
  if (f == NULL || r == NULL)
    return err_set(err, WEIGHTD_E_INVALID, "AWS credentials: %s is set but %s is not",
                   f ? "AWS_WEB_IDENTITY_TOKEN_FILE" : "AWS_ROLE_ARN", f ? "AWS_ROLE_ARN" : "AWS_WEB_IDENTITY_TOKEN_FILE");
  int rc = set_web_identity(p, e, r, f, nz(e->role_session_name), err);
  if (rc == 0 && (p->source = fmt_dup("web identity (role %s)", r)) == NULL) rc = nomem(err);
  return rc != 0 ? rc : 1;
}

/* What a found profile says: its source, 0 when it has no credentials, or an error. */
static int profile_source(struct creds_provider *p, const struct creds_env *e, const char *name,
                          const struct creds_profile *pr, struct wd_error *err) {
  const char *const *v = (const char *const *)pr->v;
  int rc;
  if (v[CREDS_P_ROLE_ARN] != NULL) {
    if (v[CREDS_P_TOKEN_FILE] != NULL) {
      const char *sn = nz(e->role_session_name) ? e->role_session_name : v[CREDS_P_SESSION_NAME];
      rc = set_web_identity(p, e, v[CREDS_P_ROLE_ARN], v[CREDS_P_TOKEN_FILE], sn, err);
      if (rc == 0 && (p->source = fmt_dup("profile %s: web identity (role %s)", name, v[CREDS_P_ROLE_ARN])) == NULL)
        rc = nomem(err);
      return rc != 0 ? rc : 1;
    }
    if (v[CREDS_P_SOURCE_PROFILE] != NULL || v[CREDS_P_CREDENTIAL_SOURCE] != NULL)
      return err_set(err, WEIGHTD_E_UNSUPPORTED,
                     "AWS profile %s: role_arn with source_profile or credential_source (assume-role chains) is not "
                     "supported; use web_identity_token_file, keys, or the instance role",
                     name);
    return err_set(err, WEIGHTD_E_INVALID,
                   "AWS profile %s (%s): role_arn without web_identity_token_file, source_profile or credential_source",
                   name, pr->from[CREDS_P_ROLE_ARN]);
  }
  const char *k = v[CREDS_P_ACCESS_KEY], *s = v[CREDS_P_SECRET_KEY];
  if (k != NULL || s != NULL) {
    const char *where = pr->from[k ? CREDS_P_ACCESS_KEY : CREDS_P_SECRET_KEY];
    if (k == NULL || s == NULL)
      return err_set(err, WEIGHTD_E_INVALID, "AWS profile %s (%s): %s without %s", name, where,
                     k ? "aws_access_key_id" : "aws_secret_access_key", k ? "aws_secret_access_key" : "aws_access_key_id");
    rc = set_static(p, k, s, v[CREDS_P_SESSION_TOKEN], where, err);
    if (rc == 0 && (p->source = fmt_dup("profile %s (%s)", name, where)) == NULL) rc = nomem(err);
    return rc != 0 ? rc : 1;
  }
  if (v[CREDS_P_CREDENTIAL_PROCESS] != NULL)
    return err_set(err, WEIGHTD_E_UNSUPPORTED, "AWS profile %s: credential_process is not supported (weightd runs no "
                   "helper programs); use keys, web identity or the instance role", name);
  if (v[CREDS_P_SSO_START_URL] != NULL || v[CREDS_P_SSO_SESSION] != NULL)
    return err_set(err, WEIGHTD_E_UNSUPPORTED, "AWS profile %s: SSO is not supported by weightd", name);
  return 0;
}

/*
 * The profile in the shared files, read whatever the source turns out to be
 * (its region counts with any source, and a profile named by AWS_PROFILE
 * must exist, as the AWS tools have it). *looked says where, for messages.
 */
static int load_profile(struct creds_provider *p, const struct creds_env *e, struct creds_profile *pr, char **looked,
                        struct wd_error *err) {
  const char *name = nz(e->profile) ? e->profile : "default";
  char *cfg = nz(e->config_file) ? strdup(e->config_file) : nz(e->home) ? fmt_dup("%s/.aws/config", e->home) : NULL;
  char *crd = nz(e->shared_credentials_file) ? strdup(e->shared_credentials_file)
              : nz(e->home)                  ? fmt_dup("%s/.aws/credentials", e->home)
                                             : NULL;
  int rc = creds_profile_load(cfg, crd, name, pr, err);
  const char *region = pr->v[CREDS_P_REGION];
  char q[160];
  if (rc == 0 && region != NULL && p->region == NULL) {
    if (!region_valid(region))
      rc = err_set(err, WEIGHTD_E_INVALID, "AWS profile %s: region '%s' is not a region name", name,
                   err_quote(region, strlen(region), q, sizeof q));
    else if ((p->region = strdup(region)) == NULL)
      rc = nomem(err);
  }
  if (rc == 0 && !pr->found && nz(e->profile))
    rc = err_set(err, WEIGHTD_E_INVALID, "AWS profile %s (AWS_PROFILE) is in neither %s nor %s", name,
                 cfg ? cfg : "(no config file)", crd ? crd : "(no credentials file)");
  if (rc == 0 && (*looked = fmt_dup("profile %s in %s and %s", name, cfg ? cfg : "(no config file: HOME unset)",
                                    crd ? crd : "(no credentials file: HOME unset)")) == NULL)
    rc = nomem(err);
  /* Kept while p lives: pr->from points at them. */
  p->config_path = cfg;
  p->credentials_path = crd;
  return rc;
}

/* 3: the profile's credentials. */
static int chain_profile(struct creds_provider *p, const struct creds_env *e, const struct creds_profile *pr,
                         struct wd_error *err) {
  if (!pr->found) return 0;
  return profile_source(p, e, nz(e->profile) ? e->profile : "default", pr, err);
}

/* 4: the instance metadata service. */
static int chain_imds(struct creds_provider *p, const struct creds_env *e, const char *looked, struct wd_error *err) {
  if (e->imds_disabled)
    return err_set(err, WEIGHTD_E_NOT_FOUND,
                   "no AWS credentials: none in the environment (AWS_ACCESS_KEY_ID, AWS_WEB_IDENTITY_TOKEN_FILE), "
                   "none in %s, and the instance metadata service is off (AWS_EC2_METADATA_DISABLED)",
                   looked ? looked : "the shared files");
  int rc = nz(e->imds_endpoint) ? endpoint_url(e->imds_endpoint, "AWS_EC2_METADATA_SERVICE_ENDPOINT", &p->imds_url, err)
                                : ((p->imds_url = strdup("http://169.254.169.254/")) ? 0 : nomem(err));
  if (rc != 0) return rc;
  p->kind = SRC_IMDS;
  if ((p->source = fmt_dup("instance metadata (%s)", p->imds_url)) == NULL) return nomem(err);
  return 1;
}

int creds_provider_create(const struct creds_env *e, const struct creds_hooks *hooks, struct creds_provider **out,
                          struct wd_error *err) {
  *out = NULL;
  struct creds_provider *p = calloc(1, sizeof *p);
  if (p == NULL) return nomem(err);
  pthread_mutex_init(&p->lock, NULL);
  if (hooks != NULL) p->hooks = *hooks;
  int rc = 0;
  char *looked = NULL, q[160];
  if (nz(e->region) && !region_valid(e->region))
    rc = err_set(err, WEIGHTD_E_INVALID, "AWS_REGION '%s' is not a region name",
                 err_quote(e->region, strlen(e->region), q, sizeof q));
  else if (nz(e->profile) && !profile_name_valid(e->profile))
    rc = err_set(err, WEIGHTD_E_INVALID, "AWS_PROFILE '%s' is not a profile name (no spaces or control bytes)",
                 err_quote(e->profile, strlen(e->profile), q, sizeof q));
  else if (nz(e->region) && (p->region = strdup(e->region)) == NULL)
    rc = nomem(err);
  struct creds_profile pr = {0};
  if (rc == 0) rc = load_profile(p, e, &pr, &looked, err);
  if (rc == 0) rc = chain_env(p, e, err);
  if (rc == 0) rc = chain_web_identity(p, e, err);
  if (rc == 0) rc = chain_profile(p, e, &pr, err);
  if (rc == 0) rc = chain_imds(p, e, looked, err);
  creds_profile_free(&pr);
  free(looked);
  if (rc < 0) {
    creds_provider_free(p);
    return rc;
  }
  *out = p;
  return 0;
}

/* ---- getting and refreshing ------------------------------------------------------- */

static int64_t now_ms(const struct creds_provider *p) {
  if (p->hooks.clock_ms != NULL) return p->hooks.clock_ms(p->hooks.arg);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void say(const struct creds_provider *p, enum log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void say(const struct creds_provider *p, enum log_level level, const char *fmt, ...) {
  if (p->hooks.log == NULL) return;
  char line[WD_ERROR_MSG_MAX + 256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  p->hooks.log(p->hooks.arg, level, line);
}

static int fetch(const struct creds_provider *p, struct s3_creds *out, struct wd_error *err) {
  if (p->kind == SRC_IMDS) return creds_fetch_imds(p->imds_url, p->source, out, err);
  struct creds_web_identity w = {.role_arn = p->role_arn, .token_file = p->token_file, .session_name = p->session_name,
                                 .sts_url = p->sts_url, .duration_s = p->duration_s};
  return creds_fetch_sts(&w, p->source, out, err);
}

/* Under p->lock: makes p->cur current when it is due for a refresh. Returns 0 when p->cur may be used. */
static int refresh_locked(struct creds_provider *p, int64_t now, struct wd_error *err) {
  bool valid = p->have && now < p->cur.expires_unix_ms;
  if (valid && now < p->cur.expires_unix_ms - CREDS_REFRESH_MARGIN_MS) return 0;
  if (now < p->retry_at_ms) {
    if (valid) return 0;
    if (err != NULL) *err = p->last;
    return p->last.code;
  }
  struct s3_creds fresh;
  struct wd_error ferr = {0};
  char when[32];
  int rc = fetch(p, &fresh, &ferr);
  if (rc == 0) {
    creds_clear(&p->cur);
    p->cur = fresh;
    p->have = true;
    p->retry_at_ms = 0;
    say(p, LOG_INFO, "AWS credentials from %s fetched; they expire at %s", p->source,
        creds_format_time(fresh.expires_unix_ms, when, sizeof when));
    return 0;
  }
  p->last = ferr;
  p->retry_at_ms = now + CREDS_RETRY_MS;
  if (valid) {
    say(p, LOG_WARN, "refreshing AWS credentials failed: %s; the current ones stay in use until %s (next try in %d s)",
        ferr.msg, creds_format_time(p->cur.expires_unix_ms, when, sizeof when), CREDS_RETRY_MS / 1000);
    return 0;
  }
  if (err != NULL) *err = ferr;
  return rc;
}

int creds_get(struct creds_provider *p, struct s3_creds *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&p->lock);
  int rc = p->kind == SRC_STATIC ? 0 : refresh_locked(p, now_ms(p), err);
  if (rc == 0 && creds_copy(out, &p->cur) != 0) rc = nomem(err);
  pthread_mutex_unlock(&p->lock);
  return rc;
}

const char *creds_source(const struct creds_provider *p) { return p->source; }

const char *creds_region(const struct creds_provider *p) { return p->region; }

void creds_provider_free(struct creds_provider *p) {
  if (p == NULL) return;
  creds_clear(&p->cur);
  free(p->source);
  free(p->region);
  free(p->role_arn);
  free(p->token_file);
  free(p->session_name);
  free(p->sts_url);
  free(p->imds_url);
  free(p->config_path);
  free(p->credentials_path);
  pthread_mutex_destroy(&p->lock);
  explicit_bzero(p, sizeof *p);
  free(p);
}
