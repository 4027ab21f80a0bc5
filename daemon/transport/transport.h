/*
 * transport.h - what the server's files share: the server, the request
 * memory constants, the connection state tests and the calls between them.
 *
 * Only daemon/transport/server.c, server_read.c and server_send.c include it. Calls go
 * one way: server.c (accept, connection lifetime, the loop's callbacks) calls
 * server_read.c (frames, request memory, the request queue), which calls
 * server_send.c (replies and descriptors). The lower files reach the upper
 * ones only by handing libuv their callbacks (conn_on_poll, conn_on_resume, conn_on_kill).
 * server_send.c applies the rules of output_budget.h (pure figures) to what
 * connections leave unread.
 * Everything here runs on the loop thread.
 */
#ifndef WD_TRANSPORT_H
#define WD_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "server.h"

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
  struct ob_uid *uids;    /* one entry per uid with a connection open: its queued reply bytes */
  size_t nwaiting_memory; /* connections whose next frame waits for request memory */
  uint64_t last_serial;   /* the daemon-wide id of the latest request read */
};

/* ---- server.c: the loop's callbacks, handed to libuv by the lower files ------------ */

/* Closes the connection (the resume timer's callback after conn_kill). */
void conn_on_kill(uv_timer_t *t);
/* Goes on with whatever may now proceed: queued requests, held and buffered frames, the socket. */
void conn_on_resume(uv_timer_t *t);
/* The connection's socket is readable, writable or closed. */
void conn_on_poll(uv_poll_t *p, int status, int events);

/* ---- server_read.c: frames, request memory, the request queue ---------------------- */

/* Drops a request's parsed arguments and gives their request memory back. */
void req_drop_args(struct request *r);
/* Arms the idle timer when nothing is in progress (whether leases are held is asked when it fires). */
void conn_watch_idle(struct conn *c);
/* Ends a request: unlinks it, gives its memory back and drops its reference on the connection. */
void req_finish(struct request *r);
/* Takes the first queued request off the queue, or returns NULL. */
struct request *conn_queue_pop(struct conn *c);
/* Takes the queued request with this id off the queue (it is then finished as a started one), or returns NULL. */
struct request *conn_unqueue(struct conn *c, const cJSON *id);
/* Takes r off the queue (it is then finished as a started one); false when it was not queued. */
bool conn_dequeue(struct conn *c, struct request *r);
/* The first of the server's connections. */
struct conn *conn_first(const struct conn *c);
/* Starts queued requests while there is room. */
void conn_start_queued(struct conn *c);
/* Handles buffered frames while frames may be taken. */
void conn_process_frames(struct conn *c);
/* Arms the frame timer while a partial frame waits for bytes the client should send. */
void conn_watch_partial_frame(struct conn *c);
/* Takes a frame held back for memory, once memory allows. */
void conn_take_held(struct conn *c);

/* ---- server_send.c: replies and descriptors ------------------------------------------ */

/* Whether the connection's unsent replies (its own, its uid's, the daemon's) stop its requests being read. */
bool conn_output_backlogged(const struct conn *c);
/* Frees the connection's unsent replies and their descriptors, and uncounts them. */
void conn_drop_output(struct conn *c);
/* Watches the socket for what the connection can do now. */
void conn_update_poll(struct conn *c);
/* Closes the connection soon, from the loop, never from inside a send. */
void conn_kill(struct conn *c);
/* Schedules conn_on_resume (never runs it inside a caller that may be walking a list). */
void conn_kick(struct conn *c);
/* Sends what the socket takes of the queued replies. */
void conn_flush(struct conn *c);
/* Queues a final reply, or a LIMIT error in its place (server_send.c says which). */
int conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds);
/* Queues a progress event, or drops it. */
int conn_send_event(struct conn *c, cJSON *ev);
/* A final protocol error: reply, then close once it is sent (or after frame_timeout_ms at most). */
void conn_fail(struct conn *c, const cJSON *id, int code, const char *msg);

/* ---- references and state ------------------------------------------------------ */

/* Drops a reference; the connection is freed once none is left and its handles are closed. */
/* Frees a connection nothing refers to and whose handles are closed, with what it owns. */
void conn_free(struct conn *c);

static inline void conn_unref(struct conn *c) {
  if (--c->refs > 0) return;
  if (c->handles_open == 0) conn_free(c);
}

/* Replies pile up unread: stop reading this client's requests (output_budget.h says when). */
static inline bool backlogged(const struct conn *c) { return conn_output_backlogged(c); }

static inline bool alive(const struct conn *c) { return !c->closed && !c->dead; }

/* May frames be taken from this connection now? */
static inline bool can_take(const struct conn *c) {
  return alive(c) && !c->closing && !c->parsing && !c->waiting_memory && c->nqueued < CONN_MAX_QUEUED &&
         !backlogged(c);
}

#endif
