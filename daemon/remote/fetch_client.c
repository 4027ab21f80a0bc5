/*
 * fetch_client.c - the remote client itself (see fetch.h): its
 * configuration and defaults, the libcurl multi handle and the loop thread
 * it starts (fetch_loop.c), the counters; and the pieces with no I/O that
 * the calls (fetch.c) and the unit tests use: backoff, the retry verdict,
 * Content-Range and S3 error bodies.
 */
#include "fetch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "fetch_internal.h"

/* ---- pure pieces ------------------------------------------------------------ */

uint64_t rf_backoff_ms(unsigned base_ms, unsigned max_ms, unsigned attempt, uint64_t rnd) {
  uint64_t cap = base_ms;
  for (unsigned i = 1; i < attempt && cap < max_ms; i++) cap *= 2;
  if (cap > max_ms) cap = max_ms;
  return rnd % (cap + 1);
}

enum rf_retry_verdict rf_retry_decide(const struct rf_config *c, unsigned attempt, uint64_t elapsed_ms,
                                      uint64_t retry_after_ms, uint64_t rnd, uint64_t *delay_ms) {
  *delay_ms = 0;
  if (attempt > c->retries) return RF_GIVE_UP_COUNT;
  uint64_t d = rf_backoff_ms(c->backoff_base_ms, c->backoff_max_ms, attempt, rnd);
  if (retry_after_ms > d) d = retry_after_ms;
  if (elapsed_ms + d > c->retry_budget_ms) return RF_GIVE_UP_BUDGET;
  *delay_ms = d;
  return RF_RETRY;
}

static int parse_u64(const char **p, uint64_t *out) {
  const char *s = *p;
  if (*s < '0' || *s > '9') return -1;
  uint64_t v = 0;
  for (; *s >= '0' && *s <= '9'; s++) {
    uint64_t d = (uint64_t)(*s - '0');
    if (v > UINT64_MAX / 10 || (v == UINT64_MAX / 10 && d > UINT64_MAX % 10)) return -1;
    v = v * 10 + d;
  }
  *out = v;
  *p = s;
  return 0;
}

int rf_content_range_parse(const char *v, uint64_t *first, uint64_t *last, uint64_t *total) {
  if (strncmp(v, "bytes ", 6) != 0) return -1;
  const char *p = v + 6;
  if (*p == '*') {
    *first = *last = UINT64_MAX;
    p++;
  } else {
    if (parse_u64(&p, first) != 0 || *p++ != '-' || parse_u64(&p, last) != 0 || *last < *first) return -1;
  }
  if (*p++ != '/') return -1;
  if (*p == '*' && p[1] == '\0') {
    if (*first == UINT64_MAX) return -1; /* a star for both the range and the total says nothing */
    *total = UINT64_MAX;
    return 0;
  }
  if (parse_u64(&p, total) != 0 || *p != '\0') return -1;
  if (*first != UINT64_MAX && *last >= *total) return -1;
  return 0;
}

void rf_s3_error_code(const char *body, size_t len, char *code, size_t codelen) {
  code[0] = '\0';
  const char *open = memmem(body, len, "<Code>", 6);
  if (open == NULL) return;
  const char *s = open + 6;
  const char *close = memmem(s, len - (size_t)(s - body), "</Code>", 7);
  if (close == NULL) return;
  size_t o = 0;
  for (; s < close && o + 1 < codelen; s++)
    if (*s > ' ' && *s < 127) code[o++] = *s;
  code[o] = '\0';
}

/* ---- configuration, client ------------------------------------------------- */

void rf_config_defaults(struct rf_config *c) {
  *c = (struct rf_config){
      .max_connections = 16,
      .part_bytes = 8u << 20,
      .retries = 5,
      .retry_budget_ms = 30000,
      .backoff_base_ms = 100,
      .backoff_max_ms = 5000,
      .stall_ms = 10000,
      .connect_timeout_ms = 5000,
  };
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;

static void curl_init_once(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

static int config_check(const struct rf_config *c, struct wd_error *err) {
  if (c->max_connections < 1 || c->max_connections > 1024)
    return err_set(err, WEIGHTD_E_INVALID, "remote client: max_connections %u is not in 1..1024", c->max_connections);
  if (c->part_bytes < 4096 || c->part_bytes > (1ull << 30))
    return err_set(err, WEIGHTD_E_INVALID, "remote client: part_bytes %llu is not between 4096 and 1 GiB",
                   (unsigned long long)c->part_bytes);
  if (c->backoff_max_ms < c->backoff_base_ms)
    return err_set(err, WEIGHTD_E_INVALID, "remote client: backoff_max_ms %u is below backoff_base_ms %u",
                   c->backoff_max_ms, c->backoff_base_ms);
  return 0;
}

int rf_client_create(const struct rf_config *cfg, struct rf_client **out, struct wd_error *err) {
  *out = NULL;
  int rc = config_check(cfg, err);
  if (rc != 0) return rc;
  pthread_once(&curl_once, curl_init_once);
  if (curl_init_rc != CURLE_OK)
    return err_set(err, WEIGHTD_E_IO, "remote client: libcurl: %s", curl_easy_strerror(curl_init_rc));
  struct rf_client *c = calloc(1, sizeof *c);
  if (c == NULL) return err_set(err, WEIGHTD_E_NOMEM, "remote client: out of memory");
  c->cfg = *cfg;
  c->cfg.ca_file = NULL;
  pthread_mutex_init(&c->lock, NULL);
  atomic_init(&c->rng, clock_ns() ^ (uint64_t)(uintptr_t)c);
  if (cfg->ca_file && (c->ca_file = strdup(cfg->ca_file)) == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "remote client: out of memory");
    goto fail;
  }
  c->multi = curl_multi_init();
  if (c->multi == NULL) {
    rc = err_set(err, WEIGHTD_E_IO, "remote client: curl_multi_init failed");
    goto fail;
  }
  curl_multi_setopt(c->multi, CURLMOPT_PIPELINING, (long)CURLPIPE_MULTIPLEX);
  curl_multi_setopt(c->multi, CURLMOPT_MAX_HOST_CONNECTIONS, (long)cfg->max_connections);
  curl_multi_setopt(c->multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, (long)cfg->max_connections);
  curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, (long)cfg->max_connections); /* idle ones kept */
  rc = loop_start(c, err);
  if (rc != 0) goto fail;
  *out = c;
  return 0;
fail:
  rf_client_free(c);
  return rc;
}

void rf_client_free(struct rf_client *c) {
  if (c == NULL) return;
  loop_stop(c);
  if (c->multi) curl_multi_cleanup(c->multi);
  pthread_mutex_destroy(&c->lock);
  free(c->ca_file);
  free(c);
}

void rf_client_stats(struct rf_client *c, struct rf_stats *out) {
  for (int i = 0; i < 6; i++) out->requests[i] = atomic_load(&c->stats.requests[i]);
  out->bytes = atomic_load(&c->stats.bytes);
  out->retries = atomic_load(&c->stats.retries);
  out->stalls = atomic_load(&c->stats.stalls);
  out->redirects = atomic_load(&c->stats.redirects);
  out->connects = atomic_load(&c->stats.connects);
  out->http2 = atomic_load(&c->stats.http2);
  out->in_flight = atomic_load(&c->stats.in_flight);
}
