/* bench_daemon.h - weightd-bench's connections to the daemons (bench_daemon.c). */
#ifndef WD_BENCH_DAEMON_H
#define WD_BENCH_DAEMON_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "weightd.h"

struct daemon_conn {
  weightd_client *c;
  const char *sock;
  char strided[16], pin[16], method[16]; /* its settings, from status */
  char name[24];                          /* what results call it: --names, else its staged_strided */
  int pid;
};

extern struct daemon_conn bench_daemons[2]; /* --socket, then --alt-socket */
extern int bench_ndaemons;

weightd_client *bench_connect_or_die(const char *sock);
/* Sends one request; returns the parsed reply (cJSON_Delete it). */
cJSON *bench_request_json(weightd_client *c, const char *json, int *rc);
void bench_request_or_die(weightd_client *c, const char *json);
const char *bench_jstr(const cJSON *o, const char *k);
double bench_jnum(const cJSON *o, const char *k);
void bench_daemon_attach(struct daemon_conn *d, const char *sock);
/* The checkpoint's entry in the daemon's status (a new object), or NULL when it is not open. */
cJSON *bench_ckpt_status(struct daemon_conn *d, const char *abs);
void bench_evict_all(int device);
/* Closes the checkpoint in every daemon (which unpins it); its sets are evicted first. */
void bench_close_all(const char *abs, int device);
/* A request object with op, path and (when given) the plan (free it). */
char *bench_plan_request(const char *op, const char *abs, const char *extra);
/*
 * One timed load after evicting the device's sets and waiting settle_ms
 * (bench_daemon.c says why), with the load's source option `source` (NULL:
 * --source, else none). The method goes to method, what read the bytes to
 * read_from (either may be NULL).
 */
double bench_timed_load_from(struct daemon_conn *d, const char *abs, const char *source, char *method, size_t mlen,
                             char *read_from, size_t rlen, int settle_ms);
double bench_timed_load(struct daemon_conn *d, const char *abs, char *method, size_t mlen, int settle_ms);
uint64_t bench_daemon_rss_anon(int pid);

#endif
