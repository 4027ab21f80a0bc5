/*
 * plan.c - the plan object and the builder's top (see plan.h and
 * plan_build.h; the semantics are docs/protocol.md's "Plans", which are
 * vLLM's).
 *
 * plan_build runs the spec's kind: explicit plans are built here from the
 * primitives of plan_out.c (pieces and outputs, with every check), presets
 * by plan_presets.c; then the names are checked and the outputs placed in
 * the slab with checked sums. Nothing here reads tensor data; plan_gather
 * does, later.
 */
#include "plan.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan_build.h"

/* ---- the plan object ---------------------------------------------------------- */

void plan_free(struct plan *p) {
  if (p == NULL) return;
  for (size_t i = 0; i < p->noutputs; i++) {
    free(p->outputs[i].name);
    free(p->outputs[i].shape);
    free(p->outputs[i].pieces);
  }
  free(p->outputs);
  free(p->key);
  free(p);
}

int plan_copy(const struct plan *p, struct plan **out) {
  *out = NULL;
  struct plan *c = calloc(1, sizeof *c);
  if (c == NULL) return WEIGHTD_E_NOMEM;
  c->payload_bytes = p->payload_bytes;
  c->slab_bytes = p->slab_bytes;
  c->key = strdup(p->key);
  c->outputs = calloc(p->noutputs ? p->noutputs : 1, sizeof *c->outputs);
  if (c->key == NULL || c->outputs == NULL) goto fail;
  c->noutputs = p->noutputs; /* from here plan_free frees what each output got */
  for (size_t i = 0; i < p->noutputs; i++) {
    const struct plan_output *o = &p->outputs[i];
    struct plan_output *d = &c->outputs[i];
    *d = *o;
    d->name = NULL;
    d->shape = NULL;
    d->pieces = NULL;
    d->name = strdup(o->name);
    d->shape = malloc((o->ndim ? o->ndim : 1) * sizeof *d->shape);
    d->pieces = malloc((o->npieces ? o->npieces : 1) * sizeof *d->pieces);
    if (d->name == NULL || d->shape == NULL || d->pieces == NULL) goto fail;
    memcpy(d->shape, o->shape, o->ndim * sizeof *d->shape);
    memcpy(d->pieces, o->pieces, o->npieces * sizeof *d->pieces);
  }
  *out = c;
  return 0;
fail:
  plan_free(c);
  return WEIGHTD_E_NOMEM;
}

const struct plan_output *plan_output_at(const struct plan *p, uint64_t lo) {
  size_t a = 0, b = p->noutputs;
  while (a < b) { /* the first output that ends after lo */
    size_t m = a + (b - a) / 2;
    if (p->outputs[m].offset + p->outputs[m].nbytes <= lo) a = m + 1;
    else b = m;
  }
  return a < p->noutputs ? &p->outputs[a] : NULL;
}

/* ---- explicit plans ---------------------------------------------------------------------- */

/* One piece of an explicit output: the spec's tensor slice, resolved against the checkpoint. */
static int explicit_piece(struct plan_builder *b, const struct plan_spec_output *so, const struct plan_spec_piece *sp) {
  if (sp->tensor == NULL) return plan_out_zeros(b, sp->zeros);
  const struct ckpt_ref *r = ckpt_tensor_find(b->c, sp->tensor);
  if (r == NULL) return plan_fail(b, "output '%s': no tensor '%s' in the checkpoint", so->name, sp->tensor);
  const struct st_tensor *st = r->t;
  uint64_t end = sp->end;
  if (end == PLAN_END_WHOLE) end = st->ndim == 0 ? 1 : sp->dim < st->ndim ? st->shape[sp->dim] : 0;
  struct plan_piece pc;
  int rc = plan_piece_slice(b, r, sp->dim, sp->start, end, &pc); /* checks dim < ndim */
  if (rc != 0) return rc;
  /* Concatenation or stacking along dimension 0: the trailing dimensions must agree. */
  unsigned nd = so->ndim;
  bool concat = st->ndim == nd, stack = st->ndim + 1 == nd;
  for (unsigned d = 1; concat && d < st->ndim; d++) concat = (d == sp->dim ? end - sp->start : st->shape[d]) == so->shape[d];
  for (unsigned d = 1; stack && d < st->ndim; d++) stack = (d == sp->dim ? end - sp->start : st->shape[d]) == so->shape[d + 1];
  if (nd > 0 && st->ndim > 0 && !concat && !stack)
    return plan_fail(b, "output '%s': piece '%s' does not match the output's trailing dimensions", so->name, st->name);
  return plan_out_add(b, &pc);
}

