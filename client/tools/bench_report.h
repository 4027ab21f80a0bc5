/* bench_report.h - weightd-bench's options, result and table, shared by its parts (bench_report.c). */
#ifndef WD_BENCH_REPORT_H
#define WD_BENCH_REPORT_H

#include <cjson/cJSON.h>
#include <cuda_runtime.h>
#include <stdio.h>

#define GiB (1024.0 * 1024.0 * 1024.0)
#define SLOT (64u << 20)
#define MAX_RUNS 64

#define CUDA_OK(call)                                                \
  do {                                                               \
    cudaError_t e_ = (call);                                         \
    if (e_ != cudaSuccess) bench_die(#call, cudaGetErrorString(e_)); \
  } while (0)

struct bench_opt {
  const char *path, *sock, *alt_sock, *label, *json_out;
  const char *plan_json; /* --plan, or NULL for every tensor whole */
  const char *names;     /* --names A,B: the two daemons' names in results (default: their staged_strided) */
  const char *source;    /* --source S: every timed load's source option (NULL: the daemon's setting) */
  int device, runs, settle_ms, json, b2b;
  unsigned fill_threads;
  double ceiling_max_gib;
  char phases[256];
};

extern struct bench_opt bench_cfg; /* set by main before any phase runs */
extern cJSON *bench_result;        /* everything measured, written with --json / --json-out */
extern FILE *bench_out;            /* the table: stdout, or nowhere with --json */
extern double bench_ceiling_s;     /* for the plan's bytes */
extern double bench_gib;           /* the plan's payload in GiB */

/* The median of v[0..n) (v is left as it was). */
double bench_median(const double *v, int n);
_Noreturn void bench_die(const char *what, const char *detail);
void bench_put_num(cJSON *o, const char *k, double v);
void bench_put_runs(cJSON *o, const char *k, const double *v, int n);
/* A table row with the rate and the ratio to the ceiling; bench_row_plain: the time and a note. */
void bench_row(const char *label, double s);
void bench_row_plain(const char *label, double s, const char *note);

#endif
