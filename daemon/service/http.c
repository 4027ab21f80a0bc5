/* http.c - the metrics and probe endpoints on the loop (see http.h). */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"
#include "clock.h"
#include "ops/telemetry.h"

/* Bounds on what HTTP clients may hold (the endpoints are for scrapers and probes). */
#define HTTP_IDLE_S 5              /* a connection without a byte this long is closed */
#define HTTP_MEMORY (32u * 1024u)  /* per connection: request line and headers must fit */
#define HTTP_PER_IP 32             /* connections from one address */
#define HTTP_ACCEPT_BATCH 16       /* connections accepted before the library reads their requests */
#define HTTP_ACCEPT_PAUSE_MS 100   /* out of descriptors: accepting waits this long */
#define HTTP_DEFER_ACCEPT_S 1      /* a peer is accepted once its first bytes came, or after this long */

/*
 * One connection the library holds, as the accept path sees it. A
 * connection is closed here by shutting its socket down: the library then
 * reads the end of the stream and closes it on its next run. It is either
 * waiting for a whole request (from its accept or its previous answer on)
 * or answering: from the moment a response is queued for its request until
 * the library has handed the last byte of it to the kernel.
 */
struct http_conn {
  struct http_conn *prev, *next;
  int fd;
  struct sockaddr_storage peer;
  uint64_t since_ms; /* when its current request began: accepted, or its last answer sent */
  unsigned answered; /* answers written on it before its current request */
  bool answering;    /* a response is queued for its request and not yet all written */
  bool closing;      /* shut down here; gone when the library closes it */
};

struct http {
  struct daemon *d;
  struct MHD_Daemon *mhd;
  int listen_fd;            /* ours, not the library's: accepting never depends on its state */
  uv_poll_t listen_poll;
  uv_poll_t poll;           /* the library's epoll descriptor */
  uv_timer_t timer;         /* the library's next timeout, or the next request deadline */
  uv_timer_t accept_pause;  /* accepting again after running out of descriptors */
  struct http_conn *conns;  /* every connection the library holds */
  unsigned max_connections;
  uint64_t deadline_ms;     /* metrics_request_timeout_ms */
  uint64_t refused_emfile;  /* accept failures for want of descriptors, since the last success */
  int handles;              /* open handles; freed when all are closed */
};

static void on_timer(uv_timer_t *t);

/* The record of the library's connection, or NULL when it has none (it ran out of memory). */
static struct http_conn *conn_of(struct MHD_Connection *conn) {
  const union MHD_ConnectionInfo *info = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  return info != NULL ? info->socket_context : NULL;
}

/*
 * Queues a response, which makes its connection one that is answering; an
 * owned body (malloc'd) passes to the library, any other is copied.
 */
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
  struct http_conn *c = conn_of(conn);
  if (ok == MHD_YES && c != NULL) c->answering = true;
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

/* ---- connections and their deadlines ---------------------------------------------------- */

/* Shuts a connection down once; the library closes it when it next runs. */
static void conn_close(struct http_conn *c, const char *why) {
  if (c->closing) return;
  c->closing = true;
  shutdown(c->fd, SHUT_RDWR);
  log_msg(LOG_DEBUG, "http: closing a connection: %s", why);
}

/* Whether two peers are the same address (the port aside). */
static bool same_address(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
  if (a->ss_family != b->ss_family) return false;
  if (a->ss_family == AF_INET)
    return ((const struct sockaddr_in *)a)->sin_addr.s_addr == ((const struct sockaddr_in *)b)->sin_addr.s_addr;
  if (a->ss_family == AF_INET6)
    return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr,
                  sizeof(struct in6_addr)) == 0;
  return false;
}

