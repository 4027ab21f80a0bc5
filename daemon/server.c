/*
 * server.c - the Unix socket: accepting, peer checks, framing, replies.
 *
 * DESIGN: runs entirely on the loop thread (large requests are parsed on a
 * control job, which reads only the frame it was handed). This is the
 * transport layer: it reads frames, checks the op table's rules (hello first,
 * what runs while stopping, what skips the queue, descriptors) and hands each
 * request to the op handlers (ops.h), which reach back only through the
 * connection's conn_ops table. Sockets are nonblocking and watched with
 * uv_poll; frames go through proto/wire.h (descriptors with SCM_RIGHTS).
 *
 * No client can deny service to another; every resource a connection can
 * make the daemon hold is bounded, and the bound is met by waiting or by a
 * LIMIT answer, never by dropping a well-behaved client:
 *   - requests in progress (CONN_MAX_INFLIGHT) and queued (CONN_MAX_QUEUED):
 *     past them the socket is not read;
 *   - request bytes: a frame over max_request_bytes is refused from its length
 *     prefix; parsed requests are charged against request_memory (a quarter
 *     of it per connection, and large requests together at most three
 *     quarters, so that they never keep small ones waiting); a frame that
 *     does not fit waits unparsed until memory frees, for at most
 *     frame_timeout_ms, then is answered LIMIT; requests that wait (for a
 *     set, a prefetch) keep only their id;
 *   - reply bytes and descriptors queued for a client that does not read:
 *     past half of max_queued_output / max_queued_fds its requests are not
 *     read and its progress events are dropped (they can be); a final reply
 *     that would pass the limit is answered LIMIT instead (once per request,
 *     so at most one per request read); a LIMIT answer that would pass twice
 *     max_queued_output closes the connection;
 *   - connections: max_connections, plus reserved_connections for root and the
 *     daemon's uid; connections and the descriptors queued in replies stay
 *     within RLIMIT_NOFILE less what the daemon keeps for its own work (a
 *     quarter, daemon_fd_budget); idle ones (no lease, nothing in progress)
 *     close after idle_timeout_ms; when descriptors run out all the same,
 *     accept refuses with LIMIT through a reserved descriptor and pauses
 *     instead of spinning.
 * A connection is reference counted: the server holds one reference until it
 * closes, and each request still in progress holds one.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <malloc.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "server.h"

#include "clock.h"
#include "log.h"
#include "msg.h"
#include "ops.h"
#include "request.h"

/* Requests up to this size are parsed on the loop; larger ones on a control job. */
#define PARSE_INLINE_MAX (64u * 1024u)
/*
 * Reading and parsing a request can take this many bytes per byte of its text:
 * the densest JSON ("0,0,0,...") is a tree node per two bytes, 72 bytes each
 * in the strict parser's arena and then 80 with malloc's overhead in cJSON's
 * tree, besides the text itself. Measured with glibc: at most 50.
 */
#define REQUEST_MEMORY_FACTOR 64u
/*
 * Once requests charged at least this much have given their memory back, and
 * no request that large is still held, the heap is returned to the system
 * (malloc_trim) after TRIM_DELAY_MS: at most once per delay, never per request.
 */
#define REQUEST_MEMORY_TRIM (16u << 20)
#define TRIM_DELAY_MS 250
/* How long the listener pauses when the process is out of descriptors. */
#define ACCEPT_PAUSE_MS 100

struct server {
  struct daemon *d;
  int listen_fd;
  uv_poll_t listen_poll;
  bool listening;
  bool passed;             /* the socket was passed at start: never unlinked */
  int reserve_fd;          /* held to accept-and-refuse when descriptors run out */
  uv_timer_t accept_timer; /* resumes accepting after a pause */
  uv_timer_t trim_timer;   /* returns the heap of large requests to the system */
  bool accept_paused;
  uint64_t refused_emfile; /* connections refused in the current out-of-descriptors episode */
  struct conn *conns;
  size_t nconns;
  size_t nwaiting_memory; /* connections whose next frame waits for request memory */
  uint64_t last_serial;   /* the daemon-wide id of the latest request read */
};

static void conn_close(struct conn *c);
static void kick(struct conn *c);
static int conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds);
static int conn_send_event(struct conn *c, cJSON *ev);
static void req_finish(struct request *r);
static struct request *conn_unqueue(struct conn *c, const cJSON *id);
static bool conn_dequeue(struct conn *c, struct request *r);
static struct conn *conn_first(const struct conn *c);
static void req_drop_args(struct request *r);

/* What the op handlers reach the transport through (request.h). */
static const struct conn_ops transport = {
    .send = conn_send,
    .send_event = conn_send_event,
    .finish = req_finish,
    .unqueue = conn_unqueue,
    .dequeue = conn_dequeue,
    .first = conn_first,
    .drop_args = req_drop_args,
};

/* ---- references --------------------------------------------------------------- */

#define CONN_HANDLES 4 /* poll, frame_timer, resume_timer, idle_timer */

static void conn_handle_closed(uv_handle_t *h) {
  struct conn *c = h->data;
  if (--c->handles_open == 0 && c->refs == 0) free(c);
}

static void conn_unref(struct conn *c) {
  if (--c->refs > 0) return;
  if (c->handles_open == 0) free(c);
}

/* ---- state -------------------------------------------------------------------- */

/* Replies pile up unread: stop reading this client's requests. */
static bool backlogged(const struct conn *c) {
  return wire_writer_bytes(&c->writer) > c->d->cfg.max_queued_output / 2 ||
         wire_writer_fds(&c->writer) > c->d->cfg.max_queued_fds / 2;
}

static bool alive(const struct conn *c) { return !c->closed && !c->dead; }

/* May frames be taken from this connection now? */
static bool can_take(const struct conn *c) {
  return alive(c) && !c->closing && !c->parsing && !c->waiting_memory && c->nqueued < CONN_MAX_QUEUED &&
         !backlogged(c);
}

