/*
 * ctl_plan.c - what weightctl's plan-aware commands share: the plan flags
 * and the spec they make, plan files, checkpoints opened and planned here
 * (for plan, export and attach --verify), and the SIGBUS guard for reading
 * mapped shards.
 */
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "checkpoint.h"
#include "ctl.h"
#include "family.h"
#include "pathutil.h"
#include "plan.h"

/* The largest integer the protocol carries exactly (2^53 - 1). */
#define WIRE_MAX_INT 9007199254740991ull

/* ---- flags ------------------------------------------------------------------------ */

static const struct optab_opt plan_flags_table[] = {
    {CTL_OPT_PRESET, "preset", 0, OPTAB_VALUE, "NAME",
     "The plan's preset: whole (every tensor as the files hold it), auto (the family from config.json's "
     "model_type), or a family: dense, qwen3_moe, deepseek_v3.",
     0, "whole auto dense qwen3_moe deepseek_v3"},
    {CTL_OPT_PLAN, "plan", 0, OPTAB_VALUE, "FILE",
     "A JSON plan object from FILE (a preset with its fields, or explicit outputs; see docs/protocol.md).", 0,
     "@file"},
    {CTL_OPT_TP_SIZE, "tp-size", 0, OPTAB_VALUE, "N", "Tensor-parallel size (vLLM's slicing).", 0, NULL},
    {CTL_OPT_TP_RANK, "tp-rank", 0, OPTAB_VALUE, "R", "This rank's tensor-parallel rank, 0 to N-1.", 0, NULL},
    {CTL_OPT_EP_SIZE, "ep-size", 0, OPTAB_VALUE, "N", "Expert-parallel size: a rank holds its experts whole.", 0,
     NULL},
    {CTL_OPT_EP_RANK, "ep-rank", 0, OPTAB_VALUE, "R", "This rank's expert-parallel rank, 0 to N-1.", 0, NULL},
    {CTL_OPT_EXPERTS, "experts", 0, OPTAB_VALUE, "LIST",
     "The experts this rank holds, comma-separated ids (with --ep-size 2 or more).", 0, NULL},
    {CTL_OPT_FUSE, "fuse", 0, OPTAB_SWITCH, NULL,
     "Fused outputs as vLLM names them (qkv_proj, gate_up_proj, w13_weight/w2_weight).", 0, NULL},
};
const struct optab_list ctl_plan_options = {CTL_OPTS(plan_flags_table)};

/* The counted plan flags: the option, where its value and its "given" go. */
static const struct plan_count {
  enum ctl_opt_id id;
  const char *flag;
  size_t value; /* offsetof the field in struct ctl_plan_args */
  size_t given; /* offsetof its has_ field */
} plan_counts[] = {
    {CTL_OPT_TP_SIZE, "--tp-size", offsetof(struct ctl_plan_args, tp_size), offsetof(struct ctl_plan_args, has_tp_size)},
    {CTL_OPT_TP_RANK, "--tp-rank", offsetof(struct ctl_plan_args, tp_rank), offsetof(struct ctl_plan_args, has_tp_rank)},
    {CTL_OPT_EP_SIZE, "--ep-size", offsetof(struct ctl_plan_args, ep_size), offsetof(struct ctl_plan_args, has_ep_size)},
    {CTL_OPT_EP_RANK, "--ep-rank", offsetof(struct ctl_plan_args, ep_rank), offsetof(struct ctl_plan_args, has_ep_rank)},
};

int ctl_plan_args_get(const struct ctl_args *a, struct ctl_plan_args *pa) {
  memset(pa, 0, sizeof *pa);
  pa->cmd = a->cmd->name;
  pa->preset = ctl_val(a, CTL_OPT_PRESET);
  pa->file = ctl_val(a, CTL_OPT_PLAN);
  pa->experts = ctl_val(a, CTL_OPT_EXPERTS);
  pa->fuse = ctl_has(a, CTL_OPT_FUSE);
  char *base = (char *)pa;
  for (size_t k = 0; k < sizeof plan_counts / sizeof plan_counts[0]; k++) {
    const struct plan_count *f = &plan_counts[k];
    const char *v = ctl_val(a, f->id);
    if (v == NULL) continue;
    unsigned long long n;
    if (ctl_parse_u64(v, &n) != 0 || n > WIRE_MAX_INT) {
      ctl_errorc("USAGE", "%s: %s wants a non-negative whole number, not '%s'", pa->cmd, f->flag, v);
      return CTL_EXIT_USAGE;
    }
    *(unsigned long long *)(base + f->value) = n;
    *(int *)(base + f->given) = 1;
  }
  return 0;
}

