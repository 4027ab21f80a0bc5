/*
 * fetch.h - the range-GET engine of remote sources: HTTP(S) and S3 object
 * stores read by byte ranges, straight into the caller's memory.
 *
 * One client (struct rf_client) per daemon owns a libcurl multi handle and
 * one thread that runs it (curl_multi_poll, woken by curl_multi_wakeup).
 * Callers - fill threads, control threads - call the blocking functions
 * below from any number of threads at once; each call waits on its own
 * completion, so many callers mean many requests in flight over the same
 * connections (reused; HTTP/2 streams multiplexed on one connection where the
 * server offers HTTP/2, which servers do over TLS; at most max_connections
 * connections per host).
 *
 * What this layer knows of a request is where it goes (struct rf_location:
 * scheme, host, port, an encoded path and query) and who signs it (struct
 * rf_auth): URLs of s3:// or https:// roots, signatures and credentials are
 * the layers above (url.h, sigv4.h, creds.h); nothing here parses a user's
 * URL.
 *
 * Consistency: rf_stat records an object's size, ETag and Last-Modified;
 * every ranged GET of rf_read carries If-Match with that ETag (a weak or
 * missing ETag: If-Unmodified-Since with Last-Modified), and each response's
 * Content-Range is checked against the range asked for and the size
 * recorded before a byte of its body is written. An object replaced since
 * it was opened (412, a Content-Range whose total differs, 416, or a 200 to a
 * partial range) fails the call with WEIGHTD_E_STALE naming the object:
 * never bytes of two versions in one buffer.
 *
 * Faults: a request that fails with a 5xx, a 408 or a 429 (Retry-After
 * honoured), a reset or refused connection, a timeout, a short body, or
 * that delivers no byte for stall_ms (cut, then re-requested) is tried again
 * for what it has not delivered yet, after an exponential backoff with full
 * jitter, up to `retries` times and within retry_budget_ms for the whole
 * call. Errors name the object (its name, or its URL without the query: no
 * signature, no credentials), the HTTP status and an S3 error body's <Code>.
 *
 * Redirects are never followed by libcurl: a 301/302/303/307/308 is followed
 * by this layer when the caller's allow_redirect says yes, never to a
 * link-local or metadata address (169.254.0.0/16, fe80::/10,
 * fd00:ec2::254, 100.100.100.200: every connection's address is checked, a
 * name that resolves there included), at most RF_MAX_REDIRECTS hops. The
 * auth hook's headers go only to the endpoint the object was opened on.
 * Proxies named by the environment (http_proxy, ...) are not used: they
 * would connect where no address check sees.
 *
 * Threads: every function but rf_client_create/rf_client_free may be called
 * from any thread at once; the auth hook runs on the caller's thread (so a
 * credential refresh never blocks the engine's thread), the body is written
 * from the engine's thread, into pages the caller's thread faulted in before
 * the part's request went out (base/prefault.h; where the kernel refuses,
 * they fault as they are written).
 */
#ifndef WD_REMOTE_FETCH_H
#define WD_REMOTE_FETCH_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define RF_HOST_MAX 256
#define RF_ETAG_MAX 256
#define RF_DATE_MAX 64
#define RF_MAX_REDIRECTS 5

/* Where requests go: a host name or an IP literal (IPv6 without brackets), a port, TLS or not. */
struct rf_endpoint {
  bool tls;
  char host[RF_HOST_MAX];
  int port;
};

/* An object to open: its endpoint and request target, as the layer above built them. */
struct rf_location {
  struct rf_endpoint ep;
  const char *path;  /* absolute and already percent-encoded ("/bucket/key"), no query */
  const char *query; /* without '?', as it is to be sent (and signed); NULL or "": none. Never in errors */
  const char *name;  /* how errors name the object ("s3://bucket/key"); NULL: scheme://host:port/path */
};

/*
 * The remote root's policy for a request: who signs it and where it may be
 * redirected. Both hooks may be NULL (no extra headers; no redirect is
 * followed). The hooks run on the calling thread.
 */