static void on_poll(uv_poll_t *p, int status, int events);

static void update_poll(struct conn *c) {
  if (!alive(c)) return;
  /* A closing connection only drains its replies: reading it could spin forever. */
  int ev = UV_DISCONNECT | (can_take(c) ? UV_READABLE : 0);
  if (wire_writer_bytes(&c->writer) > 0) ev |= UV_WRITABLE;
  uv_poll_start(&c->poll, ev, on_poll);
}

static void on_kill(uv_timer_t *t) { conn_close(t->data); }

/*
 * Closes the connection soon, from the loop, never from inside a send: the
 * caller may be walking a list that closing the connection would free.
 */
static void conn_kill(struct conn *c) {
  if (!alive(c)) return;
  c->dead = true;
  uv_poll_stop(&c->poll);
  uv_timer_stop(&c->frame_timer);
  uv_timer_stop(&c->idle_timer);
  uv_timer_start(&c->resume_timer, on_kill, 0, 0);
}

/* ---- sending -------------------------------------------------------------------- */

static void flush(struct conn *c) {
  if (!alive(c)) return;
  bool was_backlogged = backlogged(c);
  size_t fds_before = wire_writer_fds(&c->writer), bytes_before = wire_writer_bytes(&c->writer);
  int rc = wire_writer_flush(&c->writer, c->fd);
  c->d->stats.fds_queued -= fds_before - wire_writer_fds(&c->writer);
  c->d->stats.output_queued -= bytes_before - wire_writer_bytes(&c->writer);
  if (rc < 0) {
    log_msg(LOG_DEBUG, "connection of pid %d: send failed: %s", (int)c->pid, weightd_strerror(rc));
    conn_kill(c);
    return;
  }
  if (c->closing && rc == 0) {
    conn_kill(c);
    return;
  }
  if (was_backlogged && !backlogged(c)) kick(c);
  update_poll(c);
}

/* The text of an error reply to the request with this id (small: it always fits). */
static char *error_text(const cJSON *id, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static char *error_text(const cJSON *id, int code, const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  cJSON *e = msg_reply_error(id, code, msg);
  char *text = e ? msg_serialize(e) : NULL;
  cJSON_Delete(e);
  return text;
}

/* Queues a serialised frame (text is freed) and sends what it can; on failure the connection is killed. */
static int queue_text(struct conn *c, char *text, const int *fds, size_t nfds) {
  size_t bytes_before = wire_writer_bytes(&c->writer);
  int rc = wire_writer_push(&c->writer, text, strlen(text), fds, nfds);
  free(text);
  if (rc != 0) {
    log_msg(LOG_ERROR, "cannot queue a reply for pid %d: %s", (int)c->pid, weightd_strerror(rc));
    conn_kill(c);
    return rc;
  }
  c->d->stats.fds_queued += nfds;
  c->d->stats.output_queued += wire_writer_bytes(&c->writer) - bytes_before;
  flush(c);
  return 0;
}

/*
 * Queues a final reply (one per request; the handlers never send two). A
 * reply that breaks a limit (the frame size, the connection's queued bytes or
 * descriptors) is replaced by a LIMIT error for the same id and its
 * descriptors are closed; when even that would pass twice max_queued_output
 * the connection is closed. Returns 0 when the frame itself was queued,
 * WEIGHTD_E_LIMIT when a LIMIT error went in its place, or WEIGHTD_E_CLOSED /
 * WEIGHTD_E_NOMEM when nothing could be queued.
 */
static int conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds) {
  const struct wd_config *cfg = &c->d->cfg;
  const cJSON *id = reply ? cJSON_GetObjectItemCaseSensitive(reply, "id") : NULL;
  char *text = reply ? msg_serialize(reply) : NULL;
  int result = 0;
  size_t len = text ? strlen(text) : 0;
  char *limited = NULL;
  if (text != NULL && len > WIRE_MAX_FRAME)
    limited = error_text(id, WEIGHTD_E_LIMIT, "the reply (%zu bytes) exceeds the %u-byte frame limit", len,
                         WIRE_MAX_FRAME);
  else if (text != NULL && wire_writer_bytes(&c->writer) + len > cfg->max_queued_output)
    limited = error_text(id, WEIGHTD_E_LIMIT,
                         "%zu bytes of replies wait unread on this connection: this one (%zu bytes) would pass "
                         "max_queued_output (%" PRIu64 "); read the replies",
                         wire_writer_bytes(&c->writer), len, cfg->max_queued_output);
  else if (text != NULL && nfds > 0 && wire_writer_fds(&c->writer) + nfds > cfg->max_queued_fds)
    limited = error_text(id, WEIGHTD_E_LIMIT,
                         "%zu file descriptors wait unread on this connection: max_queued_fds (%" PRIu64
                         ") reached; read the replies",
                         wire_writer_fds(&c->writer), cfg->max_queued_fds);
  if (limited != NULL) {
    log_msg(LOG_DEBUG, "a reply for pid %d breaks a limit: LIMIT sent instead", (int)c->pid);
    free(text);
    text = limited;
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    nfds = 0;
    result = WEIGHTD_E_LIMIT;
    if (alive(c) && wire_writer_bytes(&c->writer) + strlen(text) > 2 * cfg->max_queued_output) {
      log_msg(LOG_WARN, "connection of pid %d: %zu reply bytes wait unread, past twice max_queued_output: closing it",
              (int)c->pid, wire_writer_bytes(&c->writer));
      cJSON_Delete(reply);
      free(text);
      conn_kill(c);
      return WEIGHTD_E_CLOSED;
    }
  }
  cJSON_Delete(reply);
  if (!alive(c)) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    free(text);
    return WEIGHTD_E_CLOSED;
  }
  if (text == NULL) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    log_msg(LOG_ERROR, "out of memory serialising a reply: closing connection of pid %d", (int)c->pid);
    conn_kill(c);
    return WEIGHTD_E_NOMEM;
  }
  int rc = queue_text(c, text, fds, nfds);
  return rc != 0 ? rc : result;
}

