/*
 * pool.c - the fill threads (see pool.h).
 *
 * DESIGN: batches (one per ld_pool_run call) sit in a list in the order they
 * started, each numbered (serial), guarded by `lock`. A pool thread picks,
 * among the batches with a task left (its node's first), the first one
 * numbered after the batch a pool thread served last, else the first one:
 * round robin. It claims that batch's next task index, runs it unlocked,
 * then counts it finished; the batch's owner helps with its own tasks and
 * waits on `done` until its count reaches ntasks.
 */
#include "pool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

struct batch {
  void (*fn)(void *arg, size_t i);
  void *arg;
  size_t ntasks, next, finished;
  int node;        /* the node of the device it feeds, -1: none */
  uint64_t serial; /* start order */
  struct batch *link;
};

struct worker {
  struct ld_pool *p;
  pthread_t thread;
  int node; /* bound to, -1: unbound (guarded by the pool's lock) */
};

struct ld_pool {
  pthread_mutex_t lock;
  pthread_cond_t work;
  pthread_cond_t done;
  struct batch *batches, *tail;
  uint64_t serial;      /* of the last batch started */
  uint64_t last_served; /* serial of the batch a pool thread claimed from last */
  int stopping;
  unsigned nthreads;
  struct worker *workers;
};

static _Thread_local int home_node = -1;

void ld_pool_set_home(int node) { home_node = node; }

/*
 * The batch a pool thread on `node` serves next: round robin by serial after
 * last_served, among its node's batches first, then among all. Lock held.
 */
static struct batch *pick(struct ld_pool *p, int node) {
  for (int pass = node >= 0 ? 0 : 1; pass < 2; pass++) {
    struct batch *first = NULL, *after = NULL;
    for (struct batch *b = p->batches; b != NULL && after == NULL; b = b->link) {
      if (b->next >= b->ntasks || (pass == 0 && b->node != node)) continue;
      if (first == NULL) first = b;
      if (b->serial > p->last_served) after = b;
    }
    if (after != NULL) return after;
    if (first != NULL) return first;
  }
  return NULL;
}

static void finish(struct ld_pool *p, struct batch *b) {
  if (++b->finished == b->ntasks) pthread_cond_broadcast(&p->done);
}

static void *fill_thread(void *arg) {
  struct worker *w = arg;
  struct ld_pool *p = w->p;
  pthread_mutex_lock(&p->lock);
  for (;;) {
    struct batch *b = pick(p, w->node);
    if (b == NULL) {
      if (p->stopping) break;
      pthread_cond_wait(&p->work, &p->lock);
      continue;
    }
    size_t i = b->next++;
    p->last_served = b->serial;
    pthread_mutex_unlock(&p->lock);
    b->fn(b->arg, i);
    pthread_mutex_lock(&p->lock);
    finish(p, b);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

int ld_pool_start(unsigned nthreads, struct ld_pool **out) {
  struct ld_pool *p = calloc(1, sizeof *p);
  if (p == NULL) return -1;
  p->workers = calloc(nthreads ? nthreads : 1, sizeof *p->workers);
  if (p->workers == NULL) {
    free(p);
    return -1;
  }
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->work, NULL);
  pthread_cond_init(&p->done, NULL);
  for (unsigned i = 0; i < nthreads; i++) {
    p->workers[i].p = p;
    p->workers[i].node = -1;
    if (pthread_create(&p->workers[i].thread, NULL, fill_thread, &p->workers[i]) != 0) break;
    p->nthreads = i + 1;
  }
  *out = p;
  return 0;
}

unsigned ld_pool_threads(const struct ld_pool *p) { return p->nthreads + 1; }

unsigned ld_pool_bind(struct ld_pool *p, const struct numa_map *map) {
  if (map == NULL || map->n < 2 || p->nthreads == 0) return 0;
  size_t total = 0;
  for (size_t k = 0; k < map->n; k++) total += map->nodes[k].ncpus;
  unsigned bound = 0, i = 0;
  /* Node k gets the threads whose share of the CPUs falls in its range: proportional, every thread placed. */
  size_t upto = 0;
  for (size_t k = 0; k < map->n && total > 0; k++) {
    upto += map->nodes[k].ncpus;
    unsigned until = (unsigned)((uint64_t)p->nthreads * upto / total);
    for (; i < until; i++) {
      int node = -1;
      if (numa_bind(p->workers[i].thread, &map->nodes[k]) == 0) {
        node = map->nodes[k].id;
        bound++;
      }
      pthread_mutex_lock(&p->lock);
      p->workers[i].node = node;
      pthread_mutex_unlock(&p->lock);
    }
  }
  return bound;
}

int ld_pool_thread_node(struct ld_pool *p, unsigned i) {
  if (i >= p->nthreads) return -1;
  pthread_mutex_lock(&p->lock);
  int node = p->workers[i].node;
  pthread_mutex_unlock(&p->lock);
  return node;
}

void ld_pool_run(struct ld_pool *p, size_t ntasks, void (*fn)(void *arg, size_t i), void *arg) {
  if (ntasks == 0) return;
  struct batch b = {.fn = fn, .arg = arg, .ntasks = ntasks, .node = home_node};
  pthread_mutex_lock(&p->lock);
  b.serial = ++p->serial;
  if (p->tail != NULL) p->tail->link = &b;
  else p->batches = &b;
  p->tail = &b;
  pthread_cond_broadcast(&p->work);
  while (b.next < b.ntasks) {
    size_t i = b.next++;
    pthread_mutex_unlock(&p->lock);
    fn(arg, i);
    pthread_mutex_lock(&p->lock);
    finish(p, &b);
  }
  while (b.finished < b.ntasks) pthread_cond_wait(&p->done, &p->lock);
  struct batch **pp = &p->batches, *prev = NULL;
  while (*pp != &b) {
    prev = *pp;
    pp = &(*pp)->link;
  }
  *pp = b.link;
  if (p->tail == &b) p->tail = prev;
  pthread_mutex_unlock(&p->lock);
}

void ld_pool_stop(struct ld_pool *p) {
  if (p == NULL) return;
  pthread_mutex_lock(&p->lock);
  p->stopping = 1;
  pthread_cond_broadcast(&p->work);
  pthread_mutex_unlock(&p->lock);
  for (unsigned i = 0; i < p->nthreads; i++) pthread_join(p->workers[i].thread, NULL);
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->work);
  pthread_cond_destroy(&p->done);
  free(p->workers);
  free(p);
}
