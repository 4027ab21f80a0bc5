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
#include <unistd.h>
#include <uv.h>

#include "daemon.h"
#include "error.h"
#include "state/residency.h"
#include "wire.h"

struct request;
struct conn;
struct ops_group;
struct ob_uid;

/*
 * The transport's side, which the server fills in for every connection, so
 * that the op handlers call down into it without naming the server:
 *   send    queues a frame (consumes msg; takes ownership of fds); returns 0
 *           when it was queued, WEIGHTD_E_LIMIT when a LIMIT error for the
 *           same id went in its place (a limit of the connection), or an
 *           error when nothing could be queued (the connection is gone)
 *   finish  frees a request after its final reply (or without one)
 *   unqueue takes a queued, not yet started request with this id out of the
 *           connection's queue (for cancel); NULL if none
 *   dequeue takes this queued request out of its connection's queue (for a
 *           cancel by daemon-wide id); false if it is not queued
 *   first   the first open connection of the daemon (follow ->next), for
 *           what looks across connections: status, cancel by daemon-wide id
 *   drop_args frees the parsed request (root) once nothing needs it (a
 *           waiting load keeps only its id) and gives its request memory
 *           back, so that connections waiting for that memory go on
 */
struct conn_ops {
  int (*send)(struct conn *c, cJSON *msg, const int *fds, size_t nfds); /* a final reply */
  int (*send_event)(struct conn *c, cJSON *ev);                          /* droppable: see server_send.c */
  void (*finish)(struct request *r);
  struct request *(*unqueue)(struct conn *c, const cJSON *id);
  bool (*dequeue)(struct conn *c, struct request *r);
  struct conn *(*first)(const struct conn *c);
  void (*drop_args)(struct request *r);
};

struct conn {
  const struct conn_ops *ops;
  struct server *srv;
  struct daemon *d;
  int fd;
  uv_poll_t poll;
  uv_timer_t frame_timer;
  uv_timer_t idle_timer;
  struct wire_reader reader;
  struct wire_writer writer;
  struct ob_uid *out_uid;   /* the reply bytes queued for the peer's uid (transport/output_budget.h) */
  pid_t pid;
  uid_t uid;
  gid_t gid;
  gid_t *groups;  /* every supplementary group at connect (SO_PEERGROUPS), malloc'd; freed with the conn */
  int ngroups;    /* -1: the kernel did not say (access checks then refuse; admin_gids see the primary only) */
  char client[64]; /* the name the client gave in hello ("" when none) */
  unsigned accepts; /* the handle kinds the client can open (WD_HANDLE_BIT), from hello */
  bool accepts_listed; /* hello listed them ("handles"); else accepts is WD_HANDLES_DEFAULT */
  unsigned features;   /* the attach features the client asked for in hello (WD_FEATURE_BIT) */
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
  bool parsing;             /* a large request is being parsed on a job: later frames wait */
  bool waiting_memory;      /* the next frame (held) waits for request memory */
  struct wire_frame held;   /* a frame read and not yet parsed, waiting for request memory */
  uint64_t request_mem;     /* request memory charged to this connection's requests */
  uv_timer_t resume_timer;  /* goes on with queued requests and frames once something frees */
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
  bool early;   /* attach: answer while the set loads ("early": true) */
  struct res_waiter wait; /* load and attach: waiting for a set */
  uint64_t serial;        /* the daemon-wide id: "r<serial>" in status and cancel */
  uint64_t created_ms;    /* when it was read */
  struct reg_prefetch *prefetch; /* prefetch with wait: the running read, until it answers */
  struct ops_ticker *ticker;     /* prefetch with wait: the timer of its progress events */
  struct ops_group *group;       /* load_group: its ranks (ops_multi.c) */
  uint64_t mem;           /* request memory charged for root (released with it) */
  struct request *next_in_conn;
};

/* Root, or the daemon's own uid. */
static inline bool conn_is_privileged(const struct conn *c) { return c->uid == 0 || c->uid == geteuid(); }

/* Whether the peer's primary or a supplementary group is gid. */
static inline bool conn_in_group(const struct conn *c, gid_t gid) {
  if (c->gid == gid) return true;
  for (int i = 0; i < c->ngroups; i++)
    if (c->groups[i] == gid) return true;
  return false;
}

#endif
