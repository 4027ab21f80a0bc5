/*
 * remote_probe.c - the credentials chain and SigV4 (daemon/remote) driven
 * line by line, for tests/integration/test_remote_creds.py against real
 * servers. Not a test by itself.
 *
 * The chain reads the environment as the daemon would (creds_env_from_environ);
 * --duration S sets the web identity sessions' DurationSeconds. The clock
 * the provider sees is the real one until a "clock" command sets it.
 * Commands on stdin, one answer line each on stdout:
 *   source                    "source TEXT"
 *   region                    "region NAME" or "region -"
 *   get                       "ok key=ACCESS_KEY_ID expires=UNIX_MS token=yes|no" or "error CODE MESSAGE"
 *   clock UNIX_MS             "ok"
 *   check SECRET_SHA256 TOKEN_SHA256|-
 *                             "ok secret=match|differ token=match|differ": the current
 *                             credentials compared by digest, so that neither is printed
 *   s3 METHOD URL [FILE|-] [HEADER: VALUE]...
 *                             a request signed with the current credentials (path-style;
 *                             URL's path is sent as it is, its query sorted and encoded;
 *                             FILE the body of a PUT): "status CODE S3_ERROR_CODE|- BODY_SHA256"
 *   open URL                  a remote checkpoint opened (daemon/remote/rckpt.h; s3:// to the
 *                             environment's endpoint, signed): "ok LAYOUT SHARDS TENSORS
 *                             LAYOUT_ID_HEX BYTES" or "error CODE MESSAGE"
 *   tensor URL NAME           the named tensor's bytes read from that checkpoint with range
 *                             GETs: "ok SHA256_HEX" or "error CODE MESSAGE"
 *   quit
 * Log lines of the provider go to stderr as "log LEVEL LINE". It never
 * prints a secret key or a session token.
 */
#include <curl/curl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checkpoint.h"
#include "remote/creds.h"
#include "remote/fetch.h"
#include "remote/rckpt.h"
#include "remote/sigv4.h"
#include "remote/url.h"
#include "sha256.h"

static int64_t fixed_now = -1;

static int64_t probe_clock(void *arg) {
  (void)arg;
  if (fixed_now >= 0) return fixed_now;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void probe_log(void *arg, enum log_level level, const char *line) {
  (void)arg;
  static const char *const names[] = {"error", "warn", "info", "debug"};
  fprintf(stderr, "log %s %s\n", names[level], line);
}

static void digest_hex(const void *p, size_t n, char hex[SHA256_HEX_LEN + 1]) {
  struct sha256 s;
  unsigned char d[SHA256_DIGEST_LEN];
  sha256_init(&s);
  sha256_update(&s, p, n);
  sha256_final(&s, d);
  sha256_hex(d, hex);
}

static void print_error(int rc, const struct wd_error *err) { printf("error %s %s\n", weightd_err_name(rc), err->msg); }

static void cmd_get(struct creds_provider *p) {
  struct s3_creds c;
  struct wd_error err = {0};
  int rc = creds_get(p, &c, &err);
  if (rc != 0) print_error(rc, &err);
  else printf("ok key=%s expires=%lld token=%s\n", c.access_key, (long long)c.expires_unix_ms, c.token ? "yes" : "no");
  creds_clear(&c);
}

static void cmd_check(struct creds_provider *p, const char *secret_hex, const char *token_hex) {
  struct s3_creds c;
  struct wd_error err = {0};
  int rc = creds_get(p, &c, &err);
  if (rc != 0) {
    print_error(rc, &err);
    return;
  }
  char s[SHA256_HEX_LEN + 1], t[SHA256_HEX_LEN + 1] = "-";
  digest_hex(c.secret_key, strlen(c.secret_key), s);
  if (c.token != NULL) digest_hex(c.token, strlen(c.token), t);
  printf("ok secret=%s token=%s\n", strcmp(s, secret_hex) == 0 ? "match" : "differ",
         strcmp(t, token_hex) == 0 ? "match" : "differ");
  creds_clear(&c);
}

/* ---- one signed S3 request ---------------------------------------------------------- */

struct body {
  char *data;
  size_t len;
};

static size_t on_data(char *d, size_t size, size_t n, void *arg) {
  struct body *b = arg;
  char *x = realloc(b->data, b->len + size * n + 1);
  if (x == NULL) return 0;
  memcpy(x + b->len, d, size * n);
  b->data = x;
  b->len += size * n;
  x[b->len] = '\0';
  return size * n;
}

static char *read_all(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  struct body b = {0};
  char chunk[65536];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) on_data(chunk, 1, n, &b);
  fclose(f);
  *len = b.len;
  return b.data ? b.data : calloc(1, 1);
}

