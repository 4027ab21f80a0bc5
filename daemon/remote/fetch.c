/*
 * fetch.c - the remote client's calls (see fetch.h): rf_stat, rf_read and
 * rf_readv, each a run of requests on the caller's thread, with retries,
 * redirects and the verdicts on every response. The client itself (its
 * configuration, the multi handle, counters) and the pure pieces are
 * fetch_client.c; the engine's thread is fetch_loop.c.
 *
 * DESIGN: a call is a `struct run` with one or more slots; a slot is a chain
 * of tries for one thing (rf_stat's object, or one part of rf_read's range)
 * and owns one transfer (fetch_internal.h). The caller's thread prepares a
 * try (URL, Range, If-Match, the auth hook's headers), submits it to the
 * loop thread (fetch_loop.c) and waits on the call's condition; when a
 * transfer comes back it judges it here: done, try again later (backoff),
 * follow a redirect, or fail. A failure or a cancel aborts the call's other
 * transfers, and the call returns only when the loop has handed all of them
 * back, so nothing writes into the caller's buffer after it returns. A
 * read's slots take its parts in turn (read_next_part: fetch.h's merge
 * rule), so a call keeps up to max_connections parts in flight however its
 * extents are cut.
 */
#include "fetch.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "base/prefault.h"
#include "clock.h"
#include "fetch_internal.h"

#define WAIT_SLICE_MS 20 /* how often a waiting call looks at its cancel flag */

/* ---- a call's random numbers ------------------------------------------------------------ */

static uint64_t next_random(struct rf_client *c) {
  if (c->cfg.random) return c->cfg.random(c->cfg.random_arg);
  uint64_t z = atomic_fetch_add(&c->rng, 0x9e3779b97f4a7c15ull) + 0x9e3779b97f4a7c15ull; /* splitmix64 */
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* ---- locations -------------------------------------------------------------- */

/* Where a slot's next try goes. */
struct target {
  struct rf_endpoint ep;
  char *path;
  char *query; /* "" for none */
};

static bool ep_equal(const struct rf_endpoint *a, const struct rf_endpoint *b) {
  return a->tls == b->tls && a->port == b->port && strcasecmp(a->host, b->host) == 0;
}

static void target_clear(struct target *t) {
  free(t->path);
  free(t->query);
  t->path = t->query = NULL;
}

static int target_set(struct target *t, const struct rf_endpoint *ep, const char *path, const char *query) {
  char *p = strdup(path), *q = strdup(query ? query : "");
  if (p == NULL || q == NULL) {
    free(p);
    free(q);
    return WEIGHTD_E_NOMEM;
  }
  target_clear(t);
  t->ep = *ep;
  t->path = p;
  t->query = q;
  return 0;
}

/* scheme://host[:port]path - the port shown only when not the scheme's default; never the query. */
static void endpoint_url(const struct rf_endpoint *ep, const char *path, char *out, size_t outlen) {
  bool v6 = strchr(ep->host, ':') != NULL;
  bool default_port = ep->port == (ep->tls ? 443 : 80);
  char port[16] = "";
  if (!default_port) snprintf(port, sizeof port, ":%d", ep->port);
  snprintf(out, outlen, "%s://%s%s%s%s%s", ep->tls ? "https" : "http", v6 ? "[" : "", ep->host, v6 ? "]" : "",
           port, path);
}

static char *target_request_url(const struct target *t) {
  size_t n = strlen(t->ep.host) + strlen(t->path) + strlen(t->query) + 32;
  char *u = malloc(n);
  if (u == NULL) return NULL;
  endpoint_url(&t->ep, t->path, u, n);
  if (t->query[0] != '\0') {
    strcat(u, "?");
    strcat(u, t->query);
  }
  return u;
}

static bool header_line_ok(const char *s) { return strpbrk(s, "\r\n") == NULL && strchr(s, ':') != NULL; }

static void slist_wipe_free(struct curl_slist *l) {
  for (struct curl_slist *i = l; i != NULL; i = i->next) explicit_bzero(i->data, strlen(i->data));
  curl_slist_free_all(l);
}

static void lines_wipe_free(char **lines, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (lines[i]) explicit_bzero(lines[i], strlen(lines[i]));
    free(lines[i]);
  }
  free(lines);
}

