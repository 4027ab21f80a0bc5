/*
 * fillpool.h - threads that copy bytes for loads.
 *
 * A load splits its copy into tasks and calls fill_run, which runs
 * fn(arg, i) for every i in [0, ntasks) on the pool's threads and on the
 * calling thread, and returns when all have finished. Several loads may call
 * fill_run at once; their tasks share the threads.
 */
#ifndef WD_FILLPOOL_H
#define WD_FILLPOOL_H

#include <stddef.h>

struct fillpool;

int fill_start(unsigned nthreads, struct fillpool **out);
unsigned fill_threads(const struct fillpool *p);
void fill_run(struct fillpool *p, size_t ntasks, void (*fn)(void *arg, size_t i), void *arg);
void fill_stop(struct fillpool *p);

#endif