struct rf_auth {
  /*
   * Returns, in *lines (malloc'd, *n of them, each malloc'd, "Name: value"
   * without CRLF), the headers that sign a request: method "GET" or "HEAD",
   * the endpoint (libcurl sends Host as host, or host:port when the port is
   * not the scheme's default), the encoded path and query (query "" for
   * none). Called for every attempt (a signature carries its time). The
   * engine wipes and frees the lines. Returns 0 or a negative code with err
   * filled (which the call then returns, prefixed with the object's name).
   */
  int (*headers)(void *arg, const char *method, const struct rf_endpoint *ep, const char *path,
                 const char *query, char ***lines, size_t *n, struct wd_error *err);
  /* Whether a redirect to this endpoint and path may be followed (the remote roots' allow-list). */
  bool (*allow_redirect)(void *arg, const struct rf_endpoint *to, const char *path);
  void *arg;
};

/*
 * An object as rf_stat found it. Reads go to ep/path/query, which is where
 * the object was found after any redirects; when that is not the endpoint it
 * was opened on (`redirected`), reads carry no auth headers. The strings are
 * malloc'd: rf_object_clear frees them.
 */
struct rf_object {
  struct rf_endpoint ep;
  char *path, *query, *name;
  bool redirected;
  char etag[RF_ETAG_MAX];          /* as the server sent it, quotes included; "" when it sent none */
  char last_modified[RF_DATE_MAX]; /* the HTTP date; "" when none */
  uint64_t size;
};

struct rf_config {
  unsigned max_connections;    /* connections per host, and in all (>= 1) */
  uint64_t part_bytes;         /* rf_read splits a range into parts of this size, read in parallel */
  unsigned retries;            /* tries after the first, per part (0: none) */
  unsigned retry_budget_ms;    /* every try of one call within this long from its start */
  unsigned backoff_base_ms;    /* the first retry waits up to this long, then doubling ... */
  unsigned backoff_max_ms;     /* ... up to this cap (full jitter: a uniform draw below the cap) */
  unsigned stall_ms;           /* a request that delivers no byte for this long is cut and re-requested */
  unsigned connect_timeout_ms; /* TCP and TLS set-up */
  const char *ca_file;         /* PEM bundle to verify servers with; NULL: the system's. Copied */
  /* The jitter's random numbers (called from callers' threads); NULL: the engine's own generator. */
  uint64_t (*random)(void *arg);
  void *random_arg;
};

/* Counters since the client was created (a snapshot; the engine updates them atomically). */
struct rf_stats {
  uint64_t requests[6]; /* responses by status class: [0] none (no status line), [1..5] 1xx..5xx */
  uint64_t bytes;       /* body bytes delivered into callers' buffers */
  uint64_t retries;     /* tries after a first */
  uint64_t stalls;      /* requests cut for delivering no byte for stall_ms */
  uint64_t redirects;   /* redirects followed */
  uint64_t connects;    /* connections opened (a reused one is not counted) */
  uint64_t http2;       /* responses that came over HTTP/2 */
  uint64_t in_flight;   /* requests submitted and not yet completed */
};

struct rf_client;

/* Fills c with the defaults (16 connections, 8 MiB parts, 5 retries in 30 s, backoff 100..5000 ms, stall 10 s). */
void rf_config_defaults(struct rf_config *c);

/* Starts a client and its thread. INVALID for a configuration out of range, IO when libcurl cannot start. */
int rf_client_create(const struct rf_config *cfg, struct rf_client **out, struct wd_error *err);

/* Stops the thread and frees the client (NULL-safe). Every call on it must have returned. */
void rf_client_free(struct rf_client *c);

/* The counters now. */
void rf_client_stats(struct rf_client *c, struct rf_stats *out);

/*
 * Opens an object: HEAD (and a GET of bytes 0-0, reading Content-Range,
 * where HEAD is refused or fails with a client error, whose body then says
 * why) for its size, ETag and Last-Modified, following allowed redirects,
 * with retries as rf_read's. Fills *out (which the caller clears with
 * rf_object_clear) and returns 0; NOT_FOUND (404, 410), PERMISSION (401,
 * 403), PATH_DENIED (a redirect not allowed or to a forbidden address),
 * CANCELED (*cancel became true), IO otherwise, each naming the object.
 * cancel may be NULL.
 */
