/*
 * url.h - the URLs of remote checkpoints: s3://BUCKET[/KEY] and
 * http(s)://HOST[:PORT][/PATH], parsed strictly.
 *
 * A URL names an object store's bucket and key, or an HTTP server's path;
 * it never carries a secret, so that URLs can go into logs, errors and
 * status as they are: userinfo ("user:pass@"), a query and a fragment are
 * refused (credentials come from the AWS chain, daemon/remote/creds.h, or a
 * bearer token file). What is accepted:
 *
 *   s3://BUCKET             key ""
 *   s3://BUCKET/            key ""
 *   s3://BUCKET/KEY         key "KEY" (an object, or a prefix: "models/llama/")
 *   http(s)://HOST[:PORT]/PATH
 *
 * The scheme is matched without regard to case. BUCKET follows S3's naming
 * rules: 3 to 63 of a-z, 0-9, '.' and '-', starting and ending with a
 * letter or digit, no "..". HOST is a DNS name (letters, digits, '-' and
 * '.'; lowercased), an IPv4 address, or an IPv6 address in brackets
 * ("[::1]", kept with its brackets so that it can go into a URL and a Host
 * header as it is). PORT is 1 to 65535, defaulting to 80 (http) or 443
 * (https); s3:// URLs have no port (the endpoint is configured apart).
 *
 * KEY and PATH are stored decoded: "%20" is a space, "%24" a '$', and the
 * key is the object's name as the store knows it (a request encodes it
 * again with sigv4_uri_encode). Raw characters that a URL path may not hold
 * (space, control bytes, '"', '<', '>', '\\', '^', '`', '{', '|', '}', '[',
 * ']') must be percent-encoded; bytes of 0x80 and above may be raw or
 * encoded; the decoded key must be UTF-8 without NUL or control bytes, at
 * most RURL_KEY_MAX bytes. Because keys are matched by prefix against the
 * allow-list of remote roots (rurl_within), a key's segments may not be "."
 * or ".." (raw or encoded) and may not be empty ("a//b"), except that a
 * trailing '/' names a prefix; in http(s) paths an encoded '/' (%2F) or
 * '\\' (%5C) is refused too, since servers disagree on whether it
 * separates segments.
 *
 * The whole text is at most RURL_TEXT_MAX bytes.
 */
#ifndef WD_REMOTE_URL_H
#define WD_REMOTE_URL_H

#include <stdbool.h>
#include <stddef.h>

#include "error.h"

#define RURL_TEXT_MAX 4096 /* bytes of a URL's text */
#define RURL_KEY_MAX 1024  /* bytes of a decoded key (S3's own limit) */

enum rurl_scheme { RURL_S3, RURL_HTTP, RURL_HTTPS };

struct rurl {
  enum rurl_scheme scheme;
  char *bucket; /* s3: the bucket; NULL for http(s) */
  char *key;    /* s3: the object key or prefix, http(s): the path; decoded, no leading '/', may be "" */
  char *host;   /* http(s): lowercased host, IPv6 in brackets; NULL for s3 */
  int port;     /* http(s): the port, explicit or the scheme's default; 0 for s3 */
};

/*
 * Parses text into out (zeroed first; the caller frees it with rurl_free,
 * also after a failure). Returns 0, WEIGHTD_E_INVALID with err naming the
 * URL and the rule it breaks, or WEIGHTD_E_NOMEM.
 */
int rurl_parse(const char *text, struct rurl *out, struct wd_error *err);

/*
 * Writes into out the object named rel under base: base's key as a
 * directory ("a/b" and "a/b/" alike) followed by rel, a relative name in
 * the same decoded form as a key ("model-00001-of-00002.safetensors",
 * "sub/x.json"; no leading '/', no "." or ".." or empty segments, no
 * trailing '/'). Returns 0, WEIGHTD_E_INVALID naming rel, or
 * WEIGHTD_E_NOMEM; out is freed with rurl_free in every case.
 */
int rurl_join(const struct rurl *base, const char *rel, struct rurl *out, struct wd_error *err);

/*
 * True when u lies within root: the same scheme, bucket or host and port,
 * and root's key is u's key or a prefix of it at a segment boundary (root
 * "models" holds "models" and "models/x", not "models2"; root "" holds the
 * whole bucket or server).
 */
bool rurl_within(const struct rurl *root, const struct rurl *u);

/*
 * The URL as text, its key percent-encoded again (sigv4_uri_encode's rules,
 * '/' kept), the port written only where it is not the default: the form
 * errors, logs and status show. Malloc'd; NULL when out of memory.
 */
char *rurl_format(const struct rurl *u);

/* Frees u's strings and zeroes it; NULL-safe, and safe on a zeroed struct. */
void rurl_free(struct rurl *u);

#endif
