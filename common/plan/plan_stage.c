/* plan_stage.c - the staging pipeline's windows and transfers (see plan_stage.h). */
#include "plan_stage.h"

#include <stdlib.h>
#include <string.h>

/* Transfers after the first of a window start at this alignment in the slot. */
#define XFER_ALIGN 64ull

bool plan_piece_rows(const struct plan_piece *pc, enum plan_strided mode, uint64_t slot_bytes) {
  if (pc->src == NULL || pc->height <= 1 || pc->width == 0 || pc->src_pitch == pc->width) return false;
  if (pc->src_pitch > slot_bytes) return false;
  switch (mode) {
  case PLAN_STRIDED_GATHER: return false;
  case PLAN_STRIDED_ROWS: return true;
  case PLAN_STRIDED_AUTO:
    return pc->width <= PLAN_ROWS_AUTO_WIDTH && pc->src_pitch <= PLAN_ROWS_AUTO_RATIO * pc->width &&
           pc->width * pc->height >= PLAN_ROWS_AUTO_MIN;
  }
  return false;
}

struct builder {
  struct plan_stage *s;
  const struct ckpt *c; /* aligned schedules: the shards' data_start */
  size_t wcap, xcap;
  bool open;   /* a window is open */
  uint64_t at; /* the open window's fill position */
  bool source; /* aligned: the open window's last transfer is source bytes, whose tail block is its own */
  int rc;
};

static void window_close(struct builder *b) {
  if (!b->open) return;
  b->s->windows[b->s->nwindows - 1].used = b->at;
  b->s->staged_bytes += b->at;
  b->open = false;
}

/*
 * Where the next image transfer may start in the open window (0 in a new
 * one): after a transfer of source bytes in an aligned schedule, at the next
 * aligned block, so that the blocks a read fills straight from the file
 * hold no other transfer's bytes whatever order the fill tasks run in.
 */
static uint64_t next_at(const struct builder *b) {
  if (!b->open) return 0;
  uint64_t g = b->source && b->s->align > XFER_ALIGN ? b->s->align : XFER_ALIGN;
  return (b->at + g - 1) / g * g;
}

/*
 * Where a transfer of source bytes starting at file offset `file` goes in
 * the open window: at a whole aligned block after everything before it, plus
 * the offset's remainder (0-based in a new window).
 */
static uint64_t source_at(const struct builder *b, uint64_t file) {
  uint64_t a = b->s->align;
  uint64_t region = b->open ? (b->at + a - 1) / a * a : 0;
  return region + file % a;
}

static void window_open(struct builder *b) {
  struct plan_stage *s = b->s;
  window_close(b);
  if (s->nwindows == b->wcap) {
    size_t cap = b->wcap ? 2 * b->wcap : 64;
    struct plan_window *nw = realloc(s->windows, cap * sizeof *nw);
    if (nw == NULL) {
      b->rc = WEIGHTD_E_NOMEM;
      return;
    }
    s->windows = nw;
    b->wcap = cap;
  }
  s->windows[s->nwindows++] = (struct plan_window){.first = s->nxfers};
  b->open = true;
  b->at = 0;
  b->source = false;
}

static void xfer_add(struct builder *b, const struct plan_xfer *x, uint64_t slab_bytes) {
  struct plan_stage *s = b->s;
  if (s->nxfers == b->xcap) {
    size_t cap = b->xcap ? 2 * b->xcap : 64;
    struct plan_xfer *nx = realloc(s->xfers, cap * sizeof *nx);
    if (nx == NULL) {
      b->rc = WEIGHTD_E_NOMEM;
      return;
    }
    s->xfers = nx;
    b->xcap = cap;
  }
  s->xfers[s->nxfers++] = *x;
  struct plan_window *w = &s->windows[s->nwindows - 1];
  w->count++;
  w->slab_bytes += slab_bytes;
  b->at = x->at + x->len;
  b->source = x->kind != PLAN_XFER_IMAGE && s->align > 1;
}

/* Slab image bytes [lo, hi), split across windows. */
static void add_image(struct builder *b, uint64_t lo, uint64_t hi) {
  while (lo < hi && b->rc == 0) {
    uint64_t at = next_at(b);
    if (!b->open || at >= b->s->slot_bytes) {
      window_open(b);
      continue;
    }
    uint64_t n = hi - lo < b->s->slot_bytes - at ? hi - lo : b->s->slot_bytes - at;
    struct plan_xfer x = {.kind = PLAN_XFER_IMAGE, .at = at, .len = n, .dst = lo};
    xfer_add(b, &x, n);
    lo += n;
  }
}

/* The file offset of piece pc's source byte `src` (aligned schedules). */
static uint64_t file_off(const struct builder *b, const struct plan_piece *pc, uint64_t src) {
  return b->c->shards[pc->src->shard].hdr->data_start + pc->src->t->begin + pc->src_offset + src;
}

/* Piece pc, at slab offset dst, as whole source rows, as many rows per window as fit. */
static void add_rows(struct builder *b, const struct plan_piece *pc, uint64_t dst) {
  uint64_t r = 0;
  bool aligned = b->s->align > 1;
  while (r < pc->height && b->rc == 0) {
    uint64_t at = aligned ? source_at(b, file_off(b, pc, r * pc->src_pitch)) : next_at(b);
    uint64_t space = b->open && at < b->s->slot_bytes ? b->s->slot_bytes - at : 0;
    uint64_t fit = space >= pc->width ? (space - pc->width) / pc->src_pitch + 1 : 0;
    if (fit == 0) { /* a new window holds at least one row (plan_piece_rows, source_piece) */
      window_open(b);
      continue;
    }
    uint64_t n = pc->height - r < fit ? pc->height - r : fit;
    struct plan_xfer x = {.kind = PLAN_XFER_ROWS,
                          .at = at,
                          .len = (n - 1) * pc->src_pitch + pc->width,
                          .dst = dst + r * pc->width,
                          .pc = pc,
                          .row0 = r,
                          .rows = n};
    xfer_add(b, &x, n * pc->width);
    r += n;
  }
}

