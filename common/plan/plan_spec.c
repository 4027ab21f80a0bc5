/*
 * plan_spec.c - reading the request's plan object into a typed, normalised
 * struct plan_spec (see plan_build.h and docs/protocol.md, "Plans").
 *
 * Each JSON object of a spec (the plan, an output, a piece) is read against
 * a table of its fields: a member the table lacks, one given twice, one of
 * the wrong type or one that does not belong to the object's kind (a preset
 * field in an explicit plan, 'tensor' in a zeros piece) is refused with its
 * path, since a misspelt field silently ignored would load the wrong
 * weights. Defaults are filled in from the same tables.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan_build.h"

/* ---- reading objects against field tables ------------------------------------------------ */

enum field_type { FT_STRING, FT_U64, FT_BOOL, FT_LIST };

struct field {
  const char *name;
  enum field_type type;
  unsigned kinds; /* the object kinds it belongs to, a bit each */
  size_t offset;  /* FT_U64, FT_BOOL: where the value goes in the typed struct */
  uint64_t def;   /* FT_U64: the default */
};

/* A JSON number that is an integer in [0, 2^53): range first, so no cast overflows. */
static bool json_uint(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble <= 9007199254740991.0) ||
      v->valuedouble != (double)(uint64_t)v->valuedouble)
    return false;
  *out = (uint64_t)v->valuedouble;
  return true;
}

/* Every refusal here is BAD_PLAN. */
#define BAD(err, ...) err_set(err, WEIGHTD_E_BAD_PLAN, __VA_ARGS__)

/*
 * Reads obj's members into found[] by field (NULL where absent): each must be
 * a field of the table, given once, of its type.
 */
static int read_object(const cJSON *obj, const char *path, const struct field *fields, size_t n,
                       const cJSON **found, struct wd_error *err) {
  if (!cJSON_IsObject(obj)) return BAD(err, "%s must be an object", path);
  for (size_t i = 0; i < n; i++) found[i] = NULL;
  const cJSON *m;
  cJSON_ArrayForEach(m, obj) {
    size_t i = 0;
    while (i < n && strcmp(fields[i].name, m->string) != 0) i++;
    if (i == n) return BAD(err, "%s: unknown field '%s'", path, m->string);
    if (found[i] != NULL) return BAD(err, "%s: field '%s' is given twice", path, m->string);
    uint64_t u;
    if (fields[i].type == FT_STRING && !cJSON_IsString(m)) return BAD(err, "%s: '%s' must be a string", path, m->string);
    if (fields[i].type == FT_U64 && !json_uint(m, &u))
      return BAD(err, "%s: '%s' must be a non-negative integer", path, m->string);
    if (fields[i].type == FT_BOOL && !cJSON_IsBool(m)) return BAD(err, "%s: '%s' must be true or false", path, m->string);
    if (fields[i].type == FT_LIST && !cJSON_IsArray(m)) return BAD(err, "%s: '%s' must be a list", path, m->string);
    found[i] = m;
  }
  return 0;
}

/* Refuses a member that does not belong to the object's kind; what names the kind. */
static int check_kind(const char *path, const struct field *fields, size_t n, const cJSON **found, unsigned kind,
                      const char *what, struct wd_error *err) {
  for (size_t i = 0; i < n; i++)
    if (found[i] != NULL && !(fields[i].kinds & kind)) return BAD(err, "%s: %s takes no '%s'", path, what, fields[i].name);
  return 0;
}

/* Stores the FT_U64 and FT_BOOL fields at their offsets in `to`, defaults where absent. */
static void store(const struct field *fields, size_t n, const cJSON **found, void *to) {
  for (size_t i = 0; i < n; i++) {
    char *at = (char *)to + fields[i].offset;
    uint64_t u = fields[i].def;
    if (fields[i].type == FT_U64) {
      if (found[i] != NULL) json_uint(found[i], &u);
      memcpy(at, &u, sizeof u);
    } else if (fields[i].type == FT_BOOL) {
      bool v = cJSON_IsTrue(found[i]);
      memcpy(at, &v, sizeof v);
    }
  }
}

/* ---- the plan object ------------------------------------------------------------------------- */

enum { K_WHOLE = 1, K_LAYERS = 2, K_EXPLICIT = 4 };
enum { F_PRESET, F_TP_SIZE, F_TP_RANK, F_EP_SIZE, F_EP_RANK, F_FUSE, F_EXPERTS, F_OUTPUTS, NPLAN_FIELDS };