/* ---- a call's run ------------------------------------------------------------ */

enum slot_state { SLOT_IDLE, SLOT_RUNNING, SLOT_WAITING };

struct slot {
  struct xfer x;
  struct target t;
  enum slot_state state;
  uint64_t retry_at_ms;
  unsigned tries; /* retries used */
  unsigned hops;
  bool head;      /* rf_stat: the HEAD try (false: the GET of byte 0) */
  uint64_t part_off, part_len, part_done;
  size_t part_ext; /* the extent that holds part_off */
};

struct run {
  struct rf_client *c;
  const struct rf_auth *a;
  const struct rf_endpoint *auth_ep; /* auth headers go only to this endpoint (NULL: never) */
  const char *name;                  /* the object in messages */
  const atomic_bool *cancel;
  struct call call;
  struct slot *slots;
  unsigned nslots, running;
  uint64_t start_ms;
  int rc;
  struct wd_error *err;
  /* rf_read, rf_readv: the extents, and where the next part starts (in ext[next_ext], at next_off) */
  const struct rf_object *o;
  const struct rf_extent *ext;
  size_t next, next_ext;
  uint64_t next_off;
  /* rf_stat */
  struct rf_object *out;
};

/* The first failure of a run: recorded, and the run's other transfers aborted. */
__attribute__((format(printf, 3, 4))) static void run_fail(struct run *r, int code, const char *fmt, ...) {
  if (r->rc != 0) return;
  r->rc = code;
  if (r->err) {
    r->err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err->msg, sizeof r->err->msg, fmt, ap);
    va_end(ap);
  }
  atomic_store(&r->call.abort, true);
  loop_wake(r->c);
}

static int run_init(struct run *r, unsigned nslots) {
  pthread_mutex_init(&r->call.lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&r->call.cond, &ca);
  pthread_condattr_destroy(&ca);
  atomic_init(&r->call.abort, false);
  r->start_ms = clock_ms();
  r->slots = calloc(nslots, sizeof *r->slots);
  if (r->slots == NULL) return WEIGHTD_E_NOMEM;
  r->nslots = nslots;
  for (unsigned i = 0; i < nslots; i++) {
    struct slot *s = &r->slots[i];
    s->x.call = &r->call;
    s->x.owner = s;
    if ((s->x.easy = curl_easy_init()) == NULL) return WEIGHTD_E_NOMEM;
  }
  return 0;
}

static void run_destroy(struct run *r) {
  for (unsigned i = 0; r->slots && i < r->nslots; i++) {
    struct slot *s = &r->slots[i];
    if (s->x.easy) curl_easy_cleanup(s->x.easy);
    slist_wipe_free(s->x.headers);
    free(s->x.redirect_url);
    target_clear(&s->t);
  }
  free(r->slots);
  pthread_cond_destroy(&r->call.cond);
  pthread_mutex_destroy(&r->call.lock);
}

/* The precondition that pins reads to the version rf_stat saw. */
static void precondition(const struct rf_object *o, char *line, size_t len) {
  line[0] = '\0';
  bool weak = strncmp(o->etag, "W/", 2) == 0;
  if (o->etag[0] != '\0' && !weak) snprintf(line, len, "If-Match: %s", o->etag);
  else if (o->last_modified[0] != '\0') snprintf(line, len, "If-Unmodified-Since: %s", o->last_modified);
}