/*
 * Queues an event (a progress tick), or drops it: events can be lost, so one
 * for a connection that is backlogged, or that would break a limit, is not
 * sent (and is counted). Returns 0 when queued, WEIGHTD_E_LIMIT when dropped,
 * WEIGHTD_E_CLOSED when the connection is gone.
 */
static int conn_send_event(struct conn *c, cJSON *ev) {
  if (ev == NULL) return WEIGHTD_E_NOMEM;
  if (!alive(c)) {
    cJSON_Delete(ev);
    return WEIGHTD_E_CLOSED;
  }
  char *text = backlogged(c) ? NULL : msg_serialize(ev);
  cJSON_Delete(ev);
  if (text == NULL || strlen(text) > WIRE_MAX_FRAME ||
      wire_writer_bytes(&c->writer) + strlen(text) > c->d->cfg.max_queued_output) {
    free(text);
    c->d->stats.events_dropped++;
    return WEIGHTD_E_LIMIT;
  }
  return queue_text(c, text, NULL, 0);
}

static void on_closing_deadline(uv_timer_t *t) { conn_kill(t->data); }

/* A final protocol error: reply, then close once it is sent (or after frame_timeout_ms at most). */
static void conn_fail(struct conn *c, const cJSON *id, int code, const char *msg) {
  if (!alive(c) || c->closing) return;
  log_msg(LOG_DEBUG, "connection of pid %d: %s", (int)c->pid, msg);
  daemon_count_error(c->d, code);
  conn_send(c, msg_reply_error(id, code, msg), NULL, 0);
  if (alive(c)) {
    c->closing = true;
    uv_timer_stop(&c->frame_timer);
    uv_timer_stop(&c->idle_timer);
    uv_timer_start(&c->frame_timer, on_closing_deadline, c->d->cfg.frame_timeout_ms, 0);
    flush(c);
  }
}

/* ---- requests -------------------------------------------------------------------- */

static void req_unlink(struct request *r) {
  struct request **pp = &r->conn->requests;
  while (*pp != NULL && *pp != r) pp = &(*pp)->next_in_conn;
  if (*pp == r) *pp = r->next_in_conn;
}

/* Wakes every connection whose next frame waits for request memory. */
static void wake_memory_waiters(struct server *srv) {
  for (struct conn *c = srv->conns; c != NULL && srv->nwaiting_memory > 0; c = c->next)
    if (c->waiting_memory) {
      c->waiting_memory = false;
      srv->nwaiting_memory--;
      kick(c);
    }
}

/*
 * Returns the heap that large requests' parse trees took to the system, once
 * none is held: glibc would keep it, and one 4 MiB request would leave
 * 150 MiB resident.
 */
static void on_trim(uv_timer_t *t) {
  struct server *srv = t->data;
  if (srv->d->stats.request_mem >= REQUEST_MEMORY_TRIM) { /* a large request is still held: later */
    uv_timer_start(t, on_trim, TRIM_DELAY_MS, 0);
    return;
  }
#ifdef __GLIBC__
  double t0 = clock_s();
  malloc_trim(0);
  log_msg(LOG_DEBUG, "returned the heap of large requests to the system in %.1f ms", (clock_s() - t0) * 1e3);
#endif
}

/*
 * Gives back request memory charged to c (whether c is alive or not), lets
 * every connection that waits for request memory try again, and after a
 * large request has the heap returned (on_trim).
 */
static void release_memory(struct conn *c, uint64_t mem) {
  if (mem == 0) return;
  c->request_mem -= mem;
  c->d->stats.request_mem -= mem;
  if (mem >= REQUEST_MEMORY_TRIM && c->srv->listening && !uv_is_active((uv_handle_t *)&c->srv->trim_timer))
    uv_timer_start(&c->srv->trim_timer, on_trim, TRIM_DELAY_MS, 0);
  wake_memory_waiters(c->srv);
}

static void req_drop_args(struct request *r) {
  cJSON_Delete(r->root);
  r->root = NULL;
  uint64_t mem = r->mem;
  r->mem = 0;
  release_memory(r->conn, mem);
}

static void on_idle(uv_timer_t *t);

/* True when the connection has a request in any stage: started, queued, being parsed or waiting for memory. */
static bool busy(const struct conn *c) {
  return c->inflight > 0 || c->nqueued > 0 || c->parsing || c->held.json != NULL;
}

/* Arms the idle timer when nothing is in progress (whether leases are held is asked when it fires). */
static void watch_idle(struct conn *c) {
  if (!alive(c) || c->closing || c->d->cfg.idle_timeout_ms == 0) return;
  if (!busy(c)) uv_timer_start(&c->idle_timer, on_idle, c->d->cfg.idle_timeout_ms, 0);
  else uv_timer_stop(&c->idle_timer);
}

static void req_finish(struct request *r) {
  struct conn *c = r->conn;
  req_unlink(r);
  if (r->started) {
    c->inflight--;
    c->d->stats.requests_inflight--;
  }
  req_drop_args(r);
  cJSON_Delete(r->id);
  free(r);
  if (alive(c)) {
    kick(c); /* not from inside a handler: queued requests and buffered frames go on from the loop */
    watch_idle(c);
  }
  conn_unref(c);
}

/* Counts a request in progress and runs its handler. */
static void req_start(struct request *r) {
  struct conn *c = r->conn;
  r->started = true;
  c->inflight++;
  c->d->stats.requests++;
  c->d->stats.requests_inflight++;
  r->next_in_conn = c->requests;
  c->requests = r;
  uv_timer_stop(&c->idle_timer);
  ops_dispatch(r);
}