int rf_stat(struct rf_client *c, const struct rf_auth *a, const struct rf_location *loc,
            const atomic_bool *cancel, struct rf_object *out, struct wd_error *err);

/*
 * Reads bytes [off, off + len) of the object into dst: exactly len bytes,
 * or an error. Ranges longer than part_bytes are read as parallel parts
 * (at most max_connections at once for one call), each written in place.
 * Returns 0; STALE (the object changed since rf_stat), NOT_FOUND,
 * PERMISSION, PATH_DENIED, CANCELED (*cancel became true: the call returns
 * as soon as its requests are aborted), INVALID (a range beyond the object),
 * IO (retries exhausted or a fault that no retry mends: the status, the S3
 * error code and the number of tries named). On error, dst holds no
 * promised bytes, and nothing writes to it after the call returns.
 */
int rf_read(struct rf_client *c, const struct rf_auth *a, const struct rf_object *o, uint64_t off, uint64_t len,
            void *dst, const atomic_bool *cancel, struct wd_error *err);

/* One piece of a vectored read (rf_readv): bytes [off, off + len) of the object, written at dst. */
struct rf_extent {
  uint64_t off, len;
  unsigned char *dst;
};

/*
 * Reads n extents of one object, each into its dst: every byte of every
 * extent, or an error, as rf_read reads one range. The merge rule: extents
 * that touch (one starts where the one before it ends) form one run of the
 * object, and a run is fetched as parts of at most part_bytes from its
 * start, each part one ranged GET whose body is scattered into the extents
 * it covers; extents that do not touch are never joined, so no byte outside
 * the extents is fetched (no gap is bridged). A run of L bytes therefore
 * costs ceil(L / part_bytes) requests. Each part carries If-Match and is
 * checked and retried on its own, for what it has not delivered yet; at
 * most max_connections parts of one call are in flight. The extents come in
 * ascending order of off, each at least one byte and within the object
 * (INVALID otherwise, naming the object); an extent that overlaps the one
 * before it starts a run of its own. Returns as rf_read does.
 */
int rf_readv(struct rf_client *c, const struct rf_auth *a, const struct rf_object *o, const struct rf_extent *ext,
             size_t n, const atomic_bool *cancel, struct wd_error *err);

/* Frees an object's strings and zeroes it (NULL-safe). */
void rf_object_clear(struct rf_object *o);

/* ---- pieces with no I/O, for the unit tests -------------------------------- */

/*
 * The wait before retry number `attempt` (1 for the first): full jitter, a
 * draw from [0, min(max_ms, base_ms * 2^(attempt-1))] taken from rnd.
 */
uint64_t rf_backoff_ms(unsigned base_ms, unsigned max_ms, unsigned attempt, uint64_t rnd);

enum rf_retry_verdict { RF_RETRY, RF_GIVE_UP_COUNT, RF_GIVE_UP_BUDGET };

/*
 * Whether retry number `attempt` may happen `elapsed_ms` after the call
 * began, and after how long (*delay_ms): the backoff, or the server's
 * Retry-After when longer; never past the budget.
 */
enum rf_retry_verdict rf_retry_decide(const struct rf_config *c, unsigned attempt, uint64_t elapsed_ms,
                                      uint64_t retry_after_ms, uint64_t rnd, uint64_t *delay_ms);

/*
 * Parses a Content-Range value "bytes FIRST-LAST/TOTAL" (TOTAL may be a
 * star) or its unsatisfied form, a star for FIRST-LAST. Returns 0 with the
 * values (*total UINT64_MAX for a star; *first = *last = UINT64_MAX for the
 * unsatisfied form), -1 if malformed.
 */
int rf_content_range_parse(const char *v, uint64_t *first, uint64_t *last, uint64_t *total);

/* Whether a host literal is an address the engine never connects to (link-local, metadata). */
bool rf_host_forbidden(const char *host);

/* Copies an S3 error body's <Code> (printable characters only) into code; "" when it has none. */
void rf_s3_error_code(const char *body, size_t len, char *code, size_t codelen);

#endif
