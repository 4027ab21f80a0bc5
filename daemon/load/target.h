/*
 * target.h - what one load is: the target a caller fills in and every part
 * of the load room reads (loader.h), with the copies a replica may come from,
 * the shares of a striped load, and how the load went.
 */
#ifndef WD_LD_TARGET_H
#define WD_LD_TARGET_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "checkpoint.h"
#include "plan.h"
#include "source.h"

/* The most devices one striped load uses: its own and up to LD_MAX_LINKS - 1 neighbours. */
#define LD_MAX_LINKS 16

/* How a load moved its bytes (printed through ld_method_name: "memcpy", "staged", ...). */
enum ld_method {
  LD_METHOD_MEMCPY,  /* fill threads gathered into a host slab in place */
  LD_METHOD_STAGED,  /* through the pinned staging slots, over the device's own host link */
  LD_METHOD_DIRECT,  /* the copy engines read registered mappings (the pinned-resident tier) */
  LD_METHOD_PEER,    /* a replica copied device to device from another device's copy */
  LD_METHOD_STRIPED, /* the staging pipeline over several devices' host links */
  LD_METHOD_COUNT
};
const char *ld_method_name(enum ld_method m);

/* A ready copy of the same set on another device, which a replica may be copied from. */
struct ld_copy {
  const struct wd_slab *slab;
  int device;
  /* The copy's digests as recorded at its load (one per plan output), or NULL: a replica copied from it must
   * hash to the same (digest.c), so bytes that went wrong in the copy, or in the copy since its load, fail it. */
  const unsigned char (*digests)[WD_DIGEST_BYTES];
};

/* A share of a striped load: slab bytes [lo, hi) came over `device`'s host link. */
struct ld_share {
  int device;
  uint64_t lo, hi;
};

/*
 * One load: what to fill from where, and what the load reports back.
 *
 * The slab fills in offset order, as far as anyone outside can tell:
 * ready_bytes is a watermark below which every slab byte holds its final
 * value (on a GPU, the copy that wrote it has completed). It only grows;
 * memcpy loads raise it as each contiguous run of fill tasks finishes;
 * pipeline loads (staged, direct, striped) as each window of the staging
 * schedule (plan_stage.h: a contiguous slab range) is known complete (its
 * slot's event waited for) together with every window before it; replicas
 * once, when they finish.
 */
struct ld_target {
  const struct plan *plan;
  const struct ckpt *ck; /* the checkpoint: immutable while the load runs */
  const char *name;      /* the checkpoint's path, for messages */
  /* The checkpoint's own source (owned by the caller until ld_fill returns): mmap for files (what direct DMA reads), remote for a URL. */
  struct ld_source *mmap;
  enum ld_source_choice choice; /* where the load should read from */
  /* A source the caller composed (a route over sources it chose; kept until ld_fill returns): when not NULL the load reads through it and choice does not apply. */
  struct ld_source *src;
  int device;
  /*
   * The mmap source's registered ranges when the load was queued (sorted by
   * shard and offset, disjoint; owned by the caller, which keeps them from
   * being unregistered until ld_fill returns): a load whose every source
   * byte lies in them copies straight from the mappings ("direct", or a
   * striped load's direct windows).
   */
  const struct plan_range *pins;
  size_t npins;
  atomic_uint_fast64_t bytes_done;  /* progress, in slab bytes (read by the loop) */
  atomic_uint_fast64_t ready_bytes; /* the watermark, in slab bytes */
  atomic_bool cancel;               /* set by the loop: the load stops between windows */
  /*
   * What the load reads from while it runs, for status (set by the load's
   * thread, read by the loop): the kind of the source it reads through (-1
   * until it has chosen one) and the device whose copy it copies (-1: none,
   * the bytes come from host memory).
   */
  atomic_int reading_kind;
  atomic_int reading_device;
  /*
   * Hooks, each may be NULL; they run on the load's threads. allocated runs
   * once the slab exists (t->slab is set and stays so); ready each time
   * ready_bytes grows (calls from several fill threads may overlap and come
   * out of order: each passes the value it raised ready_bytes to).
   */
  void (*allocated)(struct ld_target *t);
  void (*ready)(struct ld_target *t, uint64_t ready_bytes);
  /* Copies of the same set on other devices, kept resident by the caller until ld_fill returns. */
  const struct ld_copy *copies;
  size_t ncopies;
  /* Results (valid once ld_fill returns). */
  struct wd_slab *slab; /* the slab, owned by the caller, also when the fill failed */
  enum ld_method method;
  char source[48];      /* the source the bytes were read through (its label; "" for a replica) */
  enum ld_source_kind source_kind;
  atomic_uint_fast64_t source_bytes[LD_SOURCE_KINDS]; /* file bytes read, by the leaf source that read them */
  bool read_failed;     /* the fill failed reading the source (not moving bytes): no other path is tried */
  double alloc_seconds;
  int source_device;    /* method peer: the device whose copy was copied; else -1 (host memory) */
  size_t nshares;       /* method striped: the links that moved the bytes, the target's first */
  struct ld_share shares[LD_MAX_LINKS];
  bool hold_ready;            /* the watermark stays at 0 until the whole slab is published (verify on_load, digests vs the manifest) */
  uint64_t verified_chunks;   /* manifest chunks checked, by verify on_load or a remote source as it read (0: none) */
  uint64_t verify_mismatches; /* of them, those whose digest differed */
  atomic_uint_fast64_t source_checked, source_mismatches; /* what the source checked as it read (fill threads) */
  /* XXH3-128 of each plan output as loaded (digest.c; malloc'd, the set's to free), or NULL: the backend cannot hash. */
  unsigned char (*digests)[WD_DIGEST_BYTES];
};

#endif