static struct request *queue_pop(struct conn *c) {
  struct request *r = c->queued;
  if (r == NULL) return NULL;
  c->queued = r->next_in_conn;
  if (c->queued == NULL) c->queued_tail = &c->queued;
  c->nqueued--;
  r->next_in_conn = NULL;
  return r;
}

static struct request *conn_unqueue(struct conn *c, const cJSON *id) {
  for (struct request **pp = &c->queued; *pp != NULL; pp = &(*pp)->next_in_conn) {
    struct request *r = *pp;
    if (r->id == NULL || !msg_id_equal(r->id, id)) continue;
    *pp = r->next_in_conn;
    if (*pp == NULL) c->queued_tail = pp;
    c->nqueued--;
    r->next_in_conn = c->requests; /* finished as a started request would be */
    c->requests = r;
    return r;
  }
  return NULL;
}

static bool conn_dequeue(struct conn *c, struct request *r) {
  for (struct request **pp = &c->queued; *pp != NULL; pp = &(*pp)->next_in_conn) {
    if (*pp != r) continue;
    *pp = r->next_in_conn;
    if (*pp == NULL) c->queued_tail = pp;
    c->nqueued--;
    r->next_in_conn = c->requests; /* finished as a started request would be */
    c->requests = r;
    return true;
  }
  return false;
}

static struct conn *conn_first(const struct conn *c) { return c->srv->conns; }

/* Starts queued requests while there is room. */
static void start_queued(struct conn *c) {
  while (alive(c) && c->inflight < CONN_MAX_INFLIGHT && c->queued != NULL) req_start(queue_pop(c));
}

/* A request read and parsed: check the op's rules, then start it or queue it. mem is charged already. */
static void take_request(struct conn *c, struct msg_request *m, int rc, const struct wd_error *err, size_t nfds,
                         size_t mem) {
  unsigned flags = rc == 0 ? msg_op_flags(m->op) : 0;
  const char *refusal = NULL;
  int code = rc;
  if (nfds > 0 && !(flags & MSG_OPF_FDS_IN)) {
    code = WEIGHTD_E_PROTOCOL;
    refusal = "this request may not carry file descriptors";
  } else if (rc != 0) {
    refusal = err->msg;
  } else if (!c->hello_done && !(flags & MSG_OPF_BEFORE_HELLO)) {
    code = WEIGHTD_E_PROTOCOL;
    refusal = "the first request on a connection must be 'hello'";
  }
  if (refusal != NULL) {
    /* Before hello, or with descriptors, the stream cannot be trusted: the connection closes. */
    if (!c->hello_done || code == WEIGHTD_E_PROTOCOL) conn_fail(c, m->id, code, refusal);
    else conn_send(c, msg_reply_error(m->id, code, refusal), NULL, 0);
  } else if (c->d->stopping && !(flags & MSG_OPF_WHILE_STOPPING)) {
    conn_send(c, msg_reply_error(m->id, WEIGHTD_E_SHUTDOWN, "the daemon is shutting down"), NULL, 0);
    refusal = "stopping";
  }
  struct request *r = refusal == NULL ? calloc(1, sizeof *r) : NULL;
  if (refusal == NULL && r == NULL) conn_send(c, msg_reply_error(m->id, WEIGHTD_E_NOMEM, "out of memory"), NULL, 0);
  if (r == NULL) {
    msg_request_free(m);
    release_memory(c, mem);
    return;
  }
  r->conn = c;
  r->root = m->root;
  r->id = m->id;
  r->op = m->op;
  r->mem = mem;
  r->serial = ++c->srv->last_serial;
  r->created_ms = clock_ms();
  m->root = NULL;
  m->id = NULL;
  msg_request_free(m);
  c->refs++;
  /* Some ops (cancel) go past the line; anything else waits its turn behind the queue. */
  if (!(flags & MSG_OPF_SKIPS_QUEUE) && (c->inflight >= CONN_MAX_INFLIGHT || c->nqueued > 0)) {
    r->next_in_conn = NULL;
    *c->queued_tail = r;
    c->queued_tail = &r->next_in_conn;
    c->nqueued++;
    return;
  }
  req_start(r);
}

/* A large request parsed on a control job, which reads only this struct. */
struct parse_job {
  struct job job;
  struct conn *conn; /* referenced */
  char *json;
  size_t len, nfds, mem;
  struct msg_request m;
  int rc;
  struct wd_error err;
};

static void parse_work(struct job *j) {
  struct parse_job *pj = (struct parse_job *)j;
  pj->rc = msg_request_parse(pj->json, pj->len, &pj->m, &pj->err);
}

static void parse_done(struct job *j) {
  struct parse_job *pj = (struct parse_job *)j;
  struct conn *c = pj->conn;
  c->parsing = false;
  free(pj->json);
  if (alive(c)) {
    take_request(c, &pj->m, pj->rc, &pj->err, pj->nfds, pj->mem);
    kick(c);
    watch_idle(c);
  } else {
    msg_request_free(&pj->m);
    release_memory(c, pj->mem);
  }
  conn_unref(c);
  free(pj);
}

/* Parses a frame (on the loop, or on a job when it is large) and hands it on. */
static void handle_frame(struct conn *c, struct wire_frame *f, size_t mem) {
  if (f->len > PARSE_INLINE_MAX && c->d->control_pool != NULL) {
    struct parse_job *pj = calloc(1, sizeof *pj);
    if (pj != NULL) {
      pj->job.work = parse_work;
      pj->job.done = parse_done;
      pj->conn = c;
      pj->json = f->json; /* the job takes the text */
      f->json = NULL;
      pj->len = f->len;
      pj->nfds = f->nfds;
      pj->mem = mem;
      c->refs++;
      c->parsing = true; /* frames after it wait: requests are taken in order */
      jobs_submit(c->d->control_pool, &pj->job);
      return;
    }
  }
  struct msg_request m = {0};
  struct wd_error err = {0};
  int rc = msg_request_parse(f->json, f->len, &m, &err);
  take_request(c, &m, rc, &err, f->nfds, mem);
}

