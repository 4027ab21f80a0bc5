/* ctl_client.c - what weightctl's daemon commands share: connecting, requests, errors, output. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctl.h"
#include "wire.h"

int ctl_connect(weightd_client **out) {
  weightd_client *c = NULL;
  char name[64];
  snprintf(name, sizeof name, "weightctl %s", ctl_opts.cmd ? ctl_opts.cmd : "");
  struct weightd_connect_options o = {.struct_size = sizeof o, .socket_path = ctl_opts.socket, .client_name = name};
  /* The watch starts first, so that --timeout covers connecting too. */
  ctl_guard_start();
  ctl_guard_call_begin();
  int rc = weightd_connect_opts(&o, &c);
  ctl_guard_call_end();
  if (rc != 0) {
    const char *msg = c ? weightd_last_error(c) : weightd_strerror(rc);
    int code = ctl_exit_for(rc);
    if (code == CTL_EXIT_TIMEOUT && ctl_guard_reason() == CTL_GUARD_TIMEOUT)
      ctl_errorx("TIMEOUT", "the daemon did not answer within %g s", ctl_opts.timeout_s);
    else
      ctl_errorx(weightd_err_name(rc), "%s", msg);
    ctl_guard_stop();
    weightd_close(c);
    *out = NULL;
    return code;
  }
  ctl_guard_socket(weightd_socket_path(c));
  *out = c;
  return 0;
}

void ctl_disconnect(weightd_client *c) {
  ctl_guard_stop();
  weightd_close(c);
}

int ctl_exit_for(int rc) {
  if (rc == 0) return CTL_EXIT_OK;
  if (rc == WEIGHTD_E_CONNECT) return CTL_EXIT_UNREACHABLE;
  if (rc == WEIGHTD_E_TIMEOUT) return CTL_EXIT_TIMEOUT;
  if (rc == WEIGHTD_E_CANCELED && ctl_guard_reason() == CTL_GUARD_TIMEOUT) return CTL_EXIT_TIMEOUT;
  return CTL_EXIT_FAIL;
}

