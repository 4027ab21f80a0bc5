/*
 * internal.h - what the load room's files share and nothing outside
 * includes: the loader, its links and lanes, and the calls one file makes in
 * another. Calls run one way: loader.c calls multi.c, pipeline.c and
 * control.c; multi.c calls pipeline.c and control.c; pipeline.c calls
 * control.c; control.c calls nothing of the room; the sources call nothing
 * of it either.
 */
#ifndef WD_LD_INTERNAL_H
#define WD_LD_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "loader.h"
#include "multi.h"

/* Pinned zero bytes that direct windows copy alignment gaps and zero pieces from. */
#define LD_ZEROS (1u << 20)
/* Slots of a lending link (a neighbour's share of a striped load). */
#define LD_LEND_SLOTS 2

/*
 * A host link's staging: pinned slots with a stream and an event each. A
 * device's own link (home) carries its loads; its lending link (lend) carries
 * its share of a neighbour's striped load and has a bounce buffer per slot on
 * the device, from which each window is forwarded over the peer link. A link
 * belongs to one load at a time (`lock`).
 */
struct ld_link {
  pthread_mutex_t lock;
  int device;
  size_t nslots;
  uint64_t slot_bytes;
  void **slots;
  struct wd_slab **bounce; /* lend: per slot, on the device; home: NULL */
  struct wd_stream **streams;
  struct wd_event **events;
};

/* The stream replica copies onto one device run on. */
struct ld_lane {
  pthread_mutex_t lock;
  struct wd_stream *stream;
  struct wd_event *event;
};

struct loader {
  const struct wd_backend *backend;
  struct ld_pool *pool;
  const struct topology *topo;
  int ndevices;
  bool staged_only;
  enum plan_strided strided;
  enum ld_writes writes;
  size_t staging_slots;
  uint64_t staging_slot_bytes;
  bool peers;     /* several devices with peer copies */
  bool replicas;  /* peers and replicas = auto */
  bool striping;  /* peers and striping = auto */
  uint64_t stripe_min_bytes;
  bool refuse_odirect;
  uint64_t auto_direct_bytes; /* 0: LD_AUTO_DIRECT_PERCENT of host memory */
  bool verify;                /* ld_params' verify */
  bool digests;               /* ld_params' digests */
  char *gate;     /* test_load_gate, or NULL */
  int *nodes;     /* per device, its NUMA node (-1: none) */
  void (*place)(void *arg, int device);
  void *place_arg;
  atomic_int *busy; /* per device: loads onto it, lendings, copies read from it */
  /* Made by ld_staging_start (NULL until then, or when not needed). */
  struct ld_link *home;  /* per device */
  struct ld_link *lend;  /* per device, when striping */
  struct ld_lane *lanes; /* per device, when replicas */
  int nhome, nlend, nlanes; /* how many were made (ld_destroy frees those) */
  void *zeros;           /* LD_ZEROS pinned zero bytes, with home links */
};

/* ---- control.c ---------------------------------------------------------------------- */

/*
 * Raises the watermark while the fill runs, short of the end of the slab: a
 * wait for the whole slab succeeds only once the shards are known unchanged.
 * Nothing while t->hold_ready (a load whose bytes are verified after the
 * fill: no early attacher uses them before).
 */
void ld_publish_ready(struct ld_target *t, uint64_t v);

/* The whole slab is ready: after the fill and the check that no shard changed under it. */
void ld_publish_final(struct ld_target *t);

/* CANCELED (naming the checkpoint) once the target's load was canceled, else 0: every way checks here. */
int ld_check_cancel(const struct ld_target *t, struct wd_error *err);

/* Opens the test gate for one load: its descriptor, or -1 when there is none (the gate is open). */
int ld_gate_open(const struct loader *ld);

/*
 * Waits for one byte from the test gate (a FIFO) before a window: 0 to go
 * on, CANCELED when the load is canceled meanwhile. End of file (every writer
 * gone) or a failed read closes *gate: from then on the gate is open.
 */
int ld_gate_pass(int *gate, const struct ld_target *t, struct wd_error *err);

/*
 * Bytes per fill task for a window read from src: one task per fill thread,
 * 256 KiB to 8 MiB each (at least src's read_min, at most the window), in
 * 64 KiB multiples. A staged load has its slots' windows in flight at once,
 * so every fill thread has a task while the slots are free (16 threads and
 * 16 MiB windows: 1 MiB tasks, as measured on the H200 host;
 * docs/benchmarks.md); a memcpy load's 256 MiB windows get 8 MiB tasks; an
 * O_DIRECT source's reads are 4 MiB or more.
 */
uint64_t ld_task_bytes(const struct loader *ld, uint64_t window, const struct ld_source *src);

/* A FAULT error naming the tensor at slab offset off (a shard truncated while it was read). */
int ld_fault_error(const struct ld_target *t, uint64_t off, struct wd_error *err);

/* Adds a fill task's per-kind read counts, and the manifest chunks its source checked, to the target's. */
void ld_count_reads(struct ld_target *t, const struct ld_reader *rd);

/* ---- verify.c ------------------------------------------------------------------------ */

/*
 * Checks every manifest chunk of the files that t's plan reads from, read
 * through src, against t->ck->manifest (not NULL): 0, or BAD_CHECKSUM naming
 * the file and the bytes of the first chunk found to differ (each one is
 * logged), CANCELED, or a read's error. Sets t's verified_chunks and
 * verify_mismatches.
 */
int ld_verify(struct loader *ld, struct ld_target *t, const struct ld_source *src, struct wd_error *err);

/*
 * digest.c: the set's own digests (t->digests, one per plan output) from the
 * backend's slab_hash over the filled slab, each whole-tensor output checked
 * against the manifest when there is one (BAD_CHECKSUM naming the tensor).
 * A backend without slab_hash, or whose slab_hash fails (logged), leaves
 * t->digests NULL and returns 0.
 */
int ld_digest(struct loader *ld, struct ld_target *t, struct wd_error *err);

/* ---- pipeline.c --------------------------------------------------------------------- */

/* The registered-range test: bytes from file offset off of shard that lie in one of t->pins (0: none). */
uint64_t ld_pinned_run(const struct ld_target *t, uint32_t shard, uint64_t off);
/* True when every source byte of t's plan lies in t->pins, so that the copy engines may read the mappings. */
bool ld_plan_pinned(const struct ld_target *t);

/*
 * One run of the staging pipeline over nlinks host links (links[0] the
 * target's own, taken by the caller; the others neighbours' lending links
 * the caller took): the schedule's windows go to the link whose share
 * [cuts[i], cuts[i + 1]) holds their first slab byte (cuts has nlinks + 1
 * entries, from 0 to the slab's size; NULL with one link). direct: the copy
 * engines read t->mmap's registered mappings window by window; else the fill
 * threads read each window from src into a slot. Records the links that got
 * windows in t->shares when there are several. Every link is idle again when
 * it returns.
 */
int ld_pipe_run(struct loader *ld, struct ld_target *t, const struct ld_source *src, struct ld_link *const *links,
                const uint64_t *cuts, size_t nlinks, bool direct, struct wd_error *err);

/* ---- multi.c ------------------------------------------------------------------------ */

/*
 * A replica, or a striped run of the pipeline, when multi.h's rules choose
 * one; *filled false: nothing was moved (the caller fills the slab the usual
 * way; 0 is returned). True: the result is the fill's.
 */
int ld_multi_fill(struct loader *ld, struct ld_target *t, const struct ld_source *src, bool *filled,
                  struct wd_error *err);

#endif