/* Parses --experts LIST into a new JSON array; NULL after printing why. */
static cJSON *experts_parse(const struct ctl_plan_args *a) {
  cJSON *arr = cJSON_CreateArray();
  unsigned long long *seen = NULL;
  size_t n = 0;
  const char *p = a->experts;
  if (arr == NULL) goto nomem;
  seen = malloc((strlen(p) / 2 + 1) * sizeof *seen);
  if (seen == NULL) goto nomem;
  for (;;) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    char item[32];
    unsigned long long id;
    if (len == 0 || len >= sizeof item) goto bad;
    memcpy(item, p, len);
    item[len] = '\0';
    if (ctl_parse_u64(item, &id) != 0 || id > WIRE_MAX_INT) goto bad;
    for (size_t k = 0; k < n; k++) {
      if (seen[k] == id) {
        ctl_errorc("USAGE", "%s: --experts lists expert %llu twice", a->cmd, id);
        goto fail;
      }
    }
    seen[n++] = id;
    cJSON_AddItemToArray(arr, cJSON_CreateNumber((double)id));
    if (comma == NULL) break;
    p = comma + 1;
  }
  free(seen);
  return arr;

bad:
  ctl_errorc("USAGE", "%s: --experts wants comma-separated expert ids such as 0,1,2, not '%s'", a->cmd, a->experts);
  goto fail;
nomem:
  ctl_errorf("%s: out of memory", a->cmd);
fail:
  free(seen);
  cJSON_Delete(arr);
  return NULL;
}

/*
 * Checks one parallel dimension ("tp" or "ep"): size at least 1, rank below
 * size, and a rank for a size above 1 unless ranks are optional or the
 * experts are listed. Returns 0 or -1 after printing why.
 */
static int check_dim(const struct ctl_plan_args *a, const char *dim, int has_size, unsigned long long size,
                     int has_rank, unsigned long long rank, int rank_optional) {
  if (has_size && size == 0) {
    ctl_errorc("USAGE", "%s: --%s-size must be at least 1", a->cmd, dim);
    return -1;
  }
  unsigned long long n = has_size ? size : 1;
  if (has_rank && rank >= n) {
    if (has_size)
      ctl_errorc("USAGE", "%s: --%s-rank %llu must be below --%s-size %llu", a->cmd, dim, rank, dim, size);
    else
      ctl_errorc("USAGE", "%s: --%s-rank %llu needs --%s-size above it", a->cmd, dim, rank, dim);
    return -1;
  }
  if (n > 1 && !has_rank && !rank_optional) {
    ctl_errorc("USAGE", "%s: --%s-size %llu needs --%s-rank (0 to %llu)", a->cmd, dim, n, dim, n - 1);
    return -1;
  }
  return 0;
}

int ctl_plan_spec(const struct ctl_plan_args *a, int ranks_optional, cJSON **spec) {
  *spec = NULL;
  int layout = a->has_tp_size || a->has_tp_rank || a->has_ep_size || a->has_ep_rank || a->experts != NULL || a->fuse;
  if (a->file != NULL && a->preset != NULL) {
    ctl_errorc("USAGE", "%s: --plan FILE and --preset cannot be combined", a->cmd);
    return CTL_EXIT_USAGE;
  }
  if (a->file != NULL && layout) {
    ctl_errorc("USAGE", "%s: --plan FILE cannot be combined with --tp-*, --ep-*, --experts or --fuse "
               "(write them in the file)",
               a->cmd);
    return CTL_EXIT_USAGE;
  }
  if (a->file != NULL) return (*spec = ctl_plan_read(a->file)) != NULL ? 0 : CTL_EXIT_FAIL;
  if (a->preset == NULL && !layout) return 0;
  const char *preset = a->preset != NULL ? a->preset : "auto";
  if (strcmp(preset, "whole") != 0 && strcmp(preset, "auto") != 0 && family_by_name(preset) == FAMILY_NONE) {
    char families[64];
    family_names(families, sizeof families, ", ");
    ctl_errorc("USAGE", "%s: unknown preset '%s' (whole, auto, %s)", a->cmd, preset, families);
    return CTL_EXIT_USAGE;
  }
  if (strcmp(preset, "whole") == 0 && layout) {
    ctl_errorc("USAGE", "%s: --preset whole takes no --tp-*, --ep-*, --experts or --fuse", a->cmd);
    return CTL_EXIT_USAGE;
  }
  if (check_dim(a, "tp", a->has_tp_size, a->tp_size, a->has_tp_rank, a->tp_rank, ranks_optional) != 0 ||
      check_dim(a, "ep", a->has_ep_size, a->ep_size, a->has_ep_rank, a->ep_rank,
                ranks_optional || a->experts != NULL) != 0)
    return CTL_EXIT_USAGE;
  if (a->experts != NULL && (!a->has_ep_size || a->ep_size < 2)) {
    ctl_errorc("USAGE", "%s: --experts lists one rank's experts under expert parallelism: it needs --ep-size 2 or more",
               a->cmd);
    return CTL_EXIT_USAGE;
  }
  cJSON *experts = NULL;
  if (a->experts != NULL && (experts = experts_parse(a)) == NULL) return CTL_EXIT_USAGE;
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) {
    cJSON_Delete(experts);
    ctl_errorf("%s: out of memory", a->cmd);
    return CTL_EXIT_FAIL;
  }
  cJSON_AddStringToObject(o, "preset", preset);
  if (a->has_tp_size) cJSON_AddNumberToObject(o, "tp_size", (double)a->tp_size);
  if (a->has_tp_rank) cJSON_AddNumberToObject(o, "tp_rank", (double)a->tp_rank);
  if (a->has_ep_size) cJSON_AddNumberToObject(o, "ep_size", (double)a->ep_size);
  if (a->has_ep_rank) cJSON_AddNumberToObject(o, "ep_rank", (double)a->ep_rank);
  if (experts != NULL) cJSON_AddItemToObject(o, "experts", experts);
  if (a->fuse) cJSON_AddTrueToObject(o, "fuse");
  *spec = o;
  return 0;
}

