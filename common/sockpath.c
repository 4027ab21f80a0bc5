/* sockpath.c - the daemon's socket: where it is and whom a client accepts behind it (see sockpath.h). */
#include "sockpath.h"

#include <errno.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* What to do when the per-user directory is refused, for every refusal's message. */
#define DIR_ADVICE                                                                                             \
  "refused, since another user may have made it to receive your clients or to keep your daemon from starting; " \
  "remove it, or set XDG_RUNTIME_DIR or name a socket explicitly"

/* Writes "UID (NAME)", or "UID" for a uid with no account, into buf; returns buf. */
static const char *uid_text(unsigned uid, char *buf, size_t len) {
  struct passwd pw, *found = NULL;
  char pb[4096];
  if (getpwuid_r((uid_t)uid, &pw, pb, sizeof pb, &found) == 0 && found != NULL)
    snprintf(buf, len, "%u (%s)", uid, found->pw_name);
  else snprintf(buf, len, "%u", uid);
  return buf;
}

/* The uid of the account name into *uid; false when there is none. */
static bool user_uid(const char *name, unsigned *uid) {
  struct passwd pw, *found = NULL;
  char pb[4096];
  if (name == NULL || getpwnam_r(name, &pw, pb, sizeof pb, &found) != 0 || found == NULL) return false;
  *uid = (unsigned)found->pw_uid;
  return true;
}

int sockpath_user_socket(unsigned uid, struct sockpath *out, struct wd_error *err) {
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  out->label = "";
  out->private_dir[0] = '\0';
  if (xdg != NULL && xdg[0] == '/') {
    int n = snprintf(out->path, sizeof out->path, "%s/weightd.sock", xdg);
    if (n < 0 || (size_t)n >= sizeof out->path)
      return err_set(err, WEIGHTD_E_INVALID, "$XDG_RUNTIME_DIR is too long for a socket path (%zu bytes)",
                     strlen(xdg));
    return 0;
  }
  snprintf(out->private_dir, sizeof out->private_dir, "/tmp/weightd-%u", uid);
  snprintf(out->path, sizeof out->path, "%s/weightd.sock", out->private_dir);
  return 0;
}

int sockpath_search(const char *explicit_path, unsigned uid, struct sockpath out[2], size_t *n,
                    struct wd_error *err) {
  const char *env = getenv("WEIGHTD_SOCKET");
  const char *named = explicit_path != NULL ? explicit_path : env != NULL && env[0] != '\0' ? env : NULL;
  *n = 0;
  if (named != NULL) {
    int w = snprintf(out[0].path, sizeof out[0].path, "%s", named);
    if (w < 0 || (size_t)w >= sizeof out[0].path)
      return err_set(err, WEIGHTD_E_INVALID, "socket path too long (%zu bytes)", strlen(named));
    out[0].label = explicit_path != NULL ? "" : "$WEIGHTD_SOCKET=";
    out[0].private_dir[0] = '\0';
    *n = 1;
    return 0;
  }
  snprintf(out[0].path, sizeof out[0].path, "%s", SOCKPATH_SERVICE);
  out[0].label = "";
  out[0].private_dir[0] = '\0';
  int rc = sockpath_user_socket(uid, &out[1], err);
  if (rc == 0) *n = 2;
  return rc;
}

int sockpath_dir_check(const char *dir, unsigned uid, bool create, struct wd_error *err) {
  struct stat st;
  if (lstat(dir, &st) != 0) {
    if (errno != ENOENT) return err_set(err, WEIGHTD_E_IO, "%s: %s", dir, strerror(errno));
    if (!create) return err_set(err, WEIGHTD_E_NOT_FOUND, "%s: no such directory", dir);
    /* Made 0700 whatever the umask; one made by someone else meanwhile is judged below like any other. */
    if (mkdir(dir, 0700) == 0) {
      if (chmod(dir, 0700) != 0) return err_set(err, WEIGHTD_E_IO, "chmod %s: %s", dir, strerror(errno));
    } else if (errno != EEXIST) {
      return err_set(err, WEIGHTD_E_IO, "cannot create the socket's directory %s: %s", dir, strerror(errno));
    }
    if (lstat(dir, &st) != 0) return err_set(err, WEIGHTD_E_IO, "%s: %s", dir, strerror(errno));
  }
  char owner[96];
  if (S_ISLNK(st.st_mode))
    return err_set(err, WEIGHTD_E_PERMISSION, "%s is a symbolic link, not a directory of uid %u: " DIR_ADVICE, dir,
                   uid);
  if (!S_ISDIR(st.st_mode))
    return err_set(err, WEIGHTD_E_PERMISSION, "%s is not a directory (owned by uid %s): " DIR_ADVICE, dir,
                   uid_text((unsigned)st.st_uid, owner, sizeof owner));
  if ((unsigned)st.st_uid != uid)
    return err_set(err, WEIGHTD_E_PERMISSION, "%s is owned by uid %s, not by uid %u: " DIR_ADVICE, dir,
                   uid_text((unsigned)st.st_uid, owner, sizeof owner), uid);
  if ((st.st_mode & 07777) != 0700)
    return err_set(err, WEIGHTD_E_PERMISSION,
                   "%s has mode %04o, not 0700, so other users may reach into it: refused; chmod 700 %s, or "
                   "remove it",
                   dir, (unsigned)(st.st_mode & 07777), dir);
  return 0;
}

bool sockpath_uid_trusted(unsigned uid, const char *service_user) {
  unsigned service;
  if (uid == 0 || uid == (unsigned)getuid() || uid == (unsigned)geteuid()) return true;
  return user_uid(service_user, &service) && uid == service;
}

int sockpath_peer_check(int fd, const char *shown, struct wd_error *err) {
  struct ucred cr;
  socklen_t len = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0)
    return err_set(err, WEIGHTD_E_IO, "%s: cannot read the credentials of the daemon (SO_PEERCRED): %s", shown,
                   strerror(errno));
  if (sockpath_uid_trusted((unsigned)cr.uid, SOCKPATH_SERVICE_USER)) return 0;
  char found[96], service[64] = "no such account";
  unsigned suid;
  if (user_uid(SOCKPATH_SERVICE_USER, &suid)) snprintf(service, sizeof service, "uid %u", suid);
  return err_set(err, WEIGHTD_E_PERMISSION,
                 "%s: the daemon there runs as uid %s, pid %d, which is neither you (uid %u), root nor the service "
                 "user " SOCKPATH_SERVICE_USER " (%s): refused, since another user's process could serve you "
                 "memory of its own (name the socket of your own daemon or of the service)",
                 shown, uid_text((unsigned)cr.uid, found, sizeof found), (int)cr.pid, (unsigned)getuid(), service);
}