/* ---- reading ------------------------------------------------------------------------ */

static void on_frame_timeout(uv_timer_t *t) {
  struct conn *c = t->data;
  conn_fail(c, NULL, WEIGHTD_E_PROTOCOL, "a request frame did not arrive whole within frame_timeout_ms");
}

/*
 * A frame held back for request memory for frame_timeout_ms is answered
 * LIMIT (its id read without parsing it) and dropped; the connection stays
 * open and goes on with its next frame. Waiting is bounded so that requests
 * that hold memory for long cannot keep another client waiting for ever.
 */
/* Answers a frame that is not parsed LIMIT (its id read without parsing it) and drops it. */
static void frame_refuse(struct conn *c, struct wire_frame *f, const char *why) {
  cJSON *id = msg_request_peek_id(f->json, f->len);
  char msg[256];
  snprintf(msg, sizeof msg, "the request (%zu bytes) %s", f->len, why);
  log_msg(LOG_DEBUG, "a request of pid %d: LIMIT: %s", (int)c->pid, msg);
  wire_frame_clear(f);
  conn_send(c, msg_reply_error(id, WEIGHTD_E_LIMIT, msg), NULL, 0);
  cJSON_Delete(id);
}

static void on_held_timeout(uv_timer_t *t) {
  struct conn *c = t->data;
  if (!alive(c) || c->held.json == NULL) return;
  if (c->waiting_memory) {
    c->waiting_memory = false;
    c->srv->nwaiting_memory--;
  }
  frame_refuse(c, &c->held,
               "got no request memory within frame_timeout_ms: other requests hold request_memory; send it "
               "again later");
  kick(c);
}

/*
 * Whether a frame charged mem can ever be taken: one connection's share of
 * request_memory (a quarter). The configuration's checks keep frames within
 * it; a reload that shrinks request_memory can leave a frame read before it
 * over it.
 */
static bool within_share(const struct conn *c, size_t mem) { return mem <= c->d->cfg.request_memory / 4; }

static const char over_share[] = "is over one connection's share of request_memory (a reload shrank it)";

/*
 * Reserves memory for the next frame, or marks the connection as waiting for
 * it. Large requests (those parsed on a job) may use three quarters of
 * request_memory together: the rest keeps small ones (a status, a release)
 * going while large ones wait.
 */
static bool reserve_memory(struct conn *c, size_t mem) {
  const struct wd_config *cfg = &c->d->cfg;
  uint64_t global = cfg->request_memory;
  if (mem > (uint64_t)PARSE_INLINE_MAX * REQUEST_MEMORY_FACTOR) global -= cfg->request_memory / 4;
  if (c->request_mem + mem <= cfg->request_memory / 4 && c->d->stats.request_mem + mem <= global) {
    c->request_mem += mem;
    c->d->stats.request_mem += mem;
    return true;
  }
  if (!c->waiting_memory) {
    c->waiting_memory = true;
    c->srv->nwaiting_memory++;
  }
  return false;
}

/*
 * Handles buffered frames while frames may be taken. Every completed frame
 * restarts the frame timeout: it runs from a frame's first byte.
 */
static void process_frames(struct conn *c) {
  while (can_take(c)) {
    uint32_t next = wire_reader_next_len(&c->reader);
    if (next == 0 && !wire_reader_pending(&c->reader)) return;
    size_t mem = (size_t)next * REQUEST_MEMORY_FACTOR;
    struct wire_frame f = {0};
    struct wd_error err = {0};
    c->reader.max_frame = (uint32_t)c->d->cfg.max_request_bytes; /* as configured now (reloads) */
    int n = wire_reader_next(&c->reader, &f, &err);
    if (n == 0) return;
    if (n < 0) {
      conn_fail(c, NULL, n, err.msg);
      return;
    }
    if (!within_share(c, mem)) {
      uv_timer_stop(&c->frame_timer);
      frame_refuse(c, &f, over_share);
      continue;
    }
    if (!reserve_memory(c, mem)) {
      /* Put it back: the reader keeps no frame once taken, so hold it until memory frees. */
      c->held = f;
      uv_timer_start(&c->frame_timer, on_held_timeout, c->d->cfg.frame_timeout_ms, 0);
      return;
    }
    uv_timer_stop(&c->frame_timer);
    handle_frame(c, &f, mem);
    wire_frame_clear(&f);
  }
}

/* Arms the frame timer while a partial frame waits for bytes the client should send. */
static void watch_partial_frame(struct conn *c) {
  if (!alive(c) || c->closing || c->held.json != NULL) return; /* the timer is the held frame's */
  if (can_take(c) && wire_reader_pending(&c->reader)) {
    if (!uv_is_active((uv_handle_t *)&c->frame_timer))
      uv_timer_start(&c->frame_timer, on_frame_timeout, c->d->cfg.frame_timeout_ms, 0);
  } else {
    uv_timer_stop(&c->frame_timer);
  }
}

static void do_read(struct conn *c) {
  for (int rounds = 0; rounds < 16 && can_take(c); rounds++) {
    c->reader.max_frame = (uint32_t)c->d->cfg.max_request_bytes; /* as configured now (reloads) */
    int rc = wire_reader_fill(&c->reader, c->fd);
    if (rc == WIRE_AGAIN) break;
    if (rc == 0) {
      conn_close(c);
      return;
    }
    if (rc < 0 && rc != WEIGHTD_E_BUSY) {
      conn_fail(c, NULL, rc, c->reader.err.msg);
      return;
    }
    uv_timer_stop(&c->idle_timer);
    process_frames(c);
  }
  watch_partial_frame(c);
  update_poll(c);
}

