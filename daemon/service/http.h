/*
 * http.h - the metrics and probe endpoints (GET /metrics, /healthz, /readyz),
 * served by libmicrohttpd driven from the daemon's own libuv loop.
 *
 * The library runs in its external mode with epoll: its one epoll descriptor
 * sits on a uv_poll and its timeout on a uv_timer, so requests are answered
 * on the loop thread itself: an answer proves the loop is alive, and the
 * handlers read loop state without locks. The library never blocks: a slow or
 * hostile HTTP client (slowloris, huge headers, many connections) costs
 * bounded memory and descriptors and never delays the Unix-socket clients.
 */
#ifndef WD_HTTP_H
#define WD_HTTP_H

#include "daemon.h"
#include "error.h"

/*
 * Starts serving on address ("HOST:PORT", an IPv4 or IPv6 literal (in
 * brackets), or "" for none: *out is then NULL). Returns 0 or an error naming
 * the address.
 */
int http_start(struct daemon *d, const char *address, unsigned max_connections, struct http **out,
               struct wd_error *err);

/* Stops serving and closes every HTTP connection; the loop then runs until its handles close. */
void http_stop(struct http *h);

#endif
