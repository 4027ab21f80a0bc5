/*
 * loader.c - moving a plan's bytes from the shard mappings into a slab.
 *
 * DESIGN: ld_fill runs on a job thread and owns the set's slab until it
 * returns. It splits the plan into copy tasks of about LD_CHUNK bytes and runs
 * them on the fill threads (fillpool.h): for the host backend each task is a
 * memcpy from the mapping straight into the slab, guarded against SIGBUS
 * (fault.h) in case a shard is truncated under us. Tasks only read the
 * immutable checkpoint and plan and write disjoint slab ranges; the first
 * error wins under `lock`. Progress goes to the set's atomic bytes_done,
 * which the loop reports; cancellation is the set's atomic cancel flag,
 * checked before each task.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "fault.h"
#include "log.h"

#define LD_CHUNK (16ull << 20)

struct ld_task {
  const struct plan_piece *piece;
  uint64_t dst;       /* slab offset of the task's first byte */
  uint64_t row0;      /* first row of the piece */
  uint64_t rows;      /* rows of the piece (height 1 pieces: 1) */
  uint64_t byte0;     /* height-1 pieces: first byte within the row */
  uint64_t bytes;     /* bytes this task writes */
};

struct ld_run {
  struct res_set *set;
  struct ld_task *tasks;
  size_t ntasks;
  pthread_mutex_t lock;
  int rc;
  struct wd_error err;
};

/* Splits every piece of every output into tasks of at most about LD_CHUNK bytes. */
static int make_tasks(struct ld_run *run, struct wd_error *err) {
  const struct plan *p = run->set->plan;
  size_t cap = 64, n = 0;
  struct ld_task *t = malloc(cap * sizeof *t);
  if (t == NULL) return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
  for (size_t o = 0; o < p->noutputs; o++) {
    uint64_t dst = p->outputs[o].offset;
    for (size_t k = 0; k < p->outputs[o].npieces; k++) {
      const struct plan_piece *pc = &p->outputs[o].pieces[k];
      uint64_t total = pc->width * pc->height;
      uint64_t rows_per = pc->height > 1 ? (pc->width >= LD_CHUNK ? 1 : LD_CHUNK / pc->width) : 1;
      for (uint64_t done = 0; done < total;) {
        if (n == cap) {
          cap *= 2;
          struct ld_task *nt = realloc(t, cap * sizeof *t);
          if (nt == NULL) {
            free(t);
            return err_set(err, WEIGHTD_E_NOMEM, "out of memory");
          }
          t = nt;
        }
        struct ld_task *x = &t[n++];
        x->piece = pc;
        x->dst = dst + done;
        if (pc->height <= 1) {
          x->row0 = 0;
          x->rows = 1;
          x->byte0 = done;
          x->bytes = total - done < LD_CHUNK ? total - done : LD_CHUNK;
        } else {
          x->row0 = done / pc->width;
          x->rows = pc->height - x->row0 < rows_per ? pc->height - x->row0 : rows_per;
          x->byte0 = 0;
          x->bytes = x->rows * pc->width;
        }
        done += x->bytes;
      }
      dst += total;
    }
  }
  run->tasks = t;
  run->ntasks = n;
  return 0;
}

static const unsigned char zeros[1u << 16];

struct copy_args {
  struct ld_run *run;
  const struct ld_task *task;
  struct wd_stream *stream;
  struct wd_error *err;
};

/* One task's copy; runs under fault_call, so a SIGBUS returns WEIGHTD_E_FAULT. */
static int copy_task(void *arg) {
  struct copy_args *a = arg;
  const struct ld_task *t = a->task;
  const struct plan_piece *pc = t->piece;
  struct res_set *s = a->run->set;
  const struct wd_backend_ops *ops = wd->backend.ops;
  if (pc->src == NULL) {
    for (uint64_t off = 0; off < t->bytes; off += sizeof zeros) {
      size_t n = t->bytes - off < sizeof zeros ? (size_t)(t->bytes - off) : sizeof zeros;
      int rc = ops->copy_h2d(wd->backend.ctx, s->slab, t->dst + off, n, zeros, n, n, 1, a->stream, a->err);
      if (rc != 0) return rc;
    }
    return 0;
  }
  const struct ckpt *c = s->ck->ck;
  const struct ckpt_shard *sh = &c->shards[pc->src->shard];
  const unsigned char *src = (const unsigned char *)s->ck->maps[pc->src->shard] + sh->hdr->data_start +
                             pc->src->t->begin + pc->src_offset;
  if (pc->height <= 1)
    return ops->copy_h2d(wd->backend.ctx, s->slab, t->dst, (size_t)t->bytes, src + t->byte0,
                         (size_t)t->bytes, (size_t)t->bytes, 1, a->stream, a->err);
  return ops->copy_h2d(wd->backend.ctx, s->slab, t->dst, (size_t)pc->width, src + t->row0 * pc->src_pitch,
                       (size_t)pc->src_pitch, (size_t)pc->width, (size_t)t->rows, a->stream, a->err);
}

static void run_task(void *arg, size_t i) {
  struct ld_run *run = arg;
  struct res_set *s = run->set;
  pthread_mutex_lock(&run->lock);
  int failed = run->rc != 0;
  pthread_mutex_unlock(&run->lock);
  if (failed) return;
  if (atomic_load(&s->cancel)) {
    pthread_mutex_lock(&run->lock);
    if (run->rc == 0) run->rc = err_set(&run->err, WEIGHTD_E_CANCELED, "load of %s canceled", s->ck->path);
    pthread_mutex_unlock(&run->lock);
    return;
  }
  struct wd_error err = {0};
  struct copy_args a = {run, &run->tasks[i], NULL, &err};
  int rc = fault_call(copy_task, &a);
  if (rc == WEIGHTD_E_FAULT) {
    const struct plan_piece *pc = run->tasks[i].piece;
    err_set(&err, WEIGHTD_E_FAULT,
            "%s: tensor '%s': the shard was truncated or became unreadable while it was read",
            pc->src ? s->ck->ck->shards[pc->src->shard].rel : "?", pc->src ? pc->src->t->name : "?");
  }
  if (rc != 0) {
    pthread_mutex_lock(&run->lock);
    if (run->rc == 0) {
      run->rc = rc;
      run->err = err;
    }
    pthread_mutex_unlock(&run->lock);
    return;
  }
  atomic_fetch_add(&s->bytes_done, run->tasks[i].bytes);
}

int ld_fill(struct res_set *s, struct wd_error *err) {
  const struct wd_backend_ops *ops = wd->backend.ops;
  int rc = ops->slab_alloc(wd->backend.ctx, s->device, s->plan->slab_bytes, &s->slab, err);
  if (rc != 0) return rc;
  struct ld_run run = {.set = s};
  pthread_mutex_init(&run.lock, NULL);
  if ((rc = make_tasks(&run, err)) != 0) goto fail;
  fill_run(wd->fill, run.ntasks, run_task, &run);
  if (run.rc != 0) {
    rc = run.rc;
    *err = run.err;
    goto fail;
  }
  /* A shard rewritten while we copied would have given us a mix of old and new bytes. */
  if ((rc = ckpt_check_unchanged(s->ck->ck, err)) != 0) goto fail;
  if (ops->slab_seal != NULL && (rc = ops->slab_seal(wd->backend.ctx, s->slab, err)) != 0) goto fail;
  free(run.tasks);
  pthread_mutex_destroy(&run.lock);
  return 0;
fail:
  free(run.tasks);
  pthread_mutex_destroy(&run.lock);
  ops->slab_free(wd->backend.ctx, s->slab);
  s->slab = NULL;
  return rc;
}
