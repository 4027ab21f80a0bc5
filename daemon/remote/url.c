/* url.c - parsing, joining and matching remote checkpoint URLs (see url.h). */
#include "url.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "sigv4.h"

/* The text of a URL for a message: quoted, control bytes escaped, cut when long. */
#define QUOTED(text, buf) err_quote((text), strlen(text), (buf), sizeof(buf))

static int refuse(struct wd_error *err, const char *text, const char *why) {
  char q[256];
  return err_set(err, WEIGHTD_E_INVALID, "remote URL '%s': %s", QUOTED(text, q), why);
}

static char *dup_n(const char *s, size_t n) {
  char *d = malloc(n + 1);
  if (d == NULL) return NULL;
  memcpy(d, s, n);
  d[n] = '\0';
  return d;
}

static int hexval(int c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* ---- the key (path) ------------------------------------------------------------ */

/* Characters a URL path may not hold raw (RFC 3986's pchar and '/' aside from these). */
static bool raw_forbidden(unsigned char c) {
  return c <= 0x20 || c == 0x7f || strchr("\"<>\\^`{|}[]", c) != NULL;
}

/* True when s[0..n) is well-formed UTF-8 (no overlongs, no surrogates, at most U+10FFFF). */
static bool utf8_valid(const unsigned char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned char c = s[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      i++;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xc0) != 0x80) return false;
      cp = cp << 6 | (s[i + k] & 0x3f);
    }
    static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += len;
  }
  return true;
}

/*
 * The segment rules on a decoded key: no "." or ".." segment, no empty one
 * except after a trailing '/' (when trailing_ok). Returns NULL or why not.
 */