/* Takes a frame held back for memory, once memory allows. */
static void take_held(struct conn *c) {
  if (c->held.json == NULL || !can_take(c)) return;
  size_t mem = c->held.len * REQUEST_MEMORY_FACTOR;
  if (!within_share(c, mem)) {
    uv_timer_stop(&c->frame_timer);
    frame_refuse(c, &c->held, over_share);
    return;
  }
  if (!reserve_memory(c, mem)) return;
  uv_timer_stop(&c->frame_timer);
  struct wire_frame f = c->held;
  memset(&c->held, 0, sizeof c->held);
  handle_frame(c, &f, mem);
  wire_frame_clear(&f);
}

/* Goes on with whatever may now proceed: queued requests, held and buffered frames, the socket. */
static void on_resume(uv_timer_t *t) {
  struct conn *c = t->data;
  if (!alive(c)) return;
  c->refs++;
  start_queued(c);
  take_held(c);
  if (c->held.json == NULL) process_frames(c);
  if (can_take(c) && c->held.json == NULL) do_read(c);
  else {
    watch_partial_frame(c);
    update_poll(c);
  }
  conn_unref(c);
}

/* Schedules on_resume (never runs it inside a caller that may be walking a list). */
static void kick(struct conn *c) {
  if (alive(c)) uv_timer_start(&c->resume_timer, on_resume, 0, 0);
}

static void on_poll(uv_poll_t *p, int status, int events) {
  struct conn *c = p->data;
  if (!alive(c)) return;
  if (status < 0) {
    conn_close(c);
    return;
  }
  c->refs++; /* hold the connection while handlers run */
  if (events & UV_WRITABLE) flush(c);
  if (can_take(c) && c->held.json == NULL && (events & (UV_READABLE | UV_DISCONNECT))) do_read(c);
  else if (alive(c) && !c->closed && (events & UV_DISCONNECT)) conn_close(c);
  conn_unref(c);
}

static void on_idle(uv_timer_t *t) {
  struct conn *c = t->data;
  if (!alive(c) || c->closing || busy(c)) return;
  if (ops_conn_holds_leases(c)) return; /* engines holding leases are never dropped */
  log_msg(LOG_DEBUG, "connection of pid %d idle for %" PRIu64 " ms: closing", (int)c->pid,
          c->d->cfg.idle_timeout_ms);
  conn_kill(c);
}

/* ---- connection lifetime --------------------------------------------------------------- */

static void conn_close(struct conn *c) {
  if (c->closed) return;
  c->closed = true;
  struct server *srv = c->srv;
  struct conn **pp = &srv->conns;
  while (*pp != NULL && *pp != c) pp = &(*pp)->next;
  if (*pp == c) *pp = c->next;
  srv->nconns--;
  srv->d->stats.connections = srv->nconns;
  if (c->waiting_memory) {
    c->waiting_memory = false;
    srv->nwaiting_memory--;
  }
  ops_conn_gone(c);
  /* Queued requests never started; requests waiting for a set stop waiting; the others finish on their own. */
  for (struct request *q = queue_pop(c); q != NULL; q = queue_pop(c)) req_finish(q);
  struct request *r = c->requests;
  while (r != NULL) {
    struct request *next = r->next_in_conn;
    ops_request_gone(r);
    r = next;
  }
  uv_poll_stop(&c->poll);
  uv_timer_stop(&c->frame_timer);
  uv_timer_stop(&c->resume_timer);
  uv_timer_stop(&c->idle_timer);
  wire_frame_clear(&c->held);
  wire_reader_free(&c->reader);
  srv->d->stats.fds_queued -= wire_writer_fds(&c->writer);
  srv->d->stats.output_queued -= wire_writer_bytes(&c->writer);
  wire_writer_free(&c->writer);
  close(c->fd);
  c->fd = -1;
  uv_close((uv_handle_t *)&c->poll, conn_handle_closed);
  uv_close((uv_handle_t *)&c->frame_timer, conn_handle_closed);
  uv_close((uv_handle_t *)&c->resume_timer, conn_handle_closed);
  uv_close((uv_handle_t *)&c->idle_timer, conn_handle_closed);
  log_msg(LOG_DEBUG, "connection of pid %d closed", (int)c->pid);
  conn_unref(c);
}

static bool uid_privileged(uid_t uid) { return uid == 0 || uid == geteuid(); }

/*
 * Whether one more connection may be served: within max_connections (plus
 * reserved_connections for root and the daemon's uid), and within the
 * descriptors the daemon gives to connections and queued replies
 * (daemon_fd_budget), so that clients never take the descriptors it needs to
 * open shards and create slabs for them. The reserved connections stay free
 * of other peers' connections in both counts.
 */
static bool may_accept(const struct server *srv, bool privileged) {
  const struct daemon *d = srv->d;
  uint64_t held_back = privileged ? 0 : d->cfg.reserved_connections;
  if (srv->nconns + held_back >= d->cfg.max_connections + d->cfg.reserved_connections) return false;
  return srv->nconns + d->stats.fds_queued + held_back < daemon_fd_budget(d);
}

static bool peer_allowed(const struct conn *c) {
  const struct wd_config *cfg = &c->d->cfg;
  if (conn_is_privileged(c)) return true;
  if (cfg->n_allowed_uids == 0 && cfg->n_allowed_gids == 0) return true;
  for (size_t i = 0; i < cfg->n_allowed_uids; i++)
    if (cfg->allowed_uids[i] == (uint64_t)c->uid) return true;
  for (size_t i = 0; i < cfg->n_allowed_gids; i++)
    if (cfg->allowed_gids[i] == (uint64_t)c->gid) return true;
  return false;
}

