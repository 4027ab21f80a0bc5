/*
 * load_source.c - reading a load's source (see load_source.h). No state and
 * no threads of its own: each function reads only the target it is given.
 */
#include "load_source.h"

#include <stdlib.h>

/* Names the tensor at slab offset off, for a FAULT message. */
int ld_fault_error(const struct ld_target *s, uint64_t off, struct wd_error *err) {
  const struct plan_output *o = plan_output_at(s->plan, off);
  const char *shard = "?", *name = o ? o->name : "?";
  if (o != NULL && o->npieces > 0 && o->pieces[0].src != NULL)
    shard = s->ck->ck->shards[o->pieces[0].src->shard].rel;
  return err_set(err, WEIGHTD_E_FAULT,
                 "%s: tensor '%s': the shard was truncated or became unreadable while it was read", shard,
                 name);
}

/* Per shard, where its data section starts in the mapping (a new array, or NULL). */
const unsigned char **ld_shard_data(const struct ld_target *s) {
  const struct ckpt *c = s->ck->ck;
  const unsigned char **data = malloc((c->nshards ? c->nshards : 1) * sizeof *data);
  for (size_t i = 0; data != NULL && i < c->nshards; i++)
    data[i] = s->ck->maps[i] ? (const unsigned char *)s->ck->maps[i] + c->shards[i].hdr->data_start : NULL;
  return data;
}

/*
 * Bytes from file offset off of shard `shard` that lie in one registration
 * (a copy never crosses from one registration into the next), or 0 when off
 * is not registered.
 */
uint64_t ld_pinned_run(const struct ld_target *t, uint32_t shard, uint64_t off) {
  size_t a = 0, b = t->npins;
  while (a < b) { /* the first registration after (shard, off) */
    size_t m = a + (b - a) / 2;
    const struct plan_range *p = &t->pins[m];
    if (p->shard < shard || (p->shard == shard && p->off <= off)) a = m + 1;
    else b = m;
  }
  if (a == 0) return 0;
  const struct plan_range *p = &t->pins[a - 1];
  return p->shard == shard && off < p->off + p->len ? p->off + p->len - off : 0;
}

/* Where piece pc's source starts in its shard file. */
uint64_t ld_piece_file_off(const struct ld_target *s, const struct plan_piece *pc) {
  return s->ck->ck->shards[pc->src->shard].hdr->data_start + pc->src->t->begin + pc->src_offset;
}

/* True when every source byte of the plan lies in registered ranges. */
bool ld_plan_pinned(const struct ld_target *s) {
  if (s->npins == 0) return false;
  const struct plan *p = s->plan;
  for (size_t o = 0; o < p->noutputs; o++)
    for (size_t k = 0; k < p->outputs[o].npieces; k++) {
      const struct plan_piece *pc = &p->outputs[o].pieces[k];
      if (pc->src == NULL || pc->width == 0 || pc->height == 0) continue;
      uint64_t a = ld_piece_file_off(s, pc), b = a + (pc->height - 1) * pc->src_pitch + pc->width;
      while (a < b) {
        uint64_t n = ld_pinned_run(s, pc->src->shard, a);
        if (n == 0) return false;
        a += n;
      }
    }
  return true;
}
