/* bench_phases.h - weightd-bench's timed phases on this side (bench_phases.c). */
#ifndef WD_BENCH_PHASES_H
#define WD_BENCH_PHASES_H

#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"
#include "plan.h"
#include "plan_stage.h"

/* The checkpoint mapped here, with the plan's ranges touched (page cache warm for them). */
struct mapped {
  const struct ckpt *c;
  void **maps;
  const unsigned char **data; /* per shard: its data section */
};

/* Pinned-source H2D: seconds for `bytes` in 64 MiB copies from two pinned buffers on two streams. */
double bench_h2d_ceiling(int device, uint64_t bytes);
void bench_map_ckpt(const struct ckpt *c, const struct plan_range *r, size_t nr, struct mapped *m);
void bench_unmap_ckpt(struct mapped *m);
/* How the fill writes pinned memory: the daemon's staging_writes choices. */
enum bench_writes { BENCH_WRITES_CACHED, BENCH_WRITES_STREAMING, BENCH_WRITES_WRITE_COMBINED };
/* Page cache -> pinned memory as the staging pipeline fills its slots: seconds; bytes copied in *copied. */
double bench_fill_rate(const struct mapped *m, const struct plan *plan, enum plan_strided mode,
                       enum bench_writes writes, unsigned nthreads, uint64_t *copied);
/* --runs loads through daemon 0 (and, alternating, daemon 1), recorded under key, with the load's source (NULL: --source). */
void bench_run_loads(const char *abs, const char *key, const char *what, int with_alt, const char *source);
void bench_phase_auto(const char *abs);
void bench_phase_cold(const char *abs, const struct ckpt *c, const struct plan *plan, const struct plan_range *r,
                      size_t nr, uint64_t read_bytes);

#endif
