/*
 * plan.h - a plan: the output tensors one rank needs, where each one's bytes
 * come from, and where it sits in the rank's slab.
 *
 * A plan is built for one checkpoint from a spec, the JSON object a load
 * request carries (docs/protocol.md, "Plans"): a preset - every tensor whole
 * ({"preset": "whole"}, the default), or a model family's layer rules
 * ("dense", "qwen3_moe", "deepseek_v3", or "auto" for the family of
 * config.json's model_type) for one tensor- and expert-parallel rank, fused
 * or not, as vLLM lays it out - or an explicit plan listing the outputs
 * ({"outputs": [...]}). A spec is read strictly: an unknown field, a field
 * given twice or one that does not belong to the spec's kind is BAD_PLAN
 * naming its path ("plan.outputs[3]: unknown field 'x'").
 *
 * Each output is a concatenation, in order, of pieces; a piece is `height`
 * rows of `width` bytes read from a source tensor starting at `src_offset`,
 * rows `src_pitch` apart (a whole tensor is one row; a column slice is many
 * short rows), or zeros when it has no source (padding). Outputs sit in one
 * slab at offsets aligned to PLAN_ALIGN; every size and offset was summed
 * with overflow checks. A plan keeps pointers into the checkpoint it was
 * built for, which must outlive it.
 *
 * Its key identifies it within that checkpoint: a resident set's identity
 * includes it, so identical plans share a set however their specs were
 * written. The key is short JSON text of at most PLAN_KEY_MAX bytes: a
 * preset's normal form ({"preset":"dense","tp_size":2,"tp_rank":0,...}),
 * or for an explicit plan the count and SHA-256 of its outputs' normal form
 * ({"outputs":N,"sha256":"..."}). The form is versioned and stable across
 * daemon versions; docs/protocol.md ("Plans" -> "Identity") defines it.
 */
#ifndef WD_PLAN_H
#define WD_PLAN_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "checkpoint.h"
#include "dtype.h"
#include "error.h"

#define PLAN_ALIGN 256u

/* The longest key, in bytes without its NUL, whatever the plan. */
#define PLAN_KEY_MAX 320u

struct plan_piece {
  const struct ckpt_ref *src; /* NULL: zeros */
  uint64_t src_offset;        /* bytes into the source tensor's data */
  uint64_t width;             /* bytes per row */
  uint64_t src_pitch;         /* bytes between source rows */
  uint64_t height;            /* rows */
  /* What the piece is, for people: rows [start, end) of dimension dim of src
   * (the whole tensor: dim 0, start 0, end shape[0]), or `end` rows of zeros. */
  unsigned dim;
  uint64_t start, end;
};

struct plan_output {
  char *name;
  enum wd_dtype dtype;
  unsigned ndim;
  uint64_t *shape;
  uint64_t nbytes;
  uint64_t offset; /* in the slab */
  size_t npieces;
  struct plan_piece *pieces;
};

struct plan {
  char *key; /* the identity key: JSON text, at most PLAN_KEY_MAX bytes */
  size_t noutputs;
  struct plan_output *outputs;
  uint64_t payload_bytes; /* sum of the outputs' bytes */
  uint64_t slab_bytes;    /* with alignment */
};

/*
 * Builds the plan `spec` describes for checkpoint c (spec NULL means
 * {"preset": "whole"}). Errors are WEIGHTD_E_BAD_PLAN naming what does not
 * fit (the field, the tensor, the rule), or WEIGHTD_E_NOMEM.
 */
int plan_build(const struct ckpt *c, const cJSON *spec, struct plan **out, struct wd_error *err);

void plan_free(struct plan *p);
/* A copy of p for the same checkpoint (its pieces point into it as p's do): 0, or WEIGHTD_E_NOMEM. */
int plan_copy(const struct plan *p, struct plan **out);

/*
 * The plan as JSON: {"key": the key, "payload_bytes", "slab_bytes",
 * "outputs": [{"name", "dtype", "shape", "offset", "nbytes", "pieces":
 * [{"tensor", "dim", "start", "end"} | {"zeros": rows}]}]}.
 */
cJSON *plan_describe(const struct plan *p);

/* The outputs alone, without their pieces: the tensor table attach replies carry. */
cJSON *plan_table(const struct plan *p);

/* The first output that ends after slab offset off (the one holding it, or the next), or NULL. */
const struct plan_output *plan_output_at(const struct plan *p, uint64_t off);

/*
 * Writes the slab image of bytes [lo, hi) to dst: each output's pieces in
 * order, zeros in the alignment gaps. data[i] points at shard i's data
 * section (its mapping + data_start). Reads mappings: a caller that fears
 * truncated files runs it under a SIGBUS guard.
 */
