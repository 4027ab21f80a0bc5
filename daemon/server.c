/*
 * server.c - the Unix socket: accepting, peer checks, framing, replies.
 *
 * DESIGN: runs entirely on the loop thread. This is the transport layer: it
 * reads frames, checks the op table's rules (hello first, privileged, what
 * runs while stopping, what skips the queue, descriptors) and hands each
 * request to ops.c, the only code that builds replies. The listening socket and every
 * connection are nonblocking descriptors watched with uv_poll; reads and
 * writes go through proto/wire.h (which passes descriptors with SCM_RIGHTS).
 * A connection is reference counted: the server holds one reference until the
 * connection closes, and each request still in flight holds one, so a client
 * that vanishes mid-load leaves its requests something valid to finish on.
 * A frame not completed within frame_timeout_ms, a protocol error, or more
 * than max_queued_output bytes of unread replies closes the connection.
 */
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "server.h"

#include "log.h"
#include "msg.h"
#include "ops.h"
#include "request.h"

struct server {
  struct daemon *d;
  int listen_fd;
  uv_poll_t listen_poll;
  bool listening;
  struct conn *conns;
  size_t nconns;
};

static void conn_close(struct conn *c);
static void on_resume(uv_timer_t *t);
static void conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds);
static void req_finish(struct request *r);
static struct request *conn_unqueue(struct conn *c, const cJSON *id);

/* What the op handlers reach the transport through (request.h). */
static const struct conn_ops transport = {
    .send = conn_send,
    .finish = req_finish,
    .unqueue = conn_unqueue,
};

/* ---- references --------------------------------------------------------------- */

static void conn_handle_closed(uv_handle_t *h) {
  struct conn *c = h->data;
  if (--c->handles_open == 0 && c->refs == 0) free(c);
}

static void conn_unref(struct conn *c) {
  if (--c->refs > 0) return;
  if (c->handles_open == 0) free(c);
}

/* ---- sending -------------------------------------------------------------------- */

static void on_poll(uv_poll_t *p, int status, int events);

static void update_poll(struct conn *c) {
  if (c->closed || c->dead) return;
  /* A closing connection only drains its replies: reading it could spin forever. */
  int ev = UV_DISCONNECT | (c->paused || c->closing ? 0 : UV_READABLE);
  if (wire_writer_bytes(&c->writer) > 0) ev |= UV_WRITABLE;
  uv_poll_start(&c->poll, ev, on_poll);
}

static void on_kill(uv_timer_t *t) { conn_close(t->data); }

/*
 * Closes the connection soon, from the loop, never from inside a send: the
 * caller may be walking a list that closing the connection would free.
 */
static void conn_kill(struct conn *c) {
  if (c->closed || c->dead) return;
  c->dead = true;
  uv_poll_stop(&c->poll);
  uv_timer_stop(&c->frame_timer);
  uv_timer_start(&c->resume_timer, on_kill, 0, 0);
}

static void flush(struct conn *c) {
  if (c->closed || c->dead) return;
  int rc = wire_writer_flush(&c->writer, c->fd);
  if (rc < 0) {
    log_msg(LOG_DEBUG, "connection of pid %d: send failed: %s", (int)c->pid, weightd_strerror(rc));
    conn_kill(c);
    return;
  }
  if (c->closing && rc == 0) {
    conn_kill(c);
    return;
  }
  update_poll(c);
}

/* An error reply in place of one that cannot be sent (over the frame limit). */
static char *replacement_error(const cJSON *reply, size_t len) {
  char msg[128];
  snprintf(msg, sizeof msg, "the reply (%zu bytes) exceeds the %u-byte frame limit", len, WIRE_MAX_FRAME);
  cJSON *e = msg_reply_error(cJSON_GetObjectItemCaseSensitive(reply, "id"), WEIGHTD_E_LIMIT, msg);
  char *text = e ? msg_serialize(e) : NULL;
  cJSON_Delete(e);
  return text;
}

