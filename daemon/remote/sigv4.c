/* sigv4.c - AWS Signature Version 4 over common/sha256.c (see sigv4.h). */
#include "sigv4.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- encoding ------------------------------------------------------------------ */

static bool unreserved(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
         c == '_' || c == '~';
}

size_t sigv4_uri_encode(const char *in, bool slash_ok, char *out, size_t outlen) {
  static const char hex[] = "0123456789ABCDEF";
  size_t o = 0;
  for (const unsigned char *p = (const unsigned char *)in; *p; p++) {
    char enc[3] = {(char)*p, 0, 0};
    size_t k = 1;
    if (!unreserved(*p) && !(slash_ok && *p == '/')) {
      enc[0] = '%', enc[1] = hex[*p >> 4], enc[2] = hex[*p & 15];
      k = 3;
    }
    for (size_t i = 0; i < k; i++, o++)
      if (o + 1 < outlen) out[o] = enc[i];
  }
  if (outlen > 0) out[o < outlen ? o : outlen - 1] = '\0';
  return o;
}

static char *encode_dup(const char *in) {
  size_t n = sigv4_uri_encode(in, false, NULL, 0);
  char *s = malloc(n + 1);
  if (s != NULL) sigv4_uri_encode(in, false, s, n + 1);
  return s;
}

struct qparam {
  char *name, *value;
};

static int qparam_cmp(const void *a, const void *b) {
  const struct qparam *x = a, *y = b;
  int c = strcmp(x->name, y->name);
  return c != 0 ? c : strcmp(x->value, y->value);
}

int sigv4_query(const char *const *names, const char *const *values, size_t n, char **out, struct wd_error *err) {
  *out = NULL;
  struct qparam *q = calloc(n ? n : 1, sizeof *q);
  int rc = 0;
  size_t total = 1;
  for (size_t i = 0; q != NULL && i < n && rc == 0; i++) {
    q[i].name = encode_dup(names[i]);
    q[i].value = encode_dup(values && values[i] ? values[i] : "");
    if (q[i].name == NULL || q[i].value == NULL) rc = WEIGHTD_E_NOMEM;
    else total += strlen(q[i].name) + strlen(q[i].value) + 2;
  }
  char *s = q != NULL && rc == 0 ? malloc(total) : NULL;
  if (s != NULL) {
    qsort(q, n, sizeof *q, qparam_cmp);
    size_t o = 0;
    for (size_t i = 0; i < n; i++)
      o += (size_t)snprintf(s + o, total - o, "%s%s=%s", i ? "&" : "", q[i].name, q[i].value);
    s[o] = '\0';
    *out = s;
  }
  for (size_t i = 0; q != NULL && i < n; i++) {
    free(q[i].name);
    free(q[i].value);
  }
  free(q);
  return s != NULL ? 0 : err_set(err, WEIGHTD_E_NOMEM, "signing a request: out of memory");
}

/* ---- a growing string ------------------------------------------------------------ */

struct buf {
  char *s;
  size_t len, cap;
  bool failed;
};

