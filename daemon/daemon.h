/*
 * daemon.h - the daemon's shared state and the interfaces between its files.
 *
 * DESIGN: one libuv loop thread owns everything here: connections, the
 * checkpoint registry, resident sets and leases. File and device work runs on
 * job threads (jobs.h) and fill threads (fillpool.h); a job reads only what
 * its owner handed it (an open checkpoint is immutable; a loading set's slab
 * belongs to its load job until the job is done) and reports back through
 * its done() callback on the loop thread. Objects a job uses are reference
 * counted so that a client that vanishes mid-request frees nothing under it.
 */
#ifndef WD_DAEMON_H
#define WD_DAEMON_H

#include <cjson/cJSON.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "backend.h"
#include "checkpoint.h"
#include "clock.h"
#include "config.h"
#include "error.h"
#include "fillpool.h"
#include "jobs.h"
#include "plan.h"
#include "wire.h"

struct conn;
struct request;

/* ---- checkpoints (registry.c) --------------------------------------------- */

enum reg_state { REG_OPENING, REG_OPEN, REG_FAILED };

struct reg_ckpt {
  char *path; /* resolved; the registry key */
  uint64_t generation;
  enum reg_state state;
  struct ckpt *ck;    /* immutable once open */
  void **maps;        /* per shard: the read-only MAP_SHARED mapping (NULL for an empty file) */
  int refs;           /* the registry's own, sets, jobs and waiters */
  bool detached;      /* no longer in the registry (closed or replaced) */
  bool prefetching;
  atomic_bool pinned; /* in the pinned-resident tier (read by load jobs) */
  bool unpinning;     /* a job is unregistering it: no new pin until it is done */
  uint64_t pinned_bytes; /* bytes registered, counted against host_pin_budget */
  uint64_t last_used_ms;
  struct reg_waiter *waiters; /* requests waiting for REG_OPENING */
  struct reg_ckpt *next;
};

/* Called on the loop when a checkpoint is ready (ck != NULL) or failed (err set). */
typedef void (*reg_ready_fn)(struct request *req, struct reg_ckpt *ck, const struct wd_error *err);

struct reg_waiter {
  struct request *req;
  reg_ready_fn cb;
  struct reg_waiter *next;
};

/*
 * Resolves path, checks it against the model roots, and calls cb with the
 * open checkpoint (opening it, or reopening a replaced one, on a job thread).
 * cb receives a reference it must drop with reg_unref.
 */
void reg_acquire(struct request *req, const char *path, reg_ready_fn cb);
void reg_ref(struct reg_ckpt *ck);
void reg_unref(struct reg_ckpt *ck);
/* Finds an open checkpoint by resolved path (no I/O), or NULL. */
struct reg_ckpt *reg_find(const char *resolved);
/* Removes a checkpoint that nothing uses: 0, or WEIGHTD_E_BUSY / NOT_FOUND. */
int reg_close(const char *resolved, struct wd_error *err);
/* Shard bytes in the page cache (mincore); runs on a job thread. */
uint64_t reg_resident_bytes(const struct reg_ckpt *ck);
/*
 * Starts a background read of every shard, and with pin its registration for
 * direct DMA within host_pin_budget; replies to wait_req when done (if set).
 * Returns 0, or an error (pin over budget) without starting anything.
 */
int reg_prefetch(struct reg_ckpt *ck, bool pin, struct request *wait_req, struct wd_error *err);
void reg_shutdown(void);

/* ---- resident sets and leases (residency.c) ------------------------------ */

enum set_state { SET_LOADING, SET_READY, SET_FAILED };

struct set_waiter {
  struct request *req;
  bool joined; /* it found the set already loading (its reply says shared) */
  struct set_waiter *next;
};

struct res_set {
  char id[24];
  char *key; /* checkpoint path + generation + device + plan key */
  struct reg_ckpt *ck;
  int device;
  struct plan *plan;
  struct wd_slab *slab;
  enum set_state state;
  int leases;
  uint64_t last_used_ms;
  atomic_uint_fast64_t bytes_done; /* written by the load job */
  atomic_bool cancel;
  double seconds;       /* the whole load job */
  double alloc_seconds; /* of which: allocating the slab */
  const char *method;
  struct set_waiter *waiters; /* load/attach requests waiting for SET_LOADING */
  char *table_json;           /* the attach reply's tensor table, built once */
  uv_timer_t progress_timer;
  bool timer_active;
  struct res_set *next;
};

struct lease {
  char id[24];
  struct res_set *set;
  struct conn *owner;
  struct lease *next;
};

/* ---- connections and requests (server.c) ---------------------------------- */

struct conn {
  int fd;
  uv_poll_t poll;
  uv_timer_t frame_timer;
  struct wire_reader reader;
  struct wire_writer writer;
  pid_t pid;
  uid_t uid;
  gid_t gid;
  bool hello_done;
  bool closing;
  bool dead;   /* closing soon from the loop (conn_kill); nothing more is sent */
  bool closed;
  int refs; /* the server's, plus one per outstanding request */
  int handles_open;
  struct request *requests; /* outstanding asynchronous requests */
  unsigned inflight;        /* requests started and not yet finished */
  struct request *queued;   /* read but not started (CONN_MAX_INFLIGHT reached), in order */
  struct request **queued_tail;
  unsigned nqueued;
  bool paused;              /* CONN_MAX_QUEUED reached: frames wait unread in the socket */
  uv_timer_t resume_timer;  /* starts queued requests once others finish */
  struct conn *next;
};

