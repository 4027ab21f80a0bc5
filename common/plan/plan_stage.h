/*
 * plan_stage.h - how the staging pipeline cuts a plan into slot-sized
 * windows, and what each window's transfers are.
 *
 * A staged load fills a pinned slot on the CPU and lets the GPU's copy engine
 * move it. Most pieces are staged as the slab image: their bytes in slab
 * order (plan_gather), one plain copy per run of the slab. A piece whose rows
 * are short and strided (a column slice: `width` bytes every `src_pitch`)
 * may instead be staged as whole rows: the fill threads copy the contiguous
 * source span (rows x src_pitch) with large memcpys, and one 2D copy takes
 * `width` bytes of each row from the slot to the slab (slot pitch src_pitch,
 * slab pitch width), so PCIe still moves only the rank's bytes while the CPU
 * copies src_pitch / width times as many. Which pieces go that way is the
 * `staged_strided` setting (docs/operations.md):
 *
 *   gather  never: the CPU gathers every row (the slab image, as before);
 *   rows    every strided piece whose source rows fit a slot;
 *   auto    strided pieces with rows of at most PLAN_ROWS_AUTO_WIDTH bytes,
 *           a pitch at most PLAN_ROWS_AUTO_RATIO times the width (a TP=2
 *           column slice) and at least PLAN_ROWS_AUTO_MIN bytes. Whole rows
 *           win only where a contiguous memcpy beats a strided gather by more
 *           than the extra bytes cost. The rule is provisional, from one
 *           thread on a development machine (slab bytes per second: gather
 *           4.0-4.3 GiB/s vs whole rows 3.0-3.5 for 4-10 KiB rows at twice
 *           their width; 2.1-2.3 vs 2.3-2.6 for 2 KiB rows); the GPU host's
 *           fill threads decide it (tests/gpu/speed.sh measures both, see
 *           docs/benchmarks.md, "Strided pieces").
 *
 * Aligned schedules (align > 1), for sources whose reads want their
 * destination congruent to the file offset (O_DIRECT): every piece is staged
 * as its source holds it - a contiguous piece as a span of file bytes, a
 * strided one as whole rows whenever its rows fit a slot - each placed in the
 * slot at an offset congruent to its first byte's file offset modulo align,
 * with the whole aligned blocks around it its own (no other transfer's bytes
 * lie in them), so a read may fill those blocks straight from the file. Only
 * alignment gaps, zero pieces and rows too long for a slot are image bytes.
 *
 * The schedule is pure: it reads only the plan (and, aligned, the shards'
 * header lengths); plan_stage_read hands its reads to the caller's reader,
 * and plan_stage_fill reads the mappings it is handed (a caller that fears
 * truncated files runs it under a SIGBUS guard).
 */
#ifndef WD_PLAN_STAGE_H
#define WD_PLAN_STAGE_H

#include <stdbool.h>
#include <stdint.h>

#include "error.h"
#include "plan.h"

enum plan_strided { PLAN_STRIDED_GATHER, PLAN_STRIDED_ROWS, PLAN_STRIDED_AUTO };

#define PLAN_ROWS_AUTO_WIDTH (2ull << 10)
#define PLAN_ROWS_AUTO_RATIO 2ull
#define PLAN_ROWS_AUTO_MIN (1ull << 20)

/*
 * One transfer of a window: `len` slot bytes at slot offset `at`.
 *   image  the slab image [dst, dst + len), copied as is (pc NULL);
 *   rows   rows [row0, row0 + rows) of piece pc as the source holds them
 *          (src_pitch apart; the last row only `width` long), whose
 *          `width`-byte heads go to slab offset dst, `width` apart (a 2D copy);
 *   span   bytes [src, src + len) of contiguous piece pc's source, copied to
 *          slab offset dst as is (aligned schedules only).
 */
enum plan_xfer_kind { PLAN_XFER_IMAGE, PLAN_XFER_ROWS, PLAN_XFER_SPAN };

struct plan_xfer {
  enum plan_xfer_kind kind;
  uint64_t at, len, dst;
  const struct plan_piece *pc;
  uint64_t row0, rows; /* rows */
  uint64_t src;        /* span */
};

struct plan_window {
  size_t first, count; /* its transfers: xfers[first, first + count) */
  uint64_t used;       /* slot bytes it fills: the end of its last transfer */
  uint64_t slab_bytes; /* slab bytes it delivers */
};

struct plan_stage {
  uint64_t slot_bytes;
  uint64_t align; /* 1: the image schedule; else the aligned one */
  size_t nwindows, nxfers;
  struct plan_window *windows;
  struct plan_xfer *xfers;
  uint64_t staged_bytes; /* bytes the fill threads copy: the windows' used bytes */
  size_t rows_pieces;    /* pieces staged as whole rows */
};

/* Whether piece pc is staged as whole rows under mode, with slots of slot_bytes. */
bool plan_piece_rows(const struct plan_piece *pc, enum plan_strided mode, uint64_t slot_bytes);

/*
 * Cuts plan p into windows of at most slot_bytes, in slab order: every slab
 * byte is delivered by exactly one transfer (alignment gaps as image bytes),
 * transfers deliver consecutive slab ranges, so window w delivers one
 * contiguous range that starts where window w - 1's ends (the loader's ready
 * watermark relies on it). With align 1 (or 0) and no piece staged as rows,
 * window w is exactly slab bytes [w * slot_bytes, (w + 1) * slot_bytes).
 * align > 1 (a power of two, with slot_bytes a multiple of it) builds the
 * aligned schedule for c (the checkpoint p was built for; unused otherwise),
 * where mode does not apply. Returns 0, or WEIGHTD_E_NOMEM.
 */
int plan_stage_build(const struct plan *p, const struct ckpt *c, uint64_t slot_bytes, enum plan_strided mode,
                     uint64_t align, struct plan_stage **out, struct wd_error *err);

void plan_stage_free(struct plan_stage *s);

/*
 * Writes slot bytes [lo, hi) of window w into dst (dst receives slot offset
 * lo) through read: one read per part of a rows or span transfer in [lo, hi)
 * (slack set in aligned schedules), image parts as plan_image_read does.
 * Bytes between transfers (alignment) are left as they are. Returns read's
 * first non-zero result, or 0.
 */
int plan_stage_read(const struct plan_stage *s, const struct plan *p, size_t w, uint64_t lo, uint64_t hi,
                    unsigned char *dst, plan_read_fn read, void *arg);

/*
 * plan_stage_read from the mappings: data[i] points at shard i's data
 * section. Copies with copy (memcpy, or stream_copy: then the caller fences
 * before the slot is read).
 */
void plan_stage_fill(const struct plan_stage *s, const struct plan *p, const unsigned char *const *data, size_t w,
                     uint64_t lo, uint64_t hi, unsigned char *dst, plan_copy_fn copy);

#endif
