/*
 * request.h - connections and requests: what the server (transport) and the
 * op handlers (protocol) share, and nothing else includes.
 *
 * DESIGN: loop thread only. A connection is reference counted: the server
 * holds one reference until the connection closes, and each request still in
 * progress holds one, so a client that vanishes mid-request leaves its
 * requests something valid to finish on (their replies are then dropped).
 */
#ifndef WD_REQUEST_H
#define WD_REQUEST_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "daemon.h"
#include "error.h"
#include "residency.h"
#include "wire.h"

struct request;

struct conn {
  struct server *srv;
  struct daemon *d;
  int fd;
  uv_poll_t poll;
  uv_timer_t frame_timer;
  struct wire_reader reader;
  struct wire_writer writer;
  pid_t pid;
  uid_t uid;
  gid_t gid;
  char client[64]; /* the name the client gave in hello ("" when none) */
  bool hello_done;
  bool closing;
  bool dead;   /* closing soon from the loop (conn_kill); nothing more is sent */
  bool closed;
  int refs; /* the server's, plus one per outstanding request */
  int handles_open;
  struct request *requests; /* started and not finished */
  unsigned inflight;        /* requests started and not yet finished */
  struct request *queued;   /* read but not started (CONN_MAX_INFLIGHT reached), in order */
  struct request **queued_tail;
  unsigned nqueued;
  bool paused;              /* CONN_MAX_QUEUED reached: frames wait unread in the socket */
  uv_timer_t resume_timer;  /* starts queued requests once others finish */
  struct conn *next;
};

/*
 * Requests one connection may have in progress; further frames wait in the
 * socket until one finishes, so a client that pipelines thousands of
 * requests cannot queue work ahead of everyone else.
 */
#define CONN_MAX_INFLIGHT 16
/* Requests read and held back behind those; past this the socket is not read. `cancel` skips the line. */
#define CONN_MAX_QUEUED 64

struct request {
  struct conn *conn;
  cJSON *root;  /* the request object */
  cJSON *id;    /* a detached copy of "id", or NULL */
  int op;       /* enum msg_op */
  bool done;    /* the final reply was sent */
  bool canceled;
  bool started; /* dispatched (counted in conn->inflight), not just queued */
  struct res_waiter wait; /* load and attach: waiting for a set */
  struct request *next_in_conn;
};

/* Replies: each consumes `reply` (a cJSON object with "id" already set). */
void conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds);
/* The final reply: sends it and finishes the request. */
void req_reply(struct request *r, cJSON *reply, const int *fds, size_t nfds);
void req_fail(struct request *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void req_fail_err(struct request *r, const struct wd_error *err);
void req_progress(struct request *r, uint64_t done, uint64_t total);
/* Takes a queued request with this id out of its connection's queue (for cancel); NULL if none. */
struct request *conn_unqueue(struct conn *c, const cJSON *id);
/* Frees a request after its final reply (or without one when its connection is gone). */
void req_finish(struct request *r);
/* Root, or the daemon's own uid. */
bool conn_privileged(const struct conn *c);

#endif
