/*
 * creds_fetch.c - temporary credentials from STS (AssumeRoleWithWebIdentity)
 * and from the instance metadata service (IMDSv2), over blocking libcurl
 * easy transfers (see creds_internal.h).
 *
 * Runs on the caller's thread (creds_get's); nothing here is shared between
 * calls but libcurl's global state, initialised once.
 */
#include "creds_internal.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sigv4.h"

#define BODY_MAX (64u * 1024)      /* bytes of an answer read at most */
#define TOKEN_FILE_MAX (64u * 1024) /* bytes of a web identity token */
#define IMDS_TOKEN_TTL_S "21600"    /* the metadata session token's life (6 h, the AWS tools' value) */

/* ---- time ------------------------------------------------------------------------ */

int creds_parse_time(const char *s, int64_t *unix_ms) {
  struct tm tm = {0};
  int y, mo, d, h, mi, sec, used = 0;
  if (s == NULL || sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d%n", &y, &mo, &d, &h, &mi, &sec, &used) != 6 || used != 19)
    return WEIGHTD_E_INVALID;
  const char *p = s + used;
  int64_t ms = 0;
  if (*p == '.') {
    int digits = 0;
    for (p++; *p >= '0' && *p <= '9'; p++, digits++)
      if (digits < 3) ms = ms * 10 + (*p - '0');
    if (digits == 0) return WEIGHTD_E_INVALID;
    for (; digits < 3; digits++) ms *= 10;
  }
  if (!(strcmp(p, "Z") == 0 || strcmp(p, "+00:00") == 0)) return WEIGHTD_E_INVALID;
  if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || sec > 60) return WEIGHTD_E_INVALID;
  tm.tm_year = y - 1900, tm.tm_mon = mo - 1, tm.tm_mday = d;
  tm.tm_hour = h, tm.tm_min = mi, tm.tm_sec = sec;
  time_t t = timegm(&tm);
  if (t == (time_t)-1) return WEIGHTD_E_INVALID;
  *unix_ms = (int64_t)t * 1000 + ms;
  return 0;
}

const char *creds_format_time(int64_t unix_ms, char *buf, size_t len) {
  time_t t = (time_t)(unix_ms / 1000);
  struct tm tm;
  if (gmtime_r(&t, &tm) == NULL || strftime(buf, len, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0) snprintf(buf, len, "?");
  return buf;
}

/* ---- one HTTP exchange ------------------------------------------------------------- */

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;

static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

struct http_call {
  const char *method; /* "GET", "PUT", "POST" */
  const char *url;
  const char *const *headers; /* "Name: value", NULL-terminated; may be NULL */
  const char *body;           /* may be NULL */
  long timeout_ms, connect_ms;
  bool no_proxy;              /* the metadata service: never through a proxy */
};

struct http_answer {
  long status;
  char *body; /* NUL-terminated, wiped and freed by answer_free */
  size_t len;
  bool too_long;
};

static void answer_free(struct http_answer *a) {
  if (a->body != NULL) explicit_bzero(a->body, a->len);
  free(a->body);
  memset(a, 0, sizeof *a);
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *arg) {
  struct http_answer *a = arg;
  size_t n = size * nmemb;
  if (a->len + n > BODY_MAX) {
    a->too_long = true;
    return 0; /* ends the transfer with CURLE_WRITE_ERROR */
  }
  char *b = realloc(a->body, a->len + n + 1);
  if (b == NULL) return 0;
  memcpy(b + a->len, data, n);
  a->body = b;
  a->len += n;
  b[a->len] = '\0';
  return n;
}

/*
 * Makes one request and fills a (freed with answer_free) with the status and
 * the body, whatever the status. Fails only when no answer came: errors
 * start with label and name the URL, never a header or the body.
 */
static int http_do(const struct http_call *c, struct http_answer *a, const char *label, struct wd_error *err) {
  memset(a, 0, sizeof *a);
  pthread_once(&curl_once, curl_init);
  if (curl_init_rc != CURLE_OK)
    return err_set(err, WEIGHTD_E_INTERNAL, "%s: libcurl cannot start: %s", label, curl_easy_strerror(curl_init_rc));
  CURL *h = curl_easy_init();
  if (h == NULL) return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
  struct curl_slist *hl = NULL;
  bool nomem = false;
  for (size_t i = 0; c->headers != NULL && c->headers[i] != NULL && !nomem; i++) {
    struct curl_slist *n = curl_slist_append(hl, c->headers[i]);
    if (n == NULL) nomem = true;
    else hl = n;
  }
  curl_easy_setopt(h, CURLOPT_URL, c->url);
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, c->timeout_ms);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, c->connect_ms);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, a);
  curl_easy_setopt(h, CURLOPT_USERAGENT, "weightd");
  if (c->no_proxy) curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
  if (strcmp(c->method, "GET") != 0) curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, c->method);
  if (c->body != NULL || strcmp(c->method, "GET") != 0) {
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, c->body ? c->body : "");
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)(c->body ? strlen(c->body) : 0));
  }
  CURLcode rc = nomem ? CURLE_OUT_OF_MEMORY : curl_easy_perform(h);
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &a->status);
  curl_slist_free_all(hl);
  curl_easy_cleanup(h);
  if (rc == CURLE_OK) return 0;
  bool too_long = a->too_long;
  answer_free(a);
  if (too_long)
    return err_set(err, WEIGHTD_E_IO, "%s: %s %s: the answer is longer than %u bytes", label, c->method, c->url,
                   BODY_MAX);
  int code = rc == CURLE_OPERATION_TIMEDOUT ? WEIGHTD_E_TIMEOUT
             : rc == CURLE_OUT_OF_MEMORY    ? WEIGHTD_E_NOMEM
                                            : WEIGHTD_E_IO;
  return err_set(err, code, "%s: %s %s: %s", label, c->method, c->url, curl_easy_strerror(rc));
}

