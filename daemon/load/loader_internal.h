/*
 * loader_internal.h - what the loader's files share (loader.c, and
 * loader_staged.c for the staging pipeline): the loader and its per-GPU
 * staging, and the helpers every way of filling uses (load_control.c).
 * Not for other modules: they see loader.h.
 */
#ifndef WD_LOADER_INTERNAL_H
#define WD_LOADER_INTERNAL_H

#include <pthread.h>

#include "loader.h"

struct staging {
  pthread_mutex_t lock;
  size_t nslots;
  size_t slot_bytes;
  void **slots;
  struct wd_stream **streams;
  struct wd_event **events;
};

struct loader {
  const struct wd_backend *backend;
  struct fillpool *fill;
  struct mg *mg;
  enum cfg_load_method method;
  enum plan_strided strided;
  enum ld_writes writes;
  struct staging *stagings; /* one per device, for backends without host-visible slabs (ld_staging_start) */
  int ndevices;
  size_t staging_slots, staging_slot_bytes;
  void (*place)(void *arg, int device); /* NUMA placement before a device's staging slots (ld_params) */
  void *place_arg;
  int nstagings;
  char *gate; /* test_load_gate, or NULL */
  int *nodes; /* per device, its NUMA node (-1: none) */
};

/* ---- load_control.c ---------------------------------------------------------------- */

/*
 * Raises the watermark while the fill runs, short of the end of the slab: a
 * wait for the whole slab succeeds only once the shards are known unchanged.
 */
void ld_publish_ready(struct ld_target *t, uint64_t v);

/* The whole slab is ready: after the fill and the check that no shard changed under it. */
void ld_publish_final(struct ld_target *t);

/* CANCELED (naming the checkpoint) once the target's load was canceled, else 0. */
int ld_check_cancel(struct ld_target *s, struct wd_error *err);

/* Opens the test gate for one load: its descriptor, or -1 when there is none (the gate is open). */
int ld_gate_open(const struct loader *ld);

/*
 * Waits for one byte from the test gate (a FIFO) before a window: 0 to go
 * on, CANCELED when the load is canceled meanwhile. End of file (every writer
 * gone) or a failed read closes *gate: from then on the gate is open.
 */
int ld_gate_pass(int *gate, struct ld_target *s, struct wd_error *err);

/*
 * Bytes per fill task for a window: one task per fill thread, 256 KiB to 8
 * MiB each, in 64 KiB multiples. A staged load has its slots' windows in
 * flight at once, so every fill thread has a task while the slots are free
 * (16 threads and 16 MiB windows: 1 MiB tasks, as measured on the H200 host;
 * docs/benchmarks.md); a memcpy load's 256 MiB windows get 8 MiB tasks.
 */
uint64_t ld_task_bytes(const struct loader *ld, uint64_t window);

/* The staged pipeline (loader_staged.c, called by loader.c): fills the target's slab through its GPU's staging slots. */
int ld_fill_staged(struct loader *ld, struct ld_target *s, struct wd_error *err);

#endif