static const char *segments_bad(const char *key, bool trailing_ok) {
  const char *p = key;
  if (*p == '\0') return NULL;
  for (;;) {
    const char *slash = strchr(p, '/');
    size_t n = slash ? (size_t)(slash - p) : strlen(p);
    if (n == 0 && !(slash == NULL && trailing_ok)) return "an empty path segment ('//', or '/' at an end)";
    if ((n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.'))
      return "a '.' or '..' path segment";
    if (slash == NULL) return NULL;
    p = slash + 1;
  }
}

/*
 * Decodes the path part s[0..n) (after the authority's '/') into a malloc'd
 * key, checking every rule of url.h. Returns 0 or a negative code with err set.
 */
static int decode_key(const char *text, const char *s, size_t n, bool http, char **out, struct wd_error *err) {
  char *key = malloc(n + 1);
  if (key == NULL) return err_set(err, WEIGHTD_E_NOMEM, "remote URL: out of memory");
  size_t o = 0;
  const char *why = NULL;
  for (size_t i = 0; i < n && why == NULL; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '%') {
      int hi = i + 2 < n ? hexval((unsigned char)s[i + 1]) : -1;
      int lo = hi >= 0 ? hexval((unsigned char)s[i + 2]) : -1;
      if (hi < 0 || lo < 0) {
        why = "a '%' not followed by two hex digits";
        break;
      }
      c = (unsigned char)(hi << 4 | lo);
      i += 2;
      if (c == '/' && http) why = "an encoded '/' (%2F) in an http(s) path";
      else if (c == '\\' && http) why = "an encoded '\\' (%5C) in an http(s) path (some servers take it for '/')";
      else if (c < 0x20 || c == 0x7f) why = "an encoded control byte in the path";
    } else if (raw_forbidden(c)) {
      why = c == ' ' ? "a raw space in the path (write %20)" : "a character that must be percent-encoded in the path";
    }
    key[o++] = (char)c;
  }
  key[o] = '\0';
  if (why == NULL && o > RURL_KEY_MAX) why = "a key longer than 1024 bytes";
  if (why == NULL && !utf8_valid((const unsigned char *)key, o)) why = "a path that is not UTF-8";
  if (why == NULL) why = segments_bad(key, true);
  if (why != NULL) {
    free(key);
    return refuse(err, text, why);
  }
  *out = key;
  return 0;
}

/* ---- the authority ------------------------------------------------------------- */

static bool bucket_valid(const char *b, size_t n) {
  if (n < 3 || n > 63) return false;
  for (size_t i = 0; i < n; i++) {
    char c = b[i];
    bool alnum = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
    if (!alnum && c != '.' && c != '-') return false;
    if ((i == 0 || i == n - 1) && !alnum) return false;
    if (c == '.' && b[i + 1] == '.') return false;
  }
  return true;
}

/* A DNS name or an IPv4 address: labels of letters, digits and '-', not starting or ending with '-'. */
static bool hostname_valid(const char *h, size_t n) {
  if (n == 0 || n > 253) return false;
  size_t label = 0;
  for (size_t i = 0; i < n; i++) {
    char c = h[i];
    if (c == '.') {
      if (label == 0 || h[i - 1] == '-') return false;
      label = 0;
      continue;
    }
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
    if (!ok || (label == 0 && c == '-') || ++label > 63) return false;
  }
  return h[n - 1] != '-' && h[n - 1] != '.';
}

/* An IPv6 literal's inside: hex digits, ':' and '.' (an embedded IPv4), at least two colons. */
static bool ipv6_valid(const char *h, size_t n) {
  size_t colons = 0;
  if (n < 2 || n > 45) return false;
  for (size_t i = 0; i < n; i++) {
    if (h[i] == ':') colons++;
    else if (hexval((unsigned char)h[i]) < 0 && h[i] != '.') return false;
  }
  return colons >= 2;
}

/* Parses "HOST[:PORT]" of an http(s) URL into u. */
static int parse_host_port(const char *text, const char *a, size_t n, struct rurl *u, struct wd_error *err) {
  const char *host_end, *port_at = NULL;
  if (n > 0 && a[0] == '[') {
    const char *close = memchr(a, ']', n);
    if (close == NULL || !ipv6_valid(a + 1, (size_t)(close - a - 1))) return refuse(err, text, "a malformed IPv6 address");
    host_end = close + 1;
    if (host_end < a + n) {
      if (*host_end != ':') return refuse(err, text, "text after the IPv6 address");
      port_at = host_end + 1;
    }
  } else {
    const char *colon = memchr(a, ':', n);
    host_end = colon ? colon : a + n;
    if (!hostname_valid(a, (size_t)(host_end - a))) return refuse(err, text, "a malformed host name");
    if (colon) port_at = colon + 1;
  }
  u->port = u->scheme == RURL_HTTPS ? 443 : 80;
  if (port_at != NULL) {
    size_t pn = (size_t)(a + n - port_at);
    long port = 0;
    if (pn == 0 || pn > 5) return refuse(err, text, "a port that is not 1 to 65535");
    for (size_t i = 0; i < pn; i++) {
      if (port_at[i] < '0' || port_at[i] > '9') return refuse(err, text, "a port that is not 1 to 65535");
      port = port * 10 + (port_at[i] - '0');
    }
    if (port < 1 || port > 65535) return refuse(err, text, "a port that is not 1 to 65535");
    u->port = (int)port;
  }
  u->host = dup_n(a, (size_t)(host_end - a));
  if (u->host == NULL) return err_set(err, WEIGHTD_E_NOMEM, "remote URL: out of memory");
  for (char *p = u->host; *p; p++)
    if (*p >= 'A' && *p <= 'Z') *p = (char)(*p - 'A' + 'a');
  return 0;
}

/* ---- parse --------------------------------------------------------------------- */

static const struct {
  const char *prefix;
  enum rurl_scheme scheme;
} schemes[] = {{"s3://", RURL_S3}, {"http://", RURL_HTTP}, {"https://", RURL_HTTPS}};

int rurl_parse(const char *text, struct rurl *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  if (text == NULL || text[0] == '\0') return err_set(err, WEIGHTD_E_INVALID, "remote URL: empty");
  size_t len = strlen(text);
  if (len > RURL_TEXT_MAX) return refuse(err, text, "longer than 4096 bytes");
  size_t skip = 0;
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0] && skip == 0; i++)
    if (strncasecmp(text, schemes[i].prefix, strlen(schemes[i].prefix)) == 0) {
      out->scheme = schemes[i].scheme;
      skip = strlen(schemes[i].prefix);
    }
  if (skip == 0) return refuse(err, text, "the scheme is not s3://, http:// or https://");
  if (strchr(text, '#') != NULL) return refuse(err, text, "a fragment ('#') is not accepted");
  if (strchr(text, '?') != NULL)
    return refuse(err, text, "a query ('?') is not accepted (URLs are shown in logs and status; tokens go in files)");
  const char *a = text + skip;
  const char *slash = strchr(a, '/');
  size_t an = slash ? (size_t)(slash - a) : strlen(a);
  if (memchr(a, '@', an) != NULL)
    return refuse(err, text, "userinfo ('user@' or 'user:password@') is not accepted: credentials never go in URLs");
  int rc;
  if (out->scheme == RURL_S3) {
    if (memchr(a, ':', an) != NULL) return refuse(err, text, "an s3:// URL has no port (the endpoint is configured apart)");
    if (!bucket_valid(a, an))
      return refuse(err, text, "the bucket is not 3 to 63 of a-z, 0-9, '.', '-' starting and ending with a letter or digit");
    out->bucket = dup_n(a, an);
    if (out->bucket == NULL) return err_set(err, WEIGHTD_E_NOMEM, "remote URL: out of memory");
  } else if ((rc = parse_host_port(text, a, an, out, err)) != 0) {
    return rc;
  }
  const char *path = slash ? slash + 1 : a + an;
  return decode_key(text, path, strlen(path), out->scheme != RURL_S3, &out->key, err);
}

