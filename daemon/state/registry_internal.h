/*
 * registry_internal.h - what registry.c, registry_open.c, registry_pin.c and
 * registry_bound.c share and nothing else includes: the registry's struct and
 * the few functions one of them calls in another. Calls run one way:
 * registry_open.c uses registry_bound.c, registry_pin.c and registry.c;
 * registry_bound.c and registry_pin.c use registry.c; registry.c uses none.
 */
#ifndef WD_REGISTRY_INTERNAL_H
#define WD_REGISTRY_INTERNAL_H

#include "registry.h"

/* The model roots, shared by reference with the jobs that started under them (loop thread counts). */
struct reg_roots {
  int refs;
  size_t n;
  char **dirs;
};

struct registry {
  const struct wd_backend *backend;
  struct jobs *control, *bulk;
  struct ld_pool *fill;
  struct reg_roots *roots;
  const struct rroots *remote; /* the remote roots (reg_remote_set, before any acquire; NULL: none): immutable */
  struct jobs *remote_jobs;    /* where their opens and checks run */
  char **source_dirs; /* root_sources: resolved directories (loop thread) */
  enum ld_source_choice *source_choices;
  size_t nsources;
  struct ckpt_verdicts *verdicts; /* failed index checks, remembered by file identity */
  struct acc_cache *acls;         /* access ACLs of checked files, by identity and ctime (thread-safe) */
  uint64_t pin_budget;   /* configured; 0: derived */
  enum reg_pin_mode pin_mode;
  uint64_t pinned_bytes; /* the pinned-resident tier's total, registrations under way included */
  uint64_t next_generation;
  atomic_bool stopping; /* read by prefetch chunks on fill threads */
  bool destroyed;
  size_t nentries; /* entries not yet freed, listed or detached */
  struct reg_ckpt *ckpts;
  /* The bounds (registry_bound.c). */
  struct reg_limits limits;
  size_t nlisted;     /* entries in the list */
  uint64_t charged;   /* the charge of the open entries counted (reg_ckpt.counted) */
  size_t nmaps;       /* their mappings */
  uint64_t closed_idle, closed_room, refused, plans_reused;
  uint64_t memo_clock; /* orders plan memo uses */
  uint64_t use_clock;  /* orders entries' uses (reg_touch) */
  uv_loop_t *loop;
  uv_timer_t idle_timer; /* closes idle entries (when loop is set) */
  bool timer_open;       /* idle_timer is initialised and not closed yet */
};

struct acquire;

/*
 * An acquirer waiting for an entry to open, and the uid it is for:
 * answered with the open's verdict, or (retry) acquiring again once it ends.
 */
struct reg_waiter {
  reg_ready_fn cb;
  void *arg;
  uid_t uid;
  struct acquire *retry; /* a client with other credentials than the open's: the verdict is not its own */
  struct reg_waiter *next;
};

/* ---- registry.c ---------------------------------------------------------------------- */

/* Drops a reference to the roots, freeing them with the last (NULL-safe). */
void reg_roots_unref(struct reg_roots *rt);
/* Takes a reference to the roots; returns rt. */
struct reg_roots *reg_roots_ref(struct reg_roots *rt);
/* Whether the backend registers host memory (pins) at all. */
bool reg_registers(const struct registry *r);
/* Unregisters n ranges of ck's mappings (a job, or entry_free). */
void reg_unregister_ranges(const struct wd_backend *b, const struct reg_ckpt *ck, const struct plan_range *v,
                           size_t n);
/* Takes ck out of the registry's list and the bounds' totals, and drops the registry's reference (loop thread). */
void reg_detach(struct reg_ckpt *ck);
/* Frees the registry once it is destroyed, its last entry is gone and its timer closed. */
void reg_free_if_done(struct registry *r);

/* ---- registry_bound.c ----------------------------------------------------------------- */

/* True when nothing but the registry holds ck: no set, job, waiter, prefetch, pin or load. */
bool reg_idle(const struct reg_ckpt *ck);
/* The bytes ck is charged once open (reads only ck: runs on the job that opened it). */
uint64_t reg_entry_charge(const struct reg_ckpt *ck);
/*
 * Room for a new entry that uid opens (path, for messages): within
 * max_open and uid's share of it, closing idle entries, least recently used
 * first. 0, or WEIGHTD_E_LIMIT naming the bound.
 */
int reg_bound_admit(struct registry *r, uid_t uid, const char *path, struct wd_error *err);
/*
 * Counts a just-opened ck (charge and nmaps set, its waiters not yet told) in
 * the totals, within memory and max_maps unless only the daemon waits for it; 0 or LIMIT.
 */
int reg_bound_open(struct registry *r, struct reg_ckpt *ck, struct wd_error *err);
/*
 * Charges ck to uid within uid's shares of max_open and memory (nothing for
 * REG_UID_DAEMON or a uid it is charged to already), closing uid's idle
 * entries, least recently used first, for room; 0, LIMIT or NOMEM.
 */
int reg_bound_charge(struct registry *r, struct reg_ckpt *ck, uid_t uid, struct wd_error *err);
/* Starts, restarts or stops the idle timer for the limits in force. */
void reg_bound_timer(struct registry *r);
/* Frees ck's plan memo. */
void reg_plan_memo_free(struct reg_ckpt *ck);

/* ---- registry_pin.c ------------------------------------------------------------------- */

/* Frees digests (NULL-safe). */
void reg_digests_free(struct reg_digests *d);

/* pin on_open: a checkpoint just opened is read and registered whole, when it fits. */
void reg_pin_on_open(struct registry *r, struct reg_ckpt *ck);

#endif
