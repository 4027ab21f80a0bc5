/*
 * plan_build.h - what the files of the plan builder share; internal to
 * common/plan*.c (and their unit test). plan.h is the interface.
 *
 * A build goes: plan_spec_parse reads the request's JSON into a typed,
 * normalised spec (plan_spec.c); the builder (plan.c) runs the spec's kind -
 * every tensor whole or a family's layer rules (plan_presets.c, emitting
 * through plan_parts.c), or the explicit outputs (plan.c), all through the
 * primitives of plan_out.c - checks the names,
 * places the outputs in the slab, and plan_key_make writes the key
 * (plan_key.c). Every piece goes through plan_piece_slice and every output
 * through plan_out_begin / plan_out_add / plan_out_end, which hold all the
 * checks on bounds, dtypes and sizes.
 */
#ifndef WD_PLAN_BUILD_H
#define WD_PLAN_BUILD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "family.h"
#include "modelcfg.h"
#include "plan.h"

/* The most dimensions an output may have (an expert stack adds one to its tensors'). */
#define PLAN_MAX_DIMS 8u

/* A piece's `end` when the spec leaves it out: the tensor's size along `dim`. */
#define PLAN_END_WHOLE UINT64_MAX

/* ---- the spec (plan_spec.c) ------------------------------------------------------------ */

enum plan_kind {
  PLAN_WHOLE,    /* {"preset": "whole"}, {} or no plan */
  PLAN_LAYERS,   /* a family's layer rules */
  PLAN_EXPLICIT, /* {"outputs": [...]} */
};

struct plan_spec_piece {
  const char *tensor; /* NULL: rows of zeros */
  uint64_t dim, start, end; /* end: PLAN_END_WHOLE when not given */
  uint64_t zeros;           /* rows, when tensor is NULL */
};

struct plan_spec_output {
  const char *name;
  enum wd_dtype dtype;
  unsigned ndim;
  uint64_t shape[PLAN_MAX_DIMS];
  size_t npieces;
  struct plan_spec_piece *pieces;
};

/*
 * A spec, read and normalised: defaults filled in, ranks checked against
 * sizes, "auto" resolved to a family, experts sorted. Strings point into the
 * JSON it was read from, which must outlive it.
 */
struct plan_spec {
  enum plan_kind kind;
  enum family family; /* PLAN_LAYERS */
  uint64_t tp_size, tp_rank, ep_size, ep_rank;
  bool fuse;
  uint64_t *experts; /* this rank's experts, ascending; NULL: a contiguous range */
  size_t nexperts;
  struct plan_spec_output *outputs; /* PLAN_EXPLICIT */
  size_t noutputs;
};

/*
 * Reads spec (NULL: every tensor whole) into *out; config (NULL when the
 * checkpoint has no config.json) resolves "auto". Errors are
 * WEIGHTD_E_BAD_PLAN naming the field's path, or WEIGHTD_E_NOMEM. *out is
 * freed with plan_spec_free either way.
 */
int plan_spec_parse(const cJSON *spec, const struct mcfg *config, struct plan_spec *out, struct wd_error *err);

void plan_spec_free(struct plan_spec *s);

/* ---- the key (plan_key.c) ---------------------------------------------------------------- */

/*
 * Writes the key of the plan s describes (docs/protocol.md, "Plans" ->
 * "Identity") into *key, a new string of at most PLAN_KEY_MAX bytes. p, the
 * plan built from s, is read only for an explicit plan (it may be NULL for a
 * preset). Returns 0, WEIGHTD_E_NOMEM, or WEIGHTD_E_INTERNAL should a key
 * outgrow PLAN_KEY_MAX (the documented forms cannot).
 */
int plan_key_make(const struct plan_spec *s, const struct plan *p, char **key, struct wd_error *err);

/* ---- the builder and its primitives (plan_out.c) --------------------------------------- */

