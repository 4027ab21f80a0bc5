/*
 * test_sigv4.c - HMAC-SHA256 (common/sha256.c) against RFC 4231's test
 * cases, and Signature Version 4 (daemon/remote/sigv4.c) against examples
 * AWS publishes: the four S3 examples of "Signature Calculations for the
 * Authorization Header" (GET Object with a Range, PUT Object with a signed
 * payload and a '$' in the key, GET Bucket Lifecycle, GET Bucket with a
 * query), whose canonical requests, strings to sign and signatures are
 * reproduced exactly, and cases of AWS's Signature Version 4 test suite
 * (a service other than S3, no x-amz-content-sha256) for the query's
 * sorting and encoding and for the session token header. Then the encoder
 * and the checks on the caller's headers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote/sigv4.h"
#include "sha256.h"
#include "testutil.h"

/* ---- HMAC-SHA256: RFC 4231, section 4 -------------------------------------------- */

static void hex(const unsigned char *d, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

static void check_hmac(const void *key, size_t kn, const void *msg, size_t mn, const char *want, size_t want_bytes) {
  unsigned char mac[SHA256_DIGEST_LEN];
  char h[2 * SHA256_DIGEST_LEN + 1];
  sha256_hmac(key, kn, msg, mn, mac);
  hex(mac, want_bytes, h);
  if (strcmp(h, want) != 0) fprintf(stderr, "  HMAC %s, expected %s\n", h, want);
  CHECK(strcmp(h, want) == 0);
}

static void test_hmac_rfc4231(void) {
  unsigned char k[131], m[152];
  memset(k, 0x0b, 20);
  check_hmac(k, 20, "Hi There", 8, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7", 32);
  check_hmac("Jefe", 4, "what do ya want for nothing?", 28,
             "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", 32);
  memset(k, 0xaa, 20);
  memset(m, 0xdd, 50);
  check_hmac(k, 20, m, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe", 32);
  for (int i = 0; i < 25; i++) k[i] = (unsigned char)(i + 1);
  memset(m, 0xcd, 50);
  check_hmac(k, 25, m, 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b", 32);
  memset(k, 0x0c, 20);
  check_hmac(k, 20, "Test With Truncation", 20, "a3b6167473100ee06e0c796c2955552b", 16); /* truncated to 128 bits */
  memset(k, 0xaa, 131);
  const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  check_hmac(k, 131, m6, strlen(m6), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54", 32);
  const char *m7 = "This is a test using a larger than block-size key and a larger than block-size data. The key needs "
                   "to be hashed before being used by the HMAC algorithm.";
  check_hmac(k, 131, m7, strlen(m7), "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2", 32);
  /* A key of exactly one block is used as it is, not hashed. */
  unsigned char k64[64];
  memset(k64, 0x11, 64);
  unsigned char a[32], b[32], hk[32];
  sha256_hmac(k64, 64, "x", 1, a);
  struct sha256 s;
  sha256_init(&s);
  sha256_update(&s, k64, 64);
  sha256_final(&s, hk);
  sha256_hmac(hk, 32, "x", 1, b);
  CHECK(memcmp(a, b, 32) != 0);
}

/* ---- the S3 examples ------------------------------------------------------------ */

#define EXAMPLE_TIME 1369353600 /* 2013-05-24T00:00:00Z */

static struct s3_creds example_creds(void) {
  struct s3_creds c = {0};
  strcpy(c.access_key, "AKIAIOSFODNN7EXAMPLE");
  strcpy(c.secret_key, "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY");
  return c;
}

static void check_text(const char *got, const char *want) {
  if (got == NULL || strcmp(got, want) != 0) fprintf(stderr, "  got:\n%s\n  expected:\n%s\n", got ? got : "NULL", want);
  CHECK(got != NULL && strcmp(got, want) == 0);
}

static void test_s3_get_object(void) {
  struct s3_creds c = example_creds();
  const char *names[] = {"Range"}, *values[] = {"bytes=0-9"};
  struct sigv4_req r = {.method = "GET", .host = "examplebucket.s3.amazonaws.com", .path = "/test.txt", .query = "",
                        .payload_sha256 = SIGV4_EMPTY_SHA256, .region = "us-east-1", .service = "s3",
                        .now = EXAMPLE_TIME, .hdr_names = names, .hdr_values = values, .nhdrs = 1};
  struct sigv4_parts p;
  struct wd_error err = {0};
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), 0);
  check_text(p.canonical_request,
             "GET\n/test.txt\n\n"
             "host:examplebucket.s3.amazonaws.com\n"
             "range:bytes=0-9\n"
             "x-amz-content-sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
             "x-amz-date:20130524T000000Z\n\n"
             "host;range;x-amz-content-sha256;x-amz-date\n"
             "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  check_text(p.string_to_sign,
             "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
             "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972");
  check_text(p.signature, "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
  check_text(p.credential, "AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request");
  sigv4_parts_free(&p);

  /* The header lines, as curl gets them. */
  char **lines;
  size_t n;
  CHECK_EQ_INT(sigv4_headers(&r, &c, &lines, &n, &err), 0);
  CHECK_EQ_INT(n, 3);
  if (n == 3) {
    check_text(lines[0], "Authorization: AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/"
                         "aws4_request, SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
                         "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
    check_text(lines[1], "x-amz-date: 20130524T000000Z");
    check_text(lines[2], "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  }
  sigv4_lines_free(lines, n);
}

static void test_s3_put_object(void) {
  struct s3_creds c = example_creds();
  /* The key "test$file.text" is encoded once, as S3 wants. */
  char path[64] = "/";
  CHECK_EQ_INT(sigv4_uri_encode("test$file.text", true, path + 1, sizeof path - 1), 16);
  check_text(path, "/test%24file.text");
  struct sha256 s;
  unsigned char d[32];
  char body_hash[SHA256_HEX_LEN + 1];
  sha256_init(&s);
  sha256_update(&s, "Welcome to Amazon S3.", 21);
  sha256_final(&s, d);
  sha256_hex(d, body_hash);
  check_text(body_hash, "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
  /* Names in mixed case and a value with spaces to trim and fold: canonicalised as SigV4 says. */
  const char *names[] = {"X-Amz-Storage-Class", "Date"};
  const char *values[] = {"  REDUCED_REDUNDANCY ", "Fri,   24 May 2013 00:00:00 GMT"};
  struct sigv4_req r = {.method = "PUT", .host = "examplebucket.s3.amazonaws.com", .path = path,
                        .payload_sha256 = body_hash, .region = "us-east-1", .service = "s3", .now = EXAMPLE_TIME,
                        .hdr_names = names, .hdr_values = values, .nhdrs = 2};
  struct sigv4_parts p;
  struct wd_error err = {0};
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), 0);
  check_text(p.canonical_request,
             "PUT\n/test%24file.text\n\n"
             "date:Fri, 24 May 2013 00:00:00 GMT\n"
             "host:examplebucket.s3.amazonaws.com\n"
             "x-amz-content-sha256:44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072\n"
             "x-amz-date:20130524T000000Z\n"
             "x-amz-storage-class:REDUCED_REDUNDANCY\n\n"
             "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class\n"
             "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
  check_text(p.string_to_sign,
             "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
             "9e0e90d9c76de8fa5b200d8c849cd5b8dc7a3be3951ddb7f6a76b4158342019d");
  check_text(p.signature, "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
  sigv4_parts_free(&p);
}

/* A GET on the bucket with a query given as parameters, signed; returns the signature. */
static void check_bucket_query(const char *const *names, const char *const *values, size_t n, const char *want_query,
                               const char *want_sig) {
  struct s3_creds c = example_creds();
  char *q = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(sigv4_query(names, values, n, &q, &err), 0);
  check_text(q, want_query);
  struct sigv4_req r = {.method = "GET", .host = "examplebucket.s3.amazonaws.com", .path = "/", .query = q,
                        .payload_sha256 = SIGV4_EMPTY_SHA256, .region = "us-east-1", .service = "s3",
                        .now = EXAMPLE_TIME};
  struct sigv4_parts p;
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), 0);
  check_text(p.signed_headers, "host;x-amz-content-sha256;x-amz-date");
  check_text(p.signature, want_sig);
  sigv4_parts_free(&p);
  free(q);
}

static void test_s3_bucket_queries(void) {
  const char *lc[] = {"lifecycle"};
  check_bucket_query(lc, NULL, 1, "lifecycle=", "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543");
  /* Given out of order: sorted. */
  const char *ln[] = {"prefix", "max-keys"}, *lv[] = {"J", "2"};
  check_bucket_query(ln, lv, 2, "max-keys=2&prefix=J", "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
}

/* ---- AWS's Signature Version 4 test suite (service "service", no payload header) ---- */

#define SUITE_TIME 1440938160 /* 2015-08-30T12:36:00Z */

static void check_suite(const char *path, const char *const *qn, const char *const *qv, size_t nq, const char *token,
                        const char *want_signed, const char *want_sig) {
  struct s3_creds c = {0};
  strcpy(c.access_key, "AKIDEXAMPLE");
  strcpy(c.secret_key, "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY");
  c.token = (char *)token;
  char *q = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(sigv4_query(qn, qv, nq, &q, &err), 0);
  struct sigv4_req r = {.method = "GET", .host = "example.amazonaws.com", .path = path, .query = q,
                        .region = "us-east-1", .service = "service", .now = SUITE_TIME};
  struct sigv4_parts p;
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), 0);
  check_text(p.signed_headers, want_signed);
  check_text(p.signature, want_sig);
  sigv4_parts_free(&p);
  free(q);
}

static void test_suite_queries(void) {
  /* get-vanilla-query-order-key-case: "Param2=value2&Param1=value1" sorted. */
  const char *n1[] = {"Param2", "Param1"}, *v1[] = {"value2", "value1"};
  check_suite("/", n1, v1, 2, NULL, "host;x-amz-date", "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500");
  /* get-vanilla-query-unreserved: the unreserved characters are not encoded. */
  const char *un = "-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
  const char *n2[] = {un}, *v2[] = {un};
  check_suite("/", n2, v2, 1, NULL, "host;x-amz-date", "9c3e54bfcdf0b19771a7f523ee5669cdf59bc7cc0884027167c21bb143a40197");
  /* get-vanilla-utf8-query: a UTF-8 name encoded byte by byte. */
  const char *n3[] = {"\xe1\x88\xb4"}, *v3[] = {"bar"};
  check_suite("/", n3, v3, 1, NULL, "host;x-amz-date", "2cdec8eed098649ff3a119c94853b13c643bcf08f8b0a1d91e12c9027818dd04");
  char *q;
  struct wd_error err = {0};
  CHECK_EQ_INT(sigv4_query(n3, v3, 1, &q, &err), 0);
  check_text(q, "%E1%88%B4=bar");
  free(q);
  /* Equal names sort by value; '/' and '=' and ' ' in values are encoded. */
  const char *n4[] = {"b", "a", "a"}, *v4[] = {"x/y", "2 =", "1"};
  CHECK_EQ_INT(sigv4_query(n4, v4, 3, &q, &err), 0);
  check_text(q, "a=1&a=2%20%3D&b=x%2Fy");
  free(q);
  CHECK_EQ_INT(sigv4_query(NULL, NULL, 0, &q, &err), 0);
  check_text(q, "");
  free(q);
}

static void test_suite_session_token(void) {
  /* get-vanilla-with-session-token: the token is a signed header. */
  check_suite("/", NULL, NULL, 0, "6e86291e8372ff2a2260956d9b8aae1d763fbf315fa00fa31553b73ebf194267",
              "host;x-amz-date;x-amz-security-token",
              "07ec1639c89043aa0e3e2de82b96708f198cceab042d4a97044c66dd9f74e7f8");
  /* And sigv4_headers sends it, last. */
  struct s3_creds c = example_creds();
  c.token = "FwoGZXIvYXdzEXAMPLETOKEN";
  struct sigv4_req r = {.method = "HEAD", .host = "127.0.0.1:8333", .path = "/b/k", .payload_sha256 = SIGV4_UNSIGNED_PAYLOAD,
                        .region = "us-east-1", .service = "s3", .now = EXAMPLE_TIME};
  char **lines;
  size_t n;
  struct wd_error err = {0};
  CHECK_EQ_INT(sigv4_headers(&r, &c, &lines, &n, &err), 0);
  CHECK_EQ_INT(n, 4);
  if (n == 4) {
    CHECK_STR_CONTAINS(lines[0], "SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-security-token,");
    check_text(lines[2], "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    check_text(lines[3], "x-amz-security-token: FwoGZXIvYXdzEXAMPLETOKEN");
  }
  sigv4_lines_free(lines, n);
  /* Without a token, no such line and no such signed header. */
  c.token = NULL;
  CHECK_EQ_INT(sigv4_headers(&r, &c, &lines, &n, &err), 0);
  CHECK_EQ_INT(n, 3);
  if (n == 3) CHECK(strstr(lines[0], "x-amz-security-token") == NULL);
  sigv4_lines_free(lines, n);
}

/* ---- the encoder and the checks -------------------------------------------------- */

static void check_enc(const char *in, bool slash_ok, const char *want) {
  char out[128];
  size_t n = sigv4_uri_encode(in, slash_ok, out, sizeof out);
  CHECK_EQ_INT(n, strlen(want));
  check_text(out, want);
}

static void test_uri_encode(void) {
  check_enc("", true, "");
  check_enc("a/b c", true, "a/b%20c");
  check_enc("a/b c", false, "a%2Fb%20c");
  check_enc("AZaz09-._~", false, "AZaz09-._~");
  check_enc("+=&?#%!*'()", true, "%2B%3D%26%3F%23%25%21%2A%27%28%29");
  check_enc("\xc3\xa9", true, "%C3%A9");
  /* Cut output: the length needed is returned, the output ends with a NUL within outlen. */
  char small[4];
  CHECK_EQ_INT(sigv4_uri_encode("a b", true, small, sizeof small), 5);
  CHECK(strlen(small) < sizeof small);
  CHECK_EQ_INT(sigv4_uri_encode("a b", true, NULL, 0), 5);
}

static void test_refusals(void) {
  struct s3_creds c = example_creds();
  struct sigv4_req r = {.method = "GET", .host = "h", .path = "/k", .payload_sha256 = SIGV4_UNSIGNED_PAYLOAD,
                        .region = "us-east-1", .service = "s3", .now = EXAMPLE_TIME};
  struct sigv4_parts p;
  struct wd_error err = {0};
  const char *dn[] = {"Range", "range"}, *dv[] = {"bytes=0-1", "bytes=2-3"};
  r.hdr_names = dn, r.hdr_values = dv, r.nhdrs = 2;
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "header 'range' given twice");
  const char *rn[] = {"X-Amz-Date"}, *rv[] = {"20000101T000000Z"};
  r.hdr_names = rn, r.hdr_values = rv, r.nhdrs = 1;
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "a header sigv4 adds itself");
  const char *bn[] = {"Bad Name"}, *bv[] = {"x"};
  r.hdr_names = bn, r.hdr_values = bv;
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), WEIGHTD_E_INVALID);
  const char *cn[] = {"X-Ok"}, *cv[] = {"a\r\nInjected: 1"};
  r.hdr_names = cn, r.hdr_values = cv;
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "control byte");
  r.nhdrs = 0;
  r.path = "k";
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "path");
  r.path = "/k";
  c.secret_key[0] = '\0';
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "no secret key");
  /* No message names the secret. */
  c = example_creds();
  r.region = "";
  CHECK_EQ_INT(sigv4_compute(&r, &c, &p, &err), WEIGHTD_E_INVALID);
  CHECK(strstr(err.msg, c.secret_key) == NULL);
}

int main(void) {
  RUN(test_hmac_rfc4231);
  RUN(test_s3_get_object);
  RUN(test_s3_put_object);
  RUN(test_s3_bucket_queries);
  RUN(test_suite_queries);
  RUN(test_suite_session_token);
  RUN(test_uri_encode);
  RUN(test_refusals);
  return tu_finish();
}
