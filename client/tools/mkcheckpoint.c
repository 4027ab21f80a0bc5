/*
 * mkcheckpoint.c - `weightctl mkcheckpoint`: writes a synthetic checkpoint
 * with the exact tensor names, shapes, dtypes and shard files of a
 * published Hugging Face model, filled with seeded random bytes.
 *
 * The main thread parses the options, builds the layout (presets.c),
 * checks the output directory and hands the tensors, their shard
 * assignment and config.json to the safetensors writer
 * (client/tools/st_writer.h), which owns the files, the worker threads (one per
 * usable CPU), the index and the renames; its workers generate ranges of
 * the stream below from the shared read-only layout and keys.
 *
 * The bytes are a counter-based stream, so any job can be generated alone
 * and the output does not depend on the thread count: 8-byte word i of a
 * tensor is splitmix64's output function applied to key + (i + 1) * golden,
 * stored little-endian, where key mixes the seed with an FNV-1a hash of the
 * tensor's name. F32 tensors (DeepSeek's weight_scale_inv and
 * e_score_correction_bias) hold finite values in [1e-4, 1e-2] instead,
 * element i taken from word i.
 */
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ctl.h"
#include "error.h"
#include "presets.h"
#include "st_writer.h"
#include "suggest.h"
#include "weightd.h"

#define GOLDEN 0x9e3779b97f4a7c15ULL

/* ---- the byte stream -------------------------------------------------------- */

/* splitmix64's output function. */
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* Converts a host-order word to little-endian. */
static inline uint64_t to_le64(uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return __builtin_bswap64(v);
#else
  return v;
#endif
}

/* The stream key of a tensor: the seed mixed with the FNV-1a hash of its name. */
static uint64_t tensor_key(uint64_t seed, const char *name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char *s = (const unsigned char *)name; *s != '\0'; s++) {
    h ^= *s;
    h *= 0x100000001b3ULL;
  }
  return mix64(mix64(seed + GOLDEN) ^ h);
}

/* Writes bytes [off, off+len) of the random stream with key `key` into dst. */
static void fill_bytes(unsigned char *dst, uint64_t key, uint64_t off, size_t len) {
  uint64_t i = off / 8;
  size_t skip = (size_t)(off % 8);
  uint64_t w;
  if (skip != 0 && len > 0) {
    size_t n = 8 - skip < len ? 8 - skip : len;
    w = to_le64(mix64(key + (i + 1) * GOLDEN));
    memcpy(dst, (unsigned char *)&w + skip, n);
    dst += n;
    len -= n;
    i++;
  }
  size_t words = len / 8;
  uint64_t z = key + (i + 1) * GOLDEN;
  for (size_t k = 0; k < words; k++, z += GOLDEN) {
    w = to_le64(mix64(z));
    memcpy(dst + 8 * k, &w, 8);
  }
  dst += 8 * words;
  len -= 8 * words;
  if (len > 0) {
    w = to_le64(mix64(z));
    memcpy(dst, &w, len);
  }
}

/* Writes bytes [off, off+len) of an F32 tensor of finite values in [1e-4, 1e-2] into dst. */
static void fill_f32_positive(unsigned char *dst, uint64_t key, uint64_t off, size_t len) {
  uint64_t e = off / 4;
  size_t skip = (size_t)(off % 4);
  while (len > 0) {
    float u = (float)(mix64(key + (e + 1) * GOLDEN) >> 40) * (1.0f / 16777216.0f);
    float v = 1e-4f + u * (1e-2f - 1e-4f);
    unsigned char le[4];
    uint32_t bits;
    memcpy(&bits, &v, 4);
    for (int b = 0; b < 4; b++) le[b] = (unsigned char)(bits >> (8 * b));
    size_t n = 4 - skip < len ? 4 - skip : len;
    memcpy(dst, le + skip, n);
    dst += n;
    len -= n;
    skip = 0;
    e++;
  }
}

/* The fill of each preset_fill kind. */
static void (*const fillers[])(unsigned char *, uint64_t, uint64_t, size_t) = {
    [PRESET_FILL_BYTES] = fill_bytes,
    [PRESET_FILL_F32_POSITIVE] = fill_f32_positive,
};

/* ---- writing -------------------------------------------------------------------- */