/* True when msg already starts with "what: " (libweightd names the operation in its own messages). */
static bool names_op(const char *msg, const char *what) {
  size_t n = strlen(what);
  return strncmp(msg, what, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ';
}

int ctl_fail(weightd_client *c, int rc, const char *what) {
  enum ctl_guard_reason why = ctl_guard_reason();
  if (rc == WEIGHTD_E_CANCELED && why == CTL_GUARD_TIMEOUT) {
    ctl_errorx("TIMEOUT", "%s: did not finish within %g s (--timeout); canceled", what, ctl_opts.timeout_s);
  } else if (rc == WEIGHTD_E_CANCELED && why == CTL_GUARD_INTERRUPTED) {
    ctl_errorx("CANCELED", "%s: interrupted; canceled", what);
  } else {
    const char *msg = c ? weightd_last_error(c) : "";
    if (msg[0] == '\0') msg = weightd_strerror(rc);
    /* "load: the daemon is shutting down", not "load: load: ...". */
    if (names_op(msg, what)) ctl_errorx(weightd_err_name(rc), "%s", msg);
    else ctl_errorx(weightd_err_name(rc), "%s: %s", what, msg);
  }
  return ctl_exit_for(rc);
}

cJSON *ctl_request_new(const char *op) {
  cJSON *o = cJSON_CreateObject();
  if (o == NULL || cJSON_AddStringToObject(o, "op", op) == NULL) {
    ctl_errorf("out of memory");
    exit(CTL_EXIT_FAIL);
  }
  return o;
}

void ctl_add_path(cJSON *req, const char *path) {
  char buf[PATH_MAX], cwd[PATH_MAX];
  const char *p = path;
  if (path[0] != '/' && !wire_path_is_url(path)) {
    /* A relative path sent as it is would be resolved in the daemon's directory: refuse it. */
    if (getcwd(cwd, sizeof cwd) == NULL) {
      ctl_errorx(weightd_err_name(WEIGHTD_E_IO), "%s: cannot make the path absolute: %s", path, strerror(errno));
      exit(CTL_EXIT_FAIL);
    }
    int n = snprintf(buf, sizeof buf, "%s/%s", strcmp(cwd, "/") == 0 ? "" : cwd, path);
    if (n < 0 || (size_t)n >= sizeof buf) {
      ctl_errorx(weightd_err_name(WEIGHTD_E_INVALID), "%.200s%s: path too long to make absolute (over %d bytes)",
                 path, strlen(path) > 200 ? "..." : "", PATH_MAX - 1);
      exit(CTL_EXIT_FAIL);
    }
    p = buf;
  }
  if (cJSON_AddStringToObject(req, "path", p) == NULL) {
    ctl_errorf("out of memory");
    exit(CTL_EXIT_FAIL);
  }
}

void ctl_add_device(cJSON *req, const char *device) {
  if (device != NULL) cJSON_AddStringToObject(req, "device", device);
}

int ctl_request(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *arg, cJSON **reply) {
  *reply = NULL;
  char *text = cJSON_PrintUnformatted(req);
  char what[64];
  snprintf(what, sizeof what, "%s", ctl_str(req, "op"));
  cJSON_Delete(req);
  if (text == NULL) {
    ctl_errorf("out of memory");
    return WEIGHTD_E_NOMEM;
  }
  /* An interrupt or the deadline stops a command of several steps between
   * them too: a step that finished although canceled is not followed by the next. */
  if (ctl_guard_reason() != CTL_GUARD_NONE) {
    free(text);
    ctl_fail(c, WEIGHTD_E_CANCELED, what);
    return WEIGHTD_E_CANCELED;
  }
  char *out = NULL;
  ctl_guard_call_begin();
  int rc = weightd_request(c, text, &out, progress, arg);
  ctl_guard_call_end();
  free(text);
  if (rc == 0 && out != NULL) *reply = cJSON_Parse(out);
  weightd_free(out);
  if (rc == 0 && *reply == NULL) {
    ctl_errorf("%s: the daemon's reply is not JSON", what);
    return WEIGHTD_E_PROTOCOL;
  }
  if (rc != 0) ctl_fail(c, rc, what);
  return rc;
}

void ctl_human_bytes(uint64_t b, char *buf, size_t len) {
  if (b >= (1ull << 30)) snprintf(buf, len, "%.2f GiB", (double)b / (1ull << 30));
  else if (b >= (1ull << 20)) snprintf(buf, len, "%.1f MiB", (double)b / (1ull << 20));
  else if (b >= 1024) snprintf(buf, len, "%.1f KiB", (double)b / 1024);
  else snprintf(buf, len, "%" PRIu64 " B", b);
}

void ctl_print_checkpoint(const char *verb, const cJSON *ck) {
  char total[32], resident[32], pinned[48] = "";
  uint64_t bytes = ctl_u64(ck, "bytes"), res = ctl_u64(ck, "resident_bytes"), pb = ctl_u64(ck, "pinned_bytes");
  ctl_human_bytes(bytes, total, sizeof total);
  ctl_human_bytes(res, resident, sizeof resident);
  if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(ck, "pinned"))) {
    snprintf(pinned, sizeof pinned, ", pinned");
  } else if (pb > 0) {
    char h[32];
    ctl_human_bytes(pb, h, sizeof h);
    snprintf(pinned, sizeof pinned, ", %s pinned", h);
  }
  uint64_t shards = ctl_u64(ck, "shards");
  printf("%s %s\n  %s layout, %" PRIu64 " shard%s, %" PRIu64 " tensors, %s; %s in the page cache%s\n", verb,
         ctl_str(ck, "path"), ctl_str(ck, "layout"), shards, shards == 1 ? "" : "s", ctl_u64(ck, "tensors"),
         total, resident, pinned);
}
