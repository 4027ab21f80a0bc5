/*
 * cmd_attach_verify.c - `attach --verify`: an attached set against the plan it was
 * loaded with, rebuilt here from the checkpoint's files: the same outputs,
 * and every byte equal to what plan_gather makes from read-only mappings of
 * the shards (host slabs are compared in place, CUDA slabs copied to the
 * host chunk by chunk). The whole plan is every tensor as its file holds it.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "ctl.h"
#include "cuda_import.h"
#include "plan.h"

#define CHUNK (16u << 20)

/* The first index where a and b differ (they are known to differ). */
static size_t first_diff(const unsigned char *a, const unsigned char *b, size_t n) {
  size_t i = 0;
  while (i < n && a[i] == b[i]) i++;
  return i;
}

struct verify_ctx {
  const weightd_set *set;
  uint64_t done, total; /* bytes compared, for the progress line */
  const struct ctl_local *local;
  unsigned char *want, *dev_buf; /* dev_buf: CUDA slabs only */
  struct cuimp_device dev;
  int have_dev;
};

/* Where an output's bytes come from, for a mismatch message: its first source tensor's shard. */
static const char *output_source(const struct ctl_local *l, const struct plan_output *o) {
  for (size_t k = 0; k < o->npieces; k++)
    if (o->pieces[k].src != NULL) return l->ck->shards[o->pieces[k].src->shard].rel;
  return "zeros";
}

/* Compares one tensor's bytes with its output gathered here; 0, or CTL_EXIT_FAIL after printing why. */
static int verify_bytes(struct verify_ctx *v, const weightd_tensor *t, const struct plan_output *o) {
  int cuda = weightd_set_memory_kind(v->set) == WEIGHTD_MEMORY_CUDA;
  for (uint64_t done = 0; done < t->nbytes;) {
    size_t n = t->nbytes - done < CHUNK ? (size_t)(t->nbytes - done) : CHUNK;
    plan_gather(v->local->plan, v->local->data, o->offset + done, o->offset + done + n, v->want);
    const unsigned char *mem;
    if (cuda) {
      struct wd_error err;
      err_clear(&err);
      if (cuimp_copy_to_host(&v->dev, v->dev_buf, (uint64_t)(uintptr_t)t->data + done, n, &err) != 0) {
        ctl_errorf("verify: tensor '%s': %s", t->name, err.msg);
        return CTL_EXIT_FAIL;
      }
      mem = v->dev_buf;
    } else {
      mem = (const unsigned char *)t->data + done;
    }
    if (memcmp(mem, v->want, n) != 0) {
      size_t at = first_diff(mem, v->want, n);
      ctl_errorf("verify: tensor '%s' differs from %s at byte %" PRIu64 " of the tensor: 0x%02x in the set, "
                 "0x%02x expected",
                 t->name, output_source(v->local, o), done + at, mem[at], v->want[at]);
      return CTL_EXIT_FAIL;
    }
    done += n;
    v->done += n;
    ctl_progress_update(v->done, v->total);
  }
  return 0;
}

/* Checks a tensor's description (dtype, shape, size) against the plan's output. */
static int verify_header(const weightd_tensor *t, const struct plan_output *o) {
  if (strcmp(t->dtype, dtype_name(o->dtype)) != 0) {
    ctl_errorf("verify: tensor '%s' is %s in the set but %s in the plan", t->name, t->dtype, dtype_name(o->dtype));
    return CTL_EXIT_FAIL;
  }
  int same = (unsigned)t->ndim == o->ndim;
  for (unsigned d = 0; same && d < o->ndim; d++) same = (uint64_t)t->shape[d] == o->shape[d];
  if (!same || t->nbytes != o->nbytes) {
    char fs[128];
    st_shape_format(o->shape, o->ndim, fs, sizeof fs);
    ctl_errorf("verify: tensor '%s' has another shape or size in the set (%d dims, %" PRIu64
               " bytes) than in the plan (%s, %" PRIu64 " bytes)",
               t->name, t->ndim, t->nbytes, fs, o->nbytes);
    return CTL_EXIT_FAIL;
  }
  return 0;
}

