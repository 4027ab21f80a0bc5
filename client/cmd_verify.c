/*
 * cmd_verify.c - `attach --verify`: every byte of an attached set against
 * the checkpoint's files, read with pread in large chunks (host slabs are
 * compared in place, CUDA slabs copied to the host chunk by chunk).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint.h"
#include "ctl.h"
#include "cuda_import.h"

#define CHUNK (16u << 20)

/* The first index where a and b differ (they are known to differ). */
static size_t first_diff(const unsigned char *a, const unsigned char *b, size_t n) {
  size_t i = 0;
  while (i < n && a[i] == b[i]) i++;
  return i;
}

struct verify_ctx {
  const weightd_set *set;
  unsigned char *file_buf, *dev_buf; /* dev_buf: CUDA slabs only */
  struct cuimp_device dev;
  int have_dev;
};

/* Compares one tensor's bytes; 0, or CTL_EXIT_FAIL after printing why. */
static int verify_tensor(struct verify_ctx *v, const weightd_tensor *t, const struct ckpt *ck,
                         const struct ckpt_ref *ref) {
  const struct ckpt_shard *sh = &ck->shards[ref->shard];
  uint64_t file_off = sh->hdr->data_start + ref->t->begin;
  int cuda = weightd_set_memory_kind(v->set) == WEIGHTD_MEMORY_CUDA;
  for (uint64_t done = 0; done < t->nbytes;) {
    size_t n = t->nbytes - done < CHUNK ? (size_t)(t->nbytes - done) : CHUNK;
    for (size_t got = 0; got < n;) {
      ssize_t r = pread(sh->fd, v->file_buf + got, n - got, (off_t)(file_off + done + got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        ctl_errorf("verify: %s: read failed: %s", sh->path, r < 0 ? strerror(errno) : "file is shorter");
        return CTL_EXIT_FAIL;
      }
      got += (size_t)r;
    }
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
    if (memcmp(mem, v->file_buf, n) != 0) {
      size_t at = first_diff(mem, v->file_buf, n);
      ctl_errorf("verify: tensor '%s' differs from %s at byte %" PRIu64 " of the tensor: 0x%02x in the set, "
                 "0x%02x in the file",
                 t->name, sh->rel, done + at, mem[at], v->file_buf[at]);
      return CTL_EXIT_FAIL;
    }
    done += n;
  }
  return 0;
}

/* Checks a tensor's description (dtype, shape, size) against the file's. */
static int verify_header(const weightd_tensor *t, const struct ckpt_ref *ref) {
  const struct st_tensor *f = ref->t;
  if (strcmp(t->dtype, dtype_name(f->dtype)) != 0) {
    ctl_errorf("verify: tensor '%s' is %s in the set but %s in the file", t->name, t->dtype, dtype_name(f->dtype));
    return CTL_EXIT_FAIL;
  }
  int same = (unsigned)t->ndim == f->ndim;
  for (unsigned d = 0; same && d < f->ndim; d++) same = (uint64_t)t->shape[d] == f->shape[d];
  if (!same || t->nbytes != f->end - f->begin) {
    char fs[128];
    st_shape_format(f->shape, f->ndim, fs, sizeof fs);
    ctl_errorf("verify: tensor '%s' has another shape or size in the set (%d dims, %" PRIu64
               " bytes) than in the file (%s, %" PRIu64 " bytes)",
               t->name, t->ndim, t->nbytes, fs, f->end - f->begin);
    return CTL_EXIT_FAIL;
  }
  return 0;
}

int ctl_verify_set(const weightd_set *s, const char *ckpt_path, int whole, struct ctl_verify_result *res) {
  memset(res, 0, sizeof *res);
  struct ckpt *ck = NULL;
  struct wd_error err;
  err_clear(&err);
  if (ckpt_open(ckpt_path, NULL, &ck, &err) != 0) {
    ctl_errorf("verify: %s (%s)", err.msg, weightd_err_name(err.code));
    return CTL_EXIT_FAIL;
  }
  struct verify_ctx v = {.set = s};
  int rc = CTL_EXIT_FAIL;
  v.file_buf = malloc(CHUNK);
  if (weightd_set_memory_kind(s) == WEIGHTD_MEMORY_CUDA) {
    v.dev_buf = malloc(CHUNK);
    if (cuimp_device_find(weightd_set_device(s), &v.dev, &err) != 0) {
      ctl_errorf("verify: %s", err.msg);
      goto done;
    }
    v.have_dev = 1;
  }
  if (v.file_buf == NULL || (v.dev_buf == NULL && v.have_dev)) {
    ctl_errorf("verify: out of memory");
    goto done;
  }
  size_t n = weightd_set_tensor_count(s);
  for (size_t i = 0; i < n; i++) {
    weightd_tensor t;
    weightd_set_tensor(s, i, &t);
    const struct ckpt_ref *ref = ckpt_tensor_find(ck, t.name);
    if (ref == NULL) {
      ctl_errorf("verify: tensor '%s' of set %s is not in %s", t.name, weightd_set_id(s), ckpt_path);
      goto done;
    }
    if (verify_header(&t, ref) != 0 || verify_tensor(&v, &t, ck, ref) != 0) goto done;
    res->tensors++;
    res->bytes += t.nbytes;
  }
  if (whole) {
    for (size_t i = 0; i < ck->ntensors; i++) {
      weightd_tensor t;
      if (weightd_set_find(s, ck->by_name[i].t->name, &t) != 0) {
        ctl_errorf("verify: tensor '%s' of the checkpoint is missing from set %s", ck->by_name[i].t->name,
                   weightd_set_id(s));
        goto done;
      }
    }
  }
  rc = 0;
done:
  if (v.have_dev) cuimp_device_put(&v.dev);
  free(v.file_buf);
  free(v.dev_buf);
  ckpt_free(ck);
  return rc;
}
