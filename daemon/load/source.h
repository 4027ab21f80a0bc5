/*
 * source.h - where a load's bytes come from: the source interface, the twin
 * of the device backend (backend.h says where bytes go).
 *
 * A source reads byte ranges of a checkpoint's shard files into host memory
 * (a staging slot, or a host slab). It is a const table of operations plus a
 * context, filled with designated initializers; optional operations may be
 * NULL and say what that means. Every load reads through one source, and the
 * loader asks it for exactly the ranges the rank's plan needs: the one
 * pipeline (pipeline.c: staged, over one link or striped over several) and
 * in-place host loads all read through ld_source_read, whatever the source
 * is.
 *
 * Kinds (enum ld_source_kind, printed through one table):
 *   mmap       the shard files mapped read-only (MAP_SHARED): reads copy out
 *              of the page cache; the only source that maps (what the direct
 *              DMA path and the pinned-resident tier need), prefetches
 *              (madvise and touching the pages) and may raise SIGBUS when a
 *              file is truncated under it. Opened with the checkpoint.
 *   pagecache  a view of an mmap source that holds only the pages the page
 *              cache holds now (mincore): a routing source puts it first, so
 *              that warm ranges are copied from memory and cold ones go to
 *              the next source.
 *   direct     O_DIRECT reads (source_direct.c): no page-cache use, for
 *              checkpoints larger than host memory and first loads that must
 *              not evict what the page cache holds. Reads want dst congruent
 *              to the file offset modulo `align` (then the bytes go straight
 *              into the slot); others go through a bounce buffer.
 *   route      several sources in order (source_route.c): each read goes to
 *              the first that holds the range; a member whose read fails
 *              hands the range to the next that holds it.
 *   remote     a checkpoint in an object store or behind an HTTP server
 *              (source_remote.c over remote/rckpt.h): range GETs straight
 *              into the destination, many in flight; with a manifest, every
 *              range is fetched as whole manifest chunks and each checked
 *              before a byte of it is used (a mismatch is fetched once more,
 *              then BAD_CHECKSUM); it does not map, so
 *              loads from it are staged (or copied in place on the host
 *              backend), never direct DMA or pinned. Opened with the
 *              checkpoint, as mmap is for files.
 *
 * Sources read the files the checkpoint was opened with (the identities in
 * struct ckpt); `unchanged` says whether they still are those files, which
 * the loader checks after every load (STALE otherwise).
 *
 * Threads: read, holds and unchanged are called from any number of fill
 * threads at once; a source guards its own shared state. Reads from a
 * mapping may raise SIGBUS: callers run them under the fault guard
 * (fault.h), and a SIGBUS becomes FAULT.
 */
#ifndef WD_LD_SOURCE_H
#define WD_LD_SOURCE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"
#include "error.h"
#include "plan.h"

enum ld_source_kind {
  LD_SOURCE_MMAP,
  LD_SOURCE_PAGECACHE,
  LD_SOURCE_DIRECT,
  LD_SOURCE_ROUTE,
  LD_SOURCE_REMOTE,
  LD_SOURCE_KINDS
};

/* The kind's name, as status, logs and metrics show it ("mmap"). */
const char *ld_source_kind_name(enum ld_source_kind k);

/*
 * What a load reads from: the `source` setting and a load's `source` option
 * (docs/operations.md). auto is mmap unless the plan's bytes exceed
 * LD_AUTO_DIRECT_PERCENT of the host memory the daemon may use; then warm
 * ranges come from the page cache and the rest with O_DIRECT.
 */
enum ld_source_choice { LD_CHOOSE_AUTO, LD_CHOOSE_MMAP, LD_CHOOSE_DIRECT, LD_CHOOSE_COUNT };
#define LD_AUTO_DIRECT_PERCENT 50

/* The choice's name ("auto", "mmap", "direct") and back (0, or -1 for an unknown name). */
const char *ld_source_choice_name(enum ld_source_choice c);
int ld_source_choice_parse(const char *name, enum ld_source_choice *out);

/*
 * One read: `height` rows of `width` bytes, `pitch` apart in shard `shard`
 * from file offset `off` (height 1: one contiguous range), written packed to
 * dst (row r at dst + r * width).
 */