/* Creates dir and its missing parents; returns 0 or WEIGHTD_E_IO. */
static int make_dirs(const char *dir, struct wd_error *err) {
  char buf[PATH_MAX];
  size_t len = strlen(dir);
  if (len == 0 || len >= sizeof buf) return err_set(err, WEIGHTD_E_INVALID, "bad output directory '%s'", dir);
  memcpy(buf, dir, len + 1);
  for (size_t i = 1; i <= len; i++) {
    if (buf[i] != '/' && buf[i] != '\0') continue;
    char c = buf[i];
    buf[i] = '\0';
    if (mkdir(buf, 0755) < 0 && errno != EEXIST)
      return err_set(err, WEIGHTD_E_IO, "%s: cannot create directory: %s", buf, strerror(errno));
    buf[i] = c;
  }
  struct stat st;
  if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode))
    return err_set(err, WEIGHTD_E_IO, "%s: not a directory", dir);
  return 0;
}

/*
 * Creates dir if missing and checks that it holds only files mkcheckpoint
 * writes. Returns 0, WEIGHTD_E_IO, or WEIGHTD_E_INVALID for a foreign entry.
 */
static int prepare_dir(const char *dir, struct wd_error *err) {
  char foreign[256];
  int rc = make_dirs(dir, err);
  if (rc == 0) rc = stw_dir_find_foreign(dir, foreign, sizeof foreign, err);
  if (rc > 0)
    rc = err_set(err, WEIGHTD_E_INVALID, "%s: holds '%s', which mkcheckpoint does not write; choose an empty directory",
                 dir, foreign);
  return rc;
}

/* What the writer's workers read: the layout and every tensor's stream key. */
struct stream {
  const struct preset_layout *l;
  uint64_t *keys;
};

/* The writer's fill callback: bytes [off, off+len) of tensor i's stream. */
static int tensor_generate(void *arg, size_t i, uint64_t off, size_t len, unsigned char *dst, struct wd_error *err) {
  const struct stream *st = arg;
  (void)err;
  fillers[st->l->tensors[i].fill](dst, st->keys[i], off, len);
  return 0;
}

/* The writer's byte counts, for the progress line. */
static void writer_progress(void *arg, uint64_t *done, uint64_t *total) { stw_progress_get(arg, done, total); }

/* Prints the config.json of layout l into a new buffer *text of *len bytes. */
static int config_build(const struct preset_layout *l, char **text, size_t *len, struct wd_error *err) {
  FILE *f = open_memstream(text, len);
  if (f == NULL) return err_set(err, WEIGHTD_E_NOMEM, "cannot build config.json");
  int rc = preset_config_write(l, f);
  if (fclose(f) != 0 && rc == 0) rc = WEIGHTD_E_NOMEM;
  if (rc < 0) {
    free(*text);
    *text = NULL;
    return err_set(err, rc, "cannot build config.json");
  }
  return 0;
}

/*
 * Writes layout l into dir with the given seed: every shard, config.json
 * and (for several shards) the index. Fills *seconds with the time the
 * writing took. Returns 0 or a negative code with err filled.
 */
static int checkpoint_write(const struct preset_layout *l, const char *dir, uint64_t seed, unsigned nthreads,
                            bool sparse, double *seconds, uint64_t *disk_bytes, struct wd_error *err) {
  struct stream st = {.l = l};
  struct stw_tensor *ts = NULL;
  struct stw_writer *w = NULL;
  char *cfg = NULL;
  size_t cfglen = 0;
  double t0 = clock_s();

  int rc = prepare_dir(dir, err);
  if (rc == 0) rc = config_build(l, &cfg, &cfglen, err);
  if (rc < 0) goto fail;
  st.keys = malloc((l->count ? l->count : 1) * sizeof *st.keys);
  ts = calloc(l->count ? l->count : 1, sizeof *ts);
  if (st.keys == NULL || ts == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "cannot allocate the writer state");
    goto fail;
  }
  for (size_t i = 0; i < l->count; i++) {
    const struct preset_tensor *t = &l->tensors[i];
    st.keys[i] = tensor_key(seed, t->name);
    ts[i] = (struct stw_tensor){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .shape = t->shape,
                                .nbytes = t->nbytes, .file = t->shard};
  }
  const struct stw_meta meta[] = {{"format", "pt"}};
  const struct stw_companion companion = {"config.json", cfg, cfglen};
  const struct stw_spec spec = {
      .dir = dir,
      .tensors = ts,
      .ntensors = l->count,
      .name_digits = l->preset->shard_count_digits,
      .meta = meta,
      .nmeta = 1,
      .companions = &companion,
      .ncompanions = 1,
      .fill = tensor_generate,
      .fill_arg = &st,
      .threads = nthreads,
      .sparse = sparse,
  };
  rc = stw_create(&spec, &w, err);
  if (rc == 0) {
    ctl_progress_watch("mkcheckpoint", writer_progress, w);
    rc = stw_run(w, err);
    ctl_progress_end();
  }
  if (rc < 0) goto fail;
  *seconds = clock_s() - t0;
  *disk_bytes = stw_disk_bytes(w);
  stw_free(w);
  free(ts);
  free(st.keys);
  free(cfg);
  return 0;