static int cmp_output_name(const void *a, const void *b) {
  return strcmp((*(const struct plan_output *const *)a)->name, (*(const struct plan_output *const *)b)->name);
}

/* The output called name in by_name (sorted), or NULL. */
static const struct plan_output *output_find(const struct plan_output *const *by_name, size_t n, const char *name) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t m = lo + (hi - lo) / 2;
    int c = strcmp(by_name[m]->name, name);
    if (c == 0) return by_name[m];
    if (c < 0) lo = m + 1;
    else hi = m;
  }
  return NULL;
}

int ctl_verify_set(const weightd_set *s, const char *ckpt_path, const cJSON *spec, struct ctl_verify_result *res) {
  memset(res, 0, sizeof *res);
  struct ctl_local local;
  if (ctl_local_open(ckpt_path, spec, 1, "verify", &local) != 0) return CTL_EXIT_FAIL;
  const struct plan *p = local.plan;
  struct verify_ctx v = {.set = s, .local = &local};
  const struct plan_output **by_name = NULL;
  int rc = CTL_EXIT_FAIL;
  struct wd_error err;
  err_clear(&err);
  v.want = malloc(CHUNK);
  by_name = malloc((p->noutputs ? p->noutputs : 1) * sizeof *by_name);
  if (weightd_set_memory_kind(s) == WEIGHTD_MEMORY_CUDA) {
    v.dev_buf = malloc(CHUNK);
    if (cuimp_device_find(weightd_set_device(s), &v.dev, &err) != 0) {
      ctl_errorf("verify: %s", err.msg);
      goto done;
    }
    v.have_dev = 1;
  }
  if (v.want == NULL || by_name == NULL || (v.dev_buf == NULL && v.have_dev)) {
    ctl_errorf("verify: out of memory");
    goto done;
  }
  for (size_t i = 0; i < p->noutputs; i++) by_name[i] = &p->outputs[i];
  qsort(by_name, p->noutputs, sizeof *by_name, cmp_output_name);
  ctl_sigbus_guard("verify", NULL);
  size_t n = weightd_set_tensor_count(s);
  for (size_t i = 0; i < n; i++) {
    weightd_tensor t = {.struct_size = sizeof t};
    if (weightd_set_tensor(s, i, &t) == 0) v.total += t.nbytes;
  }
  ctl_progress_begin("verify");
  for (size_t i = 0; i < n; i++) {
    if (ctl_guard_reason() != CTL_GUARD_NONE) { /* Ctrl-C or --timeout: the watcher leaves it to us */
      ctl_fail(NULL, WEIGHTD_E_CANCELED, "verify");
      goto done;
    }
    weightd_tensor t = {.struct_size = sizeof t};
    weightd_set_tensor(s, i, &t);
    const struct plan_output *o = output_find(by_name, p->noutputs, t.name);
    if (o == NULL) {
      ctl_errorf("verify: tensor '%s' of set %s is not an output of plan %s for %s", t.name, weightd_set_id(s),
                 p->key, ckpt_path);
      goto done;
    }
    if (verify_header(&t, o) != 0 || verify_bytes(&v, &t, o) != 0) goto done;
    res->tensors++;
    res->bytes += t.nbytes;
  }
  for (size_t i = 0; i < p->noutputs; i++) {
    weightd_tensor t = {.struct_size = sizeof t};
    if (weightd_set_find(s, p->outputs[i].name, &t) != 0) {
      ctl_errorf("verify: output '%s' of plan %s is missing from set %s", p->outputs[i].name, p->key,
                 weightd_set_id(s));
      goto done;
    }
  }
  rc = 0;
done:
  ctl_progress_end();
  if (v.have_dev) cuimp_device_put(&v.dev);
  free(by_name);
  free(v.want);
  free(v.dev_buf);
  ctl_local_close(&local);
  return rc;
}
