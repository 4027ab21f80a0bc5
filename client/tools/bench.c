/*
 * bench.c - weightd-bench: how close a running weightd gets to the hardware.
 *
 * In one run it measures the ceilings (pinned-source host-to-device copies on
 * the chosen GPU; page cache -> pinned memory fill rates with the daemon's
 * fill thread count, for the staging schedule of each staged_strided mode),
 * then loads a checkpoint's plan through the daemon in the ways the phases
 * ask for, evicting in between so that each timed load starts with no
 * resident set and includes slab allocation, times a fresh process attaching
 * the resident set (CUDA context creation reported apart from the attach; the
 * attach split into the request/reply round trip and opening the handle
 * alone: cudaIpcOpenMemHandle for a legacy cuda_ipc set, import + reserve +
 * map + set access for a cuda_vmm set, whichever the daemon's cuda_handles
 * setting makes), and reads the daemon's anonymous RSS. Each figure is
 * printed with its ratio to the ceiling measured in this same run. Attach
 * figures name the set's tensor count (the attach reply's size no longer
 * grows with it: the table is a shared binary memfd). --attach-only is
 * --phases attach: it loads the set once and times the attaches
 * (tests/gpu/bench.sh runs it against a second daemon with the other handle
 * kind; tests/gpu/attach.sh at several tensor counts). --early adds the
 * early phase (after the others).
 *
 * weightd-bench --checkpoint DIR --socket PATH [--device N] [--runs N] [--plan JSON]
 *               [--phases LIST] [--alt-socket PATH] [--names A,B] [--source S] [--label TEXT] [--fill-threads N]
 *               [--settle-ms MS] [--no-b2b] [--ceiling-max-gib N] [--attach-only]
 *               [--early] [--json] [--json-out FILE]
 * weightd-bench --attach-probe SET --socket PATH   (the fresh process)
 * weightd-bench --early-probe DIR --socket PATH    (the fresh process, early attach)
 * weightd-bench --multi MODE ...                   (several GPUs: bench_multi.c)
 *
 * Phases (comma-separated; default ceiling,fill,staged,pin,pinned,attach,rss):
 *   open     the daemon's `open` of the checkpoint, closed first (every shard
 *            header validated and mapped), and here ckpt_open + plan_build
 *   ceiling  pinned-source H2D copies of the plan's bytes (at most
 *            --ceiling-max-gib of them, the rate scaled), median of 3
 *   fill     page cache -> pinned memory with --fill-threads threads, the
 *            staging schedule of each staged_strided mode (gather, rows),
 *            and gather as each staging_writes mode writes (streaming
 *            stores, write-combined memory), median of 3 each: the fill
 *            alone, into a 64 MiB buffer per thread (never in cache, no
 *            copy alongside), not the pipeline's fill
 *   prefetch `prefetch` of the plan's bytes with wait (a plan: only its ranges)
 *   staged   --runs staged loads (the checkpoint closed first, so unpinned);
 *            with --alt-socket, loads alternate between the two daemons
 *            (each named by its staged_strided setting, or by --names A,B:
 *            two builds of the daemon compared in one run)
 *   pin      `prefetch` with pin and wait, per plan when --plan is given (in
 *            both daemons with --alt-socket)
 *   pinned   --runs loads after pin (direct), alternating like staged
 *   direct   --runs loads with the O_DIRECT source (source "direct"),
 *            alternating like staged
 *   auto     the pin policy: the checkpoint closed, one load (staged), the
 *            wait until the daemon has pinned it by itself, then --runs loads
 *   attach   a fresh process attaches the resident set (--runs, at most 16):
 *            context, round trip (with the binary tensor table, as
 *            libweightd asks), handle open (per the set's handle kind), the
 *            whole attach through libweightd, the set's tensor count
 *   rss      the daemon's RssAnon (smaps_rollup Anonymous)
 *   early    early attach (--early): a fresh process attaches the set while
 *            it loads (the device's sets evicted first, so the load starts
 *            with the attach) and times the attach, the moment the first
 *            layer's tensors (every tensor up to the last one named
 *            *.layers.0.* in slab order) are in place and usable, and the
 *            whole load, all from the attach call (--runs, at most 16)
 *   cold     the page cache dropped (root: /proc/sys/vm/drop_caches; else
 *            posix_fadvise DONTNEED, checked with mincore): the disk's
 *            O_DIRECT ceiling as the best of a sweep over threads, read
 *            sizes and io_uring depths (bench_disk.c), then two cold loads
 *            through the daemon, with its source setting and with the
 *            O_DIRECT source, each with the page cache's share of the
 *            plan's ranges before and after; page cache warm again after
 *
 * Every timed load takes --source S as its source option when given.
 */