/* The request's headers: Range, the precondition, the auth hook's lines. */
static int slot_headers(struct run *r, struct slot *s, const char *method, uint64_t first, uint64_t last) {
  struct curl_slist *l = NULL, *n;
  char line[RF_ETAG_MAX + 32];
  if (s->x.ranged) {
    snprintf(line, sizeof line, "Range: bytes=%llu-%llu", (unsigned long long)first, (unsigned long long)last);
    if ((l = curl_slist_append(l, line)) == NULL) return WEIGHTD_E_NOMEM;
  }
  if (r->o) precondition(r->o, line, sizeof line);
  else line[0] = '\0';
  if (line[0] != '\0') {
    if ((n = curl_slist_append(l, line)) == NULL) goto nomem;
    l = n;
  }
  /* Auth only to the endpoint the object was opened on, and never once a redirect was followed (another path
   * of the same host may belong to another root, or to nobody the credentials are for). */
  if (r->a && r->a->headers && r->auth_ep && s->hops == 0 && ep_equal(&s->t.ep, r->auth_ep)) {
    char **lines = NULL;
    size_t count = 0;
    struct wd_error herr = {0};
    int rc = r->a->headers(r->a->arg, method, &s->t.ep, s->t.path, s->t.query, &lines, &count, &herr);
    if (rc != 0) {
      slist_wipe_free(l);
      run_fail(r, rc, "%s: %s", r->name, herr.msg[0] ? herr.msg : weightd_strerror(rc));
      return rc;
    }
    for (size_t i = 0; i < count && rc == 0; i++) {
      if (!header_line_ok(lines[i])) {
        rc = WEIGHTD_E_INTERNAL;
        run_fail(r, rc, "%s: the auth hook returned a malformed header line", r->name);
      } else if ((n = curl_slist_append(l, lines[i])) == NULL) {
        rc = WEIGHTD_E_NOMEM;
      } else {
        l = n;
      }
    }
    lines_wipe_free(lines, count);
    if (rc != 0) {
      slist_wipe_free(l);
      return rc;
    }
  }
  s->x.headers = l;
  return 0;
nomem:
  slist_wipe_free(l);
  return WEIGHTD_E_NOMEM;
}

/*
 * Faults in the pages the transfer's body will be written to, here on the
 * caller's thread, so that the loop thread's write callback only copies (an
 * error leaves them to fault as they are written: prefault.h).
 */
static void part_prefault(const struct xfer *x) {
  uint64_t at = x->want_off, end = x->want_off + x->want_len;
  for (size_t i = x->ei; at < end; i++) {
    const struct rf_extent *e = &x->ext[i];
    uint64_t stop = e->off + e->len < end ? e->off + e->len : end;
    (void)prefault_write(e->dst + (at - e->off), (size_t)(stop - at));
    at = stop;
  }
}

/* Prepares and submits a slot's next try. */
static void slot_start(struct run *r, struct slot *s) {
  struct xfer *x = &s->x;
  curl_easy_reset(x->easy);
  slist_wipe_free(x->headers);
  x->headers = NULL;
  xfer_arm(r->c, x);
  const char *method = "GET";
  if (r->o) { /* rf_read: what of the part has not landed yet */
    x->head = false;
    x->ranged = true;
    x->discard_body = false;
    x->want_off = s->part_off + s->part_done;
    x->want_len = s->part_len - s->part_done;
    x->object_size = r->o->size;
    x->ext = r->ext;
    x->ei = s->part_ext;
    while (x->ei + 1 < r->next_ext && r->ext[x->ei].off + r->ext[x->ei].len <= x->want_off) x->ei++;
    part_prefault(x);
  } else { /* rf_stat */
    x->head = s->head;
    x->ranged = !s->head;
    x->discard_body = true;
    x->want_off = 0;
    x->want_len = 1;
    x->object_size = UINT64_MAX;
    x->ext = NULL;
    if (s->head) method = "HEAD";
  }
  int rc = slot_headers(r, s, method, x->want_off, x->want_off + x->want_len - 1);
  char *url = rc == 0 ? target_request_url(&s->t) : NULL;
  if (rc == 0 && url == NULL) rc = WEIGHTD_E_NOMEM;
  if (rc != 0) {
    if (rc == WEIGHTD_E_NOMEM) run_fail(r, rc, "%s: out of memory", r->name);
    s->state = SLOT_IDLE;
    free(url);
    return;
  }
  curl_easy_setopt(x->easy, CURLOPT_URL, url);
  free(url);
  curl_easy_setopt(x->easy, CURLOPT_HTTPHEADER, x->headers);
  if (x->head) curl_easy_setopt(x->easy, CURLOPT_NOBODY, 1L);
  else curl_easy_setopt(x->easy, CURLOPT_HTTPGET, 1L);
  s->state = SLOT_RUNNING;
  r->running++;
  xfer_submit(r->c, x);
}

/* ---- verdicts ------------------------------------------------------------- */

enum verdict { V_DONE, V_RETRY, V_REDIRECT, V_FAIL };