static const struct field plan_fields[NPLAN_FIELDS] = {
    [F_PRESET] = {"preset", FT_STRING, K_WHOLE | K_LAYERS, 0, 0},
    [F_TP_SIZE] = {"tp_size", FT_U64, K_LAYERS, offsetof(struct plan_spec, tp_size), 1},
    [F_TP_RANK] = {"tp_rank", FT_U64, K_LAYERS, offsetof(struct plan_spec, tp_rank), 0},
    [F_EP_SIZE] = {"ep_size", FT_U64, K_LAYERS, offsetof(struct plan_spec, ep_size), 1},
    [F_EP_RANK] = {"ep_rank", FT_U64, K_LAYERS, offsetof(struct plan_spec, ep_rank), 0},
    [F_FUSE] = {"fuse", FT_BOOL, K_LAYERS, offsetof(struct plan_spec, fuse), 0},
    [F_EXPERTS] = {"experts", FT_LIST, K_LAYERS, 0, 0},
    [F_OUTPUTS] = {"outputs", FT_LIST, K_EXPLICIT, 0, 0},
};

enum { O_NAME, O_DTYPE, O_SHAPE, O_PIECES, NOUT_FIELDS };

static const struct field output_fields[NOUT_FIELDS] = {
    [O_NAME] = {"name", FT_STRING, 1, 0, 0},
    [O_DTYPE] = {"dtype", FT_STRING, 1, 0, 0},
    [O_SHAPE] = {"shape", FT_LIST, 1, 0, 0},
    [O_PIECES] = {"pieces", FT_LIST, 1, 0, 0},
};

enum { K_TENSOR = 1, K_ZEROS = 2 };
enum { P_TENSOR, P_DIM, P_START, P_END, P_ZEROS, NPIECE_FIELDS };

static const struct field piece_fields[NPIECE_FIELDS] = {
    [P_TENSOR] = {"tensor", FT_STRING, K_TENSOR, 0, 0},
    [P_DIM] = {"dim", FT_U64, K_TENSOR, offsetof(struct plan_spec_piece, dim), 0},
    [P_START] = {"start", FT_U64, K_TENSOR, offsetof(struct plan_spec_piece, start), 0},
    [P_END] = {"end", FT_U64, K_TENSOR, offsetof(struct plan_spec_piece, end), PLAN_END_WHOLE},
    [P_ZEROS] = {"zeros", FT_U64, K_ZEROS, offsetof(struct plan_spec_piece, zeros), 0},
};

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* The preset's family: a family's name, or "auto" for config.json's model_type. */
static int read_family(const char *preset, const struct mcfg *config, struct plan_spec *s, struct wd_error *err) {
  char names[64];
  family_names(names, sizeof names, ", ");
  if (strcmp(preset, "auto") == 0) {
    const char *mt = config != NULL ? config->model_type : NULL;
    if (mt == NULL) return BAD(err, "preset 'auto' needs config.json's model_type");
    const struct family_model *m = family_model_find(mt);
    if (m == NULL) return BAD(err, "no preset for model_type '%s': name one (%s) or send an explicit plan", mt, names);
    s->family = m->family;
    return 0;
  }
  s->family = family_by_name(preset);
  if (s->family == FAMILY_NONE) return BAD(err, "unknown plan preset '%s' (whole, auto, %s)", preset, names);
  return 0;
}

/* The layer preset's values: ranks below sizes, the expert list sorted and without repeats. */
static int read_layers(const cJSON *experts, struct plan_spec *s, struct wd_error *err) {
  if (s->tp_size == 0) return BAD(err, "plan: tp_size must be at least 1");
  if (s->ep_size == 0) return BAD(err, "plan: ep_size must be at least 1");
  if (s->tp_rank >= s->tp_size)
    return BAD(err, "plan: tp_rank %" PRIu64 " must be below tp_size %" PRIu64, s->tp_rank, s->tp_size);
  if (s->ep_rank >= s->ep_size)
    return BAD(err, "plan: ep_rank %" PRIu64 " must be below ep_size %" PRIu64, s->ep_rank, s->ep_size);
  if (experts == NULL) return 0;
  if (s->ep_size == 1) return BAD(err, "plan: 'experts' lists one rank's experts: it needs ep_size > 1");
  s->nexperts = (size_t)cJSON_GetArraySize(experts);
  s->experts = calloc(s->nexperts ? s->nexperts : 1, sizeof *s->experts);
  if (s->experts == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory reading a plan");
  size_t i = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, experts) {
    if (!json_uint(e, &s->experts[i++])) return BAD(err, "plan: 'experts' must list non-negative integers");
  }
  qsort(s->experts, s->nexperts, sizeof *s->experts, cmp_u64);
  for (i = 0; i + 1 < s->nexperts; i++)
    if (s->experts[i] == s->experts[i + 1]) return BAD(err, "plan: expert %" PRIu64 " is listed twice", s->experts[i]);
  return 0;
}

/* ---- explicit outputs -------------------------------------------------------------------------- */

static int read_piece(const cJSON *j, const char *path, const char *output, struct plan_spec_piece *p,
                      struct wd_error *err) {
  const cJSON *f[NPIECE_FIELDS];
  int rc = read_object(j, path, piece_fields, NPIECE_FIELDS, f, err);
  if (rc != 0) return rc;
  if (f[P_TENSOR] == NULL && f[P_ZEROS] == NULL) return BAD(err, "%s: output '%s': a piece needs 'tensor' or 'zeros'", path, output);
  bool zeros = f[P_ZEROS] != NULL;
  rc = check_kind(path, piece_fields, NPIECE_FIELDS, f, zeros ? K_ZEROS : K_TENSOR, zeros ? "a 'zeros' piece" : "a 'tensor' piece", err);
  if (rc != 0) return rc;
  store(piece_fields, NPIECE_FIELDS, f, p);
  p->tensor = zeros ? NULL : f[P_TENSOR]->valuestring;
  return 0;
}

