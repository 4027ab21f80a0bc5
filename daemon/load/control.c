/*
 * control.c - what a running load reports and obeys, whichever way it fills
 * (loader.c, pipeline.c, multi.c): the ready watermark, cancellation, the
 * test gate, the size of its fill tasks, and the FAULT error. Safe from any
 * of the load's threads (the watermark is a compare-and-swap that only
 * grows).
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"

/* Bytes one fill task gathers, at least and at most (ld_task_bytes). */
#define LD_TASK_MIN (256ull << 10)
#define LD_TASK_MAX (8ull << 20)

/* ---- the ready watermark ------------------------------------------------------------ */

/* Raises the target's ready watermark to v (never lowers it) and tells the hook. */
static void raise_ready(struct ld_target *t, uint64_t v) {
  uint_fast64_t cur = atomic_load(&t->ready_bytes);
  while (cur < v)
    if (atomic_compare_exchange_weak(&t->ready_bytes, &cur, v)) {
      if (t->ready != NULL) t->ready(t, v);
      return;
    }
}

void ld_publish_ready(struct ld_target *t, uint64_t v) {
  if (v < t->plan->slab_bytes && !t->hold_ready) raise_ready(t, v);
}

void ld_publish_final(struct ld_target *t) { raise_ready(t, t->plan->slab_bytes); }

/* ---- cancellation and the test gate ---------------------------------------------------- */

int ld_check_cancel(const struct ld_target *t, struct wd_error *err) {
  if (!atomic_load(&t->cancel)) return 0;
  return err_set(err, WEIGHTD_E_CANCELED, "load of %s canceled", t->name);
}

int ld_gate_open(const struct loader *ld) {
  if (ld->gate == NULL) return -1;
  int gate = open(ld->gate, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (gate < 0) log_msg(LOG_WARN, "test_load_gate %s: %s (the gate stays open)", ld->gate, strerror(errno));
  return gate;
}

int ld_gate_pass(int *gate, const struct ld_target *t, struct wd_error *err) {
  while (*gate >= 0) {
    char byte;
    ssize_t n = read(*gate, &byte, 1);
    if (n == 1) return 0;
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      int rc = ld_check_cancel(t, err);
      if (rc != 0) return rc;
      struct pollfd p = {.fd = *gate, .events = POLLIN};
      poll(&p, 1, 20);
      continue;
    }
    close(*gate);
    *gate = -1;
  }
  return 0;
}

/* ---- fill tasks --------------------------------------------------------------------------- */

uint64_t ld_task_bytes(const struct loader *ld, uint64_t window, const struct ld_source *src) {
  uint64_t task = window / (uint64_t)ld_pool_threads(ld->pool);
  task = task < LD_TASK_MIN ? LD_TASK_MIN : task > LD_TASK_MAX ? LD_TASK_MAX : task;
  if (src != NULL && task < src->read_min) task = src->read_min < window ? src->read_min : window;
  return (task + 65535) / 65536 * 65536;
}

int ld_fault_error(const struct ld_target *t, uint64_t off, struct wd_error *err) {
  const struct plan_output *o = plan_output_at(t->plan, off);
  const char *shard = "?", *name = o ? o->name : "?";
  if (o != NULL && o->npieces > 0 && o->pieces[0].src != NULL) shard = t->ck->shards[o->pieces[0].src->shard].rel;
  return err_set(err, WEIGHTD_E_FAULT,
                 "%s: tensor '%s': the shard was truncated or became unreadable while it was read", shard, name);
}

void ld_count_reads(struct ld_target *t, const struct ld_reader *rd) {
  for (int k = 0; k < LD_SOURCE_KINDS; k++)
    if (rd->counts[k] != 0) atomic_fetch_add(&t->source_bytes[k], rd->counts[k]);
  if (rd->checks[0] != 0) atomic_fetch_add(&t->source_checked, rd->checks[0]);
  if (rd->checks[1] != 0) atomic_fetch_add(&t->source_mismatches, rd->checks[1]);
}
