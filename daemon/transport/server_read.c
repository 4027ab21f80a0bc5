/*
 * server_read.c - reading requests: frames, request memory and its limits,
 * the connection's request queue.
 *
 * DESIGN: runs on the loop thread (large requests are parsed on a control
 * job, which reads only the frame it was handed). Frames are taken from the
 * connection's wire reader while can_take allows, charged against
 * request_memory (or held back until it frees, or answered LIMIT), parsed,
 * checked against the op table's rules and started or queued; requests in
 * progress are handed to the op handlers (ops.h).
 */
#include <inttypes.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport.h"

#include "clock.h"
#include "base/log.h"
#include "msg.h"
#include "ops/ops.h"

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
      conn_kick(c);
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

void req_drop_args(struct request *r) {
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
void conn_watch_idle(struct conn *c) {
  if (!alive(c) || c->closing || c->d->cfg.idle_timeout_ms == 0) return;
  if (!busy(c)) uv_timer_start(&c->idle_timer, on_idle, c->d->cfg.idle_timeout_ms, 0);
  else uv_timer_stop(&c->idle_timer);
}

void req_finish(struct request *r) {
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
    conn_kick(c); /* not from inside a handler: queued requests and buffered frames go on from the loop */
    conn_watch_idle(c);
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

struct request *conn_queue_pop(struct conn *c) {
  struct request *r = c->queued;
  if (r == NULL) return NULL;
  c->queued = r->next_in_conn;
  if (c->queued == NULL) c->queued_tail = &c->queued;
  c->nqueued--;
  r->next_in_conn = NULL;
  return r;
}

/* Takes the queued request *pp out of c's queue into its requests (finished as a started request would be). */
static struct request *take_queued(struct conn *c, struct request **pp) {
  struct request *r = *pp;
  *pp = r->next_in_conn;
  if (*pp == NULL) c->queued_tail = pp;
  c->nqueued--;
  r->next_in_conn = c->requests;
  c->requests = r;
  return r;
}

struct request *conn_unqueue(struct conn *c, const cJSON *id) {
  for (struct request **pp = &c->queued; *pp != NULL; pp = &(*pp)->next_in_conn)
    if ((*pp)->id != NULL && msg_id_equal((*pp)->id, id)) return take_queued(c, pp);
  return NULL;
}

bool conn_dequeue(struct conn *c, struct request *r) {
  for (struct request **pp = &c->queued; *pp != NULL; pp = &(*pp)->next_in_conn)
    if (*pp == r) return take_queued(c, pp) != NULL;
  return false;
}

struct conn *conn_first(const struct conn *c) { return c->srv->conns; }

/* Starts queued requests while there is room. */
void conn_start_queued(struct conn *c) {
  while (alive(c) && c->inflight < CONN_MAX_INFLIGHT && c->queued != NULL) req_start(conn_queue_pop(c));
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
    conn_kick(c);
    conn_watch_idle(c);
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
  conn_kick(c);
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
void conn_process_frames(struct conn *c) {
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
void conn_watch_partial_frame(struct conn *c) {
  if (!alive(c) || c->closing || c->held.json != NULL) return; /* the timer is the held frame's */
  if (can_take(c) && wire_reader_pending(&c->reader)) {
    if (!uv_is_active((uv_handle_t *)&c->frame_timer))
      uv_timer_start(&c->frame_timer, on_frame_timeout, c->d->cfg.frame_timeout_ms, 0);
  } else {
    uv_timer_stop(&c->frame_timer);
  }
}

/* Takes a frame held back for memory, once memory allows. */
void conn_take_held(struct conn *c) {
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

static void on_idle(uv_timer_t *t) {
  struct conn *c = t->data;
  if (!alive(c) || c->closing || busy(c)) return;
  if (ops_conn_holds_leases(c)) return; /* engines holding leases are never dropped */
  log_msg(LOG_DEBUG, "connection of pid %d idle for %" PRIu64 " ms: closing", (int)c->pid,
          c->d->cfg.idle_timeout_ms);
  conn_kill(c);
}
