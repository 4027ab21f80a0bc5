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
  size_t wcap, xcap;
  bool open;   /* a window is open */
  uint64_t at; /* the open window's fill position */
  int rc;
};

static void window_close(struct builder *b) {
  if (!b->open) return;
  b->s->windows[b->s->nwindows - 1].used = b->at;
  b->s->staged_bytes += b->at;
  b->open = false;
}

/* Where the next transfer may start in the open window (0 in a new one). */
static uint64_t next_at(const struct builder *b) {
  return b->open ? (b->at + XFER_ALIGN - 1) / XFER_ALIGN * XFER_ALIGN : 0;
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
    struct plan_xfer x = {.at = at, .len = n, .dst = lo};
    xfer_add(b, &x, n);
    lo += n;
  }
}

/* Piece pc, at slab offset dst, as whole source rows, as many rows per window as fit. */
static void add_rows(struct builder *b, const struct plan_piece *pc, uint64_t dst) {
  uint64_t r = 0;
  while (r < pc->height && b->rc == 0) {
    uint64_t at = next_at(b);
    uint64_t space = b->open && at < b->s->slot_bytes ? b->s->slot_bytes - at : 0;
    uint64_t fit = space >= pc->width ? (space - pc->width) / pc->src_pitch + 1 : 0;
    if (fit == 0) { /* src_pitch <= slot_bytes: a new window holds at least one row */
      window_open(b);
      continue;
    }
    uint64_t n = pc->height - r < fit ? pc->height - r : fit;
    struct plan_xfer x = {.at = at,
                          .len = (n - 1) * pc->src_pitch + pc->width,
                          .dst = dst + r * pc->width,
                          .pc = pc,
                          .row0 = r,
                          .rows = n};
    xfer_add(b, &x, n * pc->width);
    r += n;
  }
}

int plan_stage_build(const struct plan *p, uint64_t slot_bytes, enum plan_strided mode, struct plan_stage **out,
                     struct wd_error *err) {
  *out = NULL;
  struct plan_stage *s = calloc(1, sizeof *s);
  if (s == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory planning the staging windows");
  s->slot_bytes = slot_bytes;
  struct builder b = {.s = s};
  uint64_t img = 0; /* slab bytes before this are scheduled */
  for (size_t i = 0; i < p->noutputs && b.rc == 0; i++) {
    const struct plan_output *o = &p->outputs[i];
    uint64_t pos = o->offset;
    for (size_t k = 0; k < o->npieces && b.rc == 0; k++) {
      const struct plan_piece *pc = &o->pieces[k];
      uint64_t len = pc->width * pc->height;
      if (plan_piece_rows(pc, mode, slot_bytes)) {
        add_image(&b, img, pos);
        add_rows(&b, pc, pos);
        s->rows_pieces++;
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

void plan_stage_fill(const struct plan_stage *s, const struct plan *p, const unsigned char *const *data, size_t w,
                     uint64_t lo, uint64_t hi, unsigned char *dst, plan_copy_fn copy) {
  const struct plan_window *win = &s->windows[w];
  for (size_t i = win->first; i < win->first + win->count; i++) {
    const struct plan_xfer *x = &s->xfers[i];
    uint64_t a = x->at > lo ? x->at : lo, e = x->at + x->len < hi ? x->at + x->len : hi;
    if (a >= e) continue;
    if (x->pc == NULL) {
      plan_gather_with(p, data, x->dst + (a - x->at), x->dst + (e - x->at), dst + (a - lo), copy);
    } else {
      const struct plan_piece *pc = x->pc;
      const unsigned char *src = data[pc->src->shard] + pc->src->t->begin + pc->src_offset + x->row0 * pc->src_pitch;
      copy(dst + (a - lo), src + (a - x->at), (size_t)(e - a));
    }
  }
}
