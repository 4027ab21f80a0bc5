/*
 * plan_json.c - a plan as JSON (see plan.h): plan_describe for weightctl
 * plan --json, plan_table for the tensor table attach replies carry.
 */
#include <stdbool.h>

#include "jsonutil.h"
#include "plan.h"

static cJSON *outputs_json(const struct plan *p, bool with_pieces) {
  cJSON *outs = cJSON_CreateArray();
  for (size_t i = 0; outs != NULL && i < p->noutputs; i++) {
    const struct plan_output *po = &p->outputs[i];
    cJSON *jo = cJSON_CreateObject();
    cJSON_AddStringToObject(jo, "name", po->name);
    cJSON_AddStringToObject(jo, "dtype", dtype_name(po->dtype));
    cJSON *sh = cJSON_AddArrayToObject(jo, "shape");
    for (unsigned d = 0; d < po->ndim; d++) json_u64_add(sh, NULL, po->shape[d]);
    json_u64_add(jo, "offset", po->offset);
    json_u64_add(jo, "nbytes", po->nbytes);
    cJSON *pcs = with_pieces ? cJSON_AddArrayToObject(jo, "pieces") : NULL;
    for (size_t k = 0; pcs != NULL && k < po->npieces; k++) {
      const struct plan_piece *pc = &po->pieces[k];
      cJSON *jp = cJSON_CreateObject();
      if (pc->src == NULL) {
        json_u64_add(jp, "zeros", pc->end);
      } else {
        cJSON_AddStringToObject(jp, "tensor", pc->src->t->name);
        cJSON_AddNumberToObject(jp, "dim", pc->dim);
        json_u64_add(jp, "start", pc->start);
        json_u64_add(jp, "end", pc->end);
      }
      cJSON_AddItemToArray(pcs, jp);
    }
    cJSON_AddItemToArray(outs, jo);
  }
  return outs;
}

cJSON *plan_describe(const struct plan *p) {
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) return NULL;
  cJSON_AddItemToObject(o, "key", cJSON_Parse(p->key));
  json_u64_add(o, "payload_bytes", p->payload_bytes);
  json_u64_add(o, "slab_bytes", p->slab_bytes);
  cJSON_AddItemToObject(o, "outputs", outputs_json(p, true));
  return o;
}

cJSON *plan_table(const struct plan *p) { return outputs_json(p, false); }
