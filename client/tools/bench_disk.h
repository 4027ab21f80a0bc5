/* bench_disk.h - the disk's O_DIRECT ceiling, swept over ways of reading (bench_disk.c). */
#ifndef WD_BENCH_DISK_H
#define WD_BENCH_DISK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "checkpoint.h"
#include "plan.h"

/* One way of reading: preads of `size` on `threads` threads, or io_uring with `threads` reads in flight. */
struct bench_disk_point {
  bool uring;
  unsigned threads;
  uint64_t size;
  double gbps;
};

struct bench_disk {
  size_t npoints;
  struct bench_disk_point points[32];
  struct bench_disk_point best; /* the way of the ceiling */
  double ceiling_gbps;          /* the faster of the two fastest ways, each over every range */
  uint64_t ceiling_bytes;
  bool have_uring;              /* built with liburing: io_uring points are in the sweep */
};

/*
 * Sweeps the ways of reading ranges r[0..nr) of c with O_DIRECT, each on a
 * slice of its own, drop(arg) before each (the page cache dropped again),
 * then reads every range with each of the two fastest ways: the faster is
 * the ceiling. 0, or -1 when memory runs out.
 */
int bench_disk_sweep(const struct ckpt *c, const struct plan_range *r, size_t nr, void (*drop)(void *arg),
                     void *arg, struct bench_disk *out);

#endif
