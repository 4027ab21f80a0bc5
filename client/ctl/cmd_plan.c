/*
 * cmd_plan.c - `weightctl plan PATH [plan flags] [--json]`: builds a rank's
 * plan here, without a daemon, and prints it: one line per output with its
 * sources, then the totals. A parallel size given without its rank
 * (`--tp-size 4`) prints the bytes of every rank instead.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint.h"
#include "ctl.h"
#include "plan.h"

/* Pieces shown per output line; the rest are counted (--json lists them all). */
#define SHOWN_PIECES 8
/* The daemon pins a plan's ranges closer than this as one (REG_PIN_MERGE_GAP in daemon/state/registry.h). */
#define CTL_PIN_MERGE_GAP (2ull << 20)
/* Rows of a per-rank table at most. */
#define MAX_RANK_ROWS 4096

/*
 * The part of source name src worth printing next to output name out: the
 * dotted prefix both share is dropped, but never the source's last two
 * components ("model.layers.0.self_attn.q_proj.weight" next to
 * "model.layers.0.self_attn.qkv_proj.weight" is "q_proj.weight").
 */
static const char *short_source(const char *out, const char *src) {
  size_t cut = 0;
  for (size_t i = 0; out[i] != '\0' && out[i] == src[i]; i++)
    if (src[i] == '.') cut = i + 1;
  size_t last = 0, second = 0;
  for (size_t i = 0; src[i] != '\0'; i++)
    if (src[i] == '.') {
      second = last;
      last = i + 1;
    }
  return src + (cut < second ? cut : second);
}

/* Appends one piece, as "q_proj.weight[0:2048 of dim 0]", "norm.weight" (whole) or "zeros[8 rows]". */
static void piece_format(const struct plan_output *o, const struct plan_piece *pc, char *buf, size_t len) {
  if (pc->src == NULL) {
    snprintf(buf, len, "zeros[%" PRIu64 " rows]", pc->end);
    return;
  }
  const struct st_tensor *t = pc->src->t;
  const char *name = short_source(o->name, t->name);
  int whole = t->ndim == 0 || (pc->dim < t->ndim && pc->start == 0 && pc->end == t->shape[pc->dim]);
  if (whole) snprintf(buf, len, "%s", name);
  else snprintf(buf, len, "%s[%" PRIu64 ":%" PRIu64 " of dim %u]", name, pc->start, pc->end, pc->dim);
}

static void print_output(const struct plan_output *o, int name_w) {
  char shape[128], piece[512];
  st_shape_format(o->shape, o->ndim, shape, sizeof shape);
  printf("  %-*s  %-7s %-20s %12" PRIu64 "  ", name_w, o->name, dtype_name(o->dtype), shape, o->nbytes);
  size_t shown = o->npieces < SHOWN_PIECES ? o->npieces : SHOWN_PIECES;
  for (size_t k = 0; k < shown; k++) {
    piece_format(o, &o->pieces[k], piece, sizeof piece);
    printf("%s%s", k ? " + " : "", piece);
  }
  if (o->npieces > shown) printf(" + ... (%zu pieces in all)", o->npieces);
  printf("\n");
}

static void print_bytes_line(const char *label, uint64_t b) {
  char h[32];
  ctl_human_bytes(b, h, sizeof h);
  printf("%-14s %" PRIu64 " (%s)", label, b, h);
}

/* One rank's plan, output by output, then the totals. */
static void print_plan(const struct ckpt *ck, const struct plan *p) {
  int name_w = 0;
  for (size_t i = 0; i < p->noutputs; i++) {
    int n = (int)strlen(p->outputs[i].name);
    if (n > name_w) name_w = n;
  }
  if (name_w > 64) name_w = 64;
  printf("plan %s for %s\n", p->key, ck->path);
  for (size_t i = 0; i < p->noutputs; i++) print_output(&p->outputs[i], name_w);
  printf("%-14s %zu\n", "outputs", p->noutputs);
  print_bytes_line("payload bytes", p->payload_bytes);
  printf("\n");
  print_bytes_line("slab bytes", p->slab_bytes);
  printf("\n");
  print_bytes_line("read bytes", ctl_plan_read_bytes(p));
  char h[32];
  ctl_human_bytes(ck->total_bytes, h, sizeof h);
  printf(" of the checkpoint's %" PRIu64 " (%s)\n", ck->total_bytes, h);
  /* What pinning this plan registers: its ranges widened to pages, as the daemon merges them. */
  struct plan_range *r = NULL;
  size_t n = 0;
  struct wd_error err = {0};
  if (plan_ranges(p, ck, (uint64_t)sysconf(_SC_PAGESIZE), CTL_PIN_MERGE_GAP, &r, &n, &err) == 0) {
    print_bytes_line("pin bytes", plan_ranges_bytes(r, n));
    printf(" in %zu range%s\n", n, n == 1 ? "" : "s");
  }
  free(r);
}

