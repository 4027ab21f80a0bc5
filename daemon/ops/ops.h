/*
 * ops.h - the op handlers: the protocol layer, as the server sees it.
 *
 * ops_dispatch runs a request's handler (one per op of the catalogue,
 * proto/msg.h); handlers reply at once or from continuations of the state
 * modules. The ops are the only code that builds replies and events.
 */
#ifndef WD_OPS_H
#define WD_OPS_H

#include "transport/request.h"

/* Runs the handler of r->op (checking the op's privileged rule first). */
void ops_dispatch(struct request *r);

/* The request's connection closed: stop waiting for whatever it waits for (nothing is replied). */
void ops_request_gone(struct request *r);

/* A connection closes: its leases end. */
void ops_conn_gone(struct conn *c);

/* True while the connection holds a lease (it is then never closed for idleness). */
bool ops_conn_holds_leases(const struct conn *c);

struct res_set;
/*
 * The scrubber's on_corrupt hook (arg: the daemon): tells every connection
 * holding a lease on s, with an unsolicited {"event": "corrupt"} naming the
 * set and the tensors outs[0..n) of its plan found changed.
 */
void ops_scrub_corrupt(void *arg, struct res_set *s, const size_t *outs, size_t n);

#endif
