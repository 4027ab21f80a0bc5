/*
 * server_send.c - replies: queueing and sending them, with their descriptors.
 *
 * DESIGN: runs on the loop thread. Replies and events are serialised into the
 * connection's wire writer and sent as the socket takes them; the bounds on
 * what a client that does not read can make the daemon hold (max_queued_output,
 * max_queued_fds) are kept here. A connection is never closed from inside a
 * send: conn_kill schedules it.
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
 * caller may be walking a list that closing the connection would free.
 */
void conn_kill(struct conn *c) {
  if (!alive(c)) return;
  c->dead = true;
  uv_poll_stop(&c->poll);
  uv_timer_stop(&c->frame_timer);
  uv_timer_stop(&c->idle_timer);
  uv_timer_start(&c->resume_timer, conn_on_kill, 0, 0);
}

/* Schedules conn_on_resume (never runs it inside a caller that may be walking a list). */
void conn_kick(struct conn *c) {
  if (alive(c)) uv_timer_start(&c->resume_timer, conn_on_resume, 0, 0);
}

/* ---- sending -------------------------------------------------------------------- */

void conn_flush(struct conn *c) {
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
  conn_flush(c);
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
int conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds) {
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
int conn_send_event(struct conn *c, cJSON *ev) {
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
