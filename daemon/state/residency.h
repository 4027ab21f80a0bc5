/*
 * residency.h - resident sets, leases and eviction.
 *
 * A resident set is one plan of one checkpoint loaded onto one device, in
 * one slab. Residency is loop-owned state with an explicit context (struct
 * residency); it runs loads on its job pool through the loader and reports
 * back through typed continuations: a caller that wants a set passes a
 * struct res_waiter (embedded in its own state) whose done() runs once the
 * set is ready or the load failed, and whose progress() runs while it loads.
 * Residency knows nothing of requests or the protocol; lease owners are
 * opaque pointers it only compares.
 *
 * A set with a lease is never freed; unleased READY sets are evicted least
 * recently used first when a device's budget (or the device itself) has no
 * room for a new set. A request that arrives while an identical set loads
 * waits for it instead of loading again. The same checkpoint and plan on
 * another device is another set; when one is ready, a load of it onto a new
 * device is offered it as a source to copy from (the loader decides), and it
 * is not evicted while that load runs.
 *
 * Early attach: a waiter that says `early` is answered while the set still
 * loads, as soon as its slab exists and may be shared, and may lease it; how
 * far the load has come is on the set's progress page (progress_page.h),
 * which the load's threads advance and load_done finishes (ready, failed or
 * canceled). A set whose load fails or is canceled while leased leaves the
 * list of sets at once (nobody finds it, status does not show it) but keeps
 * its slab, counted against its device, until its last lease ends.
 */
#ifndef WD_RESIDENCY_H
#define WD_RESIDENCY_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "backend/backend.h"
#include "error.h"
#include "progress_page.h"
#include "base/jobs.h"
#include "load/loader.h"
#include "plan.h"
#include "registry.h"

struct residency;
struct res_waiter;

enum set_state { SET_LOADING, SET_READY, SET_FAILED };

struct res_set {
  struct residency *res;
  char id[24];
  char *key; /* checkpoint path + generation + device + plan key: the set's identity */
  struct reg_ckpt *ck;
  int device;
  struct plan *plan;
  struct ld_target load; /* the loader's target: slab, method, progress, cancel */
  bool cancel_asked;     /* its last waiter canceled the load (not a shutdown): nothing is kept when it ends */
  uid_t loader_uid;      /* who asked for the load that made it ((uid_t)-1: re-adopted, unknown) */
  bool adopted;          /* re-adopted after a restart: never loaded by this daemon */
  enum set_state state;
  int leases;
  uint64_t last_used_ms;
  double seconds;             /* the whole load job */
  struct res_waiter *waiters; /* waiting for SET_LOADING */
  char *table_cache;          /* the attach table as the op handlers serialise it, built once */
  int table_fd;               /* the binary tensor table, a sealed memfd built once (res_set_table_fd); -1 */
  uint64_t table_bytes;
  uint64_t table_sum;         /* its XXH64 (the set description names the table by it) */
  /* What the stored slab handle maps (restart survival: taken when first stored, or from the description). */
  bool store_refused; /* the fd store had no room for it (logged once) */
  uint64_t store_alloc_bytes;
  unsigned char store_alloc_id[WD_ALLOC_ID_BYTES];
  struct wd_progress_page *page; /* how far the load has come (NULL: the kernel cannot share one) */
  int page_fd;                   /* the page's sealed memfd, or -1 */
  atomic_bool allocated;         /* the load job has allocated load.slab (then readable on the loop) */
  bool orphan;                   /* failed or canceled while leased, or retired: off the list until its last lease ends */
  uv_timer_t progress_timer;
  /* Replicas (docs/multi-gpu.md): while this set loads, the ready copies on other devices it may be
   * copied from (load.sources) are kept resident; `copying` counts the loads holding this one so. */
  struct res_set **copy_from;
  size_t ncopy_from;
  unsigned copying;
  /* Scrubs (scrub.h): how many are reading the slab now (the set is not evicted meanwhile), and the outputs
   * found to differ from their digests at load (NULL until one does; then noutputs flags), ncorrupt of them. */
  unsigned scrubbing;
  bool *corrupt;
  size_t ncorrupt;
  struct res_set *next;
};

/*
 * Someone waiting for a set. Embed it in your own state and fill done (and
 * progress, or NULL). done runs once, on the loop thread: with the ready set
 * (err NULL; joined tells whether the set was already loading or resident
 * when asked), or with s NULL and err saying why the load failed. It may run
 * before the call that registered the waiter returns. An early waiter's done
 * may come with the set still SET_LOADING: as soon as its slab is allocated
 * and res_set_early_ok says it can be shared.
 */
struct res_waiter {
  void (*done)(struct res_waiter *w, struct res_set *s, bool joined, const struct wd_error *err);
  void (*progress)(struct res_waiter *w, uint64_t done, uint64_t total);
  bool early; /* the caller's: done may come while the set loads */
  uid_t uid;  /* the caller's: a set its request starts records it as its loader */
  /* Residency's own. */
  struct res_set *set; /* the set waited for; NULL when not waiting */
  bool joined;
  struct res_waiter *next;
};

