/*
 * test_remote_url.c - remote checkpoint URLs (daemon/remote/url.c): a table
 * of texts accepted (with what each part parses to) and refused (with the
 * rule the message names), joining shard names under a root, the remote
 * roots' prefix match, and the text written back.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote/url.h"
#include "testutil.h"

struct accept_case {
  const char *text;
  enum rurl_scheme scheme;
  const char *bucket, *host;
  int port;
  const char *key;
};

static const struct accept_case accepted[] = {
    {"s3://bucket", RURL_S3, "bucket", NULL, 0, ""},
    {"s3://bucket/", RURL_S3, "bucket", NULL, 0, ""},
    {"s3://my.bucket-1/models/llama/", RURL_S3, "my.bucket-1", NULL, 0, "models/llama/"},
    {"s3://abc/model-00001-of-00002.safetensors", RURL_S3, "abc", NULL, 0, "model-00001-of-00002.safetensors"},
    {"S3://abc/k", RURL_S3, "abc", NULL, 0, "k"},
    {"s3://abc/a%20b/c%24d", RURL_S3, "abc", NULL, 0, "a b/c$d"},
    {"s3://abc/100%25", RURL_S3, "abc", NULL, 0, "100%"},
    {"s3://abc/a%2Fb", RURL_S3, "abc", NULL, 0, "a/b"},
    {"s3://abc/\xc3\xa9t\xc3\xa9", RURL_S3, "abc", NULL, 0, "\xc3\xa9t\xc3\xa9"},
    {"s3://abc/%C3%A9", RURL_S3, "abc", NULL, 0, "\xc3\xa9"},
    {"s3://abc/a+b=c,d;e:f@g!h", RURL_S3, "abc", NULL, 0, "a+b=c,d;e:f@g!h"},
    {"https://huggingface.co/org/model/resolve/main/model.safetensors", RURL_HTTPS, NULL, "huggingface.co", 443,
     "org/model/resolve/main/model.safetensors"},
    {"http://Example.COM", RURL_HTTP, NULL, "example.com", 80, ""},
    {"http://example.com/", RURL_HTTP, NULL, "example.com", 80, ""},
    {"http://127.0.0.1:8333/b/k", RURL_HTTP, NULL, "127.0.0.1", 8333, "b/k"},
    {"https://host:1/x", RURL_HTTPS, NULL, "host", 1, "x"},
    {"https://host:65535/x", RURL_HTTPS, NULL, "host", 65535, "x"},
    {"http://[::1]:9000/x", RURL_HTTP, NULL, "[::1]", 9000, "x"},
    {"http://[fd00:ec2::254]/latest/", RURL_HTTP, NULL, "[fd00:ec2::254]", 80, "latest/"},
    {"https://h/a%20b", RURL_HTTPS, NULL, "h", 443, "a b"},
};

struct refuse_case {
  const char *text;
  const char *why; /* a part of the message */
};

static const struct refuse_case refused[] = {
    {"", "empty"},
    {"ftp://host/x", "scheme"},
    {"s3:/bucket/x", "scheme"},
    {"file:///etc/passwd", "scheme"},
    {"s3://user@bucket/x", "userinfo"},
    {"s3://AKIA:secret@bucket/x", "userinfo"},
    {"https://user:pass@host/x", "userinfo"},
    {"https://token@host/x", "userinfo"},
    {"https://host/x?X-Amz-Signature=abc", "query"},
    {"s3://bucket/x?versionId=1", "query"},
    {"https://host/x#frag", "fragment"},
    {"s3://bucket:443/x", "no port"},
    {"s3://ab/x", "bucket"},
    {"s3://Bucket/x", "bucket"},
    {"s3://bucket_1/x", "bucket"},
    {"s3://-bucket/x", "bucket"},
    {"s3://bucket-/x", "bucket"},
    {"s3://a..b/x", "bucket"},
    {"s3:///x", "bucket"},
    {"s3://bucket/a b", "raw space"},
    {"s3://bucket/a\tb", "percent-encoded"},
    {"s3://bucket/a|b", "percent-encoded"},
    {"s3://bucket/a%2", "two hex digits"},
    {"s3://bucket/a%zz", "two hex digits"},
    {"s3://bucket/a%00b", "control byte"},
    {"s3://bucket/a%0Ab", "control byte"},
    {"s3://bucket/a/../b", "'..'"},
    {"s3://bucket/a/%2E%2E/b", "'..'"},
    {"s3://bucket/./b", "'.'"},
    {"s3://bucket/a//b", "empty path segment"},
    {"s3://bucket//a", "empty path segment"},
    {"s3://abc/%2Fx", "empty path segment"}, /* decodes to "/x" */
    {"s3://bucket/%FF", "UTF-8"},
    {"s3://bucket/\xc0\xaf", "UTF-8"},
    {"https://host/a%2Fb", "%2F"},
    {"https://host:0/x", "port"},
    {"https://host:65536/x", "port"},
    {"https://host:/x", "port"},
    {"https://host:80a/x", "port"},
    {"https://host:-1/x", "port"},
    {"https:///x", "host name"},
    {"https://ho_st/x", "host name"},
    {"https://-host/x", "host name"},
    {"https://host./x", "host name"},
    {"https://[::1/x", "IPv6"},
    {"https://[zz::1]/x", "IPv6"},
    {"https://[::1]x/y", "after the IPv6"},
};

