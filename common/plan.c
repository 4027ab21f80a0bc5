/* plan.c - building plans from specs (see plan.h). */
#include "plan.h"

#include <stdlib.h>
#include <string.h>

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

static int cmp_file_order(const void *a, const void *b) {
  const struct ckpt_ref *x = *(const struct ckpt_ref *const *)a;
  const struct ckpt_ref *y = *(const struct ckpt_ref *const *)b;
  if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
  if (x->t->begin != y->t->begin) return x->t->begin < y->t->begin ? -1 : 1;
  return 0;
}

/* Every tensor whole, in file order so that reads stream through each shard. */
static int build_whole(const struct ckpt *c, struct plan *p, struct wd_error *err) {
  const struct ckpt_ref **order = malloc((c->ntensors ? c->ntensors : 1) * sizeof *order);
  p->outputs = calloc(c->ntensors ? c->ntensors : 1, sizeof *p->outputs);
  if (order == NULL || p->outputs == NULL) {
    free(order);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  for (size_t i = 0; i < c->ntensors; i++) order[i] = &c->by_name[i];
  qsort(order, c->ntensors, sizeof *order, cmp_file_order);
  uint64_t off = 0;
  for (size_t i = 0; i < c->ntensors; i++) {
    const struct st_tensor *t = order[i]->t;
    if (strlen(t->name) != t->name_len) {
      free(order);
      return err_set(err, WEIGHTD_E_BAD_PLAN,
                     "tensor '%s...' has U+0000 in its name, which the protocol cannot carry", t->name);
    }
    struct plan_output *o = &p->outputs[i];
    p->noutputs = i + 1;
    o->name = strdup(t->name);
    o->shape = malloc((t->ndim ? t->ndim : 1) * sizeof *o->shape);
    o->pieces = calloc(1, sizeof *o->pieces);
    if (o->name == NULL || o->shape == NULL || o->pieces == NULL) {
      free(order);
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    }
    o->dtype = t->dtype;
    o->ndim = t->ndim;
    memcpy(o->shape, t->shape, t->ndim * sizeof *o->shape);
    o->nbytes = t->end - t->begin;
    o->offset = off;
    o->npieces = 1;
    o->pieces[0] = (struct plan_piece){order[i], 0, o->nbytes, o->nbytes, 1};
    p->payload_bytes += o->nbytes;
    off += (o->nbytes + PLAN_ALIGN - 1) / PLAN_ALIGN * PLAN_ALIGN;
  }
  p->slab_bytes = off;
  free(order);
  return 0;
}

int plan_build(const struct ckpt *c, const cJSON *spec, struct plan **out, struct wd_error *err) {
  *out = NULL;
  const char *preset = "whole";
  if (spec != NULL) {
    if (!cJSON_IsObject(spec)) return err_set(err, WEIGHTD_E_BAD_PLAN, "plan must be an object");
    const cJSON *pr = cJSON_GetObjectItemCaseSensitive(spec, "preset");
    if (pr != NULL && !cJSON_IsString(pr))
      return err_set(err, WEIGHTD_E_BAD_PLAN, "plan 'preset' must be a string");
    if (pr != NULL) preset = pr->valuestring;
  }
  if (strcmp(preset, "whole") != 0)
    return err_set(err, WEIGHTD_E_BAD_PLAN, "unknown plan preset '%s' (this daemon knows 'whole')", preset);
  struct plan *p = calloc(1, sizeof *p);
  if (p == NULL || (p->key = strdup("{\"preset\":\"whole\"}")) == NULL) {
    plan_free(p);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  int rc = build_whole(c, p, err);
  if (rc != 0) {
    plan_free(p);
    return rc;
  }
  *out = p;
  return 0;
}
