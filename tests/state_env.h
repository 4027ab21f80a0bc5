/*
 * state_env.h - the daemon's state modules on a real libuv loop, with no
 * socket and no server, for unit tests: two job pools, a fill pool, the host
 * backend, a registry and (when asked) a loader and residency, built the way
 * daemon/main.c's build_state() builds them.
 *
 * env_run_until drives the loop one iteration at a time until a condition
 * holds, with a deadline so that a continuation that never fires fails the
 * test instead of hanging it (a repeating timer wakes the loop to check it).
 * env_stop shuts down in the daemon's order and checks that every handle
 * closed. A gate is a job that holds a pool's thread until it is opened, so
 * that a test decides what a load job sees when it finally runs.
 *
 * Several devices (env_opts.host_devices > 1): the host backend presents
 * them with the peers host_peers names, and the env builds the topology and
 * hands it to the loader (replicas, striping) as startup.c does.
 *
 * Include testutil.h first.
 */
#ifndef WD_STATE_ENV_H
#define WD_STATE_ENV_H

#include <pthread.h>
#include <stdbool.h>
#include <uv.h>

#include "backend/backend.h"
#include "clock.h"
#include "base/fault.h"
#include "load/pool.h"
#include "base/jobs.h"
#include "load/loader.h"
#include "base/config.h"
#include "base/log.h"
#include "state/registry.h"
#include "state/residency.h"
#include "base/topology.h"

/* A hang guard, not a measurement: far beyond anything these tests wait for. */
#define ENV_DEADLINE_MS 60000u

#define ENV_MAX_DEVICES 8

struct env {
  uv_loop_t loop;
  uv_timer_t tick; /* wakes UV_RUN_ONCE while env_run_until waits */
  struct jobs *control, *bulk;
  struct ld_pool *fill;
  struct wd_backend backend;
  struct registry *reg;
  struct loader *ld;
  struct residency *res;
  struct wd_device_info device; /* the host backend's first device */
  /* Several devices. */
  int ndevices;
  struct wd_device_info devices[ENV_MAX_DEVICES];
  struct topology *topo;
};

struct env_opts {
  unsigned bulk_threads; /* 1: a gate holds back every load */
  bool residency;        /* also a loader and residency */
  uint64_t device_budget;
  /* Optional (zero: the daemon's defaults on the host backend). */
  const struct wd_backend_ops *ops; /* a test backend instead of the host backend (on its one-device context) */
  enum cfg_load_method method;
  enum plan_strided strided;
  size_t staging_slots;      /* 0: 4, the daemon's default */
  size_t staging_slot_bytes; /* 0: 16 MiB, the daemon's default */
  enum ld_writes writes;     /* how the fill writes the slots */
  enum reg_pin_mode pin_mode;
  uint64_t pin_budget;
  /* Several devices (0 or 1: one, and nothing below applies). */
  int host_devices;
  const char *host_peers;   /* NULL: all */
  bool replicas, striping;
  const char *link_rates;   /* NULL: unmeasured */
  uint64_t stripe_min_bytes;
  size_t window_bytes;      /* striping: a window, the staging slot size unless that is given; 0: 64 KiB */
  bool refuse_odirect;      /* test_refuse_odirect */
  uint64_t auto_direct_bytes; /* source auto's threshold (0: half of host memory) */
  const char *load_gate;    /* test_load_gate: a FIFO */
};

static inline void env_tick(uv_timer_t *t) { (void)t; }

/* Builds everything; 0, or -1 after saying why on stderr. */
static inline int env_start(struct env *e, const struct env_opts *o) {
  struct wd_error err = {0};
  memset(e, 0, sizeof *e);
  if (uv_loop_init(&e->loop) != 0) return -1;
  uv_timer_init(&e->loop, &e->tick);
  int rc = jobs_start(&e->loop, 2, &e->control, &err);
  if (rc == 0) rc = jobs_start(&e->loop, o->bulk_threads ? o->bulk_threads : 2, &e->bulk, &err);
  if (rc == 0 && ld_pool_start(2, &e->fill) != 0) rc = err_set(&err, WEIGHTD_E_NOMEM, "fill_start");
  /* A test backend wraps the host backend's operations: it runs on the host backend's one-device context. */
  struct wd_host_options ho = {.devices = o->host_devices > 1 && o->ops == NULL ? o->host_devices : 1,
                               .peers = o->host_peers};
  if (rc == 0) rc = backend_host_create_devices(&e->backend, &ho, &err);
  if (rc == 0 && o->ops != NULL) e->backend.ops = o->ops;
  e->ndevices = ho.devices < ENV_MAX_DEVICES ? ho.devices : ENV_MAX_DEVICES;
  for (int i = 0; rc == 0 && i < e->ndevices; i++)
    rc = e->backend.ops->device_info(e->backend.ctx, i, &e->devices[i], &err);
  if (rc == 0 && e->ndevices > 1) rc = topo_create(&e->backend, e->ndevices, NULL, o->link_rates, &e->topo, &err);
  if (rc == 0) {
    struct reg_params gp = {.backend = &e->backend,
                            .control = e->control,
                            .bulk = e->bulk,
                            .fill = e->fill,
                            .pin_budget = o->pin_budget,
                            .pin_mode = o->pin_mode};
    rc = reg_create(&gp, &e->reg, &err);
  }
  if (rc == 0) rc = e->backend.ops->device_info(e->backend.ctx, 0, &e->device, &err);
  if (rc == 0 && o->residency) {
    size_t slot = o->staging_slot_bytes   ? o->staging_slot_bytes
                  : o->striping            ? (o->window_bytes ? o->window_bytes : (64u << 10))
                                           : 16u << 20;
    struct ld_params lp = {.backend = &e->backend,
                           .pool = e->fill,
                           .ndevices = e->ndevices,
                           .staged_only = o->method == CFG_LOAD_STAGED,
                           .strided = o->strided,
                           .staging_slots = o->staging_slots ? o->staging_slots : 4,
                           .staging_slot_bytes = slot,
                           .writes = o->writes,
                           .test_refuse_odirect = o->refuse_odirect,
                           .auto_direct_bytes = o->auto_direct_bytes,
                           .test_load_gate = o->load_gate,
                           .topo = e->topo,
                           .replicas = o->replicas,
                           .striping = o->striping,
                           .stripe_min_bytes = o->stripe_min_bytes,
                           .digests = true}; /* every load's digests, as with the scrub setting on */
    rc = ld_create(&lp, &e->ld, &err);
    if (rc == 0) rc = ld_staging_start(e->ld, &err);
    struct res_params rp = {.loop = &e->loop,
                            .backend = &e->backend,
                            .bulk = e->bulk,
                            .ld = e->ld,
                            .ndevices = e->ndevices,
                            .devices = e->devices,
                            .device_budget = o->device_budget,
                            .replicas = ld_has_peers(e->ld) && o->replicas};
    if (rc == 0) rc = res_create(&rp, &e->res, &err);
  }
  if (rc != 0) fprintf(stderr, "env_start: %s\n", err.msg);
  return rc == 0 ? 0 : -1;
}

