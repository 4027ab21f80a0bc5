/* log.c - the daemon's log lines (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static enum log_level current = LOG_INFO;
static int timestamps = 1;
static const char *const names[] = {"error", "warn", "info", "debug"};

void log_set_level(enum log_level level) { current = level; }

void log_set_timestamps(int on) { timestamps = on; }

void log_msg(enum log_level level, const char *fmt, ...) {
  if (level > current) return;
  char line[2048];
  size_t o = 0;
  if (timestamps) {
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    o += strftime(line, sizeof line, "%Y-%m-%dT%H:%M:%S", &tm);
    o += (size_t)snprintf(line + o, sizeof line - o, ".%03ldZ ", ts.tv_nsec / 1000000);
  }
  o += (size_t)snprintf(line + o, sizeof line - o, "weightd[%s]: ", names[level]);
  va_list ap;
  va_start(ap, fmt);
  if (o < sizeof line) vsnprintf(line + o, sizeof line - o, fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s\n", line);
}