static void buf_add(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void buf_add(struct buf *b, const char *fmt, ...) {
  if (b->failed) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) {
    b->failed = true;
    return;
  }
  if (b->len + (size_t)n + 1 > b->cap) {
    size_t cap = (b->len + (size_t)n + 1) * 2;
    char *s = realloc(b->s, cap);
    if (s == NULL) {
      b->failed = true;
      return;
    }
    b->s = s, b->cap = cap;
  }
  va_start(ap, fmt);
  vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

/* Hands b's string over (NULL when it failed). */
static char *buf_take(struct buf *b) {
  if (b->failed) {
    free(b->s);
    b->s = NULL;
  }
  return b->s;
}

/* ---- canonical headers ------------------------------------------------------------ */

struct hdr {
  char *name;  /* lowercased */
  char *value; /* trimmed, inner runs of spaces folded */
};

static int hdr_cmp(const void *a, const void *b) {
  return strcmp(((const struct hdr *)a)->name, ((const struct hdr *)b)->name);
}

static char *lower_dup(const char *s) {
  char *d = strdup(s);
  for (char *p = d; p && *p; p++)
    if (*p >= 'A' && *p <= 'Z') *p = (char)(*p - 'A' + 'a');
  return d;
}

/* SigV4's value rule: leading and trailing spaces trimmed, each inner run of spaces one space. */
static char *fold_dup(const char *v) {
  char *d = malloc(strlen(v) + 1);
  if (d == NULL) return NULL;
  size_t o = 0;
  while (*v == ' ' || *v == '\t') v++;
  for (; *v; v++) {
    bool space = *v == ' ' || *v == '\t';
    if (space && (o == 0 || d[o - 1] == ' ')) continue;
    d[o++] = space ? ' ' : *v;
  }
  while (o > 0 && d[o - 1] == ' ') o--;
  d[o] = '\0';
  return d;
}

static bool token_char(unsigned char c) {
  return c > 0x20 && c < 0x7f && strchr("\"(),/:;<=>?@[\\]{}", c) == NULL;
}

static const char *const reserved_headers[] = {"host", "authorization", "x-amz-date", "x-amz-content-sha256",
                                               "x-amz-security-token"};

/* Checks one extra header; NULL or why it is refused. */
static const char *hdr_refused(const char *name, const char *value) {
  if (name == NULL || name[0] == '\0') return "an empty name";
  for (const char *p = name; *p; p++)
    if (!token_char((unsigned char)*p)) return "a name with a character a header name may not hold";
  for (const char *p = value ? value : ""; *p; p++)
    if ((unsigned char)*p < 0x20 && *p != '\t') return "a value with a control byte";
  for (size_t i = 0; i < sizeof reserved_headers / sizeof reserved_headers[0]; i++)
    if (strcasecmp(name, reserved_headers[i]) == 0) return "a header sigv4 adds itself";
  return NULL;
}

static void hdrs_free(struct hdr *h, size_t n) {
  for (size_t i = 0; h != NULL && i < n; i++) {
    free(h[i].name);
    if (h[i].value != NULL) explicit_bzero(h[i].value, strlen(h[i].value));
    free(h[i].value);
  }
  free(h);
}

/*
 * All the signed headers of r, sorted by name: the ones sigv4 adds and the
 * caller's. *out is freed with hdrs_free(*out, *nout).
 */
static int collect_headers(const struct sigv4_req *r, const struct s3_creds *c, const char *amz_date,
                           struct hdr **out, size_t *nout, struct wd_error *err) {
  char q[128];
  for (size_t i = 0; i < r->nhdrs; i++) {
    const char *why = hdr_refused(r->hdr_names[i], r->hdr_values[i]);
    const char *nm = r->hdr_names[i] ? r->hdr_names[i] : "";
    if (why != NULL)
      return err_set(err, WEIGHTD_E_INVALID, "signing a request: header '%s': %s",
                     err_quote(nm, strlen(nm), q, sizeof q), why);
  }
  size_t cap = r->nhdrs + 4, n = 0;
  struct hdr *h = calloc(cap, sizeof *h);
  if (h == NULL) return err_set(err, WEIGHTD_E_NOMEM, "signing a request: out of memory");
  const char *names[4] = {"host", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token"};
  const char *values[4] = {r->host, amz_date, r->payload_sha256, c->token};
  bool nomem = false;
  for (size_t i = 0; i < 4; i++) {
    if (values[i] == NULL) continue;
    h[n].name = strdup(names[i]);
    h[n].value = fold_dup(values[i]);
    nomem |= h[n].name == NULL || h[n].value == NULL;
    n++;
  }
  for (size_t i = 0; i < r->nhdrs; i++, n++) {
    h[n].name = lower_dup(r->hdr_names[i]);
    h[n].value = fold_dup(r->hdr_values[i] ? r->hdr_values[i] : "");
    nomem |= h[n].name == NULL || h[n].value == NULL;
  }
  if (nomem) {
    hdrs_free(h, n);
    return err_set(err, WEIGHTD_E_NOMEM, "signing a request: out of memory");
  }
  qsort(h, n, sizeof *h, hdr_cmp);
  for (size_t i = 1; i < n; i++)
    if (strcmp(h[i].name, h[i - 1].name) == 0) {
      err_set(err, WEIGHTD_E_INVALID, "signing a request: header '%s' given twice",
              err_quote(h[i].name, strlen(h[i].name), q, sizeof q));
      hdrs_free(h, n);
      return WEIGHTD_E_INVALID;
    }
  *out = h;
  *nout = n;
  return 0;
}

/* ---- the signature ---------------------------------------------------------------- */

static void hex_sha256(const char *s, char hex[SHA256_HEX_LEN + 1]) {
  struct sha256 h;
  unsigned char d[SHA256_DIGEST_LEN];
  sha256_init(&h);
  sha256_update(&h, s, strlen(s));
  sha256_final(&h, d);
  sha256_hex(d, hex);
}

static void hmac_str(const unsigned char *key, size_t keylen, const char *msg, unsigned char out[SHA256_DIGEST_LEN]) {
  sha256_hmac(key, keylen, msg, strlen(msg), out);
}

/* kSigning = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), service), "aws4_request"), then the signature. */
static void sign(const char *secret, const char *date, const char *region, const char *service, const char *sts,
                 char hex[SHA256_HEX_LEN + 1]) {
  char k0[CREDS_KEY_MAX + 4];
  unsigned char k[SHA256_DIGEST_LEN], mac[SHA256_DIGEST_LEN];
  int n = snprintf(k0, sizeof k0, "AWS4%s", secret);
  hmac_str((const unsigned char *)k0, (size_t)n, date, k);
  hmac_str(k, sizeof k, region, k);
  hmac_str(k, sizeof k, service, k);
  hmac_str(k, sizeof k, "aws4_request", k);
  hmac_str(k, sizeof k, sts, mac);
  sha256_hex(mac, hex);
  explicit_bzero(k0, sizeof k0);
  explicit_bzero(k, sizeof k);
}

static const char *missing_field(const struct sigv4_req *r, const struct s3_creds *c) {
  if (r->method == NULL || r->method[0] == '\0') return "method";
  if (r->host == NULL || r->host[0] == '\0') return "host";
  if (r->path == NULL || r->path[0] != '/') return "path (must start with '/')";
  if (r->region == NULL || r->region[0] == '\0') return "region";
  if (r->service == NULL || r->service[0] == '\0') return "service";
  if (r->nhdrs > 0 && (r->hdr_names == NULL || r->hdr_values == NULL)) return "headers";
  if (c == NULL || c->access_key[0] == '\0') return "access key id";
  if (c->secret_key[0] == '\0') return "secret key";
  return NULL;
}

int sigv4_compute(const struct sigv4_req *r, const struct s3_creds *c, struct sigv4_parts *out,
                  struct wd_error *err) {
  memset(out, 0, sizeof *out);
  const char *missing = missing_field(r, c);
  if (missing != NULL) return err_set(err, WEIGHTD_E_INVALID, "signing a request: no %s", missing);
  struct tm tm;
  if (gmtime_r(&r->now, &tm) == NULL || strftime(out->amz_date, sizeof out->amz_date, "%Y%m%dT%H%M%SZ", &tm) != 16)
    return err_set(err, WEIGHTD_E_INVALID, "signing a request: the time %lld cannot be written", (long long)r->now);
  char date[9];
  memcpy(date, out->amz_date, 8);
  date[8] = '\0';

  struct hdr *h = NULL;
  size_t nh = 0;
  int rc = collect_headers(r, c, out->amz_date, &h, &nh, err);
  if (rc != 0) return rc;
  struct buf cr = {0}, sh = {0}, sts = {0}, cred = {0};
  buf_add(&cr, "%s\n%s\n%s\n", r->method, r->path, r->query ? r->query : "");
  for (size_t i = 0; i < nh; i++) {
    buf_add(&cr, "%s:%s\n", h[i].name, h[i].value);
    buf_add(&sh, "%s%s", i ? ";" : "", h[i].name);
  }
  hdrs_free(h, nh);
  buf_add(&cr, "\n%s\n%s", sh.failed ? "" : sh.s, r->payload_sha256 ? r->payload_sha256 : SIGV4_EMPTY_SHA256);
  buf_add(&cred, "%s/%s/%s/%s/aws4_request", c->access_key, date, r->region, r->service);
  char crhash[SHA256_HEX_LEN + 1] = "";
  if (!cr.failed) hex_sha256(cr.s, crhash);
  buf_add(&sts, "AWS4-HMAC-SHA256\n%s\n%s/%s/%s/aws4_request\n%s", out->amz_date, date, r->region, r->service, crhash);
  out->canonical_request = buf_take(&cr);
  out->signed_headers = buf_take(&sh);
  out->string_to_sign = buf_take(&sts);
  out->credential = buf_take(&cred);
  if (out->canonical_request == NULL || out->signed_headers == NULL || out->string_to_sign == NULL ||
      out->credential == NULL) {
    sigv4_parts_free(out);
    return err_set(err, WEIGHTD_E_NOMEM, "signing a request: out of memory");
  }
  sign(c->secret_key, date, r->region, r->service, out->string_to_sign, out->signature);
  return 0;
}

void sigv4_parts_free(struct sigv4_parts *p) {
  if (p == NULL) return;
  /* The canonical request holds the session token (a signed header): wiped. */
  if (p->canonical_request != NULL) explicit_bzero(p->canonical_request, strlen(p->canonical_request));
  free(p->canonical_request);
  free(p->string_to_sign);
  free(p->signed_headers);
  free(p->credential);
  memset(p, 0, sizeof *p);
}

/* ---- header lines ------------------------------------------------------------------- */

static char *line_dup(const char *name, const char *value) {
  size_t n = strlen(name) + 2 + strlen(value) + 1;
  char *s = malloc(n);
  if (s != NULL) snprintf(s, n, "%s: %s", name, value);
  return s;
}

int sigv4_headers(const struct sigv4_req *r, const struct s3_creds *c, char ***lines, size_t *n,
                  struct wd_error *err) {
  *lines = NULL;
  *n = 0;
  struct sigv4_parts p;
  int rc = sigv4_compute(r, c, &p, err);
  if (rc != 0) return rc;
  char **l = calloc(4, sizeof *l);
  size_t k = 0;
  if (l != NULL) {
    struct buf auth = {0};
    buf_add(&auth, "AWS4-HMAC-SHA256 Credential=%s, SignedHeaders=%s, Signature=%s", p.credential, p.signed_headers,
            p.signature);
    char *a = buf_take(&auth);
    l[k++] = a ? line_dup("Authorization", a) : NULL;
    free(a);
    l[k++] = line_dup("x-amz-date", p.amz_date);
    if (r->payload_sha256 != NULL) l[k++] = line_dup("x-amz-content-sha256", r->payload_sha256);
    if (c->token != NULL) l[k++] = line_dup("x-amz-security-token", c->token);
  }
  sigv4_parts_free(&p);
  for (size_t i = 0; l != NULL && i < k; i++)
    if (l[i] == NULL) {
      sigv4_lines_free(l, k);
      l = NULL;
    }
  if (l == NULL) return err_set(err, WEIGHTD_E_NOMEM, "signing a request: out of memory");
  *lines = l;
  *n = k;
  return 0;
}

void sigv4_lines_free(char **lines, size_t n) {
  if (lines == NULL) return;
  for (size_t i = 0; i < n; i++) {
    if (lines[i] != NULL) explicit_bzero(lines[i], strlen(lines[i]));
    free(lines[i]);
  }
  free(lines);
}
