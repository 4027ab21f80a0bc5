/*
 * service.h - the service manager's protocols, implemented here (no
 * libsystemd): readiness and status notification with descriptor passing
 * (sd_notify's datagrams on $NOTIFY_SOCKET), the watchdog interval
 * ($WATCHDOG_USEC), and descriptors passed at start ($LISTEN_FDS,
 * $LISTEN_PID, $LISTEN_FDNAMES). systemd documents these as small stable
 * protocols for programs to speak themselves; anything else that provides
 * the same variables (a test harness, another supervisor) works as well.
 *
 * Threads: called on the loop thread only (the notify socket is one
 * descriptor, opened once).
 */
#ifndef WD_SERVICE_H
#define WD_SERVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "error.h"

/* The first descriptor a service manager passes (SD_LISTEN_FDS_START). */
#define SERVICE_LISTEN_FDS_START 3

/* One descriptor received at start, with the name LISTEN_FDNAMES gave it ("" when none). */
struct service_fd {
  int fd;
  char name[256];
  bool taken; /* claimed by its user; the rest are closed by service_fds_close_unclaimed */
};

/*
 * Reads $NOTIFY_SOCKET, $WATCHDOG_USEC/$WATCHDOG_PID and $LISTEN_FDS/
 * $LISTEN_PID/$LISTEN_FDNAMES (for this process only), then unsets them so
 * that children do not inherit them. Received descriptors get FD_CLOEXEC.
 * Returns 0, or an error for variables that are malformed.
 */
int service_init(struct wd_error *err);

/* True when a notify socket was given: the daemon must not fork then. */
bool service_notify_enabled(void);

/*
 * Sends one notification: newline-separated "KEY=VALUE" assignments
 * ("READY=1", "STATUS=...", "STOPPING=1", "WATCHDOG=1", "RELOADING=1\n
 * MONOTONIC_USEC=..."), with fds[0..nfds) attached (FDSTORE=1). A no-op
 * returning 0 when there is no notify socket. Returns 0 or an error.
 */
int service_notify(const char *state, const int *fds, size_t nfds, struct wd_error *err);

/* printf-style convenience for state without descriptors; errors are logged, not returned. */
void service_notifyf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The watchdog interval in microseconds, or 0 when none was asked for. */
uint64_t service_watchdog_usec(void);

/* $FDSTORE (systemd 254+ announces FileDescriptorStoreMax= there), or -1 when absent or malformed. */
long long service_fdstore_max(void);

/* Descriptors passed at start (LISTEN_FDS), in order. */
size_t service_fd_count(void);
struct service_fd *service_fd(size_t i);
/* The first unclaimed descriptor with this name (or, when name is NULL, any), or NULL. */
struct service_fd *service_fd_find(const char *name);
/* Closes the descriptors nobody claimed (logged). */
void service_fds_close_unclaimed(void);

#endif
