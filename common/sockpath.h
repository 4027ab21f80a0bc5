/*
 * sockpath.h - where the daemon's socket is, and which daemon a client
 * accepts behind it. The one place in the code that decides both; the
 * daemon's default path (daemon/service/startup.c), libweightd's search
 * (client/lib/libweightd.c, and through it weightctl and the Python binding)
 * and their help texts all come from here. weightd.h states the same for
 * engines (weightd_connect), docs/protocol.md for other clients.
 *
 * The search, for a client that names no socket:
 *   1. a socket named explicitly (--socket, the API's argument, else
 *      $WEIGHTD_SOCKET) is the only one tried: a daemon that is not there
 *      is an error naming that path, never a reason to reach another;
 *   2. otherwise the service's socket, /run/weightd/weightd.sock;
 *   3. then the per-user socket: $XDG_RUNTIME_DIR/weightd.sock when
 *      XDG_RUNTIME_DIR is set (an absolute path), else
 *      /tmp/weightd-$UID/weightd.sock.
 * A daemon started without a socket binds /run/weightd/weightd.sock as root,
 * else the per-user socket.
 *
 * /tmp is writable by everyone, so /tmp/weightd-$UID/ must be the user's
 * own: the daemon creates it with mode 0700, and daemon and client refuse it
 * when it is not a directory of that uid with mode 0700 (a symbolic link
 * included), naming the path. Whatever the path, the client accepts only a
 * daemon whose SO_PEERCRED uid (the process that listens) is its own, root
 * (systemd's socket) or the service user's (SOCKPATH_SERVICE_USER, looked
 * up when connecting; a name with no account is not trusted): any other
 * user's process could answer attaches with memory of its own.
 */
#ifndef WD_SOCKPATH_H
#define WD_SOCKPATH_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "error.h"

/* The service's socket (systemd/weightd.socket) and the user its daemon runs as (systemd/sysusers.conf). */
#define SOCKPATH_SERVICE "/run/weightd/weightd.sock"
#define SOCKPATH_SERVICE_USER "weightd"

/* The per-user socket in words, for help texts. */
#define SOCKPATH_USER_TEXT                                                                                     \
  "$XDG_RUNTIME_DIR/weightd.sock, else /tmp/weightd-$UID/weightd.sock (a directory of mode 0700)"

/* The client's search in words (weightctl --socket, the man page). */
#define SOCKPATH_SEARCH_TEXT                                                                                   \
  "$WEIGHTD_SOCKET when set, and then only it; else " SOCKPATH_SERVICE ", then " SOCKPATH_USER_TEXT

/* The daemon's default in words (the socket key). */
#define SOCKPATH_DAEMON_TEXT SOCKPATH_SERVICE " as root, else " SOCKPATH_USER_TEXT

/* One socket to try: its path, how messages name it, and the private directory it lies in. */
struct sockpath {
  char path[PATH_MAX];
  const char *label;    /* put before the path in messages: "" or "$WEIGHTD_SOCKET=" */
  char private_dir[64]; /* /tmp/weightd-$UID, checked before connecting; "" for any other path */
};

/* Fills out with uid's per-user socket; 0, or WEIGHTD_E_INVALID when $XDG_RUNTIME_DIR is too long. */
int sockpath_user_socket(unsigned uid, struct sockpath *out, struct wd_error *err);

/*
 * The sockets a client of uid tries, in order (the search above): explicit
 * (the caller's argument) when not NULL, else $WEIGHTD_SOCKET when set, each
 * alone; else the service's and the per-user socket. Returns 0 with *n
 * (1 or 2) entries of out filled, or sockpath_user_socket's error.
 */
int sockpath_search(const char *explicit_path, unsigned uid, struct sockpath out[2], size_t *n,
                    struct wd_error *err);

/*
 * Checks that dir is a private directory of uid: a directory (not a symbolic
 * link) owned by uid with mode 0700. With create, a missing dir is made so
 * (mode 0700 whatever the umask). Returns 0; WEIGHTD_E_NOT_FOUND when it is
 * missing and not created; else WEIGHTD_E_PERMISSION (another owner, another
 * mode, a link, not a directory) or WEIGHTD_E_IO; err names the path, what
 * was found and what to do.
 */
int sockpath_dir_check(const char *dir, unsigned uid, bool create, struct wd_error *err);

/*
 * True when a daemon running as uid is one this process accepts: uid is its
 * real or effective uid, root, or that of the account service_user (looked
 * up now; NULL or a name with no account adds no one).
 */
bool sockpath_uid_trusted(unsigned uid, const char *service_user);

/*
 * Checks the daemon at the other end of fd, a socket connected to shown (the
 * path as messages name it), with sockpath_uid_trusted and
 * SOCKPATH_SERVICE_USER. Returns 0, or WEIGHTD_E_PERMISSION with err naming
 * the socket and the uid and pid found there (WEIGHTD_E_IO when the
 * credentials cannot be read).
 */
int sockpath_peer_check(int fd, const char *shown, struct wd_error *err);

#endif
