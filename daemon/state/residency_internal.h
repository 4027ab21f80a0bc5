/*
 * residency_internal.h - what residency.c and residency_load.c share.
 *
 * Not an interface: the struct residency behind residency.h's handle, and
 * the calls residency_load.c makes into residency.c (finding a set by its
 * identity, linking and destroying sets, making room, freeing slabs). The
 * arrows run one way: residency_load.c calls residency.c, never the
 * reverse. Loop thread only, except res_slab_list_free_now (a job thread).
 */
#ifndef WD_RESIDENCY_INTERNAL_H
#define WD_RESIDENCY_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "residency.h"

struct free_job;

/* Slabs taken from evicted sets, freed together off the loop. */
struct slab_list {
  struct wd_slab **v;
  size_t n, cap;
};

/*
 * A load job's request to the loop for room on its device, made when the
 * job starts (res_room_ask), so that evictions for a load happen only when
 * it is about to allocate its slab: a load canceled or still queued has
 * evicted nothing. The loop answers in on_notify.
 */
struct room_req {
  struct res_set *set;
  struct slab_list freed; /* the evicted sets' slabs, which the job frees before it allocates */
  bool answered;
  int rc;
  struct wd_error err;
  struct room_req *next;
};

struct residency {
  uv_loop_t *loop;
  const struct wd_backend *backend;
  struct jobs *bulk;
  struct loader *ld;
  int ndevices;
  struct res_device *devices;
  uint64_t device_budget;
  uint64_t next_id; /* the last set or lease id number given; never past RES_ID_MAX */
  struct res_set *sets;
  struct res_set *orphans; /* failed or canceled while leased, or retired while held: freed when nothing holds them */
  struct slab_list retired; /* slabs of sets retired unheld: the next load's job frees them before it allocates */
  struct lease *leases;
  struct res_stats stats;
  uv_async_t notify; /* a load allocated its slab (answer early waiters) or asks for room */
  pthread_mutex_t room_lock; /* guards room_queue and the queued requests' answers */
  pthread_cond_t room_cv;
  struct room_req *room_queue;
  bool destroying; /* res_destroy runs: rooms asked for now are refused */
  bool stopping;   /* res_cancel_all ran (the daemon stops): a load asking for room is told to stop */
  bool replicas;
  void (*changed)(void *arg, bool now); /* sets or leases changed (res_on_change) */
  void *changed_arg;
};

/* The largest set or lease id number (2^63 - 1, what a set description accepts): none is given past it. */
#define RES_ID_MAX 9223372036854775807ull

/* The next id number, or 0 when they are used up (only a description that took over the last one does that). */
static inline uint64_t res_next_id(struct residency *r) { return r->next_id < RES_ID_MAX ? ++r->next_id : 0; }

/* Tells the res_on_change callback that sets or leases changed (now: see res_on_change). */
static inline void res_changed(struct residency *r, bool now) {
  if (r->changed != NULL) r->changed(r->changed_arg, now);
}

/* The set of that identity (path#generation|device|plan key) that has not failed, or NULL. */
struct res_set *res_find_by_key(const struct residency *r, const char *key);
/* Puts a new set s (device and plan set) among the resident ones: its timer, its bytes on the device. */
void res_set_link(struct residency *r, struct res_set *s);
/* Takes s out of the list it is on (the sets, or the orphans). */
void res_set_unlink(struct res_set *s);
/* Unlinks and frees a set; its slab goes to `keep` when given, else to a free job. */
void res_set_destroy(struct res_set *s, struct slab_list *keep);
/* Frees every slab of the list (on a job thread) and empties it. */
void res_slab_list_free_now(const struct wd_backend *b, struct slab_list *l);
/* Frees the slabs of l on a job (f, when not NULL, may carry a continuation), or here when no job can be made. */
void res_free_later(struct residency *r, struct free_job *f, struct slab_list *l);
/* Destroys an unleased, ready set that no load copies (its slab to keep) and counts why; BUSY otherwise. */
int res_evict_one(struct res_set *s, struct slab_list *keep, enum res_evict_reason why, struct wd_error *err);
/* True when s is a ready set of device that nothing holds: no lease, no load copying it. */
bool res_evictable(const struct res_set *s, int device);
/*
 * Whether `need` more bytes could fit device's budget by evicting unleased
 * ready sets (leased and loading ones stay); nothing is evicted.
 */
bool res_room_possible(const struct residency *r, int device, uint64_t need);
/*
 * On a load's job thread: asks the loop for room for set s (counted on its
 * device since it was queued) and waits for the answer: 0 with the evicted
 * sets' slabs in req->freed, CANCELED when its load was canceled meanwhile,
 * DEVICE_NOMEM when the budget cannot hold it now.
 */
int res_room_ask(struct residency *r, struct res_set *s, struct room_req *req);

#endif
