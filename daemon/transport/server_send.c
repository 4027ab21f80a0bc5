/*
 * server_send.c - replies: queueing and sending them, with their descriptors.
 *
 * DESIGN: runs on the loop thread. Replies and events are serialised into the
 * connection's wire writer and sent as the socket takes them. What a client
 * that does not read can make the daemon hold is bounded here, by the rules
 * of output_budget.h at three levels: the connection (max_queued_output,
 * max_queued_fds), its uid (max_uid_queued_output) and the daemon
 * (max_total_queued_output). A connection is never closed from inside a
 * send: conn_kill schedules it, and frees what its replies held at once.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "transport.h"

#include "base/log.h"
#include "msg.h"
#include "output_budget.h"

/* ---- what a connection's replies hold -------------------------------------------- */

static struct ob_held held_of(const struct conn *c) {
  return (struct ob_held){
      .conn = wire_writer_bytes(&c->writer),
      .conn_fds = wire_writer_fds(&c->writer),
      .uid = c->out_uid != NULL ? c->out_uid->bytes : wire_writer_bytes(&c->writer),
      .total = c->d->stats.output_queued,
  };
}

static struct ob_limits limits_of(const struct conn *c) {
  return ob_limits_of(&c->d->cfg, WIRE_MAX_FRAME, conn_is_privileged(c));
}

bool conn_output_backlogged(const struct conn *c) {
  struct ob_held h = held_of(c);
  struct ob_limits l = limits_of(c);
  return ob_backlogged(&h, &l);
}

/* Counts what c's writer holds now, given what it held before, in the daemon's and its uid's figures. */
static void account(struct conn *c, size_t bytes_before, size_t fds_before) {
  size_t bytes = wire_writer_bytes(&c->writer), fds = wire_writer_fds(&c->writer);
  c->d->stats.output_queued = c->d->stats.output_queued - bytes_before + bytes;
  c->d->stats.fds_queued = c->d->stats.fds_queued - fds_before + fds;
  if (c->out_uid != NULL) c->out_uid->bytes = c->out_uid->bytes - bytes_before + bytes;
}

void conn_drop_output(struct conn *c) {
  size_t bytes = wire_writer_bytes(&c->writer), fds = wire_writer_fds(&c->writer);
  wire_writer_free(&c->writer);
  account(c, bytes, fds);
}

/* ---- the connection's watchers ---------------------------------------------------- */

void conn_update_poll(struct conn *c) {
  if (!alive(c)) return;
  /* A closing connection only drains its replies: reading it could spin forever. */
  int ev = UV_DISCONNECT | (can_take(c) ? UV_READABLE : 0);
  if (wire_writer_bytes(&c->writer) > 0) ev |= UV_WRITABLE;
  uv_poll_start(&c->poll, ev, conn_on_poll);
}

/*
 * Closes the connection soon, from the loop, never from inside a send: the
 * caller may be walking a list that closing the connection would free. What
 * its replies held (bytes and descriptors) is freed now: nothing more is sent.
 */
void conn_kill(struct conn *c) {
  if (!alive(c)) return;
  c->dead = true;
  uv_poll_stop(&c->poll);
  uv_timer_stop(&c->frame_timer);
  uv_timer_stop(&c->idle_timer);
  uv_timer_start(&c->resume_timer, conn_on_kill, 0, 0);
  conn_drop_output(c);
}

/* Schedules conn_on_resume (never runs it inside a caller that may be walking a list). */
void conn_kick(struct conn *c) {
  if (alive(c)) uv_timer_start(&c->resume_timer, conn_on_resume, 0, 0);
}

/* ---- closing for unread replies --------------------------------------------------- */

