/* http.c - the metrics and probe endpoints on the loop (see http.h). */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "ops/telemetry.h"

/* Bounds on what HTTP clients may hold (the endpoints are for scrapers and probes). */
#define HTTP_TIMEOUT_S 5           /* a connection idle or slow this long is closed */
#define HTTP_MEMORY (32u * 1024u)  /* per connection: request line and headers must fit */
#define HTTP_PER_IP 32             /* connections from one address */

struct http {
  struct daemon *d;
  struct MHD_Daemon *mhd;
  uv_poll_t poll;
  uv_timer_t timer;
  int handles; /* open handles; freed when both are closed */
};

static void rearm(struct http *h);

/* Queues a response; an owned body (malloc'd) passes to the library, any other is copied. */
static enum MHD_Result respond(struct MHD_Connection *conn, unsigned status, const char *type, const char *body,
                               bool owned) {
  struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), (void *)body,
                                                           owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_MUST_COPY);
  if (r == NULL) {
    if (owned) free((void *)body);
    return MHD_NO;
  }
  MHD_add_response_header(r, "Content-Type", type);
  MHD_add_response_header(r, "Cache-Control", "no-store");
  enum MHD_Result ok = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return ok;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **state) {
  struct http *h = cls;
  (void)version;
  (void)upload;
  bool head = strcmp(method, "HEAD") == 0;
  if (strcmp(method, "GET") != 0 && !head) /* answered at once: the library then closes the connection */
    return respond(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", "only GET and HEAD\n", false);
  /* The first call comes with the headers alone. A response queued then is
   * "early": the library discards the rest of the request and closes the
   * connection after answering, so keep-alive would never work. Answer on
   * the next call, once the request is whole. */
  if (*state == NULL) {
    *state = h;
    return MHD_YES;
  }
  if (*upload_size != 0) return MHD_NO; /* no bodies */
  if (strcmp(url, "/metrics") == 0) {
    char *text = telemetry_prometheus(h->d);
    if (text == NULL) return respond(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", "out of memory\n", false);
    return respond(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, true);
  }
  if (strcmp(url, "/healthz") == 0) return respond(conn, MHD_HTTP_OK, "text/plain", "ok\n", false);
  if (strcmp(url, "/readyz") == 0) {
    char why[300], body[320];
    telemetry_refresh(h->d);
    bool ready = telemetry_ready(h->d, why, sizeof why);
    snprintf(body, sizeof body, "%s%s\n", ready ? "ready" : "not ready: ", why);
    return respond(conn, ready ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE, "text/plain", body, false);
  }
  return respond(conn, MHD_HTTP_NOT_FOUND, "text/plain", "not found: /metrics, /healthz, /readyz\n", false);
}

static void on_ready(uv_poll_t *p, int status, int events) {
  (void)status;
  (void)events;
  struct http *h = p->data;
  MHD_run(h->mhd);
  rearm(h);
}

static void on_timer(uv_timer_t *t) {
  struct http *h = t->data;
  MHD_run(h->mhd);
  rearm(h);
}

/* Sets the timer to the library's next deadline (connection timeouts). */
static void rearm(struct http *h) {
  MHD_UNSIGNED_LONG_LONG ms = 0;
  if (MHD_get_timeout(h->mhd, &ms) == MHD_YES) uv_timer_start(&h->timer, on_timer, ms, 0);
  else uv_timer_stop(&h->timer);
}

/* Parses "HOST:PORT" ("[v6]:PORT" for IPv6) into a socket address. */
static int parse_address(const char *a, struct sockaddr_storage *ss, struct wd_error *err) {
  char host[128];
  const char *colon = strrchr(a, ':');
  if (colon == NULL || colon == a || (size_t)(colon - a) >= sizeof host)
    return err_set(err, WEIGHTD_E_INVALID, "metrics_address '%s' is not HOST:PORT", a);
  char *end;
  errno = 0;
  unsigned long port = strtoul(colon + 1, &end, 10);
  if (colon[1] == '\0' || *end != '\0' || errno != 0 || port > 65535)
    return err_set(err, WEIGHTD_E_INVALID, "metrics_address '%s': bad port", a);
  snprintf(host, sizeof host, "%.*s", (int)(colon - a), a);
  memset(ss, 0, sizeof *ss);
  size_t hl = strlen(host);
  if (host[0] == '[' && hl > 2 && host[hl - 1] == ']') {
    host[hl - 1] = '\0';
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)ss;
    s6->sin6_family = AF_INET6;
    s6->sin6_port = htons((uint16_t)port);
    if (inet_pton(AF_INET6, host + 1, &s6->sin6_addr) == 1) return 0;
  } else {
    struct sockaddr_in *s4 = (struct sockaddr_in *)ss;
    s4->sin_family = AF_INET;
    s4->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &s4->sin_addr) == 1) return 0;
  }
  return err_set(err, WEIGHTD_E_INVALID, "metrics_address '%s': '%s' is not an IP address", a, host);
}

static void log_mhd(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  char line[512];
  vsnprintf(line, sizeof line, fmt, ap);
  line[strcspn(line, "\n")] = '\0';
  log_msg(LOG_DEBUG, "http: %s", line);
}

int http_start(struct daemon *d, const char *address, unsigned max_connections, struct http **out,
               struct wd_error *err) {
  *out = NULL;
  if (address == NULL || address[0] == '\0') return 0;
  struct sockaddr_storage ss;
  int rc = parse_address(address, &ss, err);
  if (rc != 0) return rc;
  struct http *h = calloc(1, sizeof *h);
  if (h == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  h->d = d;
  unsigned flags = MHD_USE_EPOLL | MHD_USE_ERROR_LOG | (ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0);
  h->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                            MHD_OPTION_CONNECTION_LIMIT, max_connections, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                            (unsigned)HTTP_PER_IP, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_TIMEOUT_S,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)HTTP_MEMORY, MHD_OPTION_EXTERNAL_LOGGER,
                            log_mhd, NULL, MHD_OPTION_END);
  if (h->mhd == NULL) {
    free(h);
    return err_set(err, WEIGHTD_E_IO, "metrics_address %s: cannot listen (in use, or not an address of this host)",
                   address);
  }
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_EPOLL_FD);
  if (info == NULL) {
    MHD_stop_daemon(h->mhd);
    free(h);
    return err_set(err, WEIGHTD_E_INTERNAL, "libmicrohttpd gives no epoll descriptor");
  }
  uv_poll_init(d->loop, &h->poll, info->epoll_fd);
  uv_timer_init(d->loop, &h->timer);
  h->poll.data = h->timer.data = h;
  h->handles = 2;
  uv_poll_start(&h->poll, UV_READABLE, on_ready);
  rearm(h);
  log_msg(LOG_INFO, "metrics and probes on http://%s/ (/metrics, /healthz, /readyz)", address);
  *out = h;
  return 0;
}

static void handle_closed(uv_handle_t *hd) {
  struct http *h = hd->data;
  if (--h->handles == 0) free(h);
}

void http_stop(struct http *h) {
  if (h == NULL) return;
  uv_poll_stop(&h->poll);
  uv_timer_stop(&h->timer);
  MHD_stop_daemon(h->mhd); /* after the poll stops watching its descriptor */
  h->mhd = NULL;
  uv_close((uv_handle_t *)&h->poll, handle_closed);
  uv_close((uv_handle_t *)&h->timer, handle_closed);
}