static int build_explicit(struct plan_builder *b) {
  for (size_t i = 0; i < b->spec->noutputs; i++) {
    const struct plan_spec_output *so = &b->spec->outputs[i];
    int rc = plan_out_begin(b, so->name, so->dtype, so->ndim, so->shape);
    for (size_t k = 0; rc == 0 && k < so->npieces; k++) rc = explicit_piece(b, so, &so->pieces[k]);
    if (rc == 0) rc = plan_out_end(b);
    if (rc != 0) return rc;
  }
  return 0;
}

/* ---- checking and placing ------------------------------------------------------------------ */

static int cmp_output_names(const void *a, const void *b) {
  return strcmp((*(const struct plan_output *const *)a)->name, (*(const struct plan_output *const *)b)->name);
}

/* No output name twice: sorted once, O(n log n), however many tensors. */
static int check_names(struct plan_builder *b) {
  struct plan *p = b->p;
  const struct plan_output **v = malloc((p->noutputs ? p->noutputs : 1) * sizeof *v);
  if (v == NULL) return plan_nomem(b);
  for (size_t i = 0; i < p->noutputs; i++) v[i] = &p->outputs[i];
  qsort(v, p->noutputs, sizeof *v, cmp_output_names);
  int rc = 0;
  for (size_t i = 0; i + 1 < p->noutputs && rc == 0; i++)
    if (strcmp(v[i]->name, v[i + 1]->name) == 0) rc = plan_fail(b, "plan lists output '%s' twice", v[i]->name);
  free(v);
  return rc;
}

/* Places the outputs in the slab at aligned offsets; the sums must fit in 64 bits. */
static int place(struct plan_builder *b) {
  struct plan *p = b->p;
  uint64_t off = 0, payload = 0, padded;
  for (size_t i = 0; i < p->noutputs; i++) {
    struct plan_output *o = &p->outputs[i];
    o->offset = off;
    if (__builtin_add_overflow(payload, o->nbytes, &payload) ||
        __builtin_add_overflow(o->nbytes, (uint64_t)PLAN_ALIGN - 1, &padded) ||
        __builtin_add_overflow(off, padded / PLAN_ALIGN * PLAN_ALIGN, &off))
      return plan_fail(b, "the plan's outputs add up to more than 2^64 bytes (at output '%s')", o->name);
  }
  p->payload_bytes = payload;
  p->slab_bytes = off;
  return 0;
}

/* ---- building -------------------------------------------------------------------------------- */

int plan_build(const struct ckpt *c, const cJSON *json, struct plan **out, struct wd_error *err) {
  *out = NULL;
  struct plan_spec spec;
  struct plan_builder b = {.c = c, .spec = &spec, .err = err};
  int rc = plan_spec_parse(json, c->config, &spec, err);
  if (rc != 0) goto fail;
  b.p = calloc(1, sizeof *b.p);
  b.used = calloc(c->ntensors ? c->ntensors : 1, 1);
  if (b.p == NULL || b.used == NULL) {
    rc = plan_nomem(&b);
    goto fail;
  }
  for (size_t i = 0; i < c->ntensors; i++)
    if (strlen(c->by_name[i].t->name) != c->by_name[i].t->name_len) {
      rc = plan_fail(&b, "tensor '%s...' has U+0000 in its name, which the protocol cannot carry", c->by_name[i].t->name);
      goto fail;
    }
  if (c->config != NULL && c->config->weight_block_size[0] > 0) {
    b.block_n = (uint64_t)c->config->weight_block_size[0];
    b.block_k = (uint64_t)c->config->weight_block_size[1];
  }
  switch (spec.kind) {
  case PLAN_WHOLE:
    rc = plan_preset_whole(&b);
    break;
  case PLAN_LAYERS:
    rc = plan_preset_layers(&b);
    break;
  case PLAN_EXPLICIT:
    rc = build_explicit(&b);
    break;
  }
  if (rc == 0) rc = check_names(&b);
  if (rc == 0) rc = place(&b);
  if (rc == 0) rc = plan_key_make(&spec, b.p, &b.p->key, err);
  if (rc != 0) goto fail;
  free(b.used);
  plan_spec_free(&spec);
  *out = b.p;
  return 0;
fail:
  free(b.used);
  plan_spec_free(&spec);
  plan_free(b.p);
  return rc;
}
