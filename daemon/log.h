/*
 * log.h - the daemon's log: one line per event on stderr (journald adds the
 * time when weightd runs under systemd; a timestamp is added otherwise).
 * Safe to call from any thread.
 */
#ifndef WD_LOG_H
#define WD_LOG_H

enum log_level { LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG };

void log_set_level(enum log_level level);
void log_set_timestamps(int on);
void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