static int print_described(const struct plan *p) {
  cJSON *d = plan_describe(p);
  if (d == NULL) {
    ctl_errorf("plan: out of memory");
    return CTL_EXIT_FAIL;
  }
  ctl_json_print(d);
  return CTL_EXIT_OK;
}

/* ---- bytes per rank ------------------------------------------------------------------- */

struct rank_row {
  unsigned long long tp_rank, ep_rank;
  char *key;
  size_t outputs;
  uint64_t payload, slab, read;
};

static void print_table(const struct ckpt *ck, const char *base_key, const struct rank_row *rows, size_t n,
                        int tp_varies, int ep_varies) {
  uint64_t payload = 0, slab = 0, read = 0;
  printf("plan %s for %s: bytes per rank\n ", base_key, ck->path);
  if (tp_varies) printf(" %7s", "tp_rank");
  if (ep_varies) printf(" %7s", "ep_rank");
  printf(" %8s %16s %16s %16s\n", "outputs", "payload_bytes", "slab_bytes", "read_bytes");
  for (size_t i = 0; i < n; i++) {
    char h[32];
    ctl_human_bytes(rows[i].payload, h, sizeof h);
    printf(" ");
    if (tp_varies) printf(" %7llu", rows[i].tp_rank);
    if (ep_varies) printf(" %7llu", rows[i].ep_rank);
    printf(" %8zu %16" PRIu64 " %16" PRIu64 " %16" PRIu64 "  (%s)\n", rows[i].outputs, rows[i].payload, rows[i].slab,
           rows[i].read, h);
    payload += rows[i].payload;
    slab += rows[i].slab;
    read += rows[i].read;
  }
  printf("  %-*s %16" PRIu64 " %16" PRIu64 " %16" PRIu64 "\n", 8 * (tp_varies + ep_varies) + 8, "all ranks", payload,
         slab, read);
  print_bytes_line("checkpoint", ck->total_bytes);
  printf("\n");
}

static int print_table_json(const struct ckpt *ck, const char *base_key, const struct rank_row *rows, size_t n,
                            int tp_varies, int ep_varies) {
  cJSON *o = cJSON_CreateObject();
  cJSON *spec = cJSON_Parse(base_key);
  if (o == NULL) return CTL_EXIT_FAIL;
  cJSON_AddStringToObject(o, "path", ck->path);
  cJSON_AddItemToObject(o, "plan", spec);
  cJSON_AddItemToObject(o, "checkpoint_bytes", json_u64_create(ck->total_bytes));
  cJSON *arr = cJSON_AddArrayToObject(o, "ranks");
  for (size_t i = 0; i < n; i++) {
    cJSON *r = cJSON_CreateObject();
    if (tp_varies) cJSON_AddItemToObject(r, "tp_rank", json_u64_create(rows[i].tp_rank));
    if (ep_varies) cJSON_AddItemToObject(r, "ep_rank", json_u64_create(rows[i].ep_rank));
    cJSON_AddItemToObject(r, "key", cJSON_CreateString(rows[i].key));
    cJSON_AddItemToObject(r, "outputs", json_u64_create(rows[i].outputs));
    cJSON_AddItemToObject(r, "payload_bytes", json_u64_create(rows[i].payload));
    cJSON_AddItemToObject(r, "slab_bytes", json_u64_create(rows[i].slab));
    cJSON_AddItemToObject(r, "read_bytes", json_u64_create(rows[i].read));
    cJSON_AddItemToArray(arr, r);
  }
  ctl_json_print(o);
  return CTL_EXIT_OK;
}

/*
 * Builds the plan of every rank the flags leave open (each tp rank, each ep
 * rank, or both) and prints their sizes. Returns the exit code.
 */
