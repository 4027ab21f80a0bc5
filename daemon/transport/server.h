/*
 * server.h - the Unix socket server, as start-up and shutdown see it.
 *
 * What a connection and a request are, and how replies are queued, is in
 * request.h, which only the server and the op handlers include.
 */
#ifndef WD_SERVER_H
#define WD_SERVER_H

#include <stddef.h>

#include "daemon.h"
#include "error.h"

/*
 * Whether cfg's connection limits fit together: request_memory must hold four
 * connections' worth of the largest request at what parsing it can take, and
 * a uid's share of queued replies must be within the daemon's budget.
 * Returns 0 or WEIGHTD_E_INVALID with the figures in err (start and reload).
 */
int server_config_check(const struct wd_config *cfg, struct wd_error *err);
/*
 * Serves listen_fd, a listening socket passed at start (socket activation),
 * or, when it is -1, binds and listens on d->socket_path. d->srv is set. A
 * passed socket is never unlinked: its owner keeps it.
 */
int server_start(struct daemon *d, int listen_fd, struct wd_error *err);
/* Stops accepting, tells every client the daemon stops, closes connections once their replies are out. */
void server_stop(struct server *s);
/* Closes whatever connections are left; the loop then runs until their handles are closed. */
void server_close_all(struct server *s);
/* Frees the server once every connection is gone. */
void server_destroy(struct server *s);

#endif