/* The library tells of each connection it takes and closes; the record lives in between. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
  struct http *h = cls;
  struct http_conn *c = *socket_context;
  if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
    if (c == NULL) return;
    if (c->prev) c->prev->next = c->next;
    else h->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c);
    *socket_context = NULL;
    return;
  }
  const union MHD_ConnectionInfo *fd = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
  const union MHD_ConnectionInfo *peer = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  if (fd == NULL) return; /* cannot happen: the library holds a socket for every connection */
  c = calloc(1, sizeof *c);
  if (c == NULL) { /* untracked, it would escape the deadline: refuse it */
    shutdown(fd->connect_fd, SHUT_RDWR);
    return;
  }
  c->fd = fd->connect_fd;
  if (peer != NULL && peer->client_addr != NULL)
    memcpy(&c->peer, peer->client_addr,
           peer->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
  c->since_ms = clock_ms();
  c->next = h->conns;
  if (h->conns) h->conns->prev = c;
  h->conns = c;
  *socket_context = c;
}

/* A request is over (answered, or its connection closed): the connection waits for its next one from now. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **state, enum MHD_RequestTerminationCode toe) {
  (void)cls;
  (void)state;
  (void)toe;
  struct http_conn *c = conn_of(conn);
  if (c == NULL) return;
  c->since_ms = clock_ms();
  c->answering = false;
  c->answered++;
}

/* Closes every connection whose request has passed its deadline. */
static void close_expired(struct http *h, uint64_t now) {
  for (struct http_conn *c = h->conns; c != NULL; c = c->next)
    if (!c->closing && now - c->since_ms >= h->deadline_ms)
      conn_close(c, "its request passed metrics_request_timeout_ms");
}

/* Whether a connection's client is not reading its answer: the socket takes no more bytes. */
static bool answer_stalled(const struct http_conn *c) {
  struct pollfd p = {.fd = c->fd, .events = POLLOUT};
  return poll(&p, 1, 0) >= 0 && (p.revents & POLLOUT) == 0;
}

/*
 * Whether a connection may be closed to make room, in the order tried: 1,
 * it has not sent a whole request; 2, its answer is to a later request on
 * a kept-alive connection (what pipelining without end looks like), or its
 * client is not reading it; 0, never: the first answer on a connection
 * while its client reads (a probe's, which the pass that read its request
 * writes whole).
 */
static int closable(const struct http_conn *c) {
  if (!c->answering) return 1;
  return c->answered > 0 || answer_stalled(c) ? 2 : 0;
}

/* Whether c counts toward peer's limit (NULL: toward the total). */
static bool counts(const struct http_conn *c, const struct sockaddr_storage *peer) {
  return !c->closing && (peer == NULL || same_address(&c->peer, peer));
}

static unsigned count(const struct http *h, const struct sockaddr_storage *peer) {
  unsigned n = 0;
  for (const struct http_conn *c = h->conns; c != NULL; c = c->next) n += counts(c, peer);
  return n;
}

/* The connection of peer's (NULL: of all) to close first: by the order above, then oldest first; NULL if none. */
static struct http_conn *victim(struct http *h, const struct sockaddr_storage *peer) {
  struct http_conn *best = NULL;
  int best_rank = 0;
  for (struct http_conn *c = h->conns; c != NULL; c = c->next) {
    if (!counts(c, peer) || (best_rank == 1 && c->answering)) continue; /* rank 1 found: skip the poll */
    int rank = closable(c);
    if (rank != 0 && (best == NULL || rank < best_rank || (rank == best_rank && c->since_ms <= best->since_ms))) {
      best = c;
      best_rank = rank;
    }
  }
  return best;
}

/* Closes victims of peer's (NULL: of all) until at most limit remain or none is left; how many it closed. */
static unsigned trim(struct http *h, const struct sockaddr_storage *peer, unsigned limit, const char *why) {
  struct http_conn *v;
  unsigned closed = 0;
  for (unsigned n = count(h, peer); n > limit && (v = victim(h, peer)) != NULL; n--, closed++) conn_close(v, why);
  return closed;
}

