/*
 * cmd_export.c - `weightctl export PATH [plan flags] --out DIR`: writes one
 * rank's plan outputs as a safetensors checkpoint that any reader loads:
 * model.safetensors, or shards model-0000k-of-0000n.safetensors cut by
 * save_pretrained's greedy rule at --max-shard-bytes (4,000,000,000 by
 * default) with model.safetensors.index.json; tensors in plan order, each
 * header padded with spaces to a multiple of 8 bytes, __metadata__ holding
 * {"format": "pt", "weightd_plan": the plan's key (docs/protocol.md, "Identity"),
 * "weightd_source": the checkpoint's resolved path}; config.json copied
 * along when the checkpoint has one.
 *
 * The main thread builds the plan from read-only mappings of the shards
 * (ctl_local_open), checks the output directory and hands the outputs to
 * the safetensors writer (client/tools/st_writer.h), which owns the files, the
 * worker threads, the index and the renames; its workers gather ranges of
 * the outputs with plan_gather from the shared read-only plan and mappings.
 * A SIGBUS (a shard truncated under its mapping) removes the writer's .tmp
 * files and exits with one error line.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "ctl.h"
#include "pathutil.h"
#include "plan.h"
#include "st_writer.h"

/* A job's bytes: small enough that a worker's buffer stays in its L2 cache between gather and write. */
#define CHUNK ((uint64_t)2 << 20)
#define DEFAULT_MAX_SHARD 4000000000ull
/* Writers into the page cache stop gaining past about 4 (16-core host: 3.1 GiB/s with 1, 5.5 with 4, 5.0 with 8). */
#define DEFAULT_MAX_THREADS 4u
#define CONFIG_MAX_BYTES (16u << 20)

/*
 * Creates dir if missing (its parent must exist) and checks that it is not the
 * checkpoint's own directory and holds only files export writes.
 */
static int prepare_dir(const char *dir, const struct ckpt *ck) {
  struct stat st, src;
  struct wd_error err = {0};
  char foreign[256];
  if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
    ctl_errorf("export: %s: cannot create the directory: %s", dir, strerror(errno));
    return CTL_EXIT_FAIL;
  }
  if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode)) {
    ctl_errorf("export: %s: not a directory", dir);
    return CTL_EXIT_FAIL;
  }
  if (stat(ck->dir, &src) == 0 && src.st_dev == st.st_dev && src.st_ino == st.st_ino) {
    ctl_errorf("export: %s is the checkpoint's own directory; choose another --out", dir);
    return CTL_EXIT_FAIL;
  }
  int r = stw_dir_find_foreign(dir, foreign, sizeof foreign, &err);
  if (r < 0) ctl_errorf("export: %s", err.msg);
  else if (r > 0)
    ctl_errorf("export: %s holds '%s', which export does not write; choose an empty directory", dir, foreign);
  return r != 0 ? CTL_EXIT_FAIL : 0;
}

/* Reads the checkpoint's config.json into *text when there is one (*text stays NULL when not). */
static int config_read(const struct ckpt *ck, char **text, size_t *len) {
  *text = NULL;
  if (ck->layout == CKPT_FILE) return 0;
  char *src = path_join(ck->dir, "config.json");
  if (src == NULL) {
    ctl_errorf("export: out of memory");
    return CTL_EXIT_FAIL;
  }
  int r = path_read_file(src, CONFIG_MAX_BYTES, text, len);
  if (r == -ENOENT) {
    r = 0;
  } else if (r != 0) {
    ctl_errorf("export: %s: %s", src, strerror(-r));
    *text = NULL;
  }
  free(src);
  return r != 0 ? CTL_EXIT_FAIL : 0;
}

/* The writer's fill callback: gathers bytes of plan output `tensor` from the mapped shards. */
static int output_gather(void *arg, size_t tensor, uint64_t off, size_t len, unsigned char *dst,
                         struct wd_error *err) {
  const struct ctl_local *local = arg;
  const struct plan_output *o = &local->plan->outputs[tensor];
  (void)err;
  plan_gather(local->plan, local->data, o->offset + off, o->offset + off + len, dst);
  return 0;
}

