/*
 * load_source.h - reading a load's source: where each shard's data sits in
 * its mapping, which file bytes are registered with the GPU, and the FAULT
 * error for a shard truncated while it was read. Pure functions of an
 * ld_target (load_target.h), shared by the loader (loader.c) and the
 * striped data path (multigpu.c, stripe.c).
 */
#ifndef WD_LOAD_SOURCE_H
#define WD_LOAD_SOURCE_H

#include <stdbool.h>
#include <stdint.h>

#include "error.h"
#include "load_target.h"
#include "plan.h"

/*
 * The per-plan pin test: true when every source byte of t's plan lies in
 * t->pins, so that the copy engines may read the mappings themselves.
 */
bool ld_plan_pinned(const struct ld_target *t);

/*
 * Bytes from file offset off of shard `shard` that lie in one of t->pins
 * (a direct copy never crosses from one registration into the next), or 0
 * when off is not registered.
 */
uint64_t ld_pinned_run(const struct ld_target *t, uint32_t shard, uint64_t off);

/* Where piece pc's source starts in its shard file. */
uint64_t ld_piece_file_off(const struct ld_target *t, const struct plan_piece *pc);

/* Per shard of t's checkpoint, where its data section starts in the mapping (a new array, or NULL). */
const unsigned char **ld_shard_data(const struct ld_target *t);

/* A FAULT error naming the tensor at slab offset off (a shard truncated while it was read). */
int ld_fault_error(const struct ld_target *t, uint64_t off, struct wd_error *err);

#endif
