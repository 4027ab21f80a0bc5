/*
 * registry_internal.h - what registry.c, registry_open.c and registry_pin.c
 * share and nothing else includes: the registry's struct and the few
 * functions one of them calls in another. Calls run one way: registry_open.c
 * uses registry_pin.c and registry.c, registry_pin.c uses registry.c, and
 * registry.c uses neither.
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
/* Takes ck out of the registry's list and drops the registry's reference (loop thread). */
void reg_detach(struct reg_ckpt *ck);

/* ---- registry_pin.c ------------------------------------------------------------------- */

/* Frees digests (NULL-safe). */
void reg_digests_free(struct reg_digests *d);

/* pin on_open: a checkpoint just opened is read and registered whole, when it fits. */
void reg_pin_on_open(struct registry *r, struct reg_ckpt *ck);

#endif