/* The writer's byte counts, for the progress line. */
static void writer_progress(void *arg, uint64_t *done, uint64_t *total) { stw_progress_get(arg, done, total); }

/* ---- the command ------------------------------------------------------------------------- */

struct export_opts {
  const char *path, *out;
  unsigned long long max_shard, threads;
};

static void print_done(const struct ctl_local *local, const struct stw_writer *w, const struct export_opts *o,
                       int config, double secs) {
  const struct plan *p = local->plan;
  size_t nfiles = stw_file_count(w);
  if (ctl_opts.json) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddTrueToObject(r, "ok");
    cJSON_AddStringToObject(r, "out", o->out);
    cJSON_AddItemToObject(r, "plan", cJSON_Parse(p->key));
    cJSON_AddItemToObject(r, "tensors", json_u64_create(p->noutputs));
    cJSON_AddItemToObject(r, "bytes", json_u64_create(p->payload_bytes));
    cJSON *files = cJSON_AddArrayToObject(r, "files");
    for (size_t f = 0; f < nfiles; f++) cJSON_AddItemToArray(files, cJSON_CreateString(stw_file_name(w, f)));
    if (nfiles > 1) cJSON_AddItemToArray(files, cJSON_CreateString(STW_INDEX_NAME));
    if (config) cJSON_AddItemToArray(files, cJSON_CreateString("config.json"));
    cJSON_AddNumberToObject(r, "seconds", secs);
    cJSON_AddNumberToObject(r, "gib_per_s", secs > 0 ? (double)p->payload_bytes / (double)(1ull << 30) / secs : 0);
    ctl_json_print(r);
    return;
  }
  char h[32], files[200];
  ctl_human_bytes(p->payload_bytes, h, sizeof h);
  if (nfiles == 1)
    snprintf(files, sizeof files, "1 file, %s", stw_file_name(w, 0));
  else
    snprintf(files, sizeof files, "%zu files, %s to %s and %s", nfiles, stw_file_name(w, 0),
             stw_file_name(w, nfiles - 1), STW_INDEX_NAME);
  printf("exported plan %s of %s to %s\n  %zu tensors, %" PRIu64 " bytes (%s) in %s%s; %.2f s, %.2f GiB/s\n", p->key,
         local->ck->path, o->out, p->noutputs, p->payload_bytes, h, files, config ? "; config.json copied" : "",
         secs, secs > 0 ? (double)p->payload_bytes / (double)(1ull << 30) / secs : 0.0);
}

/*
 * Writes the export through the safetensors writer: the plan's outputs in
 * order, the plan and the source in every file's metadata, config.json
 * beside them. A SIGBUS while the outputs are gathered removes the .tmp
 * files and exits with one error line. Returns the exit code.
 */
static int export_run(const struct ctl_local *local, const struct export_opts *o) {
  const struct plan *p = local->plan;
  struct stw_tensor *ts = NULL;
  struct stw_writer *w = NULL;
  struct wd_error err = {0};
  char source[PATH_MAX], *config = NULL;
  size_t config_len = 0;
  double t0 = clock_s();
  if (realpath(o->path, source) == NULL) snprintf(source, sizeof source, "%s", o->path);
  if (prepare_dir(o->out, local->ck) != 0 || config_read(local->ck, &config, &config_len) != 0) goto fail;
  ts = calloc(p->noutputs ? p->noutputs : 1, sizeof *ts);
  if (ts == NULL) {
    ctl_errorf("export: out of memory");
    goto fail;
  }
  for (size_t i = 0; i < p->noutputs; i++) {
    const struct plan_output *po = &p->outputs[i];
    ts[i] = (struct stw_tensor){.name = po->name, .dtype = po->dtype, .ndim = po->ndim, .shape = po->shape,
                                .nbytes = po->nbytes};
  }
  const struct stw_meta meta[] = {{"format", "pt"}, {"weightd_plan", p->key}, {"weightd_source", source}};
  const struct stw_companion companion = {"config.json", config, config_len};
  const struct stw_spec spec = {
      .dir = o->out,
      .tensors = ts,
      .ntensors = p->noutputs,
      .max_file_bytes = o->max_shard,
      .meta = meta,
      .nmeta = sizeof meta / sizeof meta[0],
      .companions = &companion,
      .ncompanions = config != NULL,
      .fill = output_gather,
      .fill_arg = (void *)local,
      .threads = (unsigned)o->threads,
      .chunk_bytes = CHUNK,
  };
  int rc = stw_create(&spec, &w, &err);
  if (rc == 0) {
    ctl_sigbus_guard("export", stw_tmp_paths(w));
    ctl_progress_watch("export", writer_progress, w);
    rc = stw_run(w, &err);
    ctl_progress_end();
    ctl_sigbus_guard("export", NULL);
  }
  if (rc < 0) {
    if (rc == WEIGHTD_E_LIMIT) ctl_errorf("export: %s; use a smaller --max-shard-bytes", err.msg);
    else ctl_errorf("export: %s", err.msg);
    goto fail;
  }
  print_done(local, w, o, config != NULL, clock_s() - t0);
  stw_free(w);
  free(ts);
  free(config);
  return CTL_EXIT_OK;

fail:
  stw_free(w);
  free(ts);
  free(config);
  return CTL_EXIT_FAIL;
}