/* Closes v for the replies it leaves unread, counted under limit, and logs who it was and why. */
static void close_for_output(struct conn *v, enum daemon_reply_limit limit, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void close_for_output(struct conn *v, enum daemon_reply_limit limit, const char *fmt, ...) {
  char why[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  log_msg(LOG_WARN, "closing the connection of pid %d uid %d (client '%s'), which holds %zu unread reply bytes: %s",
          (int)v->pid, (int)v->uid, v->client, wire_writer_bytes(&v->writer), why);
  v->d->stats.reply_disconnects[limit]++;
  conn_kill(v);
}

/* Where room is made: the connections of one uid (u), or all of them (u NULL), within limit. */
struct room {
  struct ob_uid *u;
  uint64_t limit;
  const char *name; /* the limit, as the log names it */
  enum daemon_reply_limit count;
};

static uint64_t room_held(const struct conn *c, const struct room *rm) {
  return rm->u != NULL ? rm->u->bytes : c->d->stats.output_queued;
}

/*
 * The open connection in rm's scope, other than c, that holds the most unread
 * reply bytes and more than c does (NULL when none does); *larger is what all
 * those holding more than c hold together.
 */
static struct conn *largest_holder(const struct conn *c, const struct room *rm, uint64_t *larger) {
  uint64_t self = wire_writer_bytes(&c->writer), best_bytes = 0;
  struct conn *best = NULL;
  *larger = 0;
  for (struct conn *v = c->srv->conns; v != NULL; v = v->next) {
    if (v == c || !alive(v) || (rm->u != NULL && v->out_uid != rm->u)) continue;
    uint64_t held = wire_writer_bytes(&v->writer);
    if (held > self) *larger += held;
    if (ob_closes_before(held, self, best_bytes)) {
      best = v;
      best_bytes = held;
    }
  }
  return best;
}

/*
 * Makes room for len more bytes for c within rm: closes the connections of
 * its scope that hold more unread bytes than c, largest first, until they
 * fit. Returns false, closing none, when closing all of those would not make
 * room (c holds the most, or what it asks for does not fit beside its own).
 */
static bool make_room(struct conn *c, const struct room *rm, uint64_t len) {
  uint64_t larger;
  if (room_held(c, rm) + len <= rm->limit) return true;
  struct conn *v = largest_holder(c, rm, &larger);
  if (!ob_room_possible(room_held(c, rm), larger, len, rm->limit)) return false;
  while (v != NULL && room_held(c, rm) + len > rm->limit) {
    close_for_output(v, rm->count, "a reply of %" PRIu64 " bytes for pid %d uid %d (holding %zu) would pass %s (%" PRIu64
                                   " bytes, %" PRIu64 " queued): the largest holder is closed first",
                     len, (int)c->pid, (int)c->uid, wire_writer_bytes(&c->writer), rm->name, rm->limit,
                     room_held(c, rm));
    v = largest_holder(c, rm, &larger);
  }
  return room_held(c, rm) + len <= rm->limit;
}

/* The daemon's budget, as room is made in it. */
static struct room total_room(const struct conn *c) {
  return (struct room){.limit = c->d->cfg.max_total_queued_output, .name = "max_total_queued_output",
                       .count = REPLY_LIMIT_TOTAL};
}

/*
 * Whether a LIMIT answer of len bytes may be queued for c as far as its own
 * and its uid's limits go: past twice max_queued_output c is closed; past
 * twice its uid's share the uid's largest holders are closed first (c, when
 * it is the largest). Returns false when c was closed.
 */
static bool answer_fits(struct conn *c, uint64_t len) {
  struct ob_held h = held_of(c);
  struct ob_limits l = limits_of(c);
  enum ob_level why = ob_answer_breaks(&h, &l, len);
  if (why == OB_CONN) {
    close_for_output(c, REPLY_LIMIT_CONNECTION, "past twice max_queued_output (%" PRIu64 ")", l.conn);
    return false;
  }
  if (why == OB_UID) {
    struct room rm = {.u = c->out_uid, .limit = 2 * l.uid, .name = "twice max_uid_queued_output",
                      .count = REPLY_LIMIT_UID};
    if (!make_room(c, &rm, len)) {
      close_for_output(c, REPLY_LIMIT_UID,
                       "its uid's connections hold %" PRIu64 " bytes: even a LIMIT answer would pass twice "
                       "max_uid_queued_output (%" PRIu64 ") after closing those holding more",
                       h.uid, l.uid);
      return false;
    }
  }
  return true;
}

/* ---- sending -------------------------------------------------------------------- */

void conn_flush(struct conn *c) {
  if (!alive(c)) return;
  bool was_backlogged = backlogged(c);
  size_t fds_before = wire_writer_fds(&c->writer), bytes_before = wire_writer_bytes(&c->writer);
  int rc = wire_writer_flush(&c->writer, c->fd);
  account(c, bytes_before, fds_before);
  if (rc < 0) {
    log_msg(LOG_DEBUG, "connection of pid %d: send failed: %s", (int)c->pid, weightd_strerror(rc));
    conn_kill(c);
    return;
  }
  if (c->closing && rc == 0) {
    conn_kill(c);
    return;
  }
  if (was_backlogged && !backlogged(c)) conn_kick(c);
  conn_update_poll(c);
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

/* The LIMIT answer to the request with this id, whose reply of len bytes breaks the limit why. */
static char *limit_text(const struct conn *c, const cJSON *id, enum ob_level why, size_t len) {
  const struct wd_config *cfg = &c->d->cfg;
  struct ob_held h = held_of(c);
  switch (why) {
  case OB_FRAME:
    return error_text(id, WEIGHTD_E_LIMIT, "the reply (%zu bytes) exceeds the %u-byte frame limit", len,
                      WIRE_MAX_FRAME);
  case OB_CONN:
    return error_text(id, WEIGHTD_E_LIMIT,
                      "%" PRIu64 " bytes of replies wait unread on this connection: this one (%zu bytes) would pass "
                      "max_queued_output (%" PRIu64 "); read the replies",
                      h.conn, len, cfg->max_queued_output);
  case OB_FDS:
    return error_text(id, WEIGHTD_E_LIMIT,
                      "%" PRIu64 " file descriptors wait unread on this connection: max_queued_fds (%" PRIu64
                      ") reached; read the replies",
                      h.conn_fds, cfg->max_queued_fds);
  case OB_UID:
    return error_text(id, WEIGHTD_E_LIMIT,
                      "%" PRIu64 " bytes of replies wait unread on the connections of uid %d: this one (%zu bytes) "
                      "would pass their share, max_uid_queued_output (%" PRIu64 "); read the replies",
                      h.uid, (int)c->uid, len, ob_uid_share(cfg));
  case OB_TOTAL:
  case OB_NONE:
    break;
  }
  return error_text(id, WEIGHTD_E_LIMIT,
                    "%" PRIu64 " bytes of replies wait unread in the daemon, %" PRIu64 " of them on this connection: "
                    "this one (%zu bytes) would pass max_total_queued_output (%" PRIu64 "); read the replies",
                    h.total, h.conn, len, cfg->max_total_queued_output);
}

/* Queues a serialised frame (text is freed) and sends what it can; on failure the connection is killed. */
static int queue_text(struct conn *c, char *text, const int *fds, size_t nfds) {
  size_t bytes_before = wire_writer_bytes(&c->writer), fds_before = wire_writer_fds(&c->writer);
  int rc = wire_writer_push(&c->writer, text, strlen(text), fds, nfds);
  free(text);
  if (rc != 0) {
    log_msg(LOG_ERROR, "cannot queue a reply for pid %d: %s", (int)c->pid, weightd_strerror(rc));
    conn_kill(c);
    return rc;
  }
  account(c, bytes_before, fds_before);
  conn_flush(c);
  return 0;
}

static void close_fds(const int *fds, size_t nfds) {
  for (size_t i = 0; i < nfds; i++) close(fds[i]);
}

/*
 * Replaces *text (a reply that breaks the limit why) by its LIMIT answer and
 * closes the reply's descriptors. Returns 0, or WEIGHTD_E_CLOSED when even
 * the answer breaks c's or its uid's limits and c was closed, or
 * WEIGHTD_E_NOMEM (c is closed).
 */
static int answer_instead(struct conn *c, const cJSON *id, enum ob_level why, char **text, const int *fds,
                          size_t nfds) {
  char *answer = limit_text(c, id, why, strlen(*text));
  log_msg(LOG_DEBUG, "a reply for pid %d breaks a limit: LIMIT sent instead", (int)c->pid);
  free(*text);
  *text = answer;
  close_fds(fds, nfds);
  if (answer == NULL) {
    log_msg(LOG_ERROR, "out of memory serialising a reply: closing connection of pid %d", (int)c->pid);
    conn_kill(c);
    return WEIGHTD_E_NOMEM;
  }
  return answer_fits(c, strlen(answer)) ? 0 : WEIGHTD_E_CLOSED;
}

/*
 * Queues a final reply (one per request; the handlers never send two). A
 * reply that breaks a limit of the connection or of its uid (output_budget.h)
 * is replaced by a LIMIT error for the same id and its descriptors are
 * closed; a LIMIT answer past twice such a limit closes connections instead.
 * Room in the daemon's budget is made by closing the connections that hold
 * more unread bytes than c, largest first; when that cannot make room the
 * reply is answered LIMIT, and when even that answer finds none, c (then the
 * largest holder) is closed. Returns 0 when the frame itself was queued,
 * WEIGHTD_E_LIMIT when a LIMIT error went in its place, or WEIGHTD_E_CLOSED /
 * WEIGHTD_E_NOMEM when nothing could be queued.
 */
int conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds) {
  const cJSON *id = reply ? cJSON_GetObjectItemCaseSensitive(reply, "id") : NULL;
  char *text = alive(c) && reply != NULL ? msg_serialize(reply) : NULL;
  if (!alive(c) || text == NULL) {
    int gone = alive(c) ? WEIGHTD_E_NOMEM : WEIGHTD_E_CLOSED;
    if (alive(c)) {
      log_msg(LOG_ERROR, "out of memory serialising a reply: closing connection of pid %d", (int)c->pid);
      conn_kill(c);
    }
    close_fds(fds, nfds);
    free(text);
    cJSON_Delete(reply);
    return gone;
  }
  int rc = 0, result = 0;
  struct ob_held h = held_of(c);
  struct ob_limits l = limits_of(c);
  enum ob_level why = ob_reply_breaks(&h, &l, strlen(text), nfds);
  if (why != OB_NONE) {
    rc = answer_instead(c, id, why, &text, fds, nfds);
    nfds = 0;
    result = WEIGHTD_E_LIMIT;
  }
  struct room total = total_room(c);
  if (rc == 0 && !make_room(c, &total, strlen(text))) {
    if (result == 0) {
      rc = answer_instead(c, id, OB_TOTAL, &text, fds, nfds);
      nfds = 0;
      result = WEIGHTD_E_LIMIT;
    }
    if (rc == 0 && !make_room(c, &total, strlen(text))) {
      close_for_output(c, REPLY_LIMIT_TOTAL,
                       "even a LIMIT answer would pass max_total_queued_output (%" PRIu64
                       ") after closing the connections holding more",
                       total.limit);
      rc = WEIGHTD_E_CLOSED;
    }
  }
  if (rc == 0) {
    rc = queue_text(c, text, fds, nfds);
    text = NULL;
  }
  free(text);
  cJSON_Delete(reply);
  return rc != 0 ? rc : result;
}

/*
 * Queues an event (a progress tick), or drops it: events can be lost, so one
 * for a connection that is backlogged, or that would break a limit, is not
 * sent (and is counted); no room is made for one. Returns 0 when queued,
 * WEIGHTD_E_LIMIT when dropped, WEIGHTD_E_CLOSED when the connection is gone.
 */
int conn_send_event(struct conn *c, cJSON *ev) {
  if (ev == NULL) return WEIGHTD_E_NOMEM;
  if (!alive(c)) {
    cJSON_Delete(ev);
    return WEIGHTD_E_CLOSED;
  }
  struct ob_held h = held_of(c);
  struct ob_limits l = limits_of(c);
  char *text = ob_backlogged(&h, &l) ? NULL : msg_serialize(ev);
  cJSON_Delete(ev);
  if (text == NULL || ob_event_dropped(&h, &l, strlen(text))) {
    free(text);
    c->d->stats.events_dropped++;
    return WEIGHTD_E_LIMIT;
  }
  return queue_text(c, text, NULL, 0);
}

static void on_closing_deadline(uv_timer_t *t) { conn_kill(t->data); }

/* A final protocol error: reply, then close once it is sent (or after frame_timeout_ms at most). */
void conn_fail(struct conn *c, const cJSON *id, int code, const char *msg) {
  if (!alive(c) || c->closing) return;
  log_msg(LOG_DEBUG, "connection of pid %d: %s", (int)c->pid, msg);
  daemon_count_error(c->d, code);
  conn_send(c, msg_reply_error(id, code, msg), NULL, 0);
  if (alive(c)) {
    c->closing = true;
    uv_timer_stop(&c->frame_timer);
    uv_timer_stop(&c->idle_timer);
    uv_timer_start(&c->frame_timer, on_closing_deadline, c->d->cfg.frame_timeout_ms, 0);
    conn_flush(c);
  }
}
