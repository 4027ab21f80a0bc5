/* error.c - the error table's messages and names, and error detail helpers. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *weightd_strerror(int code) {
  switch (code) {
  case 0: return "success";
#define XX(name, num, msg) case -(num): return msg;
    WEIGHTD_ERRNO_MAP(XX)
#undef XX
  default: return "unknown error";
  }
}

const char *weightd_err_name(int code) {
  switch (code) {
  case 0: return "OK";
#define XX(name, num, msg) case -(num): return #name;
    WEIGHTD_ERRNO_MAP(XX)
#undef XX
  default: return "UNKNOWN";
  }
}

int err_from_name(const char *name) {
  if (name == NULL) return WEIGHTD_E_INTERNAL;
  if (strcmp(name, "OK") == 0) return 0;
#define XX(ename, num, msg) if (strcmp(name, #ename) == 0) return -(num);
  WEIGHTD_ERRNO_MAP(XX)
#undef XX
  return WEIGHTD_E_INTERNAL;
}

unsigned weightd_version(void) { return WEIGHTD_VERSION_HEX; }

const char *weightd_version_string(void) { return WEIGHTD_VERSION_STRING; }

int err_set(struct wd_error *err, int code, const char *fmt, ...) {
  if (err == NULL) return code;
  err->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err->msg, sizeof err->msg, fmt, ap);
  va_end(ap);
  return code;
}

int err_prefix(struct wd_error *err, const char *fmt, ...) {
  if (err == NULL) return WEIGHTD_E_INTERNAL;
  char prefix[WD_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  size_t pl = strlen(prefix), ml = strlen(err->msg);
  if (pl + 2 >= sizeof err->msg) pl = sizeof err->msg - 3;
  if (pl + 2 + ml >= sizeof err->msg) ml = sizeof err->msg - 3 - pl;
  memmove(err->msg + pl + 2, err->msg, ml);
  memcpy(err->msg, prefix, pl);
  memcpy(err->msg + pl, ": ", 2);
  err->msg[pl + 2 + ml] = '\0';
  return err->code;
}

void err_clear(struct wd_error *err) {
  if (err == NULL) return;
  err->code = 0;
  err->msg[0] = '\0';
}

const char *err_quote(const char *s, size_t n, char *buf, size_t buflen) {
  if (buflen < 8) {
    if (buflen > 0) buf[0] = '\0';
    return buf;
  }
  size_t o = 0;
  for (size_t i = 0; i < n && o + 5 < buflen; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c < 0x20 || c == 0x7f) o += (size_t)snprintf(buf + o, buflen - o, "\\x%02x", c);
    else buf[o++] = (char)c;
    if (i + 1 < n && o + 5 >= buflen) {
      if (o + 4 <= buflen) memcpy(buf + o - 3, "...", 3);
      break;
    }
  }
  buf[o < buflen ? o : buflen - 1] = '\0';
  return buf;
}
