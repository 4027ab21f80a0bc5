/*
 * daemon.h - the daemon's context: what main.c builds at start-up and hands
 * to the server and the op handlers.
 *
 * DESIGN: one libuv loop thread owns everything reachable from here. The
 * state modules (registry.h, residency.h, loader.h) are explicit contexts of
 * their own; their jobs run on the pools (jobs.h, load/pool.h) and read only
 * what their job structs hold, never this struct. Layers call downward only:
 *
 *   main.c, service/   start-up, signals, orderly stop, restarts, metrics
 *   transport/         the socket, connections, frames, descriptors
 *   ops/               protocol: the only code that builds replies and events
 *   state/             checkpoints and resident sets (typed continuations)
 *   load/              moving bytes from sources into slabs
 *   base/ backend/     threads, faults, log, config, devices; common/, proto/
 *
 * Nothing here is read by a worker thread.
 */
#ifndef WD_DAEMON_H
#define WD_DAEMON_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "backend/backend.h"
#include "base/config.h"
#include "load/pool.h"
#include "base/jobs.h"
#include "load/loader.h"
#include "state/registry.h"
#include "state/residency.h"

struct server;

/* Room for every error number of the table (WEIGHTD_ERRNO_MAP), indexed by -code. */
#define DAEMON_ERROR_SLOTS 64

/* The limit for which a connection was closed, its replies unread (daemon_stats.reply_disconnects). */
enum daemon_reply_limit {
  REPLY_LIMIT_CONNECTION, /* a LIMIT answer past twice max_queued_output */
  REPLY_LIMIT_UID,        /* a LIMIT answer past twice its uid's share (max_uid_queued_output) */
  REPLY_LIMIT_TOTAL,      /* room in max_total_queued_output, for a reply of another connection or its own */
  REPLY_LIMIT_COUNT
};

/* Counters the server and the op handlers keep, for status and metrics. */
struct daemon_stats {
  uint64_t requests;          /* started */
  uint64_t requests_inflight; /* started and not finished */
  uint64_t errors[DAEMON_ERROR_SLOTS]; /* error replies sent, by -code */
  uint64_t connections; /* open now */
  uint64_t fds_queued;  /* descriptors waiting in replies not yet sent */
  uint64_t output_queued;  /* reply bytes waiting unsent, all connections */
  uint64_t events_dropped; /* progress events not sent to backlogged connections */
  uint64_t reply_disconnects[REPLY_LIMIT_COUNT]; /* connections closed for their unread replies */
  uint64_t request_mem; /* request memory charged (see server_read.c) */
  uint64_t fd_limit;    /* RLIMIT_NOFILE's soft limit, raised to the hard one at start */
  bool listening;       /* the server accepts connections */
};

struct telemetry;
struct http;
struct topology;

struct daemon {
  uv_loop_t *loop;
  struct wd_config cfg;
  struct wd_backend backend;
  const char *backend_name;
  int ndevices;
  struct jobs *control_pool; /* control_threads: resolving, checking and opening checkpoints, plans, status */
  struct jobs *job_pool;     /* job_threads: loads, prefetches, freeing slabs */
  struct jobs *remote_pool;  /* with remote roots: opening and checking remote checkpoints (network waits) */
  struct ld_pool *fill;
  struct registry *reg;
  struct rroots *remote; /* the remote roots (NULL: none configured); freed after the registry */
  struct residency *res;
  struct scrubber *scrub; /* scrubs of resident sets, asked for and in the background (state/scrub.h) */
  struct loader *ld;
  struct topology *topo; /* the devices as a group: NUMA nodes, peers, link rates (immutable) */
  struct server *srv;
  struct telemetry *tel; /* metrics' cached measurements and readiness */
  struct http *http;     /* the metrics and probe endpoints, when configured */
  struct survive *surv;  /* restart survival: the fd store and re-adoption (survive.h) */
  char *socket_path;
  struct daemon_stats stats;
  uint64_t started_ms;
  bool stopping;
  int exit_code;
  /* Starts an orderly stop (main.c): cancel loads, tell clients, exit when jobs are done. */
  void (*request_stop)(struct daemon *d);
};

/*
 * The descriptors that connections and the descriptors queued in their
 * replies may hold together: RLIMIT_NOFILE less what the daemon keeps for its
 * own work (shards of open checkpoints, resident sets' slabs, the loop, the
 * log), a quarter of the limit, at least 64 or half of it. The server admits
 * a connection, and an attach queues a descriptor, only within it.
 */
static inline uint64_t daemon_fd_budget(const struct daemon *d) {
  uint64_t n = d->stats.fd_limit;
  if (n == 0 || n == UINT64_MAX) return UINT64_MAX;
  uint64_t keep = n / 4 > 64 ? n / 4 : (64 < n / 2 ? 64 : n / 2);
  return n - keep;
}

/* Counts an error reply (any code of the table). */
static inline void daemon_count_error(struct daemon *d, int code) {
  unsigned i = (unsigned)-code;
  if (code < 0 && i < DAEMON_ERROR_SLOTS) d->stats.errors[i]++;
}

#endif