struct plan_builder {
  const struct ckpt *c;
  const struct plan_spec *spec;
  struct plan *p;
  size_t cap; /* of p->outputs */
  struct wd_error *err;
  uint64_t block_n, block_k; /* FP8 block size, 0 when the checkpoint has none */
  /* the output being built */
  struct plan_output *cur;
  size_t piece_cap;
  uint64_t cur_bytes;
  unsigned char *used; /* per checkpoint tensor (by_name index): emitted already */
};

/* Sets WEIGHTD_E_BAD_PLAN with the message and returns it. */
int plan_fail(struct plan_builder *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

int plan_nomem(struct plan_builder *b);

/* The checkpoint tensor named by the format, or NULL (also when the name is too long to be one). */
const struct ckpt_ref *plan_find(struct plan_builder *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Records that r (NULL: nothing) is served, so that the layer rules do not replicate it again. */
void plan_mark_used(struct plan_builder *b, const struct ckpt_ref *r);

/*
 * Rows [start, end) of dimension dim of tensor r as a piece, with every
 * check: the dimension exists, the rows are in range, sub-byte dtypes cover
 * whole bytes, nothing overflows.
 */
int plan_piece_slice(struct plan_builder *b, const struct ckpt_ref *r, uint64_t dim, uint64_t start,
                     uint64_t end, struct plan_piece *out);

/* Starts an output of that name, dtype and shape; its pieces follow, and plan_out_end checks they fill it. */
int plan_out_begin(struct plan_builder *b, const char *name, enum wd_dtype dtype, unsigned ndim,
                   const uint64_t *shape);
int plan_out_add(struct plan_builder *b, const struct plan_piece *pc);

/* Adds rows [start, end) of dimension dim of r to the current output. */
int plan_out_slice(struct plan_builder *b, const struct ckpt_ref *r, uint64_t dim, uint64_t start, uint64_t end);

/* Adds `rows` rows of zeros of the output's row size (its shape without dimension 0). */
int plan_out_zeros(struct plan_builder *b, uint64_t rows);

int plan_out_end(struct plan_builder *b);

/* ---- outputs from parts of tensors (plan_parts.c) ------------------------------------- */

/* One part of an output: rows [a, b) of dimension dim of a tensor. */
struct plan_part {
  const struct ckpt_ref *t;
  unsigned dim;
  uint64_t a, b;
};

/*
 * Emits `name` as the concatenation of parts along dimension 0 (each part
 * sliced along its own dim), and, when the parts have FP8 scales, the scale
 * output sliced and concatenated the same way, block by block. stacked: the
 * parts form nparts/group groups of `group` (experts), and the output gets a
 * leading dimension of nparts/group.
 */
int plan_emit_parts(struct plan_builder *b, const char *name, const struct plan_part *parts, size_t nparts,
                    size_t group, bool stacked);

/* A tensor whole, under its own name (with its scale, if any); t NULL emits nothing. */
int plan_emit_whole(struct plan_builder *b, const struct ckpt_ref *t);

/* Column- (dim 0) or row- (dim 1) parallel over the tp ranks, in units of `unit` rows; t NULL emits nothing. */
int plan_emit_split(struct plan_builder *b, const struct ckpt_ref *t, unsigned dim, uint64_t unit);

/* Rows [r*n/parts, (r+1)*n/parts) of dimension dim of t, in units of `unit` rows; n must divide. */
int plan_split_range(struct plan_builder *b, const struct ckpt_ref *t, unsigned dim, uint64_t parts, uint64_t r,
                     uint64_t unit, uint64_t *a, uint64_t *e);

/* The FP8 scale tensor of a weight ("x.weight" -> "x.weight_scale_inv"), or NULL. */
const struct ckpt_ref *plan_scale_of(struct plan_builder *b, const struct ckpt_ref *w);

/* ---- the presets (plan_presets.c) ------------------------------------------------------ */

/* Every tensor whole, in file order. */
int plan_preset_whole(struct plan_builder *b);

/* The family's layer rules for the spec's rank; what no rule places is replicated whole. */
int plan_preset_layers(struct plan_builder *b);

#endif