fail:
  stw_free(w);
  free(ts);
  free(st.keys);
  free(cfg);
  return rc;
}

/* ---- the command ------------------------------------------------------------------ */

enum opt_id { OPT_PRESET, OPT_OUT, OPT_LAYERS, OPT_EXPERTS, OPT_SEED, OPT_LIST, OPT_SPARSE, OPT_COUNT };
enum opt_kind { OPT_KIND_STRING, OPT_KIND_U64, OPT_KIND_FLAG };

/* The options, one row each: the command line's option and how its value reads. */
static const struct {
  enum ctl_opt_id id;
  const char *name;
  enum opt_kind kind;
} opt_defs[OPT_COUNT] = {
    [OPT_PRESET] = {CTL_OPT_PRESET, "--preset", OPT_KIND_STRING},
    [OPT_OUT] = {CTL_OPT_OUT, "--out", OPT_KIND_STRING},
    [OPT_LAYERS] = {CTL_OPT_LAYERS, "--layers", OPT_KIND_U64},
    [OPT_EXPERTS] = {CTL_OPT_EXPERTS, "--experts", OPT_KIND_U64},
    [OPT_SEED] = {CTL_OPT_SEED, "--seed", OPT_KIND_U64},
    [OPT_LIST] = {CTL_OPT_LIST, "--list", OPT_KIND_FLAG},
    [OPT_SPARSE] = {CTL_OPT_SPARSE, "--sparse", OPT_KIND_FLAG},
};

struct options {
  bool given[OPT_COUNT];
  const char *text[OPT_COUNT];
  unsigned long long num[OPT_COUNT];
};

/* Reads the parsed arguments into o; returns 0 or -1 after printing why. */
static int options_get(const struct ctl_args *a, struct options *o) {
  memset(o, 0, sizeof *o);
  for (int k = 0; k < OPT_COUNT; k++) {
    o->given[k] = ctl_has(a, opt_defs[k].id);
    o->text[k] = ctl_val(a, opt_defs[k].id);
    if (o->given[k] && opt_defs[k].kind == OPT_KIND_U64 && ctl_parse_u64(o->text[k], &o->num[k]) < 0) {
      ctl_usage_error("%s: '%s' is not a non-negative integer", opt_defs[k].name, o->text[k]);
      return -1;
    }
  }
  return 0;
}

/* The variant of preset p that the options ask for (they were checked against p). */
static struct preset_variant variant_of(const struct options *o, const struct preset *p) {
  return (struct preset_variant){
      .layers = o->given[OPT_LAYERS] ? (uint32_t)o->num[OPT_LAYERS] : p->num_layers,
      .experts = o->given[OPT_EXPERTS] ? (uint32_t)o->num[OPT_EXPERTS] : 0,
  };
}

/*
 * Prints the presets (or the one named, as the options cut it) with their
 * layers, routed experts per MoE layer ("-" for a dense model), tensor
 * count, payload bytes and shards.
 */
static int list_presets(const struct options *o) {
  struct wd_error err = {0};
  cJSON *json = ctl_opts.json ? cJSON_CreateObject() : NULL;
  cJSON *rows = json ? cJSON_AddArrayToObject(json, "presets") : NULL;
  if (json != NULL) cJSON_AddTrueToObject(json, "ok");
  else
    printf("%-14s %-22s %6s %7s %8s %15s %11s %6s\n", "PRESET", "ARCHITECTURE", "LAYERS", "EXPERTS", "TENSORS",
           "PAYLOAD_BYTES", "PAYLOAD_GIB", "SHARDS");
  for (size_t i = 0; i < preset_count(); i++) {
    const struct preset *p = preset_at(i);
    if (o->given[OPT_PRESET] && strcmp(p->name, o->text[OPT_PRESET]) != 0) continue;
    struct preset_variant v = variant_of(o, p);
    struct preset_layout l;
    if (preset_layout_build(p, &v, &l, &err) < 0) {
      ctl_errorf("%s", err.msg);
      cJSON_Delete(json);
      return CTL_EXIT_FAIL;
    }
    char experts[16] = "-";
    if (l.model.num_experts > 0) snprintf(experts, sizeof experts, "%u", l.model.num_experts);
    if (json != NULL) {
      cJSON *r = cJSON_CreateObject();
      cJSON_AddStringToObject(r, "preset", p->name);
      cJSON_AddStringToObject(r, "architecture", p->architecture);
      cJSON_AddItemToObject(r, "layers", json_u64_create(l.layers));
      cJSON_AddItemToObject(r, "experts", json_u64_create(l.model.num_experts));
      cJSON_AddItemToObject(r, "tensors", json_u64_create(l.count));
      cJSON_AddItemToObject(r, "payload_bytes", json_u64_create(l.total_bytes));
      cJSON_AddItemToObject(r, "shards", json_u64_create(l.shards));
      cJSON_AddItemToArray(rows, r);
    } else {
      printf("%-14s %-22s %6u %7s %8zu %15llu %11.2f %6u\n", p->name, p->architecture, l.layers, experts, l.count,
             (unsigned long long)l.total_bytes, (double)l.total_bytes / (double)(1ull << 30), l.shards);
    }
    preset_layout_free(&l);
  }
  if (json != NULL) ctl_json_print(json);
  return CTL_EXIT_OK;
}