/*
 * Brings the connections back within the limits once the library has read
 * what the newcomers from peers[0..n) sent: past 32 from one of those
 * addresses, or past metrics_connections in all, victims go until it is
 * within, or none is left (every connection is on its first answer). The
 * newcomers themselves are victims like the others, so when every older
 * connection is being answered it is the newcomers still waiting for their
 * requests that are closed.
 */
static void make_room(struct http *h, const struct sockaddr_storage *peers, int n) {
  for (int i = 0; i < n; i++) trim(h, &peers[i], HTTP_PER_IP, "a newer connection from its address came past 32");
  trim(h, NULL, h->max_connections, "a newer connection came past metrics_connections");
}

/* ---- driving the library ----------------------------------------------------------------- */

/* Runs the library's pending work and sets the timer to its next timeout or the next deadline. */
static void run(struct http *h) {
  MHD_run(h->mhd);
  uint64_t now = clock_ms(), due = UINT64_MAX;
  MHD_UNSIGNED_LONG_LONG ms = 0;
  if (MHD_get_timeout(h->mhd, &ms) == MHD_YES) due = ms;
  for (const struct http_conn *c = h->conns; c != NULL; c = c->next) {
    if (c->closing) continue;
    uint64_t left = now - c->since_ms >= h->deadline_ms ? 0 : c->since_ms + h->deadline_ms - now;
    if (left < due) due = left;
  }
  if (due != UINT64_MAX) uv_timer_start(&h->timer, on_timer, due, 0);
  else uv_timer_stop(&h->timer);
}

static void on_ready(uv_poll_t *p, int status, int events) {
  (void)status;
  (void)events;
  run(p->data);
}

static void on_timer(uv_timer_t *t) {
  struct http *h = t->data;
  close_expired(h, clock_ms());
  run(h);
}

/* ---- the accept path --------------------------------------------------------------------- */

static void on_accept(uv_poll_t *p, int status, int events);

static void on_accept_resume(uv_timer_t *t) {
  struct http *h = t->data;
  uv_poll_start(&h->listen_poll, UV_READABLE, on_accept);
}

/* Out of descriptors: the waiting peers stay in the backlog, and accepting pauses (no spinning). */
static void accept_pause(struct http *h, int err) {
  if (h->refused_emfile++ == 0)
    log_msg(LOG_WARN, "http: accept: %s: pausing the metrics endpoints until descriptors free", strerror(err));
  uv_poll_stop(&h->listen_poll);
  uv_timer_start(&h->accept_pause, on_accept_resume, HTTP_ACCEPT_PAUSE_MS, 0);
}

/*
 * Accepts a batch of connections and hands them to the library, which reads
 * their requests and answers those that came whole; only then are the
 * limits applied (so what had arrived counts), and the library runs again
 * to close the connections that made room. Before the batch, connections
 * that became closable since the last one (an answer not read) go, so that
 * the library's table (the limit and a batch) has room for it.
 */
static void on_accept(uv_poll_t *p, int status, int events) {
  struct http *h = p->data;
  (void)status;
  (void)events;
  if (trim(h, NULL, h->max_connections, "a batch of newcomers came past metrics_connections") > 0) MHD_run(h->mhd);
  struct sockaddr_storage peers[HTTP_ACCEPT_BATCH];
  int n = 0;
  while (n < HTTP_ACCEPT_BATCH) {
    struct sockaddr_storage *peer = &peers[n];
    socklen_t len = sizeof *peer;
    int fd = accept4(h->listen_fd, (struct sockaddr *)peer, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) accept_pause(h, errno);
      else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
        log_msg(LOG_WARN, "http: accept: %s", strerror(errno));
      break;
    }
    if (h->refused_emfile > 0) {
      log_msg(LOG_INFO, "http: accepting again after %" PRIu64 " failure(s) for want of descriptors",
              h->refused_emfile);
      h->refused_emfile = 0;
    }
    n++;
    if (MHD_add_connection(h->mhd, fd, (struct sockaddr *)peer, len) != MHD_YES) /* it closed fd */
      log_msg(LOG_DEBUG, "http: connection not taken: %s", strerror(errno));
  }
  MHD_run(h->mhd);
  make_room(h, peers, n);
  run(h);
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

