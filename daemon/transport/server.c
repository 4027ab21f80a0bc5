/*
 * server.c - the Unix socket: listening, accepting, peer checks, the
 * connection's lifetime and the loop's callbacks. Reading requests is in
 * server_read.c, sending replies in server_send.c (transport.h says
 * how the three call one another).
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
 *     max_queued_output closes the connection. The same holds for a uid's
 *     connections together (max_uid_queued_output; root and the daemon's uid
 *     are exempt), and the daemon's queued replies never pass
 *     max_total_queued_output: room is made by closing the connections that
 *     hold the most unread bytes, largest first (output_budget.h);
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
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "transport.h"

#include "base/log.h"
#include "msg.h"
#include "ops/ops.h"
#include "output_budget.h"

/* How long the listener pauses when the process is out of descriptors. */
#define ACCEPT_PAUSE_MS 100

static void conn_close(struct conn *c);

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
  if (--c->handles_open == 0 && c->refs == 0) conn_free(c);
}

void conn_on_kill(uv_timer_t *t) { conn_close(t->data); }

/* ---- reading and resuming ------------------------------------------------------------ */

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
    conn_process_frames(c);
  }
  conn_watch_partial_frame(c);
  conn_update_poll(c);
}

/* Goes on with whatever may now proceed: queued requests, held and buffered frames, the socket. */
void conn_on_resume(uv_timer_t *t) {
  struct conn *c = t->data;
  if (!alive(c)) return;
  c->refs++;
  conn_start_queued(c);
  conn_take_held(c);
  if (c->held.json == NULL) conn_process_frames(c);
  if (can_take(c) && c->held.json == NULL) do_read(c);
  else {
    conn_watch_partial_frame(c);
    conn_update_poll(c);
  }
  conn_unref(c);
}

void conn_on_poll(uv_poll_t *p, int status, int events) {
  struct conn *c = p->data;
  if (!alive(c)) return;
  if (status < 0) {
    conn_close(c);
    return;
  }
  c->refs++; /* hold the connection while handlers run */
  if (events & UV_WRITABLE) conn_flush(c);
  if (can_take(c) && c->held.json == NULL && (events & (UV_READABLE | UV_DISCONNECT))) do_read(c);
  else if (alive(c) && !c->closed && (events & UV_DISCONNECT)) conn_close(c);
  else conn_update_poll(c); /* other connections' replies can stop this one being read: stop watching its input */
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
  if (c->waiting_memory) {
    c->waiting_memory = false;
    srv->nwaiting_memory--;
  }
  ops_conn_gone(c);
  /* Queued requests never started; requests waiting for a set stop waiting; the others finish on their own. */
  for (struct request *q = conn_queue_pop(c); q != NULL; q = conn_queue_pop(c)) req_finish(q);
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
  conn_drop_output(c);
  ob_uid_unref(&srv->uids, c->out_uid);
  c->out_uid = NULL;
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

/* The groups read first; a peer in more gets a buffer of the size the kernel asks for. */
#define PEER_GROUPS_FIRST 64

/*
 * Every one of the peer's supplementary groups (SO_PEERGROUPS, Linux 4.13),
 * into *out (malloc'd; NULL when none): how many, or -1 when the kernel did
 * not say or memory ran out (nothing is then decided on a partial list).
 * ERANGE reports the size needed; the list is fixed at connect, so the
 * second call fits, but a larger list is asked for again, up to NGROUPS_MAX.
 */
static int peer_groups(int fd, gid_t **out) {
  socklen_t len = PEER_GROUPS_FIRST * sizeof(gid_t);
  *out = NULL;
  for (int tries = 0; tries < 4; tries++) {
    gid_t *g = malloc(len ? len : sizeof(gid_t));
    if (g == NULL) return -1;
    socklen_t got = len;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, g, &got) == 0) {
      if (got == 0) {
        free(g);
        return 0;
      }
      *out = g;
      return (int)(got / sizeof(gid_t));
    }
    free(g);
    if (errno != ERANGE || got <= len || got > (socklen_t)(NGROUPS_MAX * sizeof(gid_t))) return -1;
    len = got;
  }
  return -1;
}

void conn_free(struct conn *c) {
  free(c->groups);
  free(c);
}

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
    struct ob_uid *out_uid = c != NULL ? ob_uid_ref(&srv->uids, cred.uid) : NULL;
    if (out_uid == NULL) {
      if (!d->stopping) refuse(fd, c == NULL ? "too many connections" : "out of memory");
      free(c);
      close(fd);
      continue;
    }
    c->out_uid = out_uid;
    c->srv = srv;
    c->d = d;
    c->ops = &transport;
    c->fd = fd;
    c->pid = cred.pid;
    c->uid = cred.uid;
    c->gid = cred.gid;
    c->ngroups = peer_groups(fd, &c->groups);
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
    conn_watch_idle(c);
    conn_update_poll(c);
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
  if (cfg->max_uid_queued_output > cfg->max_total_queued_output)
    return err_set(err, WEIGHTD_E_INVALID,
                   "max_uid_queued_output (%" PRIu64 ") is one uid's share of max_total_queued_output (%" PRIu64
                   ") and cannot be larger; 0 makes it a quarter",
                   cfg->max_uid_queued_output, cfg->max_total_queued_output);
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
      conn_flush(c);
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