static void conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds) {
  char *text = reply ? msg_serialize(reply) : NULL;
  if (text != NULL && strlen(text) > WIRE_MAX_FRAME) {
    log_msg(LOG_WARN, "a reply for pid %d is over the frame limit: sending LIMIT instead", (int)c->pid);
    size_t len = strlen(text);
    free(text);
    text = replacement_error(reply, len);
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    nfds = 0;
  }
  cJSON_Delete(reply);
  if (c->closed || c->dead) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    free(text);
    return;
  }
  if (text == NULL) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    log_msg(LOG_ERROR, "out of memory serialising a reply: closing connection of pid %d", (int)c->pid);
    conn_kill(c);
    return;
  }
  int rc = wire_writer_push(&c->writer, text, strlen(text), fds, nfds);
  free(text);
  if (rc != 0) {
    log_msg(LOG_ERROR, "cannot queue a reply for pid %d: %s", (int)c->pid, weightd_strerror(rc));
    conn_kill(c);
    return;
  }
  if (wire_writer_bytes(&c->writer) > c->d->cfg.max_queued_output) {
    log_msg(LOG_WARN, "pid %d does not read its replies (%zu bytes queued): disconnecting", (int)c->pid,
            wire_writer_bytes(&c->writer));
    conn_kill(c);
    return;
  }
  flush(c);
}

static void on_closing_deadline(uv_timer_t *t) { conn_kill(t->data); }