static void test_accepted(void) {
  for (size_t i = 0; i < sizeof accepted / sizeof accepted[0]; i++) {
    const struct accept_case *c = &accepted[i];
    struct rurl u;
    struct wd_error err = {0};
    int rc = rurl_parse(c->text, &u, &err);
    if (rc != 0) fprintf(stderr, "  %s: %s\n", c->text, err.msg);
    CHECK_EQ_INT(rc, 0);
    if (rc == 0) {
      CHECK_EQ_INT(u.scheme, c->scheme);
      CHECK(c->bucket ? u.bucket && strcmp(u.bucket, c->bucket) == 0 : u.bucket == NULL);
      CHECK(c->host ? u.host && strcmp(u.host, c->host) == 0 : u.host == NULL);
      CHECK_EQ_INT(u.port, c->port);
      if (strcmp(u.key, c->key) != 0) fprintf(stderr, "  %s: key '%s', expected '%s'\n", c->text, u.key, c->key);
      CHECK(strcmp(u.key, c->key) == 0);
    }
    rurl_free(&u);
  }
}

static void test_refused(void) {
  for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
    struct rurl u;
    struct wd_error err = {0};
    int rc = rurl_parse(refused[i].text, &u, &err);
    if (rc != WEIGHTD_E_INVALID || strstr(err.msg, refused[i].why) == NULL)
      fprintf(stderr, "  '%s': rc %d, message '%s', expected one naming '%s'\n", refused[i].text, rc, err.msg,
              refused[i].why);
    CHECK_EQ_INT(rc, WEIGHTD_E_INVALID);
    CHECK_STR_CONTAINS(err.msg, refused[i].why);
    rurl_free(&u);
  }
  /* The message quotes the URL, so that an operator sees which one. */
  struct rurl u;
  struct wd_error err = {0};
  CHECK_EQ_INT(rurl_parse("https://user:pass@host/x", &u, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "remote URL 'https://user:pass@host/x'");
  rurl_free(&u);
  /* Too long and too long a key. */
  char *big = malloc(RURL_TEXT_MAX + 16);
  memcpy(big, "s3://bucket/", 12);
  memset(big + 12, 'a', RURL_TEXT_MAX);
  big[RURL_TEXT_MAX + 12] = '\0';
  CHECK_EQ_INT(rurl_parse(big, &u, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "longer than 4096");
  rurl_free(&u);
  big[12 + RURL_KEY_MAX + 1] = '\0';
  CHECK_EQ_INT(rurl_parse(big, &u, &err), WEIGHTD_E_INVALID);
  CHECK_STR_CONTAINS(err.msg, "longer than 1024");
  rurl_free(&u);
  big[12 + RURL_KEY_MAX] = '\0';
  CHECK_EQ_INT(rurl_parse(big, &u, &err), 0);
  rurl_free(&u);
  free(big);
}

static void check_join(const char *base, const char *rel, const char *want_key) {
  struct rurl b, j;
  struct wd_error err = {0};
  CHECK_EQ_INT(rurl_parse(base, &b, &err), 0);
  int rc = rurl_join(&b, rel, &j, &err);
  CHECK_EQ_INT(rc, 0);
  if (rc == 0) {
    CHECK(strcmp(j.key, want_key) == 0);
    CHECK(j.scheme == b.scheme && j.port == b.port);
    CHECK(b.bucket ? strcmp(j.bucket, b.bucket) == 0 : j.bucket == NULL);
    CHECK(b.host ? strcmp(j.host, b.host) == 0 : j.host == NULL);
  }
  rurl_free(&j);
  rurl_free(&b);
}

static void test_join(void) {
  check_join("s3://bucket/models/llama", "model.safetensors", "models/llama/model.safetensors");
  check_join("s3://bucket/models/llama/", "model.safetensors", "models/llama/model.safetensors");
  check_join("s3://bucket", "config.json", "config.json");
  check_join("https://host:8443/a/b/", "sub/x y.json", "a/b/sub/x y.json");
  struct rurl b, j;
  struct wd_error err = {0};
  CHECK_EQ_INT(rurl_parse("s3://bucket/m/", &b, &err), 0);
  const char *bad[] = {"", "/abs", "..", "a/../b", "a//b", "a/", "./x", "a\nb"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK_EQ_INT(rurl_join(&b, bad[i], &j, &err), WEIGHTD_E_INVALID);
    CHECK_STR_CONTAINS(err.msg, "under a remote root");
    CHECK(j.key == NULL);
    rurl_free(&j);
  }
  rurl_free(&b);
}

static bool within(const char *root, const char *u) {
  struct rurl r, x;
  struct wd_error err = {0};
  int a = rurl_parse(root, &r, &err), b = rurl_parse(u, &x, &err);
  CHECK(a == 0 && b == 0);
  bool w = a == 0 && b == 0 && rurl_within(&r, &x);
  rurl_free(&r);
  rurl_free(&x);
  return w;
}

static void test_within(void) {
  CHECK(within("s3://bucket", "s3://bucket/any/thing"));
  CHECK(within("s3://bucket/models", "s3://bucket/models"));
  CHECK(within("s3://bucket/models", "s3://bucket/models/a"));
  CHECK(within("s3://bucket/models/", "s3://bucket/models/a"));
  CHECK(!within("s3://bucket/models", "s3://bucket/models2/a"));
  CHECK(!within("s3://bucket/models", "s3://bucket/model"));
  CHECK(!within("s3://bucket/models", "s3://bucket2/models/a"));
  CHECK(!within("s3://bucket/models", "https://bucket/models/a"));
  CHECK(within("https://huggingface.co/org", "https://huggingface.co/org/m/resolve/main/x"));
  CHECK(within("https://huggingface.co:443/org", "https://HUGGINGFACE.co/org/x"));
  CHECK(!within("https://huggingface.co/org", "https://huggingface.co:8443/org/x"));
  CHECK(!within("https://huggingface.co/org", "http://huggingface.co/org/x"));
  CHECK(!within("https://huggingface.co/org", "https://evil.co/org/x"));
  /* The encodings of one key are one key. */
  CHECK(within("s3://bucket/abc", "s3://bucket/a%62c/x"));
  CHECK(within("https://h/a%20b", "https://h/a%20b/x"));
  CHECK(!within("https://h/a%20b", "https://h/a%2520b/x"));
}

static void check_format(const char *in, const char *want) {
  struct rurl u;
  struct wd_error err = {0};
  CHECK_EQ_INT(rurl_parse(in, &u, &err), 0);
  char *s = rurl_format(&u);
  if (s == NULL || strcmp(s, want) != 0) fprintf(stderr, "  format(%s) = %s, expected %s\n", in, s ? s : "NULL", want);
  CHECK(s != NULL && strcmp(s, want) == 0);
  /* What is written parses back to the same URL. */
  struct rurl v;
  CHECK_EQ_INT(rurl_parse(s, &v, &err), 0);
  CHECK(v.scheme == u.scheme && v.port == u.port && strcmp(v.key, u.key) == 0);
  rurl_free(&v);
  free(s);
  rurl_free(&u);
}

static void test_format(void) {
  check_format("s3://bucket", "s3://bucket/");
  check_format("S3://bucket/a%20b%2Fc", "s3://bucket/a%20b/c");
  check_format("s3://bucket/a%20b/c%24~_-.", "s3://bucket/a%20b/c%24~_-.");
  check_format("https://host:443/x", "https://host/x");
  check_format("http://host:80/x", "http://host/x");
  check_format("http://HOST:8080/x", "http://host:8080/x");
  check_format("http://[::1]:9000/", "http://[::1]:9000/");
  check_format("s3://bucket/%C3%A9", "s3://bucket/%C3%A9");
}

int main(void) {
  RUN(test_accepted);
  RUN(test_refused);
  RUN(test_join);
  RUN(test_within);
  RUN(test_format);
  return tu_finish();
}
