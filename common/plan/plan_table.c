/*
 * plan_table.c - a plan and the binary tensor table (see plan.h): the
 * writer's view of a plan's outputs, and a plan rebuilt from a table for a
 * set re-adopted after a restart (its outputs, without pieces: its bytes are
 * in place and nothing reads the files for it).
 */
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "tensor_table.h"

void plan_ttab_get(void *plan, size_t i, struct ttab_tensor *t) {
  const struct plan_output *o = &((const struct plan *)plan)->outputs[i];
  t->name = o->name;
  t->name_len = strlen(o->name);
  t->dtype = dtype_name(o->dtype);
  t->ndim = o->ndim;
  t->shape = o->shape;
  t->offset = o->offset;
  t->nbytes = o->nbytes;
}

int plan_from_ttab(const struct ttab *t, const char *key, struct plan **out, struct wd_error *err) {
  *out = NULL;
  if (strlen(key) > PLAN_KEY_MAX) return err_set(err, WEIGHTD_E_BAD_PLAN, "plan key longer than %u bytes", PLAN_KEY_MAX);
  struct plan *p = calloc(1, sizeof *p);
  if (p == NULL || (p->key = strdup(key)) == NULL ||
      (t->count > 0 && (p->outputs = calloc((size_t)t->count, sizeof *p->outputs)) == NULL)) {
    plan_free(p);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  p->slab_bytes = t->slab_bytes;
  for (size_t i = 0; i < t->count; i++) {
    struct ttab_entry e;
    ttab_get(t, i, &e);
    struct plan_output *o = &p->outputs[i];
    p->noutputs = i + 1;
    o->dtype = dtype_from_name(e.dtype, strlen(e.dtype));
    if (o->dtype == WD_DTYPE_INVALID) {
      int rc = err_set(err, WEIGHTD_E_BAD_PLAN, "tensor '%s': unknown dtype '%s'", e.name, e.dtype);
      plan_free(p);
      return rc;
    }
    o->name = strdup(e.name);
    o->ndim = e.ndim;
    o->shape = calloc(e.ndim ? e.ndim : 1, sizeof *o->shape);
    if (o->name == NULL || o->shape == NULL) {
      plan_free(p);
      return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    }
    for (unsigned d = 0; d < e.ndim; d++) o->shape[d] = (uint64_t)e.shape[d];
    o->offset = e.offset;
    o->nbytes = e.nbytes;
    p->payload_bytes += e.nbytes;
  }
  *out = p;
  return 0;
}