static int read_output(const cJSON *j, size_t index, struct plan_spec_output *o, struct wd_error *err) {
  char path[64];
  snprintf(path, sizeof path, "plan.outputs[%zu]", index);
  const cJSON *f[NOUT_FIELDS];
  int rc = read_object(j, path, output_fields, NOUT_FIELDS, f, err);
  if (rc != 0) return rc;
  if (f[O_NAME] == NULL || f[O_DTYPE] == NULL || f[O_SHAPE] == NULL || f[O_PIECES] == NULL)
    return BAD(err, "%s: needs 'name', 'dtype', 'shape' and 'pieces'", path);
  o->name = f[O_NAME]->valuestring;
  const char *dt = f[O_DTYPE]->valuestring;
  o->dtype = dtype_from_name(dt, strlen(dt));
  if (o->dtype == WD_DTYPE_INVALID) return BAD(err, "%s: output '%s': unknown dtype '%s'", path, o->name, dt);
  int nd = cJSON_GetArraySize(f[O_SHAPE]);
  if (nd > (int)PLAN_MAX_DIMS) return BAD(err, "%s: output '%s': more than %u dimensions", path, o->name, PLAN_MAX_DIMS);
  o->ndim = (unsigned)nd;
  for (int d = 0; d < nd; d++)
    if (!json_uint(cJSON_GetArrayItem(f[O_SHAPE], d), &o->shape[d]))
      return BAD(err, "%s: output '%s': shape entries must be non-negative integers", path, o->name);
  o->npieces = (size_t)cJSON_GetArraySize(f[O_PIECES]);
  o->pieces = calloc(o->npieces ? o->npieces : 1, sizeof *o->pieces);
  if (o->pieces == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory reading a plan");
  size_t k = 0;
  const cJSON *pj;
  cJSON_ArrayForEach(pj, f[O_PIECES]) {
    char ppath[96];
    snprintf(ppath, sizeof ppath, "%s.pieces[%zu]", path, k);
    if ((rc = read_piece(pj, ppath, o->name, &o->pieces[k++], err)) != 0) return rc;
  }
  return 0;
}

static int read_outputs(const cJSON *outputs, struct plan_spec *s, struct wd_error *err) {
  s->noutputs = (size_t)cJSON_GetArraySize(outputs);
  if (s->noutputs == 0) return BAD(err, "plan: 'outputs' must be a non-empty list");
  s->outputs = calloc(s->noutputs, sizeof *s->outputs);
  if (s->outputs == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory reading a plan");
  size_t i = 0;
  const cJSON *o;
  cJSON_ArrayForEach(o, outputs) {
    int rc = read_output(o, i, &s->outputs[i], err);
    i++;
    if (rc != 0) return rc;
  }
  return 0;
}

/* ---- the spec ------------------------------------------------------------------------------------ */

int plan_spec_parse(const cJSON *spec, const struct mcfg *config, struct plan_spec *s, struct wd_error *err) {
  memset(s, 0, sizeof *s);
  s->kind = PLAN_WHOLE;
  s->tp_size = s->ep_size = 1;
  if (spec == NULL) return 0;
  const cJSON *f[NPLAN_FIELDS];
  int rc = read_object(spec, "plan", plan_fields, NPLAN_FIELDS, f, err);
  if (rc != 0) return rc;
  if (f[F_PRESET] != NULL && f[F_OUTPUTS] != NULL) return BAD(err, "plan has both 'preset' and 'outputs'");
  const char *preset = f[F_PRESET] != NULL ? f[F_PRESET]->valuestring : "whole";
  if (f[F_OUTPUTS] != NULL) {
    s->kind = PLAN_EXPLICIT;
    rc = check_kind("plan", plan_fields, NPLAN_FIELDS, f, K_EXPLICIT, "an explicit plan ('outputs')", err);
    return rc ? rc : read_outputs(f[F_OUTPUTS], s, err);
  }
  if (strcmp(preset, "whole") == 0) return check_kind("plan", plan_fields, NPLAN_FIELDS, f, K_WHOLE, "preset 'whole'", err);
  s->kind = PLAN_LAYERS;
  if ((rc = read_family(preset, config, s, err)) != 0) return rc;
  store(plan_fields, NPLAN_FIELDS, f, s);
  return read_layers(f[F_EXPERTS], s, err);
}

void plan_spec_free(struct plan_spec *s) {
  for (size_t i = 0; i < s->noutputs; i++) free(s->outputs[i].pieces);
  free(s->outputs);
  free(s->experts);
  memset(s, 0, sizeof *s);
}
