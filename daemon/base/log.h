/*
 * log.h - the daemon's log: one line per event, safe to call from any thread.
 *
 * Where lines go is decided once at start and again at each reload:
 *   journald  stderr is the journal's stream ($JOURNAL_STREAM names stderr's
 *             device and inode): each line starts with its priority ("<4>"),
 *             the journal adds the time;
 *   file      log_file is set: appended, with a timestamp; reopened at each
 *             reload (for log rotation);
 *   stderr    in the foreground: with a timestamp;
 *   syslog    detached without a journal or a log file: the local syslog
 *             socket (/dev/log), facility daemon.
 * A detached daemon never writes to the terminal it was started from.
 */
#ifndef WD_LOG_H
#define WD_LOG_H

#include <stdbool.h>

enum log_level { LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG };

void log_set_level(enum log_level level);

/*
 * Chooses where lines go (see above). log_file NULL or "" means none.
 * Returns 0, or -errno when log_file cannot be opened (lines then keep going
 * where they went before).
 */
int log_open(bool foreground, const char *log_file);

/* The target's name ("journald", "file", "stderr", "syslog"), for the start-up line. */
const char *log_target_name(void);

void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
