/*
 * pool.h - the fill pool: threads that copy bytes for loads.
 *
 * A load splits its copy into tasks and calls ld_pool_run, which runs
 * fn(arg, i) for every i in [0, ntasks) on the pool's threads and on the
 * calling thread, and returns when all have finished. Several loads may call
 * ld_pool_run at once, and share the threads fairly: a pool thread takes its
 * next task from the batch after the one a pool thread last served (round
 * robin over the running loads, in the order they started), so concurrent
 * loads to different devices each get their share of the threads and a new
 * load never starves one that is already running. The calling thread works
 * only on its own batch.
 *
 * NUMA: ld_pool_bind spreads the threads over the machine's nodes, each
 * restricted to its node's CPUs. A batch carries the node of the device it
 * feeds (ld_pool_set_home, set by the calling thread); a thread serves its own
 * node's batches first and others' only when its node has none, so no
 * thread idles while a load waits (work-conserving). Unbound (one node, or
 * ld_pool_bind not called), every batch is everyone's.
 */
#ifndef WD_LD_POOL_H
#define WD_LD_POOL_H

#include <stddef.h>

#include "base/numa.h"

struct ld_pool;

int ld_pool_start(unsigned nthreads, struct ld_pool **out);
unsigned ld_pool_threads(const struct ld_pool *p);

/*
 * Spreads the pool's threads over map's nodes in proportion to their CPU
 * counts and binds each to its node. Nothing changes with fewer than two
 * nodes. Returns how many threads were bound.
 */
unsigned ld_pool_bind(struct ld_pool *p, const struct numa_map *map);

/* The node pool thread i (0 to ld_pool_threads - 2) is bound to, or -1. */
int ld_pool_thread_node(struct ld_pool *p, unsigned i);

/*
 * Sets the node that the calling thread's later ld_pool_run batches feed (-1:
 * none). Per thread: a load job sets it to its device's node before it fills.
 */
void ld_pool_set_home(int node);

void ld_pool_run(struct ld_pool *p, size_t ntasks, void (*fn)(void *arg, size_t i), void *arg);
void ld_pool_stop(struct ld_pool *p);

#endif
