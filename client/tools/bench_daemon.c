/*
 * bench_daemon.c - weightd-bench's side of the daemons: connections and
 * requests through libweightd, evicting and closing in every daemon, and the
 * timed load.
 */
#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_daemon.h"
#include "bench_report.h"
#include "clock.h"
#include "weightd.h"

/* ---- the daemons ------------------------------------------------------------------ */

struct daemon_conn bench_daemons[2];
int bench_ndaemons;

weightd_client *bench_connect_or_die(const char *sock) {
  weightd_client *c = NULL;
  if (weightd_connect(sock, &c) != 0) bench_die("connect", weightd_last_error(c));
  return c;
}

/* Sends one request; returns the parsed reply (cJSON_Delete it). */
cJSON *bench_request_json(weightd_client *c, const char *json, int *rc) {
  char *r = NULL;
  int e = weightd_request(c, json, &r, NULL, NULL);
  if (rc != NULL) *rc = e;
  else if (e != 0) bench_die(json, r ? r : weightd_last_error(c));
  cJSON *j = r ? cJSON_Parse(r) : NULL;
  weightd_free(r);
  return j;
}

void bench_request_or_die(weightd_client *c, const char *json) { cJSON_Delete(bench_request_json(c, json, NULL)); }

const char *bench_jstr(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsString(v) ? v->valuestring : "";
}

double bench_jnum(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

void bench_daemon_attach(struct daemon_conn *d, const char *sock) {
  d->sock = sock;
  d->c = bench_connect_or_die(sock);
  if (strcmp(weightd_backend(d->c), "cuda") != 0) bench_die(sock, "the daemon does not use the cuda backend");
  cJSON *st = bench_request_json(d->c, "{\"op\":\"status\"}", NULL);
  const cJSON *dm = cJSON_GetObjectItemCaseSensitive(st, "daemon");
  snprintf(d->strided, sizeof d->strided, "%s", bench_jstr(dm, "staged_strided"));
  snprintf(d->name, sizeof d->name, "%s", d->strided);
  snprintf(d->pin, sizeof d->pin, "%s", bench_jstr(dm, "pin"));
  snprintf(d->method, sizeof d->method, "%s", bench_jstr(dm, "load_method"));
  d->pid = (int)bench_jnum(dm, "pid");
  cJSON_Delete(st);
}

/* The checkpoint's entry in the daemon's status (a new object), or NULL when it is not open. */
cJSON *bench_ckpt_status(struct daemon_conn *d, const char *abs) {
  cJSON *st = bench_request_json(d->c, "{\"op\":\"status\"}", NULL), *found = NULL;
  const cJSON *e;
  cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(st, "checkpoints"))
    if (strcmp(bench_jstr(e, "path"), abs) == 0) found = cJSON_Duplicate(e, 1);
  cJSON_Delete(st);
  return found;
}

void bench_evict_all(int device) {
  char req[96];
  snprintf(req, sizeof req, "{\"op\":\"evict\",\"device\":%d}", device);
  for (int i = 0; i < bench_ndaemons; i++) bench_request_or_die(bench_daemons[i].c, req);
}

/*
 * Closes the checkpoint in every daemon (which unpins it); its sets are
 * evicted first. A close answered BUSY is asked again for up to a minute:
 * the pin policy's job that registers a load's ranges (pin after_load)
 * holds the checkpoint until it ends.
 */
void bench_close_all(const char *abs, int device) {
  bench_evict_all(device);
  char req[PATH_MAX + 64];
  snprintf(req, sizeof req, "{\"op\":\"close\",\"path\":\"%s\"}", abs);
  for (int i = 0; i < bench_ndaemons; i++) {
    for (int tries = 0;; tries++) {
      int rc;
      cJSON *r = bench_request_json(bench_daemons[i].c, req, &rc);
      if (rc == WEIGHTD_E_BUSY && tries < 600) {
        cJSON_Delete(r);
        usleep(100 * 1000);
        continue;
      }
      if (rc != 0 && rc != WEIGHTD_E_NOT_FOUND)
        bench_die("close (is another client using the checkpoint?)", bench_jstr(r, "error"));
      cJSON_Delete(r);
      break;
    }
  }
}

/* A request object with op, path and (when given) the plan. */
char *bench_plan_request(const char *op, const char *abs, const char *extra) {
  char *s = NULL;
  if (asprintf(&s, "{\"op\":\"%s\",\"path\":\"%s\"%s%s%s}", op, abs, bench_cfg.plan_json ? ",\"plan\":" : "",
               bench_cfg.plan_json ? bench_cfg.plan_json : "", extra ? extra : "") < 0)
    bench_die("asprintf", "out of memory");
  return s;
}

/*
 * One timed load from request to result, slab allocation included, after
 * evicting every set of the device (in every daemon) and waiting settle_ms:
 * the driver reclaims (scrubs) freed device memory in the background with the
 * copy engines, which slows copies that start right after an eviction
 * (tests/gpu/dma_study.c). The method the daemon used goes to method.
 */
double bench_timed_load_from(struct daemon_conn *d, const char *abs, const char *source, char *method, size_t mlen,
                             char *read_from, size_t rlen, int settle_ms) {
  bench_evict_all(bench_cfg.device);
  if (settle_ms > 0) usleep((useconds_t)settle_ms * 1000);
  if (source == NULL) source = bench_cfg.source;
  char *req = NULL, extra[96];
  snprintf(extra, sizeof extra, ",\"device\":%d%s%.16s%s", bench_cfg.device, source ? ",\"source\":\"" : "",
           source ? source : "", source ? "\"" : "");
  req = bench_plan_request("load", abs, extra);
  double t0 = clock_s();
  cJSON *r = bench_request_json(d->c, req, NULL);
  double dt = clock_s() - t0;
  if (method != NULL) snprintf(method, mlen, "%s", bench_jstr(r, "method"));
  if (read_from != NULL) snprintf(read_from, rlen, "%s", bench_jstr(r, "read_from"));
  cJSON_Delete(r);
  free(req);
  return dt;
}

double bench_timed_load(struct daemon_conn *d, const char *abs, char *method, size_t mlen, int settle_ms) {
  return bench_timed_load_from(d, abs, NULL, method, mlen, NULL, 0, settle_ms);
}

uint64_t bench_daemon_rss_anon(int pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/smaps_rollup", pid);
  FILE *f = fopen(path, "r");
  uint64_t kb = 0;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "Anonymous:", 10) == 0) kb = strtoull(line + 10, NULL, 10);
  if (f) fclose(f);
  return kb * 1024;
}