/* ---- STS --------------------------------------------------------------------------- */

/* The text of the first <tag>...</tag> in xml, the five XML entities decoded, into out; false when absent or too long. */
static bool xml_text(const char *xml, const char *tag, char *out, size_t outlen) {
  char open[64], close[64];
  snprintf(open, sizeof open, "<%s>", tag);
  snprintf(close, sizeof close, "</%s>", tag);
  const char *b = strstr(xml, open), *e;
  if (b == NULL || (e = strstr(b += strlen(open), close)) == NULL) return false;
  static const struct {
    const char *ent;
    char c;
  } ents[] = {{"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
  size_t o = 0;
  while (b < e) {
    char c = *b;
    size_t skip = 1;
    for (size_t i = 0; c == '&' && i < sizeof ents / sizeof ents[0]; i++)
      if (strncmp(b, ents[i].ent, strlen(ents[i].ent)) == 0) c = ents[i].c, skip = strlen(ents[i].ent);
    if (o + 1 >= outlen) {
      explicit_bzero(out, outlen);
      return false;
    }
    out[o++] = c;
    b += skip;
  }
  out[o] = '\0';
  return true;
}

/* Appends "&name=value" (value form-encoded) to a growing body. */
static char *form_add(char *body, const char *name, const char *value) {
  size_t vn = sigv4_uri_encode(value, false, NULL, 0), bn = body ? strlen(body) : 0;
  size_t n = bn + 1 + strlen(name) + 1 + vn + 1;
  char *s = malloc(n);
  if (s != NULL) {
    int k = snprintf(s, n, "%s%s%s=", body ? body : "", body ? "&" : "", name);
    sigv4_uri_encode(value, false, s + k, n - (size_t)k);
  }
  if (body != NULL) explicit_bzero(body, bn);
  free(body);
  return s;
}

static char *sts_body(const struct creds_web_identity *w, const char *token) {
  char dur[16];
  snprintf(dur, sizeof dur, "%u", w->duration_s);
  char *b = form_add(NULL, "Action", "AssumeRoleWithWebIdentity");
  if (b) b = form_add(b, "Version", "2011-06-15");
  if (b) b = form_add(b, "RoleArn", w->role_arn);
  if (b) b = form_add(b, "RoleSessionName", w->session_name);
  if (b && w->duration_s > 0) b = form_add(b, "DurationSeconds", dur);
  if (b) b = form_add(b, "WebIdentityToken", token);
  return b;
}

/* STS's refusal: HTTP status, <Code> and <Message> (the message only when it does not hold the token). */
static int sts_refused(const struct http_answer *a, const char *url, const char *token, const char *label,
                       struct wd_error *err) {
  char code[128] = "", msg[512] = "", qc[160], qm[600];
  xml_text(a->body ? a->body : "", "Code", code, sizeof code);
  xml_text(a->body ? a->body : "", "Message", msg, sizeof msg);
  if (token[0] != '\0' && strstr(msg, token) != NULL) msg[0] = '\0';
  int rc = a->status >= 400 && a->status < 500 ? WEIGHTD_E_PERMISSION : WEIGHTD_E_IO;
  return err_set(err, rc, "%s: STS %s: HTTP %ld%s%s%s%s", label, url, a->status, code[0] ? " " : "",
                 err_quote(code, strlen(code), qc, sizeof qc), msg[0] ? ": " : "",
                 err_quote(msg, strlen(msg), qm, sizeof qm));
}

/* Copies the credentials of an answer into out; why they could not be read otherwise. */
static const char *take_creds(const char *key, const char *secret, const char *token, const char *expiration,
                              struct s3_creds *out) {
  if (key == NULL || key[0] == '\0' || secret == NULL || secret[0] == '\0') return "no access key or secret key";
  if (strlen(key) >= sizeof out->access_key || strlen(secret) >= sizeof out->secret_key) return "a key too long";
  if (expiration == NULL || creds_parse_time(expiration, &out->expires_unix_ms) != 0)
    return "no Expiration, or one that is not an ISO 8601 UTC time";
  memcpy(out->access_key, key, strlen(key) + 1);
  memcpy(out->secret_key, secret, strlen(secret) + 1);
  if (token != NULL && token[0] != '\0' && (out->token = strdup(token)) == NULL) return "out of memory";
  return NULL;
}

int creds_fetch_sts(const struct creds_web_identity *w, const char *label, struct s3_creds *out,
                    struct wd_error *err) {
  memset(out, 0, sizeof *out);
  char *token;
  size_t tlen;
  int rc = creds_file_read(w->token_file, "web identity token file", TOKEN_FILE_MAX, &token, &tlen, err);
  if (rc != 0) {
    err_prefix(err, "%s", label);
    return rc;
  }
  while (tlen > 0 && (token[tlen - 1] == '\n' || token[tlen - 1] == '\r' || token[tlen - 1] == ' ')) token[--tlen] = 0;
  if (tlen == 0) {
    free(token);
    return err_set(err, WEIGHTD_E_INVALID, "%s: web identity token file %s is empty", label, w->token_file);
  }
  char *body = sts_body(w, token);
  const char *headers[] = {"Content-Type: application/x-www-form-urlencoded", "Accept: application/xml", NULL};
  struct http_call call = {.method = "POST", .url = w->sts_url, .headers = headers, .body = body,
                           .timeout_ms = CREDS_HTTP_TIMEOUT_MS, .connect_ms = CREDS_HTTP_TIMEOUT_MS};
  struct http_answer a = {0};
  if (body == NULL) rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
  else rc = http_do(&call, &a, label, err);
  if (body != NULL) explicit_bzero(body, strlen(body));
  free(body);
  if (rc == 0 && a.status != 200) rc = sts_refused(&a, w->sts_url, token, label, err);
  explicit_bzero(token, tlen);
  free(token);
  if (rc != 0) {
    answer_free(&a);
    return rc;
  }
  /* The secret and the token are read into buffers wiped below. */
  char key[CREDS_KEY_MAX], secret[CREDS_KEY_MAX], exp[64];
  char *tok = malloc(BODY_MAX);
  const char *why = NULL;
  if (tok == NULL) why = "out of memory";
  else if (!xml_text(a.body, "AccessKeyId", key, sizeof key) || !xml_text(a.body, "SecretAccessKey", secret, sizeof secret) ||
           !xml_text(a.body, "SessionToken", tok, BODY_MAX) || !xml_text(a.body, "Expiration", exp, sizeof exp))
    why = "no Credentials (AccessKeyId, SecretAccessKey, SessionToken, Expiration) in the answer";
  else why = take_creds(key, secret, tok, exp, out);
  explicit_bzero(key, sizeof key);
  explicit_bzero(secret, sizeof secret);
  if (tok != NULL) explicit_bzero(tok, BODY_MAX);
  free(tok);
  answer_free(&a);
  if (why == NULL) return 0;
  creds_clear(out);
  return err_set(err, WEIGHTD_E_IO, "%s: STS %s: %s", label, w->sts_url, why);
}

/* ---- the instance metadata service ------------------------------------------------- */

static char *url_cat(const char *base, const char *path) {
  size_t n = strlen(base) + strlen(path) + 1;
  char *s = malloc(n);
  if (s != NULL) snprintf(s, n, "%s%s", base, path);
  return s;
}

/* One metadata request that must answer 200; the body stays in a. */
static int imds_call(const char *base, const char *path, const char *method, const char *header, struct http_answer *a,
                     const char *label, struct wd_error *err) {
  char *url = url_cat(base, path);
  if (url == NULL) return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
  const char *headers[] = {header, NULL};
  struct http_call call = {.method = method, .url = url, .headers = headers, .timeout_ms = CREDS_IMDS_TIMEOUT_MS,
                           .connect_ms = 1000, .no_proxy = true};
  int rc = http_do(&call, a, label, err);
  if (rc == 0 && a->status != 200) {
    rc = err_set(err, a->status == 401 || a->status == 403 ? WEIGHTD_E_PERMISSION : WEIGHTD_E_IO,
                 "%s: %s %s: HTTP %ld", label, method, url, a->status);
    answer_free(a);
  } else if (rc == 0 && (a->body == NULL || a->len == 0)) {
    rc = err_set(err, WEIGHTD_E_IO, "%s: %s %s: an empty answer", label, method, url);
    answer_free(a);
  }
  free(url);
  return rc;
}

/* The role's credentials, as the metadata service writes them (JSON). */
static int imds_parse(const char *json, const char *url_label, struct s3_creds *out, const char *label,
                      struct wd_error *err) {
  cJSON *j = cJSON_Parse(json);
  const char *why = NULL;
  int rc = 0;
  if (j == NULL || !cJSON_IsObject(j)) {
    why = "the answer is not a JSON object";
  } else {
    const cJSON *code = cJSON_GetObjectItemCaseSensitive(j, "Code");
    if (cJSON_IsString(code) && strcmp(code->valuestring, "Success") != 0) {
      char q[128];
      rc = err_set(err, WEIGHTD_E_PERMISSION, "%s: %s: Code %s", label, url_label,
                   err_quote(code->valuestring, strlen(code->valuestring), q, sizeof q));
    } else {
      why = take_creds(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "AccessKeyId")),
                       cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "SecretAccessKey")),
                       cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "Token")),
                       cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "Expiration")), out);
    }
    /* Wipe the parsed strings before cJSON frees them. */
    for (cJSON *it = j->child; it != NULL; it = it->next)
      if (cJSON_IsString(it)) explicit_bzero(it->valuestring, strlen(it->valuestring));
  }
  cJSON_Delete(j);
  if (rc == 0 && why == NULL) return 0;
  creds_clear(out);
  return rc != 0 ? rc : err_set(err, WEIGHTD_E_IO, "%s: %s: %s", label, url_label, why);
}