/* The query's "name=value" pairs, decoded, sorted and encoded again by sigv4_query. */
static char *canonical_query(const char *q) {
  const char *names[32], *values[32];
  char *copy = strdup(q), *save = NULL, *canon = NULL;
  size_t n = 0;
  for (char *pair = strtok_r(copy, "&", &save); pair && n < 32; pair = strtok_r(NULL, "&", &save)) {
    char *eq = strchr(pair, '=');
    if (eq) *eq = '\0';
    names[n] = pair;
    values[n++] = eq ? eq + 1 : "";
  }
  struct wd_error err = {0};
  sigv4_query(names, values, n, &canon, &err);
  free(copy);
  return canon;
}

static void cmd_s3(struct creds_provider *p, char *method, char *url, char *file, char **hdrs, size_t nh) {
  /* host[:port] and the path (as given), then the query. */
  char *q = strchr(url, '?');
  if (q) *q++ = '\0';
  char *hoststart = strstr(url, "://");
  char *path = hoststart ? strchr(hoststart + 3, '/') : NULL;
  if (path == NULL) {
    printf("error INVALID the URL has no path\n");
    return;
  }
  char host[256];
  snprintf(host, sizeof host, "%.*s", (int)(path - hoststart - 3), hoststart + 3);
  char *query = canonical_query(q ? q : "");
  struct body req = {0};
  char payload[SHA256_HEX_LEN + 1] = SIGV4_UNSIGNED_PAYLOAD;
  if (file != NULL && strcmp(file, "-") != 0) {
    req.data = read_all(file, &req.len);
    digest_hex(req.data, req.len, payload);
  }
  const char *names[8], *values[8];
  for (size_t i = 0; i < nh; i++) {
    char *colon = strchr(hdrs[i], ':');
    if (colon != NULL) *colon = '\0';
    names[i] = hdrs[i];
    values[i] = colon ? colon + 1 : "";
  }
  struct s3_creds c;
  struct wd_error err = {0};
  int rc = creds_get(p, &c, &err);
  const char *region = creds_region(p) ? creds_region(p) : "us-east-1";
  struct sigv4_req r = {.method = method, .host = host, .path = path, .query = query, .payload_sha256 = payload,
                        .region = region, .service = "s3", .now = (time_t)(probe_clock(NULL) / 1000),
                        .hdr_names = names, .hdr_values = values, .nhdrs = nh};
  char **lines = NULL;
  size_t n = 0;
  if (rc == 0) rc = sigv4_headers(&r, &c, &lines, &n, &err);
  creds_clear(&c);
  if (rc != 0) {
    print_error(rc, &err);
    free(query);
    free(req.data);
    return;
  }
  struct curl_slist *hl = NULL;
  for (size_t i = 0; i < n; i++) hl = curl_slist_append(hl, lines[i]);
  char extra[512];
  for (size_t i = 0; i < nh; i++) {
    snprintf(extra, sizeof extra, "%s:%s", names[i], values[i]);
    hl = curl_slist_append(hl, extra);
  }
  sigv4_lines_free(lines, n);
  char full[4096];
  snprintf(full, sizeof full, "%s%s%s", url, query[0] ? "?" : "", query);
  CURL *h = curl_easy_init();
  struct body answer = {0};
  curl_easy_setopt(h, CURLOPT_URL, full);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
  curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_data);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &answer);
  curl_easy_setopt(h, CURLOPT_TIMEOUT, 30L);
  if (strcmp(method, "HEAD") == 0) curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  else if (strcmp(method, "GET") != 0) curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
  if (strcmp(method, "PUT") == 0) {
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, req.data ? req.data : "");
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)req.len);
  }
  CURLcode cc = curl_easy_perform(h);
  long status = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
  char code[128] = "-", digest[SHA256_HEX_LEN + 1];
  const char *b = answer.data ? answer.data : "";
  const char *cs = strstr(b, "<Code>"), *ce = cs ? strstr(cs, "</Code>") : NULL;
  if (cs && ce && ce - cs - 6 < (long)sizeof code) snprintf(code, sizeof code, "%.*s", (int)(ce - cs - 6), cs + 6);
  digest_hex(b, answer.len, digest);
  if (cc != CURLE_OK) printf("error IO %s\n", curl_easy_strerror(cc));
  else printf("status %ld %s %s\n", status, code, digest);
  curl_easy_cleanup(h);
  curl_slist_free_all(hl);
  free(answer.data);
  free(req.data);
  free(query);
}

/* ---- remote checkpoints ----------------------------------------------------------------- */