/*
 * A listening socket on ss, nonblocking; -errno when it cannot be made or
 * bound. The kernel hands a connection over once its first bytes came (or
 * HTTP_DEFER_ACCEPT_S after its handshake): a client that sends its request
 * as it connects, as probes and scrapers do, has it read before the limits
 * are applied to it.
 */
static int listen_on(const struct sockaddr_storage *ss) {
  int fd = socket(ss->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  int one = 1, defer = HTTP_DEFER_ACCEPT_S;
  socklen_t len = ss->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_DEFER_ACCEPT, &defer, sizeof defer) != 0 ||
      (ss->ss_family == AF_INET6 && setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one) != 0) ||
      bind(fd, (const struct sockaddr *)ss, len) != 0 || listen(fd, SOMAXCONN) != 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

int http_start(struct daemon *d, const char *address, unsigned max_connections, uint64_t request_timeout_ms,
               struct http **out, struct wd_error *err) {
  *out = NULL;
  if (address == NULL || address[0] == '\0') return 0;
  struct sockaddr_storage ss;
  int rc = parse_address(address, &ss, err);
  if (rc != 0) return rc;
  int fd = listen_on(&ss);
  if (fd < 0)
    return err_set(err, WEIGHTD_E_IO, "metrics_address %s: cannot listen: %s", address, strerror(-fd));
  struct http *h = calloc(1, sizeof *h);
  if (h == NULL) {
    close(fd);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  h->d = d;
  h->listen_fd = fd;
  h->max_connections = max_connections;
  h->deadline_ms = request_timeout_ms;
  /* The library gets no listening socket: it only serves the connections the accept path hands it,
   * at most a batch of newcomers beyond the limit while the ones they displace close. */
  h->mhd = MHD_start_daemon(MHD_USE_EPOLL | MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ERROR_LOG, 0, NULL, NULL, on_request,
                            h, MHD_OPTION_CONNECTION_LIMIT, max_connections + (unsigned)HTTP_ACCEPT_BATCH,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_IDLE_S, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
                            (size_t)HTTP_MEMORY, MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_EXTERNAL_LOGGER, log_mhd, NULL,
                            MHD_OPTION_END);
  const union MHD_DaemonInfo *info = h->mhd ? MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_EPOLL_FD) : NULL;
  if (info == NULL) {
    if (h->mhd) MHD_stop_daemon(h->mhd);
    close(fd);
    free(h);
    return err_set(err, WEIGHTD_E_INTERNAL, "metrics_address %s: libmicrohttpd does not start in epoll mode",
                   address);
  }
  uv_poll_init(d->loop, &h->poll, info->epoll_fd);
  uv_poll_init(d->loop, &h->listen_poll, fd);
  uv_timer_init(d->loop, &h->timer);
  uv_timer_init(d->loop, &h->accept_pause);
  h->poll.data = h->listen_poll.data = h->timer.data = h->accept_pause.data = h;
  h->handles = 4;
  uv_poll_start(&h->poll, UV_READABLE, on_ready);
  uv_poll_start(&h->listen_poll, UV_READABLE, on_accept);
  run(h);
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
  uv_poll_stop(&h->listen_poll);
  uv_timer_stop(&h->timer);
  uv_timer_stop(&h->accept_pause);
  MHD_stop_daemon(h->mhd); /* after the poll stops watching its descriptor; closes every connection */
  h->mhd = NULL;
  uv_close((uv_handle_t *)&h->poll, handle_closed);
  uv_close((uv_handle_t *)&h->listen_poll, handle_closed);
  uv_close((uv_handle_t *)&h->timer, handle_closed);
  uv_close((uv_handle_t *)&h->accept_pause, handle_closed);
  close(h->listen_fd); /* after the poll on it is closed: libuv forgets it at uv_close */
}