/* Writes one refusal frame to a socket that is closed right after (best effort, nonblocking). */
static void refuse(int fd, const char *message) {
  char body[256];
  int n = snprintf(body, sizeof body, "{\"error\":{\"code\":\"LIMIT\",\"message\":\"%s\"}}", message);
  unsigned char frame[4 + sizeof body];
  frame[0] = (unsigned char)n;
  frame[1] = frame[2] = frame[3] = 0;
  memcpy(frame + 4, body, (size_t)n);
  if (write(fd, frame, 4 + (size_t)n) < 0) {
  }
}

static void on_accept(uv_poll_t *p, int status, int events);

static void on_accept_resume(uv_timer_t *t) {
  struct server *srv = t->data;
  if (!srv->listening) return;
  srv->accept_paused = false;
  uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
}

/*
 * Out of descriptors: give the reserved one back to accept one waiting peer
 * and refuse it with LIMIT, then pause the listener briefly. Without this a
 * level-triggered listener with peers waiting spins the loop.
 */
static void out_of_descriptors(struct server *srv, int err) {
  if (srv->refused_emfile++ == 0)
    log_msg(LOG_WARN, "accept: %s: refusing new connections until descriptors free (LimitNOFILE / RLIMIT_NOFILE)",
            strerror(err));
  if (srv->reserve_fd >= 0) {
    close(srv->reserve_fd);
    srv->reserve_fd = -1;
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      refuse(fd, "the daemon is out of file descriptors; retry later");
      close(fd);
    }
    srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  srv->accept_paused = true;
  uv_poll_stop(&srv->listen_poll);
  uv_timer_start(&srv->accept_timer, on_accept_resume, ACCEPT_PAUSE_MS, 0);
}

static void on_accept(uv_poll_t *p, int status, int events) {
  struct server *srv = p->data;
  struct daemon *d = srv->d;
  (void)events;
  if (status < 0) return;
  for (int n = 0; n < 64; n++) {
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) out_of_descriptors(srv, errno);
      else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
        log_msg(LOG_WARN, "accept: %s", strerror(errno));
      return;
    }
    if (srv->refused_emfile > 0) {
      log_msg(LOG_INFO, "accepting again after refusing %" PRIu64 " connection(s) for want of descriptors",
              srv->refused_emfile);
      srv->refused_emfile = 0;
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      close(fd);
      continue;
    }
    struct conn *c = d->stopping || !may_accept(srv, uid_privileged(cred.uid)) ? NULL : calloc(1, sizeof *c);
    if (c == NULL) {
      if (!d->stopping) refuse(fd, "too many connections");
      close(fd);
      continue;
    }
    c->srv = srv;
    c->d = d;
    c->ops = &transport;
    c->fd = fd;
    c->pid = cred.pid;
    c->uid = cred.uid;
    c->gid = cred.gid;
    c->refs = 1;
    c->queued_tail = &c->queued;
    wire_reader_init(&c->reader);
    c->reader.max_frame = (uint32_t)d->cfg.max_request_bytes;
    wire_writer_init(&c->writer);
    uv_poll_init(d->loop, &c->poll, fd);
    uv_timer_init(d->loop, &c->frame_timer);
    uv_timer_init(d->loop, &c->resume_timer);
    uv_timer_init(d->loop, &c->idle_timer);
    c->poll.data = c;
    c->frame_timer.data = c;
    c->resume_timer.data = c;
    c->idle_timer.data = c;
    c->handles_open = CONN_HANDLES;
    c->next = srv->conns;
    srv->conns = c;
    srv->nconns++;
    d->stats.connections = srv->nconns;
    if (!peer_allowed(c)) {
      log_msg(LOG_WARN, "refused pid %d uid %d gid %d: not in allowed_uids/allowed_gids", (int)c->pid, (int)c->uid,
              (int)c->gid);
      char why[200];
      snprintf(why, sizeof why,
               "uid %d (primary gid %d) may not use this daemon: add the uid to allowed_uids or the gid to "
               "allowed_gids in its configuration",
               (int)c->uid, (int)c->gid);
      conn_fail(c, NULL, WEIGHTD_E_PERMISSION, why);
      continue;
    }
    log_msg(LOG_DEBUG, "connection from pid %d uid %d", (int)c->pid, (int)c->uid);
    watch_idle(c);
    update_poll(c);
  }
}

/* ---- the listening socket ---------------------------------------------------------------- */