struct ld_read {
  uint32_t shard;
  uint64_t off, width, pitch, height;
  unsigned char *dst;
  /* How a CPU copy writes dst: memcpy, or stream_copy for staging slots (NULL: memcpy). */
  void *(*copy)(void *dst, const void *src, size_t n);
  /*
   * The caller reserved dst's whole aligned blocks around a contiguous read
   * (dst congruent to off modulo the source's align; the bytes of those
   * blocks outside [dst, dst + width) are scratch): a source may read whole
   * blocks straight into them.
   */
  bool slack;
  /* Per kind, bytes this caller read through leaf sources of that kind (the caller's own, not shared; may be NULL). */
  uint64_t *counts;
  /* The load's cancel flag (NULL: none): a source that waits on the network stops waiting when it is set (CANCELED). */
  const atomic_bool *cancel;
  /* Manifest chunks a source checked as it read ([0]) and of them those that differed first ([1]); the caller's own, may be NULL. */
  uint64_t *checks;
};

struct ld_source_ops {
  enum ld_source_kind kind;
  /* Reads rq (see struct ld_read): 0, or an error naming the shard and offset (FAULT for a truncated file). */
  int (*read)(void *ctx, const struct ld_read *rq, struct wd_error *err);
  /*
   * Reads rq[0..n), each contiguous (height 1, or pitch == width), in any
   * order and as one would read each, so that a source whose every request
   * costs a round trip can join reads that touch in the file (remote). 0, or
   * the first error (the other reads' bytes are then not promised). NULL:
   * reads are made one by one (struct ld_reader does that).
   */
  int (*readv)(void *ctx, const struct ld_read *rq, size_t n, struct wd_error *err);
  /*
   * Bytes from file offset off of shard `shard` this source holds, at most
   * len (0: it holds none at off). NULL: it holds every byte of every shard.
   */
  uint64_t (*holds)(void *ctx, uint32_t shard, uint64_t off, uint64_t len);
  /* The shard's mapping (file offset 0), or NULL: the source does not map (NULL op: never). */
  const unsigned char *(*map)(void *ctx, uint32_t shard);
  /*
   * Reads bytes [off, off + len) of shard `shard` into whatever the source
   * keeps warm, and when seen is not NULL hands them to it (in order, in
   * pieces) as they are read, so a caller digests them in the same pass.
   * NULL: the source keeps nothing warm (and no digest is made that way).
   */
  int (*prefetch)(void *ctx, uint32_t shard, uint64_t off, uint64_t len,
                  void (*seen)(void *arg, const unsigned char *p, size_t n), void *arg, struct wd_error *err);
  /* Tells the source that ranges[0..n) will be read soon (mmap: MADV_WILLNEED, which starts readahead). NULL: nothing to tell. */
  void (*advise)(void *ctx, const struct plan_range *ranges, size_t n);
  /* 0 when every shard is still the file the checkpoint was opened with, else STALE naming it. */
  int (*unchanged)(void *ctx, struct wd_error *err);
  /* Frees the context (NULL-safe ctx). */
  void (*destroy)(void *ctx);
};

struct ld_source {
  const struct ld_source_ops *ops;
  void *ctx;
  const struct ckpt *ck; /* the checkpoint it reads (outlives the source) */
  /* Reads are fastest with dst congruent to off modulo align (a power of two; 1: any). */
  uint64_t align;
  /* Reads are fastest at least this long (a device with a queue to fill: O_DIRECT); 0: any length. */
  uint64_t read_min;
  char label[48]; /* what status shows: the kind, or a route's members ("pagecache+direct") */
};

/* ---- calls ------------------------------------------------------------------------------- */

