/*
 * fillpool.c - the fill threads (see fillpool.h).
 *
 * DESIGN: batches (one per fill_run call) sit in a list guarded by `lock`.
 * A thread claims the next task index of the first batch that has one left,
 * runs it unlocked, then counts it finished; the batch's owner waits on
 * `done` until its count reaches ntasks, helping with its own tasks first.
 */
#include "fillpool.h"

#include <pthread.h>
#include <stdlib.h>

struct batch {
  void (*fn)(void *arg, size_t i);
  void *arg;
  size_t ntasks, next, finished;
  struct batch *link;
};

struct fillpool {
  pthread_mutex_t lock;
  pthread_cond_t work;
  pthread_cond_t done;
  struct batch *batches;
  int stopping;
  unsigned nthreads;
  pthread_t *threads;
};

/* Claims a task of b, or of any batch when b is NULL. Called with the lock held. */
static struct batch *claim(struct fillpool *p, struct batch *only, size_t *index) {
  for (struct batch *b = only ? only : p->batches; b != NULL; b = only ? NULL : b->link) {
    if (b->next < b->ntasks) {
      *index = b->next++;
      return b;
    }
  }
  return NULL;
}

static void finish(struct fillpool *p, struct batch *b) {
  if (++b->finished == b->ntasks) pthread_cond_broadcast(&p->done);
}

static void *fill_thread(void *arg) {
  struct fillpool *p = arg;
  pthread_mutex_lock(&p->lock);
  for (;;) {
    size_t i;
    struct batch *b = claim(p, NULL, &i);
    if (b == NULL) {
      if (p->stopping) break;
      pthread_cond_wait(&p->work, &p->lock);
      continue;
    }
    pthread_mutex_unlock(&p->lock);
    b->fn(b->arg, i);
    pthread_mutex_lock(&p->lock);
    finish(p, b);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

int fill_start(unsigned nthreads, struct fillpool **out) {
  struct fillpool *p = calloc(1, sizeof *p);
  if (p == NULL) return -1;
  p->threads = calloc(nthreads ? nthreads : 1, sizeof *p->threads);
  if (p->threads == NULL) {
    free(p);
    return -1;
  }
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->work, NULL);
  pthread_cond_init(&p->done, NULL);
  for (unsigned i = 0; i < nthreads; i++) {
    if (pthread_create(&p->threads[i], NULL, fill_thread, p) != 0) break;
    p->nthreads = i + 1;
  }
  *out = p;
  return 0;
}

unsigned fill_threads(const struct fillpool *p) { return p->nthreads + 1; }

void fill_run(struct fillpool *p, size_t ntasks, void (*fn)(void *arg, size_t i), void *arg) {
  if (ntasks == 0) return;
  struct batch b = {.fn = fn, .arg = arg, .ntasks = ntasks};
  pthread_mutex_lock(&p->lock);
  b.link = p->batches;
  p->batches = &b;
  pthread_cond_broadcast(&p->work);
  size_t i;
  while (claim(p, &b, &i) != NULL) {
    pthread_mutex_unlock(&p->lock);
    fn(arg, i);
    pthread_mutex_lock(&p->lock);
    finish(p, &b);
  }
  while (b.finished < b.ntasks) pthread_cond_wait(&p->done, &p->lock);
  struct batch **pp = &p->batches;
  while (*pp != &b) pp = &(*pp)->link;
  *pp = b.link;
  pthread_mutex_unlock(&p->lock);
}

void fill_stop(struct fillpool *p) {
  if (p == NULL) return;
  pthread_mutex_lock(&p->lock);
  p->stopping = 1;
  pthread_cond_broadcast(&p->work);
  pthread_mutex_unlock(&p->lock);
  for (unsigned i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->work);
  pthread_cond_destroy(&p->done);
  free(p->threads);
  free(p);
}