/* Who holds a lease, as the peer's credentials and hello named it. */
struct lease_holder {
  const void *owner; /* compared only: the connection */
  pid_t pid;
  uid_t uid;
  char client[64]; /* the name the client gave in hello, "" when none */
};

struct lease {
  char id[24];
  struct res_set *set;
  struct lease_holder holder;
  uint64_t created_ms;
  struct lease *next;
};

struct res_device {
  struct wd_device_info info;
  uint64_t used; /* bytes of resident sets */
};

/* What residency counts, for metrics and status (loop thread); loads by method are by enum ld_method (load/target.h). */
enum res_result { RES_RESULT_OK, RES_RESULT_FAILED, RES_RESULT_CANCELED, RES_RESULT_COUNT };
enum res_evict_reason { RES_EVICT_BUDGET, RES_EVICT_DEVICE_FULL, RES_EVICT_REQUEST, RES_EVICT_RELOAD, RES_EVICT_COUNT };
/* Upper bounds (seconds) of the load-duration histogram's buckets; a last bucket takes the rest. */
#define RES_DURATION_BOUNDS {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}
#define RES_DURATION_BUCKETS 12

struct res_stats {
  uint64_t loads[RES_RESULT_COUNT][LD_METHOD_COUNT]; /* finished load jobs */
  uint64_t source_bytes[LD_SOURCE_KINDS];           /* file bytes successful loads read, by the source that read them */
  uint64_t verified_chunks;   /* verify on_load: manifest chunks loads checked */
  uint64_t verify_mismatches; /* of them, those that differed from the manifest */
  uint64_t bytes_loaded;                              /* payload bytes of successful loads */
  double last_gib_per_s;                              /* of the last successful load */
  uint64_t duration_le[RES_DURATION_BUCKETS];         /* successful loads, per bucket (not cumulative) */
  uint64_t duration_over;                             /* longer than the last bound */
  double duration_sum;
  uint64_t evictions[RES_EVICT_COUNT];
  uint64_t adopted; /* sets re-adopted after a restart (no load) */
};

/* The names of the enums above, as labels. */
const char *res_result_name(enum res_result r);
const char *res_evict_reason_name(enum res_evict_reason r);

struct res_params {
  uv_loop_t *loop;
  const struct wd_backend *backend;
  struct jobs *bulk; /* loads and slab frees */
  struct loader *ld;
  int ndevices;
  const struct wd_device_info *devices; /* copied */
  uint64_t device_budget; /* bytes per device; 0: the device's own memory (host: half of it) */
  bool replicas; /* offer a load the ready copies of its set on other devices (replicas = auto) */
};

int res_create(const struct res_params *p, struct residency **out, struct wd_error *err);
/* Drops every lease and set; slabs are freed on the job pool (which must still run). */
void res_destroy(struct residency *r);

/* Loop-thread views for status. */
const struct res_stats *res_stats(const struct residency *r);
struct res_set *res_first_set(const struct residency *r);
struct lease *res_first_lease(const struct residency *r);
int res_device_count(const struct residency *r);
struct res_device *res_device(struct residency *r, int device);
/* The budget of device's resident sets: configured, or derived (host: half of memory); 0 = none. */
uint64_t res_device_budget(const struct residency *r, int device);
/* Changes the configured budget; evicts unleased sets (least recently used first) where a device is over it. Returns how many. */
size_t res_device_budget_set(struct residency *r, uint64_t budget);
/* Descriptors the sets hold at most (slab, progress page, table), those that failed while leased included. */
size_t res_set_fds(const struct residency *r);
/* Sets of ck (any state). */
size_t res_count_sets_of(const struct residency *r, const struct reg_ckpt *ck);

/* ---- loading and waiting --------------------------------------------------- */

/*
 * Finds or starts the set for (ck, device, plan) and makes w wait for it; a
 * new load reads through `source` (a set already resident or loading is
 * joined, however it reads). Takes the caller's references to ck and plan in
 * every case.
 */
void res_load(struct residency *r, struct reg_ckpt *ck, int device, struct plan *plan, enum ld_source_choice source,
              struct res_waiter *w);

/* How a set got its bytes, as status shows it: its load's method, or "adopted". */
const char *res_set_method(const struct res_set *s);

/* Makes w wait for a set that is still loading (as an identical load would); a ready set answers at once. */
void res_wait(struct residency *r, struct res_set *s, struct res_waiter *w);

/* Stops w waiting without calling done (its requester is gone); true if it was waiting. */
bool res_waiter_leave(struct res_waiter *w);

/*
 * Stops w waiting (without calling done); when nobody else waits and no
 * early attacher holds a lease on the set, the load is told to stop and the set shows as canceling until its job returns. True if
 * w was waiting.
 */
bool res_waiter_cancel(struct res_waiter *w);

/* True while the set is loading and nobody waits for it any more. */
bool res_set_canceling(const struct res_set *s);

