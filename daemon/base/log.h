/*
 * log.h - the daemon's log: one line per event, safe to call from any thread.
 *
 * Where lines go is decided once at start and again at each reload:
 *   journald  stderr is the journal's stream ($JOURNAL_STREAM names stderr's
 *             device and inode): each line starts with its priority ("<4>"),
 *             the journal adds the time;
 *   file      log_file is set: appended, with a timestamp; reopened at each
 *             reload (for log rotation). A regular file (created when
 *             missing), or a FIFO that has a reader; opened without ever
 *             blocking, so a FIFO without a reader is refused at once and a
 *             full one drops lines rather than stopping the daemon;
 *   stderr    in the foreground: with a timestamp;
 *   syslog    detached without a journal or a log file: the syslog socket
 *             (syslog_socket, /dev/log), facility daemon. When it cannot be
 *             reached at start (a container without a syslog daemon), lines
 *             go to stderr instead and log_fallback() says why.
 * A detached daemon never writes to the terminal it was started from, unless
 * stderr is the fallback above: the only place left to say anything.
 */
#ifndef WD_LOG_H
#define WD_LOG_H

#include <stdbool.h>

#include "error.h"

enum log_level { LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG };

void log_set_level(enum log_level level);

/*
 * Chooses where lines go (see above). log_file NULL or "" means none;
 * syslog_socket NULL or "" means no syslog (a detached daemon then logs to
 * stderr). Returns 0, or an error with err naming the file and the reason:
 * a log_file that cannot be opened or is not a regular file or a FIFO with a
 * reader (WEIGHTD_E_IO, WEIGHTD_E_INVALID), or, after the first call, a
 * syslog socket that cannot be reached (WEIGHTD_E_IO). Lines then keep going
 * where they went before.
 */
int log_open(bool foreground, const char *log_file, const char *syslog_socket, struct wd_error *err);

/* The target's name ("journald", "file", "stderr", "syslog"), for the start-up line. */
const char *log_target_name(void);

/*
 * NULL, or why lines go to stderr although the daemon is detached ("the
 * syslog socket /dev/log cannot be reached: No such file or directory").
 */
const char *log_fallback(void);

void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