/*
 * Checks --experts against preset p (NULL when none was named). Returns 0,
 * or -1 after printing one line that says why.
 */
static int experts_check(const struct options *o, const struct preset *p) {
  unsigned long long n = o->num[OPT_EXPERTS];
  if (!o->given[OPT_EXPERTS]) return 0;
  if (p == NULL) {
    ctl_usage_error("--experts needs --preset");
    return -1;
  }
  if (p->num_experts == 0) {
    ctl_usage_error("--experts: %s is a dense model without routed experts", p->name);
    return -1;
  }
  if (n < 1 || n > p->num_experts) {
    ctl_usage_error("--experts must be 1 to %u for %s, not %llu", p->num_experts, p->name, n);
    return -1;
  }
  return 0;
}

static int run_mkcheckpoint(const struct ctl_args *a) {
  struct options o;
  struct wd_error err = {0};
  struct preset_layout l = {0};
  const struct preset *p = NULL;
  double seconds = 0;
  uint64_t disk = 0;

  if (options_get(a, &o) < 0) return CTL_EXIT_USAGE;
  if (o.given[OPT_PRESET]) {
    p = preset_find(o.text[OPT_PRESET]);
    if (p == NULL) {
      const char *names[64];
      size_t n = preset_count() < 64 ? preset_count() : 64;
      for (size_t i = 0; i < n; i++) names[i] = preset_at(i)->name;
      const char *best = suggest_closest(o.text[OPT_PRESET], names, n);
      if (best != NULL) return ctl_usage_error("unknown preset '%s'; did you mean '%s'?", o.text[OPT_PRESET], best);
      return ctl_usage_error("unknown preset '%s' (--list shows them)", o.text[OPT_PRESET]);
    }
  }
  if (o.given[OPT_LAYERS] && (p == NULL || o.num[OPT_LAYERS] < 1 || o.num[OPT_LAYERS] > p->num_layers)) {
    if (p == NULL) return ctl_usage_error("--layers needs --preset");
    return ctl_usage_error("--layers must be 1 to %u for %s", p->num_layers, p->name);
  }
  if (experts_check(&o, p) < 0) return CTL_EXIT_USAGE;
  if (o.given[OPT_LIST]) return list_presets(&o);
  if (p == NULL || !o.given[OPT_OUT]) return ctl_usage_error("needs --preset and --out (or --list)");

  struct preset_variant v = variant_of(&o, p);
  unsigned nthreads = stw_cpus_usable();
  if (nthreads > STW_THREADS_MAX) nthreads = STW_THREADS_MAX;
  if (preset_layout_build(p, &v, &l, &err) < 0) goto fail;
  bool sparse = o.given[OPT_SPARSE];
  if (checkpoint_write(&l, o.text[OPT_OUT], o.num[OPT_SEED], nthreads, sparse, &seconds, &disk, &err) < 0) goto fail;
  char experts[48] = "";
  if (p->num_experts > 0) snprintf(experts, sizeof experts, ", %u of %u experts", l.model.num_experts, p->num_experts);
  double rate = seconds > 0 ? (double)l.total_bytes / (double)(1ull << 30) / seconds : 0.0;
  if (ctl_opts.json) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddTrueToObject(r, "ok");
    cJSON_AddStringToObject(r, "preset", p->name);
    cJSON_AddStringToObject(r, "out", o.text[OPT_OUT]);
    cJSON_AddItemToObject(r, "layers", json_u64_create(l.layers));
    cJSON_AddItemToObject(r, "experts", json_u64_create(l.model.num_experts));
    cJSON_AddItemToObject(r, "tensors", json_u64_create(l.count));
    cJSON_AddItemToObject(r, "payload_bytes", json_u64_create(l.total_bytes));
    cJSON_AddItemToObject(r, "shards", json_u64_create(l.shards));
    cJSON_AddBoolToObject(r, "sparse", sparse);
    if (sparse) cJSON_AddItemToObject(r, "disk_bytes", json_u64_create(disk));
    cJSON_AddNumberToObject(r, "seconds", seconds);
    if (!sparse) cJSON_AddNumberToObject(r, "gib_per_s", rate);
    cJSON_AddItemToObject(r, "threads", json_u64_create(nthreads));
    ctl_json_print(r);
  } else if (sparse) {
    printf("wrote %s sparse (%u of %u layers%s): %zu tensors, %llu payload bytes as holes that read as zeros, "
           "%u shard%s in %s; %llu bytes on disk; %.2f s\n",
           p->name, l.layers, p->num_layers, experts, l.count, (unsigned long long)l.total_bytes, l.shards,
           l.shards == 1 ? "" : "s", o.text[OPT_OUT], (unsigned long long)disk, seconds);
  } else {
    printf("wrote %s (%u of %u layers%s): %zu tensors, %llu payload bytes, %u shard%s in %s; %.2f s, %.2f GiB/s, "
           "%u thread%s\n",
           p->name, l.layers, p->num_layers, experts, l.count, (unsigned long long)l.total_bytes, l.shards,
           l.shards == 1 ? "" : "s", o.text[OPT_OUT], seconds, rate, nthreads, nthreads == 1 ? "" : "s");
  }
  if (sparse) {
    preset_layout_free(&l);
    return CTL_EXIT_OK;
  }
  preset_layout_free(&l);
  return CTL_EXIT_OK;

