/*
 * jobs.h - work the event loop hands to threads.
 *
 * A job's work() runs on one of the pool's threads; its done() then runs on
 * the loop thread, delivered through uv_async_send (calls coalesce, so
 * finished jobs wait in a queue). work() must not touch loop-owned state;
 * done() may. The job struct is embedded in the caller's own struct.
 */
#ifndef WD_JOBS_H
#define WD_JOBS_H

#include <uv.h>

#include "error.h"

struct job {
  void (*work)(struct job *j);
  void (*done)(struct job *j);
  struct job *next;
};

struct jobs;

int jobs_start(uv_loop_t *loop, unsigned nthreads, struct jobs **out, struct wd_error *err);

/* Queues a job. Never fails; the job runs even while the pool is stopping. */
void jobs_submit(struct jobs *js, struct job *j);

/* Jobs queued or running, whose done() has not run yet. */
unsigned jobs_outstanding(const struct jobs *js);

/*
 * Waits for every queued and running job, runs their done() callbacks,
 * joins the threads and closes the async handle. The loop must then run
 * once more so that the handle's close completes; js is freed then.
 */
void jobs_stop(struct jobs *js);

#endif
