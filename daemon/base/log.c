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

void log_set_level(enum log_level level) { current = level; }

/* True when $JOURNAL_STREAM names stderr ("device:inode"). */
static bool stderr_is_journal(void) {
  const char *js = getenv("JOURNAL_STREAM");
  struct stat st;
  unsigned long long dev, ino;
  if (js == NULL || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(2, &st) != 0) return false;
  return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

static int open_syslog(void) {
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  snprintf(a.sun_path, sizeof a.sun_path, "/dev/log");
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int log_open(bool foreground, const char *log_file) {
  enum target t;
  int fd = -1, rc = 0;
  if (stderr_is_journal()) {
    t = TARGET_JOURNALD;
  } else if (log_file != NULL && log_file[0] != '\0') {
    fd = open(log_file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
    if (fd < 0) return -errno;
    t = TARGET_FILE;
  } else if (foreground) {
    t = TARGET_STDERR;
  } else {
    t = TARGET_SYSLOG;
    fd = open_syslog(); /* no syslog daemon: lines are lost rather than sent to a dead terminal */
  }
  pthread_mutex_lock(&lock);
  if (out_fd > 2) close(out_fd);
  target = t;
  out_fd = t == TARGET_JOURNALD || t == TARGET_STDERR ? 2 : fd;
  pthread_mutex_unlock(&lock);
  return rc;
}

const char *log_target_name(void) {
  static const char *const names[] = {"stderr", "journald", "file", "syslog"};
  return names[target];
}

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