/* True when a LOADING set may be attached early: its slab exists, may be exported while filling, and it has a page. */
bool res_set_early_ok(const struct res_set *s);

struct res_set *res_find_set(const struct residency *r, const char *id);
/* The set res_load would find for (ck, device, a plan with this key): loading or ready; NULL when none. */
struct res_set *res_find_plan(const struct residency *r, const struct reg_ckpt *ck, int device, const char *plan_key);

/* ---- leases --------------------------------------------------------------- */

/*
 * BAD_CHECKSUM for a set a scrub found corrupt (ncorrupt > 0), naming a
 * tensor: what a lease on it, or a load that finds it, is answered.
 */
int res_set_corrupt_error(const struct res_set *s, struct wd_error *err);

/*
 * Adds a lease on a READY set, or a LOADING one that res_set_early_ok, for holder; *out is the new lease.
 * A corrupt set (scrub.h) is refused with res_set_corrupt_error.
 * A lease on a LOADING set keeps its load going (a cancel asked for before is withdrawn).
 */
int res_lease_add(struct residency *r, struct res_set *s, const struct lease_holder *holder, struct lease **out,
                  struct wd_error *err);
/* Ends one lease (the lease is freed); the last lease of a set that failed or was retired frees the set. */
void res_lease_drop(struct residency *r, struct lease *l);
struct lease *res_find_lease(const struct residency *r, const char *id);

/*
 * Takes a READY set off the list for good (a scrub found it corrupt and it
 * is loaded again): nobody finds it, status does not show it, a restart
 * does not adopt it. It is freed when nothing holds it (its slab then goes
 * with the next res_load's job, freed before that load allocates), else
 * its leases, scrubs and the loads copying from it keep its memory
 * (counted against its device) until the last one ends; s may be freed
 * when this returns.
 */
void res_set_retire(struct residency *r, struct res_set *s);
/*
 * Whether s's device has room for a second copy of s while s is still held
 * (leases, scrubs or copies keep it after a retire): true when nothing holds
 * it (retiring frees it first) or its budget allows both.
 */
bool res_set_reload_fits(const struct residency *r, const struct res_set *s);
/* Frees a retired or failed set that nothing holds any more (the scrubber, a copy's end); true if it did. */
bool res_set_release_if_orphan(struct res_set *s);
/* A set's state changed outside residency (a scrub marked it corrupt): restart survival records it now. */
void res_set_marked(struct residency *r);
/* The sets off the list that leases or scrubs still hold (failed while leased, retired). */
struct res_set *res_first_orphan(const struct residency *r);
/* True when owner holds a lease. */
bool res_owner_has_leases(const struct residency *r, const void *owner);
/* Ends every lease of owner. */
void res_leases_drop_owner(struct residency *r, const void *owner);

/* ---- eviction ------------------------------------------------------------- */

/* Called on the loop thread once evicted sets' memory is free: their ids. */
typedef void (*res_evicted_fn)(void *arg, char *const *ids, size_t n);

/*
 * Evicts the set called set_id (NULL: every unleased ready set of device
 * that may(may_arg, set) accepts; may NULL: all), then frees the memory on a
 * job and calls cb. Returns 0, or an error (no such set, BUSY: leased or
 * loading) without evicting anything.
 */
int res_evict(struct residency *r, const char *set_id, int device, bool (*may)(void *arg, const struct res_set *s),
              void *may_arg, res_evicted_fn cb, void *arg, struct wd_error *err);

/* ---- restarts ------------------------------------------------------------ */

/*
 * fn(arg, now) runs on the loop whenever a set becomes ready or goes, or a
 * lease starts or ends: now is true for what a reply is about to report (a
 * set ready, a lease granted or restored), false for what ends (a set gone,
 * a lease released), which may be recorded with the next change.
 */
void res_on_change(struct residency *r, void (*fn)(void *arg, bool now), void *arg);

/*
 * The set's binary tensor table as a sealed memfd (s->table_fd, with
 * table_bytes and table_sum), built on the first call; 0 or an error.
 */
int res_set_table_fd(struct res_set *s, struct wd_error *err);

/*
 * Registers a set an earlier daemon loaded (re-adopted after a restart): READY
 * at once, no load, its id kept (later ids come after it). Takes ck's
 * reference, plan and slab on success only. INVALID when the id or the
 * identity is taken already or the device does not exist.
 */
int res_set_adopt(struct residency *r, struct reg_ckpt *ck, int device, struct plan *plan, struct wd_slab *slab,
                  const char *id, struct res_set **out, struct wd_error *err);

/*
 * A lease an earlier daemon granted, restored with its id and holder's
 * uid/pid but no owner (holder.owner NULL) until its holder reclaims it
 * (ops: reclaim) or res_leases_drop_owner(r, NULL) ends the unclaimed ones.
 */
int res_lease_restore(struct residency *r, struct res_set *s, const char *id, const struct lease_holder *holder,
                      struct wd_error *err);

/* Tells every running load to stop (shutdown). */
void res_cancel_all(struct residency *r);

#endif
