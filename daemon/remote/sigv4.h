/*
 * sigv4.h - AWS Signature Version 4 for requests to S3-compatible stores,
 * computed here over common/sha256.c (HMAC-SHA256).
 *
 * Why our own and not libcurl's CURLOPT_AWS_SIGV4: with Debian's curl 7.88
 * the caller must still add x-amz-content-sha256 and x-amz-security-token
 * itself and hand over keys percent-encoded and queries sorted and encoded
 * (an unsorted query is refused with 403), so most of the work is ours
 * anyway; our own is a pure function of its inputs, which the published AWS
 * examples test exactly, without a server, and which also runs against a
 * real SeaweedFS that enforces signatures (tests/integration/test_remote_creds.py).
 *
 * The request is described by its canonical parts (the caller sends exactly
 * these: curl must be given the same path, query and Host):
 *   method          "GET", "HEAD", "PUT"
 *   host            the Host header's value: "bucket.s3.us-east-1.amazonaws.com",
 *                   "127.0.0.1:8333" (with ":port" unless it is the scheme's default)
 *   path            the canonical URI, already encoded once: "/" + sigv4_uri_encode(key, '/' kept)
 *                   (S3 encodes once; other services' double encoding is not done)
 *   query           the canonical query string (sigv4_query builds one), "" or NULL for none
 *   payload_sha256  the x-amz-content-sha256 value: "UNSIGNED-PAYLOAD" or the body's hex
 *                   SHA-256; NULL for a service other than S3: no such header is sent and the
 *                   empty body's digest is signed
 *   region, service "us-east-1", "s3"
 *   now             the request's time (the x-amz-date), seconds since the epoch
 *   hdr_names/values/nhdrs
 *                   further headers to sign, which the caller sends too (Range, If-Match,
 *                   Date...); names in any case, values trimmed and inner runs of spaces
 *                   folded as SigV4 says; a name may appear once, and none may be one of the
 *                   headers sigv4 adds (host, authorization, x-amz-date, x-amz-content-sha256,
 *                   x-amz-security-token)
 * Signed headers are always host, x-amz-date, x-amz-content-sha256 (when
 * payload_sha256 is set), x-amz-security-token (when the credentials carry
 * a session token, as S3 wants it: signed) and the extra ones.
 *
 * Secrets: the secret key only enters the HMAC chain (its derived keys are
 * wiped); nothing here formats a message with a key or token in it.
 */
#ifndef WD_REMOTE_SIGV4_H
#define WD_REMOTE_SIGV4_H

#include <stdbool.h>
#include <stddef.h>
#include <time.h>

#include "creds.h"
#include "error.h"
#include "sha256.h"

struct sigv4_req {
  const char *method;
  const char *host;
  const char *path;
  const char *query;
  const char *payload_sha256;
  const char *region;
  const char *service;
  time_t now;
  const char *const *hdr_names;
  const char *const *hdr_values;
  size_t nhdrs;
};

#define SIGV4_UNSIGNED_PAYLOAD "UNSIGNED-PAYLOAD"
/* The SHA-256 of an empty body. */
#define SIGV4_EMPTY_SHA256 "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

/*
 * The header lines to add to the request, each malloc'd "Name: value":
 * "Authorization: AWS4-HMAC-SHA256 Credential=...", "x-amz-date: ...",
 * "x-amz-content-sha256: ..." (when payload_sha256 is set) and
 * "x-amz-security-token: ..." (when c->token is set), in that order, ready
 * for curl_slist_append. Free them with sigv4_lines_free (which wipes the
 * token's line). Returns 0, WEIGHTD_E_INVALID naming the field that is
 * missing or malformed (never a key), or WEIGHTD_E_NOMEM.
 */
int sigv4_headers(const struct sigv4_req *r, const struct s3_creds *c, char ***lines, size_t *n,
                  struct wd_error *err);

/* Frees what sigv4_headers returned; NULL-safe. */
void sigv4_lines_free(char **lines, size_t n);

/*
 * The intermediate texts of a signature, as AWS's documentation shows them
 * (tests compare them with the published examples): malloc'd, freed with
 * sigv4_parts_free.
 */
struct sigv4_parts {
  char *canonical_request;
  char *string_to_sign;
  char *signed_headers; /* "host;range;x-amz-content-sha256;x-amz-date" */
  char *credential;     /* "AKIA.../20130524/us-east-1/s3/aws4_request" */
  char amz_date[17];    /* "20130524T000000Z" */
  char signature[SHA256_HEX_LEN + 1];
};

/* Computes the parts sigv4_headers is made of; same returns. */
int sigv4_compute(const struct sigv4_req *r, const struct s3_creds *c, struct sigv4_parts *out,
                  struct wd_error *err);

void sigv4_parts_free(struct sigv4_parts *p);

/*
 * Percent-encodes in as SigV4 wants it: every byte except A-Z a-z 0-9 - . _ ~
 * (and '/', when slash_ok) becomes %XX with uppercase hex. Writes at most
 * outlen bytes including the NUL (out may be NULL when outlen is 0) and
 * returns the length of the whole encoding, as snprintf does: the output was
 * cut when the return is outlen or more.
 */
size_t sigv4_uri_encode(const char *in, bool slash_ok, char *out, size_t outlen);

/*
 * The canonical query string of n parameters, given decoded: each name and
 * value encoded (sigv4_uri_encode, '/' encoded too), "name=value" pairs
 * sorted by encoded name, then value, joined with '&' ("lifecycle" with
 * value "" gives "lifecycle="). A NULL value is "". The same string is what
 * the request must carry after its '?'. Malloc'd into *out; returns 0 or
 * WEIGHTD_E_NOMEM.
 */
int sigv4_query(const char *const *names, const char *const *values, size_t n, char **out,
                struct wd_error *err);

#endif