#define IMDS_CREDS_PATH "latest/meta-data/iam/security-credentials/"

int creds_fetch_imds(const char *base_url, const char *label, struct s3_creds *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  struct http_answer tok, a;
  int rc = imds_call(base_url, "latest/api/token", "PUT", "X-aws-ec2-metadata-token-ttl-seconds: " IMDS_TOKEN_TTL_S,
                     &tok, label, err);
  if (rc != 0) return rc;
  tok.body[strcspn(tok.body, "\r\n")] = '\0';
  for (const char *p = tok.body; *p && rc == 0; p++)
    if ((unsigned char)*p < 0x20 || *p == 0x7f)
      rc = err_set(err, WEIGHTD_E_IO, "%s: PUT %slatest/api/token: a session token with control bytes", label, base_url);
  if (rc != 0) {
    answer_free(&tok);
    return rc;
  }
  char *hdr = url_cat("X-aws-ec2-metadata-token: ", tok.body);
  answer_free(&tok);
  if (hdr == NULL) return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
  rc = imds_call(base_url, IMDS_CREDS_PATH, "GET", hdr, &a, label, err);
  char role[256] = "";
  if (rc == 0) {
    size_t n = strcspn(a.body, "\r\n");
    if (n == 0 || n >= sizeof role || memchr(a.body, '/', n) != NULL || a.body[0] == '.')
      rc = err_set(err, WEIGHTD_E_IO, "%s: GET %s" IMDS_CREDS_PATH ": no instance role (or a malformed name)", label,
                   base_url);
    else memcpy(role, a.body, n);
    answer_free(&a);
  }
  char *path = rc == 0 ? url_cat(IMDS_CREDS_PATH, role) : NULL;
  if (rc == 0 && path == NULL) rc = err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", label);
  if (rc == 0) rc = imds_call(base_url, path, "GET", hdr, &a, label, err);
  if (rc == 0) {
    char where[512];
    snprintf(where, sizeof where, "GET %s%s", base_url, path);
    rc = imds_parse(a.body, where, out, label, err);
    answer_free(&a);
  }
  free(path);
  explicit_bzero(hdr, strlen(hdr));
  free(hdr);
  return rc;
}