/* A final protocol error: reply, then close once it is sent (or after frame_timeout_ms at most). */
static void conn_fail(struct conn *c, const cJSON *id, int code, const char *msg) {
  if (c->closed || c->closing || c->dead) return;
  log_msg(LOG_DEBUG, "connection of pid %d: %s", (int)c->pid, msg);
  conn_send(c, msg_reply_error(id, code, msg), NULL, 0);
  if (!c->closed && !c->dead) {
    c->closing = true;
    uv_timer_stop(&c->frame_timer);
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

static void on_resume(uv_timer_t *t);

static void req_finish(struct request *r) {
  struct conn *c = r->conn;
  req_unlink(r);
  if (r->started) c->inflight--;
  if ((c->nqueued > 0 || c->paused) && !c->closed && !c->dead && c->inflight < CONN_MAX_INFLIGHT)
    uv_timer_start(&c->resume_timer, on_resume, 0, 0); /* not from inside a handler */
  cJSON_Delete(r->root);
  cJSON_Delete(r->id);
  free(r);
  conn_unref(c);
}

/* Counts a request in progress and runs its handler. */
static void req_start(struct request *r) {
  struct conn *c = r->conn;
  r->started = true;
  c->inflight++;
  r->next_in_conn = c->requests;
  c->requests = r;
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
    if (r->id == NULL || !cJSON_Compare(r->id, id, true)) continue;
    *pp = r->next_in_conn;
    if (*pp == NULL) c->queued_tail = pp;
    c->nqueued--;
    r->next_in_conn = c->requests; /* finished as a started request would be */
    c->requests = r;
    return r;
  }
  return NULL;
}

/* Starts queued requests while there is room. */
static void start_queued(struct conn *c) {
  while (!c->closed && c->inflight < CONN_MAX_INFLIGHT && c->queued != NULL) req_start(queue_pop(c));
}

static void handle_frame(struct conn *c, struct wire_frame *f) {
  struct msg_request m = {0};
  struct wd_error err = {0};
  int rc = msg_request_parse(f->json, f->len, &m, &err);
  unsigned flags = rc == 0 ? msg_op_flags(m.op) : 0;
  if (f->nfds > 0 && !(flags & MSG_OPF_FDS_IN)) {
    conn_fail(c, m.id, WEIGHTD_E_PROTOCOL,
              rc == 0 ? "this request may not carry file descriptors" : "the daemon accepts no file descriptors here");
    msg_request_free(&m);
    return;
  }
  if (rc != 0) {
    if (!c->hello_done) conn_fail(c, m.id, rc, err.msg);
    else conn_send(c, msg_reply_error(m.id, rc, err.msg), NULL, 0);
    msg_request_free(&m);
    return;
  }
  if (!c->hello_done && !(flags & MSG_OPF_BEFORE_HELLO)) {
    conn_fail(c, m.id, WEIGHTD_E_PROTOCOL, "the first request on a connection must be 'hello'");
    msg_request_free(&m);
    return;
  }
  if (c->d->stopping && !(flags & MSG_OPF_WHILE_STOPPING)) {
    conn_send(c, msg_reply_error(m.id, WEIGHTD_E_SHUTDOWN, "the daemon is shutting down"), NULL, 0);
    msg_request_free(&m);
    return;
  }
  struct request *r = calloc(1, sizeof *r);
  if (r == NULL) {
    conn_send(c, msg_reply_error(m.id, WEIGHTD_E_NOMEM, "out of memory"), NULL, 0);
    msg_request_free(&m);
    return;
  }
  r->conn = c;
  r->root = m.root;
  r->id = m.id;
  r->op = m.op;
  m.root = NULL;
  m.id = NULL;
  msg_request_free(&m);
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

/* ---- reading ------------------------------------------------------------------------ */

static void on_frame_timeout(uv_timer_t *t) {
  struct conn *c = t->data;
  conn_fail(c, NULL, WEIGHTD_E_PROTOCOL, "a request frame did not arrive whole within frame_timeout_ms");
}

/*
 * Handles buffered frames until none is left or the queue is full. Every
 * completed frame restarts the frame timeout: it runs from a frame's first byte.
 */
static void process_frames(struct conn *c) {
  while (!c->closed && !c->closing && !c->dead) {
    if (c->nqueued >= CONN_MAX_QUEUED) {
      c->paused = true;
      return;
    }
    struct wire_frame f = {0};
    struct wd_error err = {0};
    int n = wire_reader_next(&c->reader, &f, &err);
    if (n == 0) return;
    if (n < 0) {
      conn_fail(c, NULL, n, err.msg);
      return;
    }
    uv_timer_stop(&c->frame_timer);
    handle_frame(c, &f);
    wire_frame_clear(&f);
  }
}

/* Arms the frame timer while a partial frame waits (and the connection is not paused). */
static void watch_partial_frame(struct conn *c) {
  if (c->closed || c->closing || c->dead) return;
  if (!c->paused && wire_reader_pending(&c->reader)) {
    if (!uv_is_active((uv_handle_t *)&c->frame_timer))
      uv_timer_start(&c->frame_timer, on_frame_timeout, c->d->cfg.frame_timeout_ms, 0);
  } else {
    uv_timer_stop(&c->frame_timer);
  }
}

static void do_read(struct conn *c) {
  for (int rounds = 0; rounds < 16 && !c->closed && !c->closing && !c->dead && !c->paused; rounds++) {
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
    process_frames(c);
  }
  watch_partial_frame(c);
  update_poll(c);
}

static void on_resume(uv_timer_t *t) {
  struct conn *c = t->data;
  if (c->closed || c->dead) return;
  c->refs++;
  start_queued(c);
  if (!c->paused || c->nqueued >= CONN_MAX_QUEUED || c->closed) {
    watch_partial_frame(c);
    update_poll(c);
    conn_unref(c);
    return;
  }
  c->paused = false;
  process_frames(c); /* may pause again */
  if (!c->closed && !c->closing && !c->paused) do_read(c);
  else {
    watch_partial_frame(c);
    update_poll(c);
  }
  conn_unref(c);
}

static void on_poll(uv_poll_t *p, int status, int events) {
  struct conn *c = p->data;
  if (c->closed || c->dead) return;
  if (status < 0) {
    conn_close(c);
    return;
  }
  c->refs++; /* hold the connection while handlers run */
  if (events & UV_WRITABLE) flush(c);
  if (!c->closed && !c->closing && !c->paused && (events & (UV_READABLE | UV_DISCONNECT))) do_read(c);
  if (!c->closed && (c->closing || c->paused) && (events & UV_DISCONNECT)) conn_close(c);
  conn_unref(c);
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
  wire_reader_free(&c->reader);
  wire_writer_free(&c->writer);
  close(c->fd);
  c->fd = -1;
  uv_close((uv_handle_t *)&c->poll, conn_handle_closed);
  uv_close((uv_handle_t *)&c->frame_timer, conn_handle_closed);
  uv_close((uv_handle_t *)&c->resume_timer, conn_handle_closed);
  log_msg(LOG_DEBUG, "connection of pid %d closed", (int)c->pid);
  conn_unref(c);
}

static bool peer_allowed(const struct conn *c) {
  if (conn_is_privileged(c)) return true;
  if (c->d->cfg.n_allowed_uids == 0 && c->d->cfg.n_allowed_gids == 0) return true;
  for (size_t i = 0; i < c->d->cfg.n_allowed_uids; i++)
    if (c->d->cfg.allowed_uids[i] == (uint64_t)c->uid) return true;
  for (size_t i = 0; i < c->d->cfg.n_allowed_gids; i++)
    if (c->d->cfg.allowed_gids[i] == (uint64_t)c->gid) return true;
  return false;
}

static void on_accept(uv_poll_t *p, int status, int events) {
  struct server *srv = p->data;
  struct daemon *d = srv->d;
  (void)events;
  if (status < 0) return;
  for (int n = 0; n < 64; n++) {
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) log_msg(LOG_WARN, "accept: %s", strerror(errno));
      return;
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      close(fd);
      continue;
    }
    struct conn *c = calloc(1, sizeof *c);
    if (c == NULL || d->stopping || srv->nconns >= d->cfg.max_connections) {
      static const char refused[] = "{\"error\":{\"code\":\"LIMIT\",\"message\":\"too many connections\"}}";
      unsigned char hdr[4] = {sizeof refused - 1, 0, 0, 0};
      if (c != NULL && !d->stopping) {
        if (write(fd, hdr, 4) == 4 && write(fd, refused, sizeof refused - 1) < 0) {
        }
      }
      free(c);
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
    wire_writer_init(&c->writer);
    uv_poll_init(d->loop, &c->poll, fd);
    uv_timer_init(d->loop, &c->frame_timer);
    uv_timer_init(d->loop, &c->resume_timer);
    c->poll.data = c;
    c->frame_timer.data = c;
    c->resume_timer.data = c;
    c->handles_open = 3;
    c->next = srv->conns;
    srv->conns = c;
    srv->nconns++;
    d->stats.connections = srv->nconns;
    if (!peer_allowed(c)) {
      log_msg(LOG_WARN, "refused pid %d uid %d gid %d: not in allowed_uids/allowed_gids", (int)c->pid, (int)c->uid,
              (int)c->gid);
      conn_fail(c, NULL, WEIGHTD_E_PERMISSION, "this uid/gid may not use the daemon");
      continue;
    }
    log_msg(LOG_DEBUG, "connection from pid %d uid %d", (int)c->pid, (int)c->uid);
    update_poll(c);
  }
}

/* ---- the listening socket ---------------------------------------------------------------- */

int server_start(struct daemon *d, struct wd_error *err) {
  const char *path = d->socket_path;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path) return err_set(err, WEIGHTD_E_INVALID, "socket path too long: %s", path);
  strcpy(addr.sun_path, path);
  struct server *srv = calloc(1, sizeof *srv);
  if (srv == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  srv->d = d;
  srv->listen_fd = -1;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    free(srv);
    return err_set(err, WEIGHTD_E_IO, "socket: %s", strerror(errno));
  }
  int rc = 0;
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
  unlink(tmp);
  mode_t old = umask(0177);
  rc = bind(fd, (struct sockaddr *)&taddr, sizeof taddr);
  umask(old);
  if (rc != 0) {
    rc = err_set(err, WEIGHTD_E_IO, "bind %s: %s", tmp, strerror(errno));
    goto fail;
  }
  if (d->cfg.socket_group != NULL && d->cfg.socket_group[0] != '\0') {
    struct group *g = getgrnam(d->cfg.socket_group);
    if (g == NULL) {
      log_msg(LOG_INFO, "group '%s' does not exist: socket keeps group %d", d->cfg.socket_group, (int)getegid());
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
  uv_poll_init(d->loop, &srv->listen_poll, fd);
  srv->listen_poll.data = srv;
  uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
  d->srv = srv;
  return 0;
fail:
  close(fd);
  free(srv);
  return rc;
}

static void listen_closed(uv_handle_t *h) { (void)h; }

void server_stop(struct server *srv) {
  if (srv->listening) {
    uv_poll_stop(&srv->listen_poll);
    uv_close((uv_handle_t *)&srv->listen_poll, listen_closed);
    close(srv->listen_fd);
    srv->listen_fd = -1;
    srv->listening = false;
    unlink(srv->d->socket_path);
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

void server_destroy(struct server *srv) { free(srv); }