/* Contiguous piece pc, at slab offset dst, as spans of its source bytes (aligned schedules). */
static void add_span(struct builder *b, const struct plan_piece *pc, uint64_t dst) {
  uint64_t len = pc->width * pc->height;
  for (uint64_t done = 0; done < len && b->rc == 0;) {
    uint64_t at = source_at(b, file_off(b, pc, done));
    if (!b->open || at >= b->s->slot_bytes) {
      window_open(b);
      continue;
    }
    uint64_t n = len - done < b->s->slot_bytes - at ? len - done : b->s->slot_bytes - at;
    struct plan_xfer x = {.kind = PLAN_XFER_SPAN, .at = at, .len = n, .dst = dst + done, .pc = pc, .src = done};
    xfer_add(b, &x, n);
    done += n;
  }
}

/* Aligned schedules: whether pc goes as its source holds it, and how (else as image bytes). */
static enum plan_xfer_kind source_piece(const struct plan_piece *pc, uint64_t slot_bytes, uint64_t align) {
  if (pc->src == NULL || pc->width == 0 || pc->height == 0) return PLAN_XFER_IMAGE;
  if (pc->height <= 1 || pc->src_pitch == pc->width) return PLAN_XFER_SPAN;
  return pc->src_pitch + align <= slot_bytes ? PLAN_XFER_ROWS : PLAN_XFER_IMAGE;
}

int plan_stage_build(const struct plan *p, const struct ckpt *c, uint64_t slot_bytes, enum plan_strided mode,
                     uint64_t align, struct plan_stage **out, struct wd_error *err) {
  *out = NULL;
  struct plan_stage *s = calloc(1, sizeof *s);
  if (s == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory planning the staging windows");
  s->align = align > 1 ? align : 1;
  s->slot_bytes = slot_bytes / s->align * s->align; /* aligned: whole blocks, so every slack block lies in the slot */
  if (s->slot_bytes < 2 * s->align) { /* no room to align in: the image schedule */
    s->align = 1;
    s->slot_bytes = slot_bytes;
  }
  struct builder b = {.s = s, .c = c};
  uint64_t img = 0; /* slab bytes before this are scheduled */
  for (size_t i = 0; i < p->noutputs && b.rc == 0; i++) {
    const struct plan_output *o = &p->outputs[i];
    uint64_t pos = o->offset;
    for (size_t k = 0; k < o->npieces && b.rc == 0; k++) {
      const struct plan_piece *pc = &o->pieces[k];
      uint64_t len = pc->width * pc->height;
      enum plan_xfer_kind kind = s->align > 1                             ? source_piece(pc, s->slot_bytes, s->align)
                                 : plan_piece_rows(pc, mode, slot_bytes) ? PLAN_XFER_ROWS
                                                                         : PLAN_XFER_IMAGE;
      if (kind != PLAN_XFER_IMAGE) {
        add_image(&b, img, pos);
        if (kind == PLAN_XFER_ROWS) {
          add_rows(&b, pc, pos);
          s->rows_pieces++;
        } else {
          add_span(&b, pc, pos);
        }
        img = pos + len;
      }
      pos += len;
    }
  }
  if (b.rc == 0) add_image(&b, img, p->slab_bytes);
  window_close(&b);
  if (b.rc != 0) {
    plan_stage_free(s);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory planning the staging windows");
  }
  *out = s;
  return 0;
}

void plan_stage_free(struct plan_stage *s) {
  if (s == NULL) return;
  free(s->windows);
  free(s->xfers);
  free(s);
}

int plan_stage_read(const struct plan_stage *s, const struct plan *p, size_t w, uint64_t lo, uint64_t hi,
                    unsigned char *dst, plan_read_fn read, void *arg) {
  const struct plan_window *win = &s->windows[w];
  int rc = 0;
  for (size_t i = win->first; i < win->first + win->count && rc == 0; i++) {
    const struct plan_xfer *x = &s->xfers[i];
    uint64_t a = x->at > lo ? x->at : lo, e = x->at + x->len < hi ? x->at + x->len : hi;
    if (a >= e) continue;
    if (x->kind == PLAN_XFER_IMAGE) {
      rc = plan_image_read(p, x->dst + (a - x->at), x->dst + (e - x->at), dst + (a - lo), read, arg);
      continue;
    }
    const struct plan_piece *pc = x->pc;
    uint64_t first = x->kind == PLAN_XFER_ROWS ? x->row0 * pc->src_pitch : x->src;
    struct plan_read rd = {.shard = pc->src->shard,
                           .off = pc->src->t->begin + pc->src_offset + first + (a - x->at),
                           .width = e - a,
                           .pitch = e - a,
                           .height = 1,
                           .dst = dst + (a - lo),
                           .slack = s->align > 1};
    rc = read(arg, &rd);
  }
  return rc;
}

void plan_stage_fill(const struct plan_stage *s, const struct plan *p, const unsigned char *const *data, size_t w,
                     uint64_t lo, uint64_t hi, unsigned char *dst, plan_copy_fn copy) {
  struct plan_maps m = {data, copy};
  plan_stage_read(s, p, w, lo, hi, dst, plan_map_read, &m);
}