static inline int ld_source_read(const struct ld_source *s, const struct ld_read *rq, struct wd_error *err) {
  return s->ops->read(s->ctx, rq, err);
}
uint64_t ld_source_holds(const struct ld_source *s, uint32_t shard, uint64_t off, uint64_t len);
/* For sources: 0 when rq's bytes lie in its shard of ck; else INTERNAL (a plan that does not fit its checkpoint). */
int ld_read_check(const struct ckpt *ck, const struct ld_read *rq, struct wd_error *err);
/* The shard's mapping, or NULL when the source does not map. */
const unsigned char *ld_source_map(const struct ld_source *s, uint32_t shard);
int ld_source_unchanged(const struct ld_source *s, struct wd_error *err);
/* The prefetch and advise operations, doing nothing where the source has none. */
int ld_source_prefetch(const struct ld_source *s, uint32_t shard, uint64_t off, uint64_t len,
                       void (*seen)(void *arg, const unsigned char *p, size_t n), void *arg, struct wd_error *err);
void ld_source_advise(const struct ld_source *s, const struct plan_range *ranges, size_t n);
/* Frees s (NULL-safe). A route frees only itself: its members stay their owners'. */
void ld_source_close(struct ld_source *s);

/*
 * A reader of plan bytes through a source (a plan_read_fn for plan.h's
 * plan_image_read and plan_stage.h's plan_stage_read): each plan read
 * becomes one ld_source_read, with the file offset its shard's header adds.
 * Where the source has readv, contiguous reads are queued instead and made
 * together by ld_reader_flush, which the task calls once its walk is done:
 * a fill task's reads then reach the source as one batch. One reader per
 * fill task: counts are its own, added to the load's totals once;
 * ld_reader_clear frees its queue.
 */
struct ld_reader {
  const struct ld_source *src;
  void *(*copy)(void *, const void *, size_t);
  const atomic_bool *cancel; /* the load's (NULL: none) */
  uint64_t checks[2];        /* manifest chunks checked as they were read, and mismatches (struct ld_read) */
  uint64_t counts[LD_SOURCE_KINDS];
  struct wd_error err; /* the first read's error */
  struct ld_read *queue; /* reads waiting for ld_reader_flush (malloc'd, cap of them) */
  size_t queued, cap;
};
int ld_reader_read(void *arg, const struct plan_read *rd);
/* Makes the queued reads (readv): 0 or the first error (in r->err). The queue is empty after. */
int ld_reader_flush(struct ld_reader *r);
/* Frees the queue (reads still in it are dropped: a walk that failed). */
void ld_reader_clear(struct ld_reader *r);

/* Where piece pc's source starts in its shard file. */
uint64_t ld_piece_file_off(const struct ckpt *ck, const struct plan_piece *pc);

/* ---- the sources ---------------------------------------------------------------------------- */

/*
 * Maps every shard of ck read-only (MAP_SHARED; empty shards stay unmapped)
 * and closes its descriptors: the mappings keep the files. On failure
 * nothing stays mapped. ck must outlive the source.
 */
int ld_source_mmap_open(struct ckpt *ck, struct ld_source **out, struct wd_error *err);

struct rck;
/*
 * The remote source of checkpoint r (rckpt.h), which it takes: closing the
 * source closes r, except r->ck, which becomes the caller's (freed after
 * the source is closed, as a file checkpoint's is).
 */
int ld_source_remote_open(struct rck *r, struct ld_source **out, struct wd_error *err);

/* A pagecache view of mmap source m (which must outlive it): holds what the page cache holds now. */
int ld_source_pagecache_open(const struct ld_source *m, struct ld_source **out, struct wd_error *err);

/*
 * Opens every shard of ck again for O_DIRECT reads, by its resolved path,
 * and checks that each is the file ck was opened with (STALE otherwise).
 * UNSUPPORTED, naming the file, when its filesystem refuses O_DIRECT (the
 * caller then reads it another way); refuse_test makes every open fail so
 * (the test_refuse_odirect setting).
 */
int ld_source_direct_open(const struct ckpt *ck, bool refuse_test, struct ld_source **out, struct wd_error *err);

/*
 * A routing source over members[0..n) in order (each outlives the route):
 * a read goes to the first member that holds its first byte, for as many
 * bytes as that member holds; a member whose read fails (not FAULT: a
 * truncated file is truncated for every member) passes the range to the next
 * one that holds it, and the failure is logged. Its align is the largest of
 * the members'.
 */
int ld_source_route_open(struct ld_source *const *members, size_t n, struct ld_source **out, struct wd_error *err);

#endif