static const struct optab_opt export_opts[] = {
    {CTL_OPT_OUT, "out", 0, OPTAB_VALUE, "DIR",
     "The directory to write (created if missing; it must hold only files export writes).", 0, "@dir"},
    {CTL_OPT_MAX_SHARD_BYTES, "max-shard-bytes", 0, OPTAB_VALUE, "N",
     "Cut the outputs into shards of at most N bytes, as save_pretrained does (default 4000000000).", 0, NULL},
    {CTL_OPT_THREADS, "threads", 0, OPTAB_VALUE, "N", "Writer threads, 1 to 64 (default: the CPUs, at most 4).", 0,
     NULL},
};

static int run_export(const struct ctl_args *a) {
  struct export_opts o = {.path = a->pos[0], .out = ctl_val(a, CTL_OPT_OUT), .max_shard = DEFAULT_MAX_SHARD};
  if (o.out == NULL) return ctl_usage_error("--out DIR is required");
  const char *v = ctl_val(a, CTL_OPT_MAX_SHARD_BYTES);
  if (v != NULL && (ctl_parse_u64(v, &o.max_shard) != 0 || o.max_shard == 0))
    return ctl_usage_error("--max-shard-bytes wants a positive number of bytes, not '%s'", v);
  v = ctl_val(a, CTL_OPT_THREADS);
  if (v != NULL && (ctl_parse_u64(v, &o.threads) != 0 || o.threads == 0 || o.threads > STW_THREADS_MAX))
    return ctl_usage_error("--threads wants a number from 1 to %u, not '%s'", STW_THREADS_MAX, v);
  if (v == NULL) {
    unsigned n = stw_cpus_usable();
    o.threads = n < DEFAULT_MAX_THREADS ? n : DEFAULT_MAX_THREADS;
  }
  struct ctl_plan_args pa;
  cJSON *spec = NULL;
  int rc = ctl_plan_args_get(a, &pa);
  if (rc == 0) rc = ctl_plan_spec(&pa, 0, &spec);
  if (rc != 0) return rc;
  struct ctl_local local;
  rc = ctl_local_open(o.path, spec, 1, "export", &local);
  cJSON_Delete(spec);
  if (rc != 0) return rc;
  rc = export_run(&local, &o);
  ctl_local_close(&local);
  return rc;
}

const struct ctl_cmd ctl_cmd_export = {
    .name = "export",
    .args = "PATH",
    .min_args = 1,
    .max_args = 1,
    .summary = "write one rank's plan outputs as a safetensors checkpoint (no daemon)",
    .description =
        "Writes the outputs of one rank's plan of the checkpoint at PATH as a safetensors checkpoint in --out "
        "DIR that any reader loads: model.safetensors, or shards and model.safetensors.index.json; config.json "
        "is copied and the plan's key is kept in every file's __metadata__. Files are written under temporary "
        "names and renamed into place. On a terminal a progress line shows the bytes, rate and time left.",
    .opts = CTL_OPTS(export_opts),
    .flags = CTL_CMD_PLAN | CTL_CMD_LOCAL,
    .run = run_export,
};