/* libcurl results that a new request may mend. */
static bool curl_transient(CURLcode rc) {
  switch (rc) {
  case CURLE_COULDNT_RESOLVE_HOST:
  case CURLE_COULDNT_CONNECT:
  case CURLE_OPERATION_TIMEDOUT:
  case CURLE_PARTIAL_FILE:
  case CURLE_RECV_ERROR:
  case CURLE_SEND_ERROR:
  case CURLE_GOT_NOTHING:
  case CURLE_HTTP2:
  case CURLE_HTTP2_STREAM:
  case CURLE_SSL_CONNECT_ERROR:
    return true;
  default:
    return false;
  }
}

/* "HTTP 503 (SlowDown)", or "HTTP 404" when the body names no code. */
static void status_text(const struct xfer *x, char *out, size_t len) {
  char code[64];
  rf_s3_error_code(x->body, x->body_len, code, sizeof code);
  if (code[0]) snprintf(out, len, "HTTP %ld (%s)", x->status, code);
  else snprintf(out, len, "HTTP %ld", x->status);
}

static void what_text(const struct slot *s, char *out, size_t len) {
  const struct xfer *x = &s->x;
  if (x->head) snprintf(out, len, "HEAD");
  else
    snprintf(out, len, "GET bytes %llu-%llu", (unsigned long long)x->want_off,
             (unsigned long long)(x->want_off + x->want_len - 1));
}

/*
 * Judges a finished transfer as every kind of call does. V_DONE means a 2xx
 * that the caller judges further; V_FAIL has run_fail called; V_RETRY leaves
 * why (and the server's Retry-After in the transfer).
 */
static enum verdict judge(struct run *r, struct slot *s, char *why, size_t whylen) {
  const struct xfer *x = &s->x;
  char what[96], st[128];
  what_text(s, what, sizeof what);
  status_text(x, st, sizeof st);
  switch (x->end) {
  case XFER_SHUTDOWN:
    run_fail(r, WEIGHTD_E_SHUTDOWN, "%s: %s: the remote client is stopping", r->name, what);
    return V_FAIL;
  case XFER_ABORTED:
    run_fail(r, WEIGHTD_E_CANCELED, "%s: %s: canceled", r->name, what);
    return V_FAIL;
  case XFER_STALLED:
    snprintf(why, whylen, "no byte for %llu ms", (unsigned long long)x->stall_ms);
    return V_RETRY;
  case XFER_COMPLETED:
    break;
  }
  if (x->forbidden_addr) {
    run_fail(r, WEIGHTD_E_PATH_DENIED, "%s: %s: refused to connect to %s, a link-local or metadata address", r->name,
             what, x->forbidden_host);
    return V_FAIL;
  }
  if (x->use == BODY_STALE) {
    run_fail(r, WEIGHTD_E_STALE, "object %s changed since it was opened (%s for %s: %s%s)", r->name, st, what,
             x->content_range[0] ? "Content-Range " : "the whole object instead of the range",
             x->content_range);
    return V_FAIL;
  }
  if (x->use == BODY_BAD_RANGE) {
    run_fail(r, WEIGHTD_E_IO, "%s: %s: the server answered other bytes (Content-Range '%s')", r->name, what,
             x->content_range);
    return V_FAIL;
  }
  if (x->overflow) {
    run_fail(r, WEIGHTD_E_IO, "%s: %s: the server sent more than the %llu bytes asked", r->name, what,
             (unsigned long long)x->want_len);
    return V_FAIL;
  }
  if (x->result != CURLE_OK && !(x->result == CURLE_WRITE_ERROR && x->cut)) {
    const char *msg = x->curl_msg[0] ? x->curl_msg : curl_easy_strerror(x->result);
    if (curl_transient(x->result)) {
      snprintf(why, whylen, "%s", msg);
      return V_RETRY;
    }
    run_fail(r, WEIGHTD_E_IO, "%s: %s: %s", r->name, what, msg);
    return V_FAIL;
  }
  long h = x->status;
  if (h >= 200 && h < 300) return V_DONE;
  if ((h == 301 || h == 302 || h == 303 || h == 307 || h == 308) && x->redirect_url) return V_REDIRECT;
  if (h == 408 || h == 429 || h >= 500) {
    snprintf(why, whylen, "%s", st);
    return V_RETRY;
  }
  if (h == 412 || h == 416) {
    run_fail(r, WEIGHTD_E_STALE, "object %s changed since it was opened (%s for %s)", r->name, st, what);
    return V_FAIL;
  }
  int code = h == 404 || h == 410 ? WEIGHTD_E_NOT_FOUND : h == 401 || h == 403 ? WEIGHTD_E_PERMISSION : WEIGHTD_E_IO;
  run_fail(r, code, "%s: %s: %s", r->name, what, st);
  return V_FAIL;
}

