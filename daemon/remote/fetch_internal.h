/*
 * fetch_internal.h - what fetch.c (the calls: requests, retries, verdicts),
 * fetch_client.c (the client: configuration, multi handle, counters) and
 * fetch_loop.c (the engine's thread) share.
 *
 * A transfer (struct xfer) belongs to its caller while the caller prepares
 * it and after it completes, and to the loop thread from xfer_submit until
 * the loop hands it back on its call's done list. The loop thread alone
 * touches the multi handle and the callbacks' fields of transfers it holds;
 * a call's done list and the submission queue are guarded by their locks.
 */
#ifndef WD_REMOTE_FETCH_INTERNAL_H
#define WD_REMOTE_FETCH_INTERNAL_H

#include <curl/curl.h>
#include <pthread.h>

#include "fetch.h"

#define RF_BODY_KEEP 4096 /* the first bytes of an error response kept for its <Code> */

/* How the loop thread ended a transfer. */
enum xfer_end {
  XFER_COMPLETED, /* libcurl finished it (result says how) */
  XFER_STALLED,   /* no byte for stall_ms: cut */
  XFER_ABORTED,   /* its call was aborted (cancel, or another part failed) */
  XFER_SHUTDOWN,  /* the client is stopping */
};

/* How the body callback judged a response's body (set on its first byte). */
enum body_use {
  BODY_UNDECIDED,
  BODY_WRITE,     /* the range asked for: written at dst */
  BODY_KEEP,      /* an error response: its first bytes kept for <Code> */
  BODY_DISCARD,   /* a response whose body is not wanted (rf_stat's GET): cut at the first byte */
  BODY_STALE,     /* a Content-Range total other than the recorded size, or a 200 to a partial range */
  BODY_BAD_RANGE, /* a 206 for other bytes than asked */
};

struct call;

struct xfer {
  struct call *call;
  void *owner;                      /* the caller's state this transfer is for */
  struct rf_client *client;
  struct xfer *next;                /* submission queue, then the call's done list */
  struct xfer *act_prev, *act_next; /* the loop's list of added transfers */
  CURL *easy;
  struct curl_slist *headers;
  bool added; /* in the multi handle (loop thread) */

  /* The request (set by the caller before submitting). */
  bool head;
  bool ranged;             /* a Range header is sent */
  uint64_t want_off;       /* the range asked for */
  uint64_t want_len;
  uint64_t object_size;    /* the size a Content-Range total must equal; UINT64_MAX: not known yet */
  bool discard_body;       /* rf_stat's GET: the headers are all it wants */
  const struct rf_extent *ext; /* where a wanted body goes: the extents from ext[ei] on, touching (NULL: none) */
  size_t ei;               /* the extent that holds byte want_off + written */
  uint64_t stall_ms;

  /* The response (written by the loop thread's callbacks; read by the caller after completion). */
  long status;
  enum body_use use;
  uint64_t written;
  bool overflow;           /* more body than asked: refused */
  bool cut;                /* the body callback ended the transfer on purpose (see use) */
  bool forbidden_addr;     /* a connection to a forbidden address was refused */
  char forbidden_host[64];
  bool has_length;
  uint64_t content_length;
  char content_range[128];
  char etag[RF_ETAG_MAX];
  char last_modified[RF_DATE_MAX];
  char body[RF_BODY_KEEP];
  size_t body_len;
  size_t discarded;        /* body bytes of a BODY_DISCARD response consumed */
  uint64_t prereq_ms;      /* when its connection was ready and the request went out (0: not yet) */
  uint64_t activity_ms;    /* the last byte received, or the request going out */

  /* The end (set by the loop thread when it hands the transfer back). */
  enum xfer_end end;
  CURLcode result;
  char curl_msg[CURL_ERROR_SIZE];
  char *redirect_url;      /* malloc'd: where a 3xx points, resolved against the request's URL */
  long retry_after_s;      /* the Retry-After header, in seconds (0: none) */
};

/* One blocking call's completions. */
struct call {
  pthread_mutex_t lock;
  pthread_cond_t cond; /* CLOCK_MONOTONIC */
  struct xfer *done_head, *done_tail;
  atomic_bool abort;   /* the loop ends this call's transfers at its next pass */
};

struct rf_client {
  struct rf_config cfg;
  char *ca_file;
  CURLM *multi;
  pthread_t thread;
  bool thread_started;

  pthread_mutex_t lock; /* guards queue and stopping */
  struct xfer *queue_head, *queue_tail;
  bool stopping;

  struct xfer *active;  /* loop thread only */

  atomic_uint_fast64_t rng;
  struct {
    atomic_uint_fast64_t requests[6], bytes, retries, stalls, redirects, connects, http2, in_flight;
  } stats;
};

/* Starts the loop thread on a client whose multi handle is set up. */
int loop_start(struct rf_client *c, struct wd_error *err);

/* Asks the loop thread to stop, and waits for it; transfers still held end as XFER_SHUTDOWN. */
void loop_stop(struct rf_client *c);

/* Hands a prepared transfer to the loop thread. */
void xfer_submit(struct rf_client *c, struct xfer *x);

/* Sets the per-attempt callbacks and options every transfer carries (loop-side state reset). */
void xfer_arm(struct rf_client *c, struct xfer *x);

/* Wakes the loop thread (after setting a call's abort flag). */
void loop_wake(struct rf_client *c);

#endif