/* Serves a socket passed at start; d->socket_path becomes its path. */
static int adopt(struct daemon *d, struct server *srv, int fd, struct wd_error *err) {
  struct sockaddr_un a;
  socklen_t len = sizeof a;
  if (getsockname(fd, (struct sockaddr *)&a, &len) == 0 && len > offsetof(struct sockaddr_un, sun_path) &&
      a.sun_path[0] != '\0') {
    char *p = strndup(a.sun_path, len - offsetof(struct sockaddr_un, sun_path));
    if (p == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    free(d->socket_path);
    d->socket_path = p;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0)
    return err_set(err, WEIGHTD_E_IO, "passed socket: %s", strerror(errno));
  srv->listen_fd = fd;
  srv->listening = true;
  srv->passed = true;
  return 0;
}

int server_config_check(const struct wd_config *cfg, struct wd_error *err) {
  if (cfg->max_request_bytes * REQUEST_MEMORY_FACTOR > cfg->request_memory / 4)
    return err_set(err, WEIGHTD_E_INVALID,
                   "max_request_bytes (%" PRIu64 ") needs request_memory of at least %" PRIu64
                   " (four connections' worth of its largest request, at %u bytes per byte)",
                   cfg->max_request_bytes, cfg->max_request_bytes * REQUEST_MEMORY_FACTOR * 4,
                   REQUEST_MEMORY_FACTOR);
  return 0;
}

int server_start(struct daemon *d, int passed_fd, struct wd_error *err) {
  const char *path = d->socket_path;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path) return err_set(err, WEIGHTD_E_INVALID, "socket path too long: %s", path);
  strcpy(addr.sun_path, path);
  int rc = server_config_check(&d->cfg, err);
  if (rc != 0) return rc;
  struct server *srv = calloc(1, sizeof *srv);
  if (srv == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  srv->d = d;
  srv->listen_fd = -1;
  srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (passed_fd >= 0) {
    rc = adopt(d, srv, passed_fd, err);
    if (rc != 0) {
      if (srv->reserve_fd >= 0) close(srv->reserve_fd);
      free(srv);
      return rc;
    }
    goto serve;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    if (srv->reserve_fd >= 0) close(srv->reserve_fd);
    free(srv);
    return err_set(err, WEIGHTD_E_IO, "socket: %s", strerror(errno));
  }
  /* A stale socket from a daemon that died is replaced; a live one is not. */
  struct stat sb;
  if (lstat(path, &sb) == 0 && S_ISSOCK(sb.st_mode)) {
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe >= 0 && connect(probe, (struct sockaddr *)&addr, sizeof addr) == 0) {
      close(probe);
      rc = err_set(err, WEIGHTD_E_BUSY, "another weightd is listening on %s", path);
      goto fail;
    }
    if (probe >= 0) close(probe);
    unlink(path);
  }
  /* Bind a temporary name and rename it into place once listening: whoever sees
   * the socket file can connect to it. */
  char tmp[sizeof addr.sun_path + 32];
  snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
  struct sockaddr_un taddr = {.sun_family = AF_UNIX};
  if (strlen(tmp) >= sizeof taddr.sun_path) {
    rc = err_set(err, WEIGHTD_E_INVALID, "socket path too long: %s", path);
    goto fail;
  }
  strcpy(taddr.sun_path, tmp);
  /* A missing directory would otherwise be reported against the temporary name. */
  char *slash = strrchr(path, '/');
  if (slash != NULL && slash != path) {
    char dir[sizeof addr.sun_path];
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    struct stat ds;
    int missing = stat(dir, &ds) != 0 ? errno : S_ISDIR(ds.st_mode) ? 0 : ENOTDIR;
    if (missing != 0) {
      rc = err_set(err, WEIGHTD_E_IO, "socket %s: %s: %s (create the directory, or choose another socket path)",
                   path, dir, strerror(missing));
      goto fail;
    }
  }
  unlink(tmp);
  mode_t old = umask(0177);
  rc = bind(fd, (struct sockaddr *)&taddr, sizeof taddr);
  umask(old);
  if (rc != 0) {
    rc = err_set(err, WEIGHTD_E_IO, "socket %s: cannot bind: %s", path, strerror(errno));
    goto fail;
  }
  if (d->cfg.socket_group != NULL && d->cfg.socket_group[0] != '\0') {
    struct group *g = getgrnam(d->cfg.socket_group);
    if (g == NULL) {
      log_msg(LOG_WARN,
              "socket_group '%s' does not exist: %s keeps the daemon's group (gid %d), so with socket_mode %04o "
              "only its members, root and uid %d can connect; create the group (systemd-sysusers, groupadd) or "
              "set socket_group",
              d->cfg.socket_group, path, (int)getegid(), (unsigned)d->cfg.socket_mode, (int)geteuid());
    } else if (chown(tmp, (uid_t)-1, g->gr_gid) != 0) {
      log_msg(LOG_WARN, "cannot give %s to group '%s': %s", path, d->cfg.socket_group, strerror(errno));
    }
  }
  if (chmod(tmp, (mode_t)d->cfg.socket_mode) != 0) log_msg(LOG_WARN, "chmod %s: %s", path, strerror(errno));
  if (listen(fd, 512) != 0 || rename(tmp, path) != 0) {
    rc = err_set(err, WEIGHTD_E_IO, "listen on %s: %s", path, strerror(errno));
    unlink(tmp);
    goto fail;
  }
  srv->listen_fd = fd;
  srv->listening = true;
serve:
  uv_poll_init(d->loop, &srv->listen_poll, srv->listen_fd);
  srv->listen_poll.data = srv;
  uv_timer_init(d->loop, &srv->accept_timer);
  srv->accept_timer.data = srv;
  uv_timer_init(d->loop, &srv->trim_timer);
  srv->trim_timer.data = srv;
  uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
  d->srv = srv;
  d->stats.listening = true;
  return 0;
fail:
  close(fd);
  if (srv->reserve_fd >= 0) close(srv->reserve_fd);
  free(srv);
  return rc;
}

static void listen_closed(uv_handle_t *h) { (void)h; }

void server_stop(struct server *srv) {
  if (srv->listening) {
    uv_poll_stop(&srv->listen_poll);
    uv_timer_stop(&srv->accept_timer);
    uv_timer_stop(&srv->trim_timer);
    uv_close((uv_handle_t *)&srv->listen_poll, listen_closed);
    uv_close((uv_handle_t *)&srv->accept_timer, listen_closed);
    uv_close((uv_handle_t *)&srv->trim_timer, listen_closed);
    close(srv->listen_fd); /* a passed socket lives on in its owner; ours was bound here */
    srv->listen_fd = -1;
    srv->listening = false;
    srv->d->stats.listening = false;
    if (!srv->passed) unlink(srv->d->socket_path);
  }
  struct conn *c = srv->conns;
  while (c != NULL) {
    struct conn *next = c->next;
    cJSON *ev = msg_event(NULL, "shutdown");
    if (ev != NULL) msg_add_string(ev, "message", "the daemon is shutting down");
    conn_send(c, ev, NULL, 0);
    if (!c->closed) {
      c->closing = true;
      flush(c);
    }
    c = next;
  }
}

void server_close_all(struct server *srv) {
  while (srv->conns != NULL) conn_close(srv->conns);
}

void server_destroy(struct server *srv) {
  if (srv == NULL) return;
  if (srv->reserve_fd >= 0) close(srv->reserve_fd);
  free(srv);
}