/* Schedules a slot's next try after the backoff, or fails the run when no try is left. */
static void slot_retry(struct run *r, struct slot *s, const char *why) {
  char what[96];
  what_text(s, what, sizeof what);
  s->tries++;
  uint64_t now = clock_ms(), delay = 0, after = (uint64_t)s->x.retry_after_s * 1000;
  enum rf_retry_verdict v = rf_retry_decide(&r->c->cfg, s->tries, now - r->start_ms, after, next_random(r->c), &delay);
  if (v == RF_GIVE_UP_COUNT) {
    run_fail(r, WEIGHTD_E_IO, "%s: %s: %s; gave up after %u tries", r->name, what, why, s->tries);
  } else if (v == RF_GIVE_UP_BUDGET && after > 0) {
    run_fail(r, WEIGHTD_E_IO, "%s: %s: %s; the server asks to retry after %ld s, past the retry budget of %u ms",
             r->name, what, why, s->x.retry_after_s, r->c->cfg.retry_budget_ms);
  } else if (v == RF_GIVE_UP_BUDGET) {
    run_fail(r, WEIGHTD_E_IO, "%s: %s: %s; the retry budget of %u ms is spent after %u tries", r->name, what, why,
             r->c->cfg.retry_budget_ms, s->tries);
  } else {
    atomic_fetch_add(&r->c->stats.retries, 1);
    s->state = SLOT_WAITING;
    s->retry_at_ms = now + delay;
  }
}

/* Points a slot at its redirect's target when the remote root allows it. */
static int slot_redirect(struct run *r, struct slot *s) {
  char what[96], shown[2048];
  what_text(s, what, sizeof what);
  if (++s->hops > RF_MAX_REDIRECTS) {
    run_fail(r, WEIGHTD_E_IO, "%s: %s: more than %d redirects", r->name, what, RF_MAX_REDIRECTS);
    return WEIGHTD_E_IO;
  }
  CURLU *u = curl_url();
  char *scheme = NULL, *host = NULL, *port = NULL, *path = NULL, *query = NULL;
  int rc = WEIGHTD_E_IO;
  if (u == NULL) {
    run_fail(r, WEIGHTD_E_NOMEM, "%s: out of memory", r->name);
    return WEIGHTD_E_NOMEM;
  }
  if (curl_url_set(u, CURLUPART_URL, s->x.redirect_url, 0) != CURLUE_OK ||
      curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) != CURLUE_OK ||
      curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK ||
      curl_url_get(u, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) != CURLUE_OK ||
      curl_url_get(u, CURLUPART_PATH, &path, 0) != CURLUE_OK) {
    run_fail(r, WEIGHTD_E_IO, "%s: %s: HTTP %ld with a Location that is not a URL", r->name, what, s->x.status);
    goto out;
  }
  if (curl_url_get(u, CURLUPART_QUERY, &query, 0) != CURLUE_OK) query = NULL;
  struct rf_endpoint ep = {.tls = strcmp(scheme, "https") == 0, .port = atoi(port)};
  size_t hl = strlen(host);
  const char *h = host;
  if (hl >= 2 && host[0] == '[') h++, hl -= 2; /* an IPv6 literal without its brackets */
  if ((strcmp(scheme, "http") != 0 && !ep.tls) || hl == 0 || hl >= sizeof ep.host) {
    run_fail(r, WEIGHTD_E_PATH_DENIED, "%s: %s: redirect to a %s URL refused", r->name, what, scheme);
    goto out;
  }
  memcpy(ep.host, h, hl);
  ep.host[hl] = '\0';
  endpoint_url(&ep, path, shown, sizeof shown);
  if (rf_host_forbidden(ep.host)) {
    run_fail(r, WEIGHTD_E_PATH_DENIED, "%s: %s: redirect to %s refused: a link-local or metadata address", r->name,
             what, shown);
    goto out;
  }
  if (r->a == NULL || r->a->allow_redirect == NULL || !r->a->allow_redirect(r->a->arg, &ep, path)) {
    run_fail(r, WEIGHTD_E_PATH_DENIED, "%s: %s: redirect to %s refused: not in the remote roots", r->name, what,
             shown);
    goto out;
  }
  if (target_set(&s->t, &ep, path, query) != 0) {
    run_fail(r, WEIGHTD_E_NOMEM, "%s: out of memory", r->name);
    rc = WEIGHTD_E_NOMEM;
    goto out;
  }
  atomic_fetch_add(&r->c->stats.redirects, 1);
  rc = 0;