cJSON *ctl_plan_read(const char *file) {
  char *text = NULL;
  size_t len = 0;
  int rc = path_read_file(file, 1 << 20, &text, &len);
  if (rc != 0) {
    ctl_errorf("%s: %s", file, strerror(-rc));
    return NULL;
  }
  cJSON *plan = cJSON_ParseWithLength(text, len);
  free(text);
  if (!cJSON_IsObject(plan)) {
    ctl_errorf("%s: a plan is one JSON object, e.g. {\"preset\": \"whole\"}", file);
    cJSON_Delete(plan);
    return NULL;
  }
  return plan;
}

char *ctl_plan_text(const cJSON *spec) {
  return spec != NULL ? cJSON_PrintUnformatted(spec) : strdup("{\"preset\":\"whole\"}");
}

/* ---- checkpoints planned here --------------------------------------------------- */

int ctl_local_open(const char *path, const cJSON *spec, int map, const char *what, struct ctl_local *out) {
  memset(out, 0, sizeof *out);
  struct wd_error err;
  err_clear(&err);
  if (ckpt_open(path, NULL, &out->ck, &err) != 0 || plan_build(out->ck, spec, &out->plan, &err) != 0) {
    ctl_errorx(weightd_err_name(err.code), "%s: %s", what, err.msg);
    ctl_local_close(out);
    return CTL_EXIT_FAIL;
  }
  if (!map) return 0;
  size_t n = out->ck->nshards;
  out->maps = calloc(n ? n : 1, sizeof *out->maps);
  out->map_len = calloc(n ? n : 1, sizeof *out->map_len);
  out->data = calloc(n ? n : 1, sizeof *out->data);
  if (out->maps == NULL || out->map_len == NULL || out->data == NULL) {
    ctl_errorf("%s: out of memory", what);
    ctl_local_close(out);
    return CTL_EXIT_FAIL;
  }
  for (size_t i = 0; i < n; i++) {
    const struct ckpt_shard *sh = &out->ck->shards[i];
    void *m = mmap(NULL, (size_t)sh->size, PROT_READ, MAP_SHARED, sh->fd, 0);
    if (m == MAP_FAILED) {
      ctl_errorf("%s: %s: mmap: %s", what, sh->path, strerror(errno));
      ctl_local_close(out);
      return CTL_EXIT_FAIL;
    }
    out->maps[i] = m;
    out->map_len[i] = (size_t)sh->size;
    out->nmaps = i + 1;
    out->data[i] = (const unsigned char *)m + sh->hdr->data_start;
  }
  return 0;
}

void ctl_local_close(struct ctl_local *l) {
  for (size_t i = 0; i < l->nmaps; i++) munmap(l->maps[i], l->map_len[i]);
  free(l->maps);
  free(l->map_len);
  free(l->data);
  plan_free(l->plan);
  ckpt_free(l->ck);
  memset(l, 0, sizeof *l);
}

uint64_t ctl_plan_read_bytes(const struct plan *p) {
  uint64_t n = 0;
  for (size_t i = 0; i < p->noutputs; i++)
    for (size_t k = 0; k < p->outputs[i].npieces; k++) {
      const struct plan_piece *pc = &p->outputs[i].pieces[k];
      if (pc->src != NULL) n += pc->width * pc->height;
    }
  return n;
}

/* ---- the SIGBUS guard --------------------------------------------------------------- */

static char bus_msg[512];
static size_t bus_len;
static const char *const *volatile bus_cleanup;

static void on_sigbus(int sig) {
  (void)sig;
  const char *const *c = bus_cleanup;
  for (; c != NULL && *c != NULL; c++) unlink(*c);
  ssize_t r = write(STDERR_FILENO, bus_msg, bus_len);
  (void)r;
  _exit(CTL_EXIT_FAIL);
}

void ctl_sigbus_guard(const char *what, const char *const *cleanup) {
  int n = snprintf(bus_msg, sizeof bus_msg,
                   "weightctl: %s: a shard was truncated or became unreadable while it was read\n", what);
  bus_len = n < 0 ? 0 : (size_t)n < sizeof bus_msg ? (size_t)n : sizeof bus_msg - 1;
  if (bus_len > 0) bus_msg[bus_len - 1] = '\n';
  bus_cleanup = cleanup;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigbus;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, NULL);
}
