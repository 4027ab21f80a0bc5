/*
 * jobs.c - the job pool (see jobs.h).
 *
 * DESIGN: N worker threads take jobs from a FIFO guarded by `lock` and `more`;
 * a finished job moves to the `finished` list under the same lock and the
 * loop is woken with uv_async_send. The loop thread drains `finished` and
 * runs done() callbacks. Workers never touch libuv handles other than the
 * async handle's send, which libuv allows from any thread.
 */
#include "jobs.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct jobs {
  uv_async_t async;
  pthread_mutex_t lock;
  pthread_cond_t more;
  pthread_cond_t idle;
  struct job *queue_head, *queue_tail;
  struct job *finished_head, *finished_tail;
  unsigned outstanding; /* submitted, done() not yet run (loop thread only) */
  unsigned running;
  int stopping;
  unsigned nthreads;
  pthread_t *threads;
};

static void *worker(void *arg) {
  struct jobs *js = arg;
  pthread_mutex_lock(&js->lock);
  for (;;) {
    while (js->queue_head == NULL && !js->stopping) pthread_cond_wait(&js->more, &js->lock);
    if (js->queue_head == NULL && js->stopping) break;
    struct job *j = js->queue_head;
    js->queue_head = j->next;
    if (js->queue_head == NULL) js->queue_tail = NULL;
    js->running++;
    pthread_mutex_unlock(&js->lock);
    j->work(j);
    pthread_mutex_lock(&js->lock);
    js->running--;
    j->next = NULL;
    if (js->finished_tail) js->finished_tail->next = j;
    else js->finished_head = j;
    js->finished_tail = j;
    pthread_cond_broadcast(&js->idle);
    uv_async_send(&js->async);
  }
  pthread_mutex_unlock(&js->lock);
  return NULL;
}

static void drain_finished(struct jobs *js) {
  pthread_mutex_lock(&js->lock);
  struct job *j = js->finished_head;
  js->finished_head = js->finished_tail = NULL;
  pthread_mutex_unlock(&js->lock);
  while (j != NULL) {
    struct job *next = j->next;
    js->outstanding--;
    j->done(j); /* may free j */
    j = next;
  }
}

static void on_async(uv_async_t *a) { drain_finished(a->data); }

int jobs_start(uv_loop_t *loop, unsigned nthreads, struct jobs **out, struct wd_error *err) {
  *out = NULL;
  struct jobs *js = calloc(1, sizeof *js);
  if (js == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  if (nthreads == 0) nthreads = 1;
  js->threads = calloc(nthreads, sizeof *js->threads);
  if (js->threads == NULL) {
    free(js);
    return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  }
  pthread_mutex_init(&js->lock, NULL);
  pthread_cond_init(&js->more, NULL);
  pthread_cond_init(&js->idle, NULL);
  uv_async_init(loop, &js->async, on_async);
  js->async.data = js;
  for (unsigned i = 0; i < nthreads; i++) {
    if (pthread_create(&js->threads[i], NULL, worker, js) != 0) {
      js->nthreads = i;
      jobs_stop(js);
      return err_set(err, WEIGHTD_E_NOMEM, "cannot start job threads");
    }
    js->nthreads = i + 1;
  }
  *out = js;
  return 0;
}

void jobs_submit(struct jobs *js, struct job *j) {
  j->next = NULL;
  js->outstanding++;
  pthread_mutex_lock(&js->lock);
  if (js->queue_tail) js->queue_tail->next = j;
  else js->queue_head = j;
  js->queue_tail = j;
  pthread_cond_signal(&js->more);
  pthread_mutex_unlock(&js->lock);
}

unsigned jobs_outstanding(const struct jobs *js) { return js->outstanding; }

static void free_on_close(uv_handle_t *h) {
  struct jobs *js = h->data;
  pthread_mutex_destroy(&js->lock);
  pthread_cond_destroy(&js->more);
  pthread_cond_destroy(&js->idle);
  free(js->threads);
  free(js);
}

void jobs_stop(struct jobs *js) {
  /* Done callbacks may submit follow-up jobs: drain until nothing is left. */
  for (;;) {
    pthread_mutex_lock(&js->lock);
    while (js->queue_head != NULL || js->running > 0) pthread_cond_wait(&js->idle, &js->lock);
    int any = js->finished_head != NULL;
    pthread_mutex_unlock(&js->lock);
    if (!any) break;
    drain_finished(js);
  }
  pthread_mutex_lock(&js->lock);
  js->stopping = 1;
  pthread_cond_broadcast(&js->more);
  pthread_mutex_unlock(&js->lock);
  for (unsigned i = 0; i < js->nthreads; i++) pthread_join(js->threads[i], NULL);
  uv_close((uv_handle_t *)&js->async, free_on_close);
}