out:
  curl_free(scheme);
  curl_free(host);
  curl_free(port);
  curl_free(path);
  curl_free(query);
  curl_url_cleanup(u);
  return rc;
}

/* ---- the driver ------------------------------------------------------------ */

/* Takes the call's finished transfers, waiting until one comes back or until deadline_ms. */
static struct xfer *call_wait(struct call *k, uint64_t deadline_ms) {
  pthread_mutex_lock(&k->lock);
  if (k->done_head == NULL) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t now = clock_ms(), wait = deadline_ms > now ? deadline_ms - now : 0;
    ts.tv_sec += (time_t)(wait / 1000);
    ts.tv_nsec += (long)(wait % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    while (k->done_head == NULL)
      if (pthread_cond_timedwait(&k->cond, &k->lock, &ts) != 0) break;
  }
  struct xfer *x = k->done_head;
  k->done_head = k->done_tail = NULL;
  pthread_mutex_unlock(&k->lock);
  return x;
}

static void on_done(struct run *r, struct slot *s);

/* Runs until every slot is idle: waits, judges what comes back, starts retries that are due. */
static void run_drive(struct run *r) {
  for (;;) {
    uint64_t now = clock_ms(), deadline = now + WAIT_SLICE_MS;
    bool waiting = false;
    for (unsigned i = 0; i < r->nslots; i++) {
      struct slot *s = &r->slots[i];
      if (s->state != SLOT_WAITING) continue;
      if (r->rc != 0) {
        s->state = SLOT_IDLE;
        continue;
      }
      if (s->retry_at_ms <= now) {
        s->state = SLOT_IDLE;
        slot_start(r, s);
        continue;
      }
      waiting = true;
      if (s->retry_at_ms < deadline) deadline = s->retry_at_ms;
    }
    if (r->running == 0 && !waiting) return;
    struct xfer *x = call_wait(&r->call, deadline);
    if (r->cancel && atomic_load(r->cancel) && r->rc == 0)
      run_fail(r, WEIGHTD_E_CANCELED, "%s: canceled", r->name);
    while (x != NULL) {
      struct xfer *next = x->next;
      struct slot *s = x->owner;
      r->running--;
      s->state = SLOT_IDLE;
      on_done(r, s);
      x = next;
    }
  }
}

/* ---- rf_read, rf_readv ------------------------------------------------------ */

/*
 * Cuts the next part (fetch.h's merge rule): from next_off on through the
 * extents that touch, until part_bytes or the end of the run.
 */
static bool read_next_part(struct run *r, struct slot *s) {
  if (r->rc != 0 || r->next_ext >= r->next) return false;
  const struct rf_extent *e = r->ext;
  size_t first = r->next_ext, i = first;
  uint64_t off = r->next_off, cap = off + r->c->cfg.part_bytes, end;
  for (;;) {
    uint64_t e_end = e[i].off + e[i].len;
    if (e_end > cap) { /* the part ends inside extent i; the next one starts there */
      end = r->next_off = cap;
      break;
    }
    end = e_end;
    i++;
    if (i == r->next || e[i].off != e_end || e_end == cap) {
      if (i < r->next) r->next_off = e[i].off;
      break;
    }
  }
  r->next_ext = i;
  s->part_off = off;
  s->part_len = end - off;
  s->part_done = 0;
  s->part_ext = first;
  s->tries = 0;
  s->hops = 0;
  if (target_set(&s->t, &r->o->ep, r->o->path, r->o->query) != 0) {
    run_fail(r, WEIGHTD_E_NOMEM, "%s: out of memory", r->name);
    return false;
  }
  slot_start(r, s);
  return true;
}