/*
 * Requests one connection may have in progress; further frames wait in the
 * socket until one finishes, so a client that pipelines thousands of
 * requests cannot queue work ahead of everyone else.
 */
#define CONN_MAX_INFLIGHT 16
/* Requests read and held back behind those; past this the socket is not read. `cancel` skips the line. */
#define CONN_MAX_QUEUED 64

struct request {
  struct conn *conn;
  cJSON *root;  /* the request object */
  cJSON *id;    /* a detached copy of "id", or NULL */
  int op;       /* enum msg_op */
  bool done;    /* the final reply was sent */
  bool canceled;
  bool started; /* dispatched (counted in conn->inflight), not just queued */
  struct res_set *waiting_on; /* a set this request waits for, if any */
  void *op_state;             /* op-specific */
  struct request *next_in_conn;
};

/* Replies: each consumes `reply` (a cJSON object with "id" already set by msg). */
void conn_send(struct conn *c, cJSON *reply, const int *fds, size_t nfds);
void req_reply(struct request *r, cJSON *reply, const int *fds, size_t nfds);
void req_fail(struct request *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void req_fail_err(struct request *r, const struct wd_error *err);
void req_progress(struct request *r, uint64_t done, uint64_t total);
/* Takes a queued request with this id out of its connection's queue (for cancel); NULL if none. */
struct request *conn_unqueue(struct conn *c, const cJSON *id);
/* Frees a request after its final reply. */
void req_finish(struct request *r);

/* ---- the daemon ------------------------------------------------------------- */

struct device_state {
  struct wd_device_info info;
  uint64_t used; /* bytes of resident sets */
};

struct daemon {
  uv_loop_t *loop;
  struct wd_config cfg;
  struct wd_backend backend;
  const char *backend_name;
  int ndevices;
  struct device_state *devices;
  char **roots; /* resolved model roots */
  size_t nroots;
  struct jobs *control_pool; /* control_threads: resolving, checking and opening checkpoints, plans, status */
  struct jobs *job_pool;     /* job_threads: loads, prefetches, freeing slabs */
  struct fillpool *fill;
  char *socket_path;
  int listen_fd;
  uv_poll_t listen_poll;
  uv_signal_t sigterm, sigint;
  struct conn *conns;
  size_t nconns;
  struct reg_ckpt *ckpts;
  struct res_set *sets;
  struct lease *leases;
  uint64_t pinned_bytes; /* the pinned-resident tier's total */
  uint64_t pin_budget;   /* its limit (config, or half of physical memory) */
  uint64_t next_id;
  uint64_t started_ms;
  bool stopping;
  atomic_bool stop_requested; /* stopping, for job threads to read */
  int exit_code;
};

extern struct daemon *wd;


/* Residency operations (residency.c). */
/* Finds or starts the set for (ck, device, plan); takes the references to ck and plan. */
void res_load(struct request *req, struct reg_ckpt *ck, int device, struct plan *plan);
/* Makes req wait for a loading set, as an identical load would. */
void res_wait_set(struct request *req, struct res_set *s);
struct res_set *res_find_set(const char *id);
void res_attach_ready(struct request *req, struct res_set *s);
int res_release(struct conn *c, const char *lease_id, bool privileged, struct wd_error *err);
void res_release_conn(struct conn *c);
/*
 * Slabs taken from evicted sets by someone who frees them off the loop: a load
 * that needs the room, or an evict request that answers once the memory is back.
 */
struct slab_list {
  struct wd_slab **v;
  size_t n, cap;
};
void slab_list_push(struct slab_list *l, struct wd_slab *slab);
/* Frees every slab in the list (a job thread) and empties it. */
void slab_list_free_now(struct slab_list *l);
/* Evicts s; its slab goes to keep (NULL: freed on a job). */
int res_evict_set(struct res_set *s, struct slab_list *keep, struct wd_error *err);
/* Evicts every unleased ready set of device; ids to evicted (may be NULL), slabs to keep (may be NULL). */
size_t res_evict_device(int device, cJSON *evicted, struct slab_list *keep);
void res_request_gone(struct request *req);
int res_cancel_request(struct request *target);
void res_cancel_all(void);
void res_shutdown(void);
cJSON *res_set_json(const struct res_set *s);

/* The device named by a request field: an index (number or text) or a UUID. */
int dev_resolve(const cJSON *v, int *device, struct wd_error *err);

/* The loader (loader.c): staging resources per GPU, and the load job's work. */
int ld_init(struct wd_error *err);
void ld_shutdown(void);
/* Allocates s->slab and fills it from the checkpoint per s->plan (a job thread). */
int ld_fill(struct res_set *s, struct wd_error *err);

/* The op handlers (ops.c). */
void ops_dispatch(struct request *req);
/* A checkpoint as replies describe it; resident is its page-cache bytes. */
cJSON *ops_checkpoint_json(const struct reg_ckpt *ck, uint64_t resident);

/* The server (server.c). */
int server_start(struct wd_error *err);
void server_stop(void);
void server_close_all(void);
bool conn_privileged(const struct conn *c);

/* Starts an orderly stop (main.c): cancel loads, tell clients, exit when jobs are done. */
void daemon_request_stop(void);

#endif