/* Runs the loop until done(arg) holds; false if the deadline passed first. */
static inline bool env_run_until(struct env *e, bool (*done)(void *arg), void *arg) {
  uint64_t deadline = clock_ms() + ENV_DEADLINE_MS;
  uv_timer_start(&e->tick, env_tick, 5, 5);
  bool ok = done(arg);
  while (!ok && clock_ms() < deadline) {
    uv_run(&e->loop, UV_RUN_ONCE);
    ok = done(arg);
  }
  uv_timer_stop(&e->tick);
  return ok;
}

static inline bool env_flag_set(void *arg) { return *(const bool *)arg; }

static inline bool env_pools_idle(void *arg) {
  const struct env *e = arg;
  return jobs_outstanding(e->control) == 0 && jobs_outstanding(e->bulk) == 0;
}

/*
 * Waits for every job, then frees everything in the daemon's order
 * (residency, registry, the pools, the loop, the loader, the fill threads,
 * the backend) and checks that the loop closes with no handle left.
 */
static inline void env_stop(struct env *e) {
  if (e->control != NULL && e->bulk != NULL) CHECK(env_run_until(e, env_pools_idle, e));
  res_destroy(e->res);
  reg_destroy(e->reg);
  if (e->bulk != NULL) jobs_stop(e->bulk);
  if (e->control != NULL) jobs_stop(e->control);
  uv_close((uv_handle_t *)&e->tick, NULL);
  uv_run(&e->loop, UV_RUN_DEFAULT);
  CHECK_EQ_INT(uv_loop_close(&e->loop), 0);
  ld_destroy(e->ld);
  topo_destroy(e->topo);
  ld_pool_stop(e->fill);
  backend_destroy(&e->backend);
}

/* ---- gates: a job that holds a pool thread until opened ----------------------------- */

struct gate {
  struct job job;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool entered, open;
  bool finished; /* its done() ran (loop thread) */
};

static inline void gate_work(struct job *j) {
  struct gate *g = (struct gate *)j;
  pthread_mutex_lock(&g->mu);
  g->entered = true;
  pthread_cond_broadcast(&g->cv);
  while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
}

static inline void gate_done(struct job *j) { ((struct gate *)j)->finished = true; }

/* Submits the gate to js and returns once a thread of js sits in it. */
static inline void gate_close(struct gate *g, struct jobs *js) {
  memset(g, 0, sizeof *g);
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->job.work = gate_work;
  g->job.done = gate_done;
  jobs_submit(js, &g->job);
  pthread_mutex_lock(&g->mu);
  while (!g->entered) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
}

/* Lets the held thread go; the loop must still run gate_done before the gate is destroyed. */
static inline void gate_open(struct gate *g) {
  pthread_mutex_lock(&g->mu);
  g->open = true;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

static inline void gate_destroy(struct gate *g) {
  pthread_mutex_destroy(&g->mu);
  pthread_cond_destroy(&g->cv);
}

/* ---- acquiring ------------------------------------------------------------------ */

/* What an acquire's continuation was given. */
struct acq {
  bool fired;
  struct reg_ckpt *ck;
  struct wd_error err;
};

static inline void acq_cb(void *arg, struct reg_ckpt *ck, const struct wd_error *err) {
  struct acq *a = arg;
  a->fired = true;
  a->ck = ck;
  if (err != NULL) a->err = *err;
}

/* Acquires path and runs the loop until the continuation fired. */
static inline struct acq env_acquire(struct env *e, const char *path) {
  struct acq a = {0};
  reg_acquire(e->reg, path, NULL, acq_cb, &a);
  CHECK(env_run_until(e, env_flag_set, &a.fired));
  return a;
}

#endif