static void read_done(struct run *r, struct slot *s, enum verdict v, const char *why) {
  s->part_done += s->x.written; /* bytes of the same version (If-Match), checked against the range */
  if (v == V_RETRY && s->part_done == s->part_len) {
    /* Every byte of the part came before the try failed (a stall after the last byte, a declared length past
     * the range, a stream reset after the last frame): nothing is left to ask for. */
    read_next_part(r, s);
  } else if (v == V_DONE && s->part_done < s->part_len) { /* a 2xx that ended early (no length to hold it to) */
    char short_body[160];
    snprintf(short_body, sizeof short_body, "short body: %llu of %llu bytes", (unsigned long long)s->x.written,
             (unsigned long long)s->x.want_len);
    slot_retry(r, s, short_body);
  } else if (v == V_RETRY) {
    slot_retry(r, s, why);
  } else if (v == V_REDIRECT) {
    if (slot_redirect(r, s) == 0) slot_start(r, s);
  } else if (v == V_DONE) {
    read_next_part(r, s);
  }
}

int rf_readv(struct rf_client *c, const struct rf_auth *a, const struct rf_object *o, const struct rf_extent *ext,
             size_t n, const atomic_bool *cancel, struct wd_error *err) {
  if (n == 0) return 0;
  uint64_t parts = 0, run_start = 0, run_end = 0, part = c->cfg.part_bytes;
  for (size_t i = 0; i < n; i++) {
    const struct rf_extent *e = &ext[i];
    if (e->len == 0 || e->off > o->size || e->len > o->size - e->off)
      return err_set(err, WEIGHTD_E_INVALID, "%s: bytes %llu+%llu are empty or beyond its %llu bytes", o->name,
                     (unsigned long long)e->off, (unsigned long long)e->len, (unsigned long long)o->size);
    if (i > 0 && e->off < ext[i - 1].off)
      return err_set(err, WEIGHTD_E_INVALID, "%s: extent %zu (byte %llu) comes before the one ahead of it", o->name,
                     i, (unsigned long long)e->off);
    if (i > 0 && e->off == run_end) {
      run_end += e->len;
      continue;
    }
    parts += (run_end - run_start + part - 1) / part;
    run_start = e->off;
    run_end = e->off + e->len;
  }
  parts += (run_end - run_start + part - 1) / part;
  unsigned nslots = parts < c->cfg.max_connections ? (unsigned)parts : c->cfg.max_connections;
  struct run r = {.c = c, .a = a, .auth_ep = o->redirected ? NULL : &o->ep, .name = o->name, .cancel = cancel,
                  .err = err, .o = o, .ext = ext, .next = n, .next_ext = 0, .next_off = ext[0].off};
  if (run_init(&r, nslots) != 0) {
    run_destroy(&r);
    return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", o->name);
  }
  for (unsigned i = 0; i < nslots; i++) read_next_part(&r, &r.slots[i]);
  run_drive(&r);
  run_destroy(&r);
  return r.rc;
}

int rf_read(struct rf_client *c, const struct rf_auth *a, const struct rf_object *o, uint64_t off, uint64_t len,
            void *dst, const atomic_bool *cancel, struct wd_error *err) {
  if (len == 0) return 0;
  if (off > o->size || len > o->size - off)
    return err_set(err, WEIGHTD_E_INVALID, "%s: bytes %llu-%llu are beyond its %llu bytes", o->name,
                   (unsigned long long)off, (unsigned long long)(off + len - 1), (unsigned long long)o->size);
  struct rf_extent e = {.off = off, .len = len, .dst = dst};
  return rf_readv(c, a, o, &e, 1, cancel, err);
}

/* ---- rf_stat ------------------------------------------------------------- */

