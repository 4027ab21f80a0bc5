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
 *
 * The listening socket is ours, not the library's: the accept path hands
 * each connection to the library (MHD_add_connection), so accepting never
 * depends on the library's state (it stops polling a listening socket of its
 * own when its table is full and may never poll it again). The kernel
 * hands a connection over once its first bytes came (TCP_DEFER_ACCEPT), and
 * a batch of newcomers is read and answered before the limits are applied:
 * then the connections waiting longest for a whole request go first, then
 * those pipelining or not reading their answers, never one on its first
 * answer while its client reads. So a probe, which sends its request as it
 * connects, is answered in the pass that reads it, whatever others do; and
 * every request has a total deadline, not only an idle timeout, so a client
 * dripping a byte at a time is closed all the same.
 */
#ifndef WD_HTTP_H
#define WD_HTTP_H

#include "daemon.h"
#include "error.h"

/*
 * Starts serving on address ("HOST:PORT", an IPv4 or IPv6 literal (in
 * brackets), or "" for none: *out is then NULL), with at most
 * max_connections connections (32 from one address) and request_timeout_ms
 * for each request, from its connection's accept or its previous answer to
 * its own answer sent. Returns 0 or an error naming the address.
 */
int http_start(struct daemon *d, const char *address, unsigned max_connections, uint64_t request_timeout_ms,
               struct http **out, struct wd_error *err);

/* Stops serving and closes every HTTP connection; the loop then runs until its handles close. */
void http_stop(struct http *h);

#endif
