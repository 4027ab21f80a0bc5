/* ctl_client.c - what weightctl's daemon commands share: connecting, requests, output. */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctl.h"

int ctl_connect(weightd_client **out) {
  weightd_client *c = NULL;
  int rc = weightd_connect(ctl_opts.socket, &c);
  if (rc != 0) {
    ctl_errorf("%s (%s)", c ? weightd_last_error(c) : weightd_strerror(rc), weightd_err_name(rc));
    weightd_close(c);
    *out = NULL;
    return CTL_EXIT_FAIL;
  }
  if (ctl_opts.timeout_ms > 0) weightd_set_timeout(c, ctl_opts.timeout_ms);
  *out = c;
  return 0;
}

int ctl_fail(weightd_client *c, int rc, const char *what) {
  const char *msg = c ? weightd_last_error(c) : "";
  ctl_errorf("%s: %s (%s)", what, msg[0] ? msg : weightd_strerror(rc), weightd_err_name(rc));
  return CTL_EXIT_FAIL;
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
  char buf[2 * PATH_MAX + 2], cwd[PATH_MAX];
  const char *p = path;
  if (path[0] != '/' && getcwd(cwd, sizeof cwd) != NULL) {
    int n = snprintf(buf, sizeof buf, "%s/%s", strcmp(cwd, "/") == 0 ? "" : cwd, path);
    if (n > 0 && (size_t)n < sizeof buf) p = buf;
  }
  cJSON_AddStringToObject(req, "path", p);
}

void ctl_add_device(cJSON *req, const char *device) {
  if (device != NULL) cJSON_AddStringToObject(req, "device", device);
}

int ctl_request(weightd_client *c, cJSON *req, weightd_progress_fn progress, void *arg, cJSON **reply) {
  *reply = NULL;
  char *text = cJSON_PrintUnformatted(req);
  const char *op = ctl_str(req, "op");
  char what[64];
  snprintf(what, sizeof what, "%s", op);
  cJSON_Delete(req);
  if (text == NULL) {
    ctl_errorf("out of memory");
    return WEIGHTD_E_NOMEM;
  }
  char *out = NULL;
  int rc = weightd_request(c, text, &out, progress, arg);
  free(text);
  if (out != NULL) {
    if (ctl_opts.json) {
      puts(out);
      fflush(stdout);
    }
    *reply = cJSON_Parse(out);
    weightd_free(out);
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

uint64_t ctl_u64(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(v) && v->valuedouble > 0 && v->valuedouble < 18446744073709551615.0 ? (uint64_t)v->valuedouble : 0;
}

const char *ctl_str(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsString(v) ? v->valuestring : "?";
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

/* ---- progress ------------------------------------------------------------------------ */

static int bar_shown;

void ctl_progress(uint64_t done, uint64_t total, void *arg) {
  (void)arg;
  if (!isatty(STDERR_FILENO) || total == 0) return;
  enum { WIDTH = 40 };
  if (done > total) done = total;
  int fill = (int)((double)done / (double)total * WIDTH);
  char bar[WIDTH + 1], d[32], t[32];
  memset(bar, '#', (size_t)fill);
  memset(bar + fill, '.', (size_t)(WIDTH - fill));
  bar[WIDTH] = '\0';
  ctl_human_bytes(done, d, sizeof d);
  ctl_human_bytes(total, t, sizeof t);
  fprintf(stderr, "\r[%s] %3d%%  %s of %s ", bar, (int)((double)done / (double)total * 100), d, t);
  fflush(stderr);
  bar_shown = 1;
}

void ctl_progress_done(void) {
  if (!bar_shown) return;
  fprintf(stderr, "\r%*s\r", 80, "");
  fflush(stderr);
  bar_shown = 0;
}
