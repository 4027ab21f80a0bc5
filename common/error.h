/*
 * error.h - internal error detail.
 *
 * A failing function returns a negative WEIGHTD_E_* code and, when the caller
 * passed a struct wd_error, fills it with a message that names the file, the
 * tensor and the rule that was broken.
 */
#ifndef WD_ERROR_H
#define WD_ERROR_H

#include "weightd.h"

#define WD_ERROR_MSG_MAX 1024

struct wd_error {
  int code;
  char msg[WD_ERROR_MSG_MAX];
};

/* Fills err (when not NULL) with code and a formatted message; returns code. */
int err_set(struct wd_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prepends "prefix: " to err's message (when err is not NULL); returns err->code. */
int err_prefix(struct wd_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/*
 * Writes s[0..n) into buf for a message: control bytes as \xNN, cut with "..."
 * when it does not fit. Names from files and requests go through it, so a
 * message stays one printable line. Returns buf.
 */
const char *err_quote(const char *s, size_t n, char *buf, size_t buflen);

/* Clears err to "no error". */
void err_clear(struct wd_error *err);

/* Maps a wire error name back to its code; 0 for "OK", WEIGHTD_E_INTERNAL when unknown. */
int err_from_name(const char *name);

#endif