void plan_gather(const struct plan *p, const unsigned char *const *data, uint64_t lo, uint64_t hi,
                 unsigned char *dst);

/* A memcpy: what plan_gather_with copies bytes with (memcpy, or stream_copy for staging slots). */
typedef void *(*plan_copy_fn)(void *dst, const void *src, size_t n);

/* plan_gather copying with copy; the zeros of alignment gaps are written with memset. */
void plan_gather_with(const struct plan *p, const unsigned char *const *data, uint64_t lo, uint64_t hi,
                      unsigned char *dst, plan_copy_fn copy);

/* ---- a plan and the binary tensor table (plan_table.c) ------------------------------ */

struct ttab;
struct ttab_tensor;

/* The tensor table writer's view (ttab_get_fn) of output i of plan (a struct plan *). */
void plan_ttab_get(void *plan, size_t i, struct ttab_tensor *out);

/*
 * A plan rebuilt from an opened tensor table and its key: the outputs in
 * slab order without pieces (for a set whose bytes are already in place,
 * re-adopted after a restart; it can never be loaded). WEIGHTD_E_BAD_PLAN
 * for an unknown dtype or a key too long, WEIGHTD_E_NOMEM.
 */
int plan_from_ttab(const struct ttab *t, const char *key, struct plan **out, struct wd_error *err);

/* ---- the byte ranges a plan reads -------------------------------------------------- */

/* A range of one shard file (header included in the offsets), as registration takes it. */
struct plan_range {
  uint32_t shard;
  uint64_t off; /* a multiple of the page size */
  uint64_t len; /* to a page boundary, or to the end of the file */
};

/*
 * The byte ranges of c's shard files that plan p reads: every piece's source
 * span (its first row's start to its last row's end), widened to whole pages
 * of `page` bytes (a power of two) and cut at the file's end, sorted by shard
 * and offset, and merged where they overlap, touch, or lie less than `gap`
 * bytes apart. These are what pinning per plan registers and prefetching per
 * plan reads. *out is a new array of *n ranges (NULL and 0 when p reads
 * nothing). Returns 0, or WEIGHTD_E_NOMEM.
 */
int plan_ranges(const struct plan *p, const struct ckpt *c, uint64_t page, uint64_t gap, struct plan_range **out,
                size_t *n, struct wd_error *err);

/* The bytes n ranges cover. */
uint64_t plan_ranges_bytes(const struct plan_range *r, size_t n);

/*
 * One run of the slab image: `height` rows of `width` bytes that land packed
 * at slab offset dst (row r at dst + r * width), read from piece pc's source
 * starting `src` bytes after the piece's first source byte, rows src_pitch
 * apart; pc NULL (an alignment gap or a piece of zeros): width * height zero
 * bytes.
 */
struct plan_segment {
  const struct plan_piece *pc;
  uint64_t dst, src, src_pitch, width, height;
};

typedef int (*plan_segment_fn)(void *arg, const struct plan_segment *sg);

/*
 * Cuts the slab image of bytes [lo, hi) into segments, in slab order, that
 * cover it exactly: a contiguous piece is one segment, a strided one at most
 * three (a partial first row, whole rows as one 2D run, a partial last row).
 * Calls fn for each and stops at its first non-zero return, which it
 * returns; 0 once every segment was given. plan_gather writes what they
 * say; a loader that has the copy engines read the mappings copies them.
 */
int plan_segments(const struct plan *p, uint64_t lo, uint64_t hi, plan_segment_fn fn, void *arg);

/*
 * One read of a plan's source bytes: `height` rows of `width` bytes, `pitch`
 * apart, starting at offset `off` of shard `shard`'s data section (the file
 * offset less the shard's header, data_start), packed into dst (row r at
 * dst + r * width). slack: dst's whole blocks of the staging schedule's
 * alignment around a contiguous read are the reader's scratch (plan_stage.h).
 */
struct plan_read {
  uint32_t shard;
  uint64_t off, width, pitch, height;
  unsigned char *dst;
  bool slack;
};

/* Performs one read: 0, or an error code that stops the walk and is returned. */
typedef int (*plan_read_fn)(void *arg, const struct plan_read *rd);

/*
 * Writes the slab image of bytes [lo, hi) to dst: zeros for alignment gaps
 * and zero pieces, and a call of read for every other segment (one per
 * contiguous run, one per run of strided rows). Returns read's first
 * non-zero result, or 0.
 */
int plan_image_read(const struct plan *p, uint64_t lo, uint64_t hi, unsigned char *dst, plan_read_fn read, void *arg);

/* The reader of mappings plan_gather uses: data[i] is shard i's data section; copy NULL means memcpy. */
struct plan_maps {
  const unsigned char *const *data;
  plan_copy_fn copy;
};
int plan_map_read(void *arg, const struct plan_read *rd);

#endif