static int open_remote(struct creds_provider *p, struct rf_client **client, struct rck_target *t, const char *url,
                       struct rck **out, struct wd_error *err) {
  if (*client == NULL) {
    struct rf_config cfg;
    rf_config_defaults(&cfg);
    cfg.ca_file = getenv("WD_PROBE_CA_FILE");
    int rc = rf_client_create(&cfg, client, err);
    if (rc != 0) return rc;
  }
  memset(t, 0, sizeof *t);
  t->client = *client;
  t->creds = getenv("WD_PROBE_UNSIGNED") ? NULL : p;
  t->s3_region = creds_region(p);
  t->manifest = true;
  int rc = rck_s3_endpoint_from_env(t->s3_region, &t->s3_endpoint, &t->s3_path_style, err);
  return rc != 0 ? rc : rck_open(t, url, out, err);
}

static void cmd_open(struct creds_provider *p, struct rf_client **client, const char *url) {
  struct rck_target t;
  struct rck *r = NULL;
  struct wd_error err = {0};
  int rc = open_remote(p, client, &t, url, &r, &err);
  if (rc != 0) {
    print_error(rc, &err);
    return;
  }
  char hex[2 * CKPT_ID_BYTES + 1];
  for (size_t i = 0; i < CKPT_ID_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", r->ck->layout_id[i]);
  printf("ok %s %zu %zu %s %llu\n", ckpt_layout_name(r->ck->layout), r->ck->nshards, r->ck->ntensors, hex,
         (unsigned long long)r->ck->total_bytes);
  rck_close(r);
}

static void cmd_tensor(struct creds_provider *p, struct rf_client **client, const char *url, const char *name) {
  struct rck_target t;
  struct rck *r = NULL;
  struct wd_error err = {0};
  int rc = open_remote(p, client, &t, url, &r, &err);
  if (rc != 0) {
    print_error(rc, &err);
    return;
  }
  const struct ckpt_ref *ref = ckpt_tensor_find(r->ck, name);
  if (ref == NULL) {
    printf("error NOT_FOUND no tensor %s\n", name);
    rck_close(r);
    return;
  }
  const struct st_header *h = r->ck->shards[ref->shard].hdr;
  uint64_t n = ref->t->end - ref->t->begin;
  unsigned char *buf = malloc(n ? n : 1);
  rc = buf ? rck_read(r, ref->shard, h->data_start + ref->t->begin, n, buf, NULL, &err) : WEIGHTD_E_NOMEM;
  if (rc != 0) {
    print_error(rc, &err);
  } else {
    char hex[SHA256_HEX_LEN + 1];
    digest_hex(buf, (size_t)n, hex);
    printf("ok %s\n", hex);
  }
  free(buf);
  rck_close(r);
}

/* ---- the loop -------------------------------------------------------------------------- */

int main(int argc, char **argv) {
  struct creds_env e;
  creds_env_from_environ(&e);
  for (int i = 1; i + 1 < argc; i += 2)
    if (strcmp(argv[i], "--duration") == 0) e.duration_s = (unsigned)strtoul(argv[i + 1], NULL, 10);
  curl_global_init(CURL_GLOBAL_DEFAULT);
  struct creds_hooks hooks = {.clock_ms = probe_clock, .log = probe_log};
  struct creds_provider *p = NULL;
  struct wd_error err = {0};
  int rc = creds_provider_create(&e, &hooks, &p, &err);
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (rc != 0) {
    print_error(rc, &err);
    return 2;
  }
  struct rf_client *client = NULL;
  char line[8192];
  while (fgets(line, sizeof line, stdin) != NULL) {
    line[strcspn(line, "\r\n")] = '\0';
    char *words[16];
    size_t n = 0;
    char *save = NULL;
    for (char *w = strtok_r(line, " ", &save); w && n < 16; w = strtok_r(NULL, " ", &save)) words[n++] = w;
    if (n == 0) continue;
    if (strcmp(words[0], "quit") == 0) break;
    if (strcmp(words[0], "source") == 0) printf("source %s\n", creds_source(p));
    else if (strcmp(words[0], "region") == 0) printf("region %s\n", creds_region(p) ? creds_region(p) : "-");
    else if (strcmp(words[0], "get") == 0) cmd_get(p);
    else if (strcmp(words[0], "clock") == 0 && n == 2) {
      fixed_now = strtoll(words[1], NULL, 10);
      printf("ok\n");
    } else if (strcmp(words[0], "check") == 0 && n == 3) cmd_check(p, words[1], words[2]);
    else if (strcmp(words[0], "s3") == 0 && n >= 3) {
      /* Headers are "Name:value" words (no spaces in the value). */
      size_t nh = n > 4 ? n - 4 : 0;
      cmd_s3(p, words[1], words[2], n > 3 ? words[3] : NULL, words + 4, nh < 8 ? nh : 8);
    } else if (strcmp(words[0], "open") == 0 && n == 2) cmd_open(p, &client, words[1]);
    else if (strcmp(words[0], "tensor") == 0 && n == 3) cmd_tensor(p, &client, words[1], words[2]);
    else printf("error INVALID unknown command\n");
  }
  rf_client_free(client);
  creds_provider_free(p);
  curl_global_cleanup();
  return 0;
}