static int per_rank(const char *path, const struct ctl_plan_args *pa, int tp_varies, int ep_varies) {
  unsigned long long ntp = tp_varies ? pa->tp_size : 1, nep = ep_varies ? pa->ep_size : 1;
  if (ntp * nep > MAX_RANK_ROWS) {
    ctl_errorf("plan: %llu ranks are too many for a table (at most %d); give --tp-rank or --ep-rank", ntp * nep,
               MAX_RANK_ROWS);
    return CTL_EXIT_USAGE;
  }
  struct ckpt *ck = NULL;
  struct rank_row *rows = calloc((size_t)(ntp * nep), sizeof *rows);
  cJSON *base = NULL;
  size_t n = 0;
  int rc = CTL_EXIT_FAIL;
  char *base_key = NULL;
  struct wd_error err;
  err_clear(&err);
  if (rows == NULL) {
    ctl_errorf("plan: out of memory");
    return CTL_EXIT_FAIL;
  }
  if (ckpt_open(path, NULL, &ck, &err) != 0) {
    ctl_errorf("plan: %s (%s)", err.msg, weightd_err_name(err.code));
    goto done;
  }
  if ((rc = ctl_plan_spec(pa, 1, &base)) != 0) goto done;
  rc = CTL_EXIT_FAIL;
  base_key = ctl_plan_text(base);
  for (unsigned long long t = 0; t < ntp; t++) {
    for (unsigned long long e = 0; e < nep; e++) {
      struct ctl_plan_args one = *pa;
      if (tp_varies) {
        one.has_tp_rank = 1;
        one.tp_rank = t;
      }
      if (ep_varies) {
        one.has_ep_rank = 1;
        one.ep_rank = e;
      }
      cJSON *spec = NULL;
      struct plan *p = NULL;
      if (ctl_plan_spec(&one, 0, &spec) != 0) goto done;
      int brc = plan_build(ck, spec, &p, &err);
      cJSON_Delete(spec);
      if (brc != 0) {
        ctl_errorf("plan: %s (%s)", err.msg, weightd_err_name(err.code));
        goto done;
      }
      rows[n] = (struct rank_row){t, e, strdup(p->key), p->noutputs, p->payload_bytes, p->slab_bytes,
                                  ctl_plan_read_bytes(p)};
      n++;
      plan_free(p);
    }
  }
  if (ctl_opts.json) {
    rc = print_table_json(ck, base_key, rows, n, tp_varies, ep_varies);
    if (rc != 0) ctl_errorf("plan: out of memory");
  } else {
    print_table(ck, base_key, rows, n, tp_varies, ep_varies);
    rc = CTL_EXIT_OK;
  }
done:
  for (size_t i = 0; i < n; i++) free(rows[i].key);
  free(rows);
  free(base_key);
  cJSON_Delete(base);
  ckpt_free(ck);
  return rc;
}

/* ---- the command ------------------------------------------------------------------------ */

static int run_plan(const struct ctl_args *a) {
  const char *path = a->pos[0];
  struct ctl_plan_args pa;
  cJSON *spec = NULL;
  int rc = ctl_plan_args_get(a, &pa);
  if (rc == 0) rc = ctl_plan_spec(&pa, 1, &spec);
  if (rc != 0) return rc;
  int tp_varies = pa.has_tp_size && pa.tp_size > 1 && !pa.has_tp_rank;
  int ep_varies = pa.has_ep_size && pa.ep_size > 1 && !pa.has_ep_rank && pa.experts == NULL;
  if (tp_varies || ep_varies) {
    cJSON_Delete(spec);
    return per_rank(path, &pa, tp_varies, ep_varies);
  }
  struct ctl_local l;
  rc = ctl_local_open(path, spec, 0, "plan", &l);
  cJSON_Delete(spec);
  if (rc != 0) return rc;
  if (ctl_opts.json) {
    rc = print_described(l.plan);
  } else {
    print_plan(l.ck, l.plan);
    rc = CTL_EXIT_OK;
  }
  ctl_local_close(&l);
  return rc;
}

const struct ctl_cmd ctl_cmd_plan = {
    .name = "plan",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "show a rank's plan for a checkpoint (no daemon); --tp-size N alone: bytes per rank",
    .description =
        "Builds one rank's plan for the checkpoint at PATH here, without the daemon, and prints each output "
        "tensor with its dtype, shape, bytes and the source slices it is made of, then the totals (payload, "
        "slab and bytes read). A parallel size given without its rank (--tp-size 4) prints a table of every "
        "rank's bytes instead. --json prints the outputs with every piece, and the plan's key.",
    .flags = CTL_CMD_PLAN | CTL_CMD_LOCAL,
    .run = run_plan,
};