#include <cjson/cJSON.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_attach.h"
#include "bench_daemon.h"
#include "bench_phases.h"
#include "bench_report.h"
#include "bench_multi.h"
#include "checkpoint.h"
#include "clock.h"
#include "plan.h"
#include "weightd.h"

/* ---- options ------------------------------------------------------------------------ */

static bool phase(const char *name) {
  size_t n = strlen(name);
  for (const char *p = bench_cfg.phases; (p = strstr(p, name)) != NULL; p += n)
    if ((p == bench_cfg.phases || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return true;
  return false;
}

/* ---- main ---------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--multi") == 0) return bench_multi_main(argc - 1, argv + 1);
  const char *probe = NULL, *eprobe = NULL;
  int attach_only = 0, early = 0;
  bench_cfg.fill_threads = (unsigned)sysconf(_SC_NPROCESSORS_ONLN);
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--json") == 0) bench_cfg.json = 1;
    else if (strcmp(argv[i], "--no-b2b") == 0) bench_cfg.b2b = 0;
    else if (strcmp(argv[i], "--attach-only") == 0) attach_only = 1;
    else if (strcmp(argv[i], "--early") == 0) early = 1;
    else if (v && strcmp(argv[i], "--checkpoint") == 0) bench_cfg.path = argv[++i];
    else if (v && strcmp(argv[i], "--socket") == 0) bench_cfg.sock = argv[++i];
    else if (v && strcmp(argv[i], "--alt-socket") == 0) bench_cfg.alt_sock = argv[++i];
    else if (v && strcmp(argv[i], "--label") == 0) bench_cfg.label = argv[++i];
    else if (v && strcmp(argv[i], "--json-out") == 0) bench_cfg.json_out = argv[++i];
    else if (v && strcmp(argv[i], "--device") == 0) bench_cfg.device = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--runs") == 0) bench_cfg.runs = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--settle-ms") == 0) bench_cfg.settle_ms = atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--plan") == 0) bench_cfg.plan_json = argv[++i];
    else if (v && strcmp(argv[i], "--names") == 0) bench_cfg.names = argv[++i];
    else if (v && strcmp(argv[i], "--source") == 0) bench_cfg.source = argv[++i];
    else if (v && strcmp(argv[i], "--phases") == 0)
      snprintf(bench_cfg.phases, sizeof bench_cfg.phases, "%s", argv[++i]);
    else if (v && strcmp(argv[i], "--ceiling-max-gib") == 0) bench_cfg.ceiling_max_gib = atof(argv[++i]);
    else if (v && strcmp(argv[i], "--fill-threads") == 0) bench_cfg.fill_threads = (unsigned)atoi(argv[++i]);
    else if (v && strcmp(argv[i], "--attach-probe") == 0) probe = argv[++i];
    else if (v && strcmp(argv[i], "--early-probe") == 0) eprobe = argv[++i];
    else {
      fprintf(stderr,
              "usage: weightd-bench --checkpoint DIR --socket PATH [--device N] [--runs N] [--plan JSON]\n"
              "                     [--phases LIST] [--alt-socket PATH] [--names A,B] [--source S] [--label TEXT]\n"
              "                     [--fill-threads N]\n"
              "                     [--settle-ms MS] [--no-b2b] [--ceiling-max-gib N] [--attach-only]\n"
              "                     [--early] [--json] [--json-out FILE]\n"
              "       weightd-bench --multi all|replica|striped|group ... (several GPUs)\n");
      return 2;
    }
  }
  if (probe) return bench_attach_probe(probe, bench_cfg.sock, bench_cfg.device);
  if (eprobe) return bench_early_probe(eprobe, bench_cfg.sock, bench_cfg.device);
  /* Only the attach figures: for a daemon with the other cuda_handles (tests/gpu/bench.sh). */
  if (attach_only) snprintf(bench_cfg.phases, sizeof bench_cfg.phases, "attach");
  if (early && !phase("early")) {
    size_t n = strlen(bench_cfg.phases);
    snprintf(bench_cfg.phases + n, sizeof bench_cfg.phases - n, "%searly", n ? "," : "");
  }
  if (bench_cfg.path == NULL || bench_cfg.sock == NULL || bench_cfg.runs < 1 || bench_cfg.fill_threads < 1) {
    fprintf(stderr, "weightd-bench: --checkpoint DIR and --socket PATH are required\n");
    return 2;
  }
  if (bench_cfg.runs > MAX_RUNS) bench_cfg.runs = MAX_RUNS;
  bench_out = bench_cfg.json ? fopen("/dev/null", "w") : stdout;
  if (bench_out == NULL) bench_die("/dev/null", strerror(errno));

  char *abs = realpath(bench_cfg.path, NULL);
  if (abs == NULL) bench_die(bench_cfg.path, strerror(errno));
  bench_result = cJSON_CreateObject();
  if (bench_cfg.label) cJSON_AddStringToObject(bench_result, "label", bench_cfg.label);
  cJSON_AddStringToObject(bench_result, "checkpoint", abs);
  bench_daemon_attach(&bench_daemons[bench_ndaemons++], bench_cfg.sock);
  if (bench_cfg.alt_sock) bench_daemon_attach(&bench_daemons[bench_ndaemons++], bench_cfg.alt_sock);
  if (bench_cfg.names != NULL) { /* --names A,B */
    const char *comma = strchr(bench_cfg.names, ',');
    if (comma == NULL || bench_ndaemons < 2) bench_die("--names", "give two names, A,B, with --alt-socket");
    snprintf(bench_daemons[0].name, sizeof bench_daemons[0].name, "%.*s", (int)(comma - bench_cfg.names),
             bench_cfg.names);
    snprintf(bench_daemons[1].name, sizeof bench_daemons[1].name, "%s", comma + 1);
  }

  /* Here: open the checkpoint and build the plan (timed), and list its byte ranges. */
  struct ckpt *c = NULL;
  struct wd_error err = {0};
  double t0 = clock_s();
  if (ckpt_open(abs, NULL, &c, &err) != 0) bench_die("checkpoint", err.msg);
  double t_ckpt_open = clock_s() - t0;
  cJSON *spec = bench_cfg.plan_json ? cJSON_Parse(bench_cfg.plan_json) : NULL;
  if (bench_cfg.plan_json != NULL && spec == NULL) bench_die("--plan", "not valid JSON");
  struct plan *plan = NULL;
  t0 = clock_s();
  if (plan_build(c, spec, &plan, &err) != 0) bench_die("plan", err.msg);
  double t_plan = clock_s() - t0;
  cJSON_Delete(spec);
  struct plan_range *ranges = NULL;
  size_t nranges = 0;
  if (plan_ranges(plan, c, 4096, 0, &ranges, &nranges, &err) != 0) bench_die("plan ranges", err.msg);
  uint64_t bytes = plan->payload_bytes, read_bytes = 0;
  for (size_t i = 0; i < plan->noutputs; i++)
    for (size_t k = 0; k < plan->outputs[i].npieces; k++)
      if (plan->outputs[i].pieces[k].src != NULL)
        read_bytes += plan->outputs[i].pieces[k].width * plan->outputs[i].pieces[k].height;
  bench_gib = (double)bytes / GiB;

  struct cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, bench_cfg.device));
  cJSON_AddStringToObject(bench_result, "gpu", prop.name);
  cJSON_AddItemToObject(bench_result, "plan", cJSON_Parse(plan->key));
  bench_put_num(bench_result, "bytes", (double)bytes);
  bench_put_num(bench_result, "outputs", (double)plan->noutputs);
  bench_put_num(bench_result, "shards", (double)c->nshards);
  bench_put_num(bench_result, "tensors", (double)c->ntensors);
  bench_put_num(bench_result, "runs", bench_cfg.runs);
  bench_put_num(bench_result, "fill_threads", bench_cfg.fill_threads);
  bench_put_num(bench_result, "settle_ms", bench_cfg.settle_ms);
  cJSON *ds = cJSON_AddArrayToObject(bench_result, "daemons");
  for (int i = 0; i < bench_ndaemons; i++) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "staged_strided", bench_daemons[i].strided);
    cJSON_AddStringToObject(o, "pin", bench_daemons[i].pin);
    cJSON_AddStringToObject(o, "load_method", bench_daemons[i].method);
    cJSON_AddItemToArray(ds, o);
  }
  fprintf(bench_out, "weightd-bench: %s, %s, %.2f GiB (%" PRIu64 " bytes), %zu outputs, %d runs each, medians%s%s\n",
          prop.name, abs, bench_gib, bytes, plan->noutputs, bench_cfg.runs, bench_cfg.label ? "; " : "",
          bench_cfg.label ? bench_cfg.label : "");
  fprintf(bench_out, "plan: %s\n", plan->key);
  fprintf(bench_out, "%-46s %11s %9s %9s\n", "", "time", "GiB/s", "ceiling");

  if (phase("open")) {
    bench_close_all(abs, bench_cfg.device);
    char req[PATH_MAX + 64];
    snprintf(req, sizeof req, "{\"op\":\"open\",\"path\":\"%s\"}", abs);
    t0 = clock_s();
    bench_request_or_die(bench_daemons[0].c, req);
    double t_open = clock_s() - t0;
    bench_put_num(bench_result, "daemon_open_s", t_open);
    bench_put_num(bench_result, "ckpt_open_s", t_ckpt_open);
    bench_put_num(bench_result, "plan_build_s", t_plan);
    char note[96];
    snprintf(note, sizeof note, "(%zu shards, %zu tensors; request to reply)", c->nshards, c->ntensors);
    bench_row_plain("open in the daemon (headers validated, mapped)", t_open, note);
    bench_row_plain("  same here (ckpt_open)", t_ckpt_open, "");
    snprintf(note, sizeof note, "(%zu outputs)", plan->noutputs);
    bench_row_plain("  plan_build here", t_plan, note);
  }

  if (phase("ceiling")) {
    uint64_t cb = bytes, cap = (uint64_t)(bench_cfg.ceiling_max_gib * GiB);
    if (cap > 0 && cb > cap) cb = cap;
    double v[3];
    for (int i = 0; i < 3; i++) v[i] = bench_h2d_ceiling(bench_cfg.device, cb);
    bench_ceiling_s = bench_median(v, 3) * ((double)bytes / (double)cb);
    bench_put_num(bench_result, "ceiling_h2d_s", bench_ceiling_s);
    bench_put_num(bench_result, "ceiling_measured_bytes", (double)cb);
    bench_put_runs(bench_result, "ceiling_runs_s", v, 3);
    bench_row(cb < bytes ? "H2D ceiling (pinned source, 64 MiB copies; scaled)"
                         : "H2D ceiling (pinned source, 64 MiB copies)",
              bench_ceiling_s);
  }

  if (phase("prefetch")) {
    char *req = bench_plan_request("prefetch", abs, ",\"wait\":true");
    t0 = clock_s();
    cJSON *r = bench_request_json(bench_daemons[0].c, req, NULL);
    double s = clock_s() - t0;
    free(req);
    bench_put_num(bench_result, "prefetch_s", s);
    bench_put_num(bench_result, "prefetch_read_s", bench_jnum(r, "read_seconds"));
    cJSON_Delete(r);
    bench_row_plain("prefetch of the plan's bytes (wait)", s, "(page cache warm for it)");
  }

  if (phase("fill")) {
    struct mapped m;
    bench_map_ckpt(c, ranges, nranges, &m);
    /* gather and rows with plain stores; gather also as the other staging_writes write. */
    static const struct {
      enum plan_strided mode;
      enum bench_writes writes;
      const char *name;
    } modes[] = {{PLAN_STRIDED_GATHER, BENCH_WRITES_CACHED, "gather"},
                 {PLAN_STRIDED_ROWS, BENCH_WRITES_CACHED, "rows"},
                 {PLAN_STRIDED_GATHER, BENCH_WRITES_STREAMING, "gather_streaming"},
                 {PLAN_STRIDED_GATHER, BENCH_WRITES_WRITE_COMBINED, "gather_write_combined"}};
    for (size_t k = 0; k < sizeof modes / sizeof modes[0]; k++) {
      double v[3];
      uint64_t copied = 0;
      for (int i = 0; i < 3; i++)
        v[i] = bench_fill_rate(&m, plan, modes[k].mode, modes[k].writes, bench_cfg.fill_threads, &copied);
      char key[48], label[96];
      snprintf(key, sizeof key, "fill_%s_s", modes[k].name);
      bench_put_num(bench_result, key, bench_median(v, 3));
      snprintf(key, sizeof key, "fill_%s_copied_bytes", modes[k].name);
      bench_put_num(bench_result, key, (double)copied);
      snprintf(label, sizeof label, "host fill, %s (%u thr, %.2f GiB copied)", modes[k].name, bench_cfg.fill_threads,
               (double)copied / GiB);
      bench_row(label, bench_median(v, 3));
    }
    bench_unmap_ckpt(&m);
  }

  if (phase("staged")) {
    bench_close_all(abs, bench_cfg.device);
    char *req = bench_plan_request("prefetch", abs, ",\"wait\":true");
    for (int i = 0; i < bench_ndaemons; i++)
      bench_request_or_die(bench_daemons[i].c, req); /* page cache warm, nothing pinned */
    free(req);
    bench_run_loads(abs, "staged", "staged", 1, NULL);
  }

  if (phase("pin")) {
    char *req = bench_plan_request("prefetch", abs, ",\"pin\":true,\"wait\":true");
    for (int i = 1; i < bench_ndaemons; i++) bench_request_or_die(bench_daemons[i].c, req); /* the partner too */
    t0 = clock_s();
    cJSON *r = bench_request_json(bench_daemons[0].c, req, NULL);
    double s = clock_s() - t0;
    free(req);
    bench_put_num(bench_result, "pin_once_s", s);
    bench_put_num(bench_result, "pin_registered_bytes", bench_jnum(r, "registered_bytes"));
    bench_put_num(bench_result, "pin_seconds_daemon", bench_jnum(r, "pin_seconds"));
    char note[96];
    snprintf(note, sizeof note, "(one-time; %.2f GiB registered%s)", bench_jnum(r, "registered_bytes") / GiB,
             bench_cfg.plan_json ? ", this plan's ranges" : "");
    cJSON_Delete(r);
    bench_row_plain("pinning (prefetch --pin --wait)", s, note);
  }

  if (phase("pinned")) bench_run_loads(abs, "pinned", "pinned-resident", 1, NULL);

  if (phase("direct")) bench_run_loads(abs, "direct", "O_DIRECT source", 1, "direct");

  if (phase("auto")) bench_phase_auto(abs);

  if (phase("attach") || phase("rss")) {
    char *req = NULL, extra[32];
    snprintf(extra, sizeof extra, ",\"device\":%d", bench_cfg.device);
    req = bench_plan_request("load", abs, extra);
    cJSON *r = bench_request_json(bench_daemons[0].c, req, NULL);
    free(req);
    char set[32];
    snprintf(set, sizeof set, "%s", bench_jstr(r, "set"));
    cJSON_Delete(r);
    if (phase("attach")) {
      double ctx_all[16], att_all[16], rt_all[16], open_all[16];
      char handles[16] = "?"; /* the set's handle kind: cuda_vmm or cuda_ipc, per the daemon's cuda_handles */
      size_t tensors = 0;
      int probes = bench_cfg.runs < 16 ? bench_cfg.runs : 16;
      for (int i = 0; i < probes; i++)
        bench_probe_attach(argv[0], bench_daemons[0].sock, set, bench_cfg.device, &ctx_all[i], &att_all[i], &rt_all[i],
                           &open_all[i], handles, &tensors);
      cJSON_AddStringToObject(bench_result, "attach_handles", handles);
      bench_put_num(bench_result, "attach_tensors", (double)tensors);
      bench_put_num(bench_result, "attach_context_s", bench_median(ctx_all, probes));
      bench_put_num(bench_result, "attach_s", bench_median(att_all, probes));
      bench_put_num(bench_result, "attach_roundtrip_s", bench_median(rt_all, probes));
      bench_put_num(bench_result, "attach_open_s", bench_median(open_all, probes));
      bench_put_num(bench_result, "attach_probes", probes);
      char label[64];
      snprintf(label, sizeof label, "fresh process: attach (%s handles)", handles);
      fprintf(bench_out, "%-46s %8.2f ms   (one-time per process)\n", "fresh process: CUDA context",
              bench_median(ctx_all, probes) * 1e3);
      fprintf(bench_out, "%-46s %8.3f ms   (to usable pointers, %zu tensors; median of %d)\n", label,
              bench_median(att_all, probes) * 1e3, tensors, probes);
      fprintf(bench_out, "%-46s %8.3f ms\n", "  of which: request/reply round trip",
              bench_median(rt_all, probes) * 1e3);
      fprintf(bench_out, "%-46s %8.3f ms\n",
              strcmp(handles, "cuda_vmm") == 0 ? "  of which: VMM import + map + access"
                                               : "  of which: cudaIpcOpenMemHandle",
              bench_median(open_all, probes) * 1e3);
    }
    if (phase("rss")) {
      uint64_t rss = bench_daemon_rss_anon(bench_daemons[0].pid);
      bench_put_num(bench_result, "daemon_rss_anon_bytes", (double)rss);
      fprintf(bench_out, "%-46s %8.1f MiB\n", "daemon RssAnon (smaps_rollup Anonymous)", (double)rss / (1 << 20));
    }
  }

  if (phase("cold")) bench_phase_cold(abs, c, plan, ranges, nranges, read_bytes);

  if (phase("early")) bench_phase_early(argv[0], abs);

  char *text = cJSON_PrintUnformatted(bench_result);
  if (bench_cfg.json) printf("%s\n", text);
  if (bench_cfg.json_out) {
    FILE *f = fopen(bench_cfg.json_out, "w");
    if (f == NULL) bench_die(bench_cfg.json_out, strerror(errno));
    fprintf(f, "%s\n", text);
    fclose(f);
  }
  free(text);
  cJSON_Delete(bench_result);
  free(ranges);
  free(abs);
  plan_free(plan);
  for (int i = 0; i < bench_ndaemons; i++) weightd_close(bench_daemons[i].c);
  ckpt_free(c);
  return 0;
}
