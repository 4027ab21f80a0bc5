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
  int pid;
};

extern struct daemon_conn daemons[2]; /* --socket, then --alt-socket */
extern int ndaemons;

weightd_client *connect_or_die(const char *sock);
/* Sends one request; returns the parsed reply (cJSON_Delete it). */
cJSON *request_json(weightd_client *c, const char *json, int *rc);
void request_or_die(weightd_client *c, const char *json);
const char *jstr(const cJSON *o, const char *k);
double jnum(const cJSON *o, const char *k);
void daemon_attach(struct daemon_conn *d, const char *sock);
/* The checkpoint's entry in the daemon's status (a new object), or NULL when it is not open. */
cJSON *ckpt_status(struct daemon_conn *d, const char *abs);
void evict_all(int device);
/* Closes the checkpoint in every daemon (which unpins it); its sets are evicted first. */
void close_all(const char *abs, int device);
/* A request object with op, path and (when given) the plan (free it). */
char *plan_request(const char *op, const char *abs, const char *extra);
/* One timed load after evicting the device's sets and waiting settle_ms (bench_daemon.c says why). */
double timed_load(struct daemon_conn *d, const char *abs, char *method, size_t mlen, int settle_ms);
uint64_t daemon_rss_anon(int pid);

#endif
