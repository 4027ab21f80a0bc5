/*
 * bench_report.c - weightd-bench's shared state and output: the options
 * (bench.c parses them), the JSON result and the printed table with each
 * figure's ratio to the ceiling.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_report.h"

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The median of v[0..n) (v is left as it was). */
double bench_median(const double *v, int n) {
  if (n <= 0) return 0;
  double *c = malloc((size_t)n * sizeof *c);
  memcpy(c, v, (size_t)n * sizeof *c);
  qsort(c, (size_t)n, sizeof *c, cmp_double);
  double m = n % 2 ? c[n / 2] : (c[n / 2 - 1] + c[n / 2]) / 2;
  free(c);
  return m;
}

_Noreturn void bench_die(const char *what, const char *detail) {
  fprintf(stderr, "weightd-bench: %s: %s\n", what, detail);
  exit(1);
}

/* ---- options and the JSON result ---------------------------------------------------- */

struct bench_opt bench_cfg = {
    .runs = 5, .settle_ms = 500, .b2b = 1, .ceiling_max_gib = 16, .phases = "ceiling,fill,staged,pin,pinned,attach,rss"};

cJSON *bench_result; /* everything measured, written with --json / --json-out */
FILE *bench_out;     /* the table: stdout, or nowhere with --json */

void bench_put_num(cJSON *o, const char *k, double v) { cJSON_AddNumberToObject(o, k, v); }

void bench_put_runs(cJSON *o, const char *k, const double *v, int n) {
  cJSON *a = cJSON_AddArrayToObject(o, k);
  for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
}

/* ---- printing -------------------------------------------------------------------------------- */

double bench_ceiling_s; /* for the plan's bytes */
double bench_gib;       /* the plan's payload in GiB */

void bench_row(const char *label, double s) {
  fprintf(bench_out, "%-46s %8.1f ms %9.1f %8.0f%%\n", label, s * 1e3, bench_gib / s,
          bench_ceiling_s > 0 ? 100 * bench_ceiling_s / s : 0);
}

void bench_row_plain(const char *label, double s, const char *note) {
  fprintf(bench_out, "%-46s %8.1f ms   %s\n", label, s * 1e3, note);
}