/* A successful HEAD or GET of byte 0: the object's size, ETag and Last-Modified. */
static void stat_found(struct run *r, struct slot *s) {
  const struct xfer *x = &s->x;
  uint64_t first, last, total;
  struct rf_object *o = r->out;
  if (x->head || x->status == 200) {
    if (!x->has_length) {
      run_fail(r, WEIGHTD_E_IO, "%s: HTTP %ld without a Content-Length", r->name, x->status);
      return;
    }
    o->size = x->content_length;
  } else if (rf_content_range_parse(x->content_range, &first, &last, &total) != 0 || total == UINT64_MAX) {
    run_fail(r, WEIGHTD_E_IO, "%s: GET bytes 0-0: HTTP %ld with Content-Range '%s'", r->name, x->status,
             x->content_range);
    return;
  } else {
    o->size = total;
  }
  snprintf(o->etag, sizeof o->etag, "%s", x->etag);
  snprintf(o->last_modified, sizeof o->last_modified, "%s", x->last_modified);
  o->ep = s->t.ep;
  o->redirected = r->auth_ep == NULL || s->hops > 0 || !ep_equal(&s->t.ep, r->auth_ep);
  o->path = s->t.path;
  o->query = s->t.query;
  s->t.path = s->t.query = NULL;
}

static void stat_done(struct run *r, struct slot *s, enum verdict v, const char *why) {
  const struct xfer *x = &s->x;
  if (v == V_DONE && x->head && !x->has_length) {
    s->head = false; /* a HEAD that does not say the size: ask for byte 0 */
    slot_start(r, s);
  } else if (v == V_DONE) {
    stat_found(r, s);
  } else if (v == V_RETRY) {
    slot_retry(r, s, why);
  } else if (v == V_REDIRECT) {
    if (slot_redirect(r, s) == 0) slot_start(r, s);
  }
}

/* A HEAD refused or failed with a client error: a GET of byte 0 may succeed, or say why in its body. */
static bool stat_head_refused(const struct xfer *x) {
  return x->head && x->end == XFER_COMPLETED && x->result == CURLE_OK && x->status >= 400 && x->status < 500 &&
         x->status != 408 && x->status != 429;
}

/* An empty object answers a GET of byte 0 with 416 and a Content-Range total of 0. */
static bool stat_empty(const struct xfer *x) {
  uint64_t first, last, total;
  return !x->head && x->status == 416 && rf_content_range_parse(x->content_range, &first, &last, &total) == 0 &&
         total == 0;
}

static void on_done(struct run *r, struct slot *s) {
  char why[512] = "";
  if (r->o == NULL && stat_head_refused(&s->x)) {
    s->head = false;
    slot_start(r, s);
    return;
  }
  if (r->o == NULL && stat_empty(&s->x)) {
    s->x.has_length = true;
    s->x.content_length = 0;
    s->x.status = 200;
    stat_found(r, s);
    return;
  }
  enum verdict v = judge(r, s, why, sizeof why);
  if (v == V_FAIL) return;
  if (r->rc != 0) return; /* the run failed elsewhere: nothing more to start */
  if (r->o) read_done(r, s, v, why);
  else stat_done(r, s, v, why);
}

int rf_stat(struct rf_client *c, const struct rf_auth *a, const struct rf_location *loc, const atomic_bool *cancel,
            struct rf_object *out, struct wd_error *err) {
  memset(out, 0, sizeof *out);
  char shown[2048];
  endpoint_url(&loc->ep, loc->path, shown, sizeof shown);
  out->name = strdup(loc->name ? loc->name : shown);
  if (out->name == NULL) return err_set(err, WEIGHTD_E_NOMEM, "%s: out of memory", shown);
  if (loc->path[0] != '/') {
    rf_object_clear(out);
    return err_set(err, WEIGHTD_E_INVALID, "%s: the request path must start with '/'", shown);
  }
  struct run r = {.c = c, .a = a, .auth_ep = &loc->ep, .name = out->name, .cancel = cancel, .err = err, .out = out};
  int rc = run_init(&r, 1);
  if (rc == 0) rc = target_set(&r.slots[0].t, &loc->ep, loc->path, loc->query);
  if (rc != 0) {
    run_destroy(&r);
    rf_object_clear(out);
    return err_set(err, rc, "%s: out of memory", shown);
  }
  r.slots[0].head = true;
  slot_start(&r, &r.slots[0]);
  run_drive(&r);
  run_destroy(&r);
  if (r.rc != 0) rf_object_clear(out);
  return r.rc;
}

void rf_object_clear(struct rf_object *o) {
  if (o == NULL) return;
  free(o->path);
  free(o->query);
  free(o->name);
  memset(o, 0, sizeof *o);
}