fail:
  ctl_errorc(weightd_err_name(err.code), "mkcheckpoint: %s", err.msg);
  preset_layout_free(&l);
  return CTL_EXIT_FAIL;
}

static const struct optab_opt mkcheckpoint_opts[] = {
    {CTL_OPT_PRESET, "preset", 0, OPTAB_VALUE, "NAME",
     "The published model whose layout to write (--list shows them: qwen3-0.6b, qwen3-4b, qwen3-30b-a3b, "
     "deepseek-v3, ...).",
     0, NULL},
    {CTL_OPT_OUT, "out", 0, OPTAB_VALUE, "DIR", "The directory to write (created if missing; it must hold only "
     "files mkcheckpoint writes).", 0, "@dir"},
    {CTL_OPT_LAYERS, "layers", 0, OPTAB_VALUE, "N", "Write only the first N layers (default: all of them).", 0,
     NULL},
    {CTL_OPT_EXPERTS, "experts", 0, OPTAB_VALUE, "N",
     "Routed experts per MoE layer (default: the model's own count); MoE presets only.", 0, NULL},
    {CTL_OPT_SEED, "seed", 0, OPTAB_VALUE, "S", "The seed of the bytes (default 0): the same seed writes the same "
     "files, whatever the thread count.", 0, NULL},
    {CTL_OPT_LIST, "list", 0, OPTAB_SWITCH, NULL,
     "List the presets (or the one --preset names, cut as --layers and --experts say) with their tensors, bytes "
     "and shards, instead of writing.", 0, NULL},
    {CTL_OPT_SPARSE, "sparse", 0, OPTAB_SWITCH, NULL,
     "Write the tensor data as holes: files of the right size that read as zeros and take almost no disk (the "
     "headers, index and config.json are real), so a 673 GB layout fits a small disk. The file system must keep "
     "holes; one that does not is refused before anything large is written.",
     0, NULL},
};

const struct ctl_cmd ctl_cmd_mkcheckpoint = {
    .name = "mkcheckpoint",
    .args = "",
    .summary = "write a synthetic checkpoint with a published model's exact layout (no daemon)",
    .description =
        "Writes a checkpoint with the exact tensor names, shapes, dtypes, shard files, index and config.json of "
        "a published Hugging Face model, filled with seeded random bytes, to qualify a node or test an engine "
        "without downloading weights (see docs/checkpoints.md). On a terminal a progress line shows the bytes, "
        "rate and time left.",
    .opts = CTL_OPTS(mkcheckpoint_opts),
    .run = run_mkcheckpoint,
};