/* ---- join, within, format, free ------------------------------------------------- */

static int copy_authority(const struct rurl *base, struct rurl *out) {
  out->scheme = base->scheme;
  out->port = base->port;
  if (base->bucket != NULL && (out->bucket = strdup(base->bucket)) == NULL) return WEIGHTD_E_NOMEM;
  if (base->host != NULL && (out->host = strdup(base->host)) == NULL) return WEIGHTD_E_NOMEM;
  return 0;
}

int rurl_join(const struct rurl *base, const char *rel, struct rurl *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  char q[256];
  const char *why = NULL;
  size_t rn = rel ? strlen(rel) : 0;
  if (rn == 0) why = "is empty";
  else if (rel[0] == '/') why = "starts with '/'";
  else if (!utf8_valid((const unsigned char *)rel, rn)) why = "is not UTF-8";
  else if ((why = segments_bad(rel, false)) == NULL)
    for (size_t i = 0; i < rn && why == NULL; i++)
      if ((unsigned char)rel[i] < 0x20 || rel[i] == 0x7f) why = "holds a control byte";
  if (why != NULL)
    return err_set(err, WEIGHTD_E_INVALID, "name '%s' under a remote root: %s", rel ? QUOTED(rel, q) : "", why);
  size_t bn = strlen(base->key);
  bool sep = bn > 0 && base->key[bn - 1] != '/';
  if (bn + sep + rn > RURL_KEY_MAX)
    return err_set(err, WEIGHTD_E_INVALID, "name '%s' under a remote root: the key would be longer than 1024 bytes",
                   QUOTED(rel, q));
  if (copy_authority(base, out) != 0 || (out->key = malloc(bn + sep + rn + 1)) == NULL) {
    rurl_free(out);
    return err_set(err, WEIGHTD_E_NOMEM, "remote URL: out of memory");
  }
  memcpy(out->key, base->key, bn);
  if (sep) out->key[bn] = '/';
  memcpy(out->key + bn + sep, rel, rn + 1);
  return 0;
}

static bool same_or_null(const char *a, const char *b) {
  return (a == NULL && b == NULL) || (a != NULL && b != NULL && strcmp(a, b) == 0);
}

bool rurl_within(const struct rurl *root, const struct rurl *u) {
  if (root->scheme != u->scheme || root->port != u->port) return false;
  if (!same_or_null(root->bucket, u->bucket) || !same_or_null(root->host, u->host)) return false;
  size_t n = strlen(root->key);
  while (n > 0 && root->key[n - 1] == '/') n--;
  if (n == 0) return true;
  return strncmp(u->key, root->key, n) == 0 && (u->key[n] == '\0' || u->key[n] == '/');
}

char *rurl_format(const struct rurl *u) {
  static const char *const names[] = {[RURL_S3] = "s3", [RURL_HTTP] = "http", [RURL_HTTPS] = "https"};
  size_t klen = sigv4_uri_encode(u->key, true, NULL, 0);
  char *key = malloc(klen + 1);
  if (key == NULL) return NULL;
  sigv4_uri_encode(u->key, true, key, klen + 1);
  char port[16] = "";
  int dflt = u->scheme == RURL_HTTPS ? 443 : 80;
  if (u->scheme != RURL_S3 && u->port != dflt) snprintf(port, sizeof port, ":%d", u->port);
  const char *auth = u->scheme == RURL_S3 ? u->bucket : u->host;
  size_t n = strlen(names[u->scheme]) + 3 + strlen(auth) + strlen(port) + 1 + klen + 1;
  char *s = malloc(n);
  if (s != NULL) snprintf(s, n, "%s://%s%s/%s", names[u->scheme], auth, port, key);
  free(key);
  return s;
}

void rurl_free(struct rurl *u) {
  if (u == NULL) return;
  free(u->bucket);
  free(u->key);
  free(u->host);
  memset(u, 0, sizeof *u);
}
