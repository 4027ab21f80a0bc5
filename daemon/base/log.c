/* log.c - the daemon's log lines (see log.h). */
#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

enum target { TARGET_STDERR, TARGET_JOURNALD, TARGET_FILE, TARGET_SYSLOG };

static const char *const level_names[] = {"error", "warn", "info", "debug"};
/* syslog severities: err, warning, info, debug. */
static const int severity[] = {3, 4, 6, 7};
#define FACILITY_DAEMON (3 << 3)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* guards the target and its descriptor */
static enum log_level current = LOG_INFO;
static enum target target = TARGET_STDERR;
static int out_fd = 2; /* TARGET_FILE: the log file; TARGET_SYSLOG: a datagram socket */
static bool opened;     /* log_open chose a target once: later failures keep it */
static char fallback[256]; /* why a detached daemon logs to stderr ("" when it does not) */

void log_set_level(enum log_level level) { current = level; }

/* True when $JOURNAL_STREAM names stderr ("device:inode"). */
static bool stderr_is_journal(void) {
  const char *js = getenv("JOURNAL_STREAM");
  struct stat st;
  unsigned long long dev, ino;
  if (js == NULL || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(2, &st) != 0) return false;
  return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

/* Connects a datagram socket to the syslog daemon's socket at path: the descriptor, or -errno. */
static int open_syslog(const char *path) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof a.sun_path) return -ENAMETOOLONG;
  snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -errno;
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

/* What a file of this mode is, for a message. */
static const char *kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISFIFO(m)) return "a FIFO";
  return "a file of another kind";
}

/*
 * Opens log_file for appending without ever blocking: a regular file
 * (created when missing) or a FIFO that has a reader. A FIFO without one
 * fails at once (ENXIO) instead of waiting for a reader; its descriptor stays
 * non-blocking, so a reader that stops reading costs lines, never the loop.
 */
static int open_file(const char *path, int *out, struct wd_error *err) {
  struct stat st;
  if (stat(path, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))
    return err_set(err, WEIGHTD_E_INVALID, "log_file %s: %s, not a regular file or a FIFO", path,
                   kind_of(st.st_mode));
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0640);
  if (fd < 0 && errno == ENXIO && stat(path, &st) == 0 && S_ISFIFO(st.st_mode))
    return err_set(err, WEIGHTD_E_INVALID, "log_file %s: a FIFO with no reader (start its reader first, or use a "
                   "regular file)", path);
  if (fd < 0) return err_set(err, WEIGHTD_E_IO, "log_file %s: %s", path, strerror(errno));
  if (fstat(fd, &st) != 0 || (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))) {
    close(fd);
    return err_set(err, WEIGHTD_E_INVALID, "log_file %s: not a regular file or a FIFO", path);
  }
  *out = fd;
  return 0;
}

int log_open(bool foreground, const char *log_file, const char *syslog_socket, struct wd_error *err) {
  enum target t;
  int fd = -1;
  char why[sizeof fallback] = "";
  if (stderr_is_journal()) {
    t = TARGET_JOURNALD;
  } else if (log_file != NULL && log_file[0] != '\0') {
    int rc = open_file(log_file, &fd, err);
    if (rc != 0) return rc;
    t = TARGET_FILE;
  } else if (foreground) {
    t = TARGET_STDERR;
  } else if (syslog_socket != NULL && syslog_socket[0] != '\0' && (fd = open_syslog(syslog_socket)) >= 0) {
    t = TARGET_SYSLOG;
  } else {
    if (syslog_socket == NULL || syslog_socket[0] == '\0')
      snprintf(why, sizeof why, "syslog_socket is empty");
    else
      snprintf(why, sizeof why, "the syslog socket %s cannot be reached: %s", syslog_socket, strerror(-fd));
    /* Once the daemon runs detached, stderr is no longer the caller's: the current target stays. */
    if (opened) return err_set(err, WEIGHTD_E_IO, "%s", why);
    t = TARGET_STDERR;
    fd = -1;
  }
  pthread_mutex_lock(&lock);
  if (out_fd > 2) close(out_fd);
  target = t;
  out_fd = t == TARGET_JOURNALD || t == TARGET_STDERR ? 2 : fd;
  snprintf(fallback, sizeof fallback, "%s", why);
  opened = true;
  pthread_mutex_unlock(&lock);
  return 0;
}

const char *log_target_name(void) {
  static const char *const names[] = {"stderr", "journald", "file", "syslog"};
  return names[target];
}

const char *log_fallback(void) { return fallback[0] != '\0' ? fallback : NULL; }

void log_msg(enum log_level level, const char *fmt, ...) {
  if (level > current) return;
  char line[2048];
  size_t o = 0;
  pthread_mutex_lock(&lock);
  enum target t = target;
  if (t == TARGET_JOURNALD) {
    o += (size_t)snprintf(line, sizeof line, "<%d>", severity[level]);
  } else if (t == TARGET_SYSLOG) {
    o += (size_t)snprintf(line, sizeof line, "<%d>weightd[%d]: ", FACILITY_DAEMON | severity[level], (int)getpid());
  } else {
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    o += strftime(line, sizeof line, "%Y-%m-%dT%H:%M:%S", &tm);
    o += (size_t)snprintf(line + o, sizeof line - o, ".%03ldZ ", ts.tv_nsec / 1000000);
  }
  if (t != TARGET_SYSLOG && o < sizeof line)
    o += (size_t)snprintf(line + o, sizeof line - o, "weightd[%s]: ", level_names[level]);
  va_list ap;
  va_start(ap, fmt);
  if (o < sizeof line) o += (size_t)vsnprintf(line + o, sizeof line - o, fmt, ap);
  va_end(ap);
  if (o >= sizeof line - 1) o = sizeof line - 2; /* cut long lines */
  if (t != TARGET_SYSLOG) line[o++] = '\n';
  if (out_fd >= 0) {
    ssize_t n = write(out_fd, line, o);
    (void)n; /* nowhere left to report a failed log write */
  }
  pthread_mutex_unlock(&lock);
}
