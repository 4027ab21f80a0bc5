/*
 * digest.c - a loaded set's own digests: the tensor digest (manifest.h's
 * tree) of each output tensor of its plan as the slab holds it (its pieces:
 * TP slices, fused tensors, whole tensors), computed once the slab is filled
 * and kept with the load (ld_target.digests), so that a scrub can later tell
 * which tensor changed. They come from the backend's slab_hash over the slab
 * itself: mf_tensor_digest over the memfd on the host backend, the scrub
 * kernels on a GPU after the copies (no CPU thread touched those bytes). An output that is one whole
 * tensor of the files is also checked against the checkpoint's manifest
 * (its tensor digest) when one was read: a mismatch fails the load with
 * BAD_CHECKSUM naming the tensor, as verify on_load fails a chunk. A
 * backend that fails to hash leaves the set without digests (logged): the
 * load is not failed for its scrubs' sake. A replica copied device to
 * device from another device's copy of the same set must hash to the
 * digests that copy recorded at its load, output by output: a copy that
 * went wrong, or a source changed since its load (a writer through a
 * legacy handle), fails the replica with BAD_CHECKSUM instead of becoming
 * a second copy whose digests vouch for the wrong bytes.
 *
 * Threads: runs on the load's job thread, after the fill and before the
 * slab is sealed; it reads only the target and the plan.
 */
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "internal.h"
#include "manifest.h"

/* The manifest's digest of the source tensor when output o is exactly one whole tensor of the files, else NULL. */
static const unsigned char *whole_tensor_digest(const struct ckpt *ck, const struct plan_output *o) {
  const struct mf_manifest *m = ck->manifest;
  if (m == NULL || o->npieces != 1 || o->pieces[0].src == NULL) return NULL;
  const struct plan_piece *p = &o->pieces[0];
  const struct st_header *h = ck->shards[p->src->shard].hdr;
  const struct st_tensor *t = p->src->t;
  uint64_t bytes = t->end - t->begin;
  bool contiguous = p->height == 1 || p->src_pitch == p->width;
  if (p->src_offset != 0 || !contiguous || p->width * p->height != bytes || o->nbytes != bytes) return NULL;
  size_t i = (size_t)(t - h->tensors);
  if (i >= m->files[p->src->shard].ntensors) return NULL;
  return m->files[p->src->shard].tensors[i];
}

/* The recorded digests of the copy a replica was copied from (method peer), or NULL when it has none. */
static const unsigned char (*copy_digests(const struct ld_target *t))[WD_DIGEST_BYTES] {
  if (t->method != LD_METHOD_PEER) return NULL;
  for (size_t i = 0; i < t->ncopies; i++)
    if (t->copies[i].device == t->source_device) return t->copies[i].digests;
  return NULL;
}

int ld_digest(struct loader *ld, struct ld_target *t, struct wd_error *err) {
  const struct wd_backend *b = ld->backend;
  free(t->digests);
  t->digests = NULL;
  if (!ld->digests || b->ops->slab_hash == NULL) return 0; /* no digests: a scrub of the set says UNSUPPORTED */
  const struct plan *p = t->plan;
  size_t n = p->noutputs;
  struct wd_hash_range *ranges = calloc(n ? n : 1, sizeof *ranges);
  unsigned char (*d)[WD_DIGEST_BYTES] = calloc(n ? n : 1, sizeof *d);
  int rc = 0;
  if (ranges == NULL || d == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory for %zu digests", n);
    goto fail;
  }
  for (size_t i = 0; i < n; i++) ranges[i] = (struct wd_hash_range){p->outputs[i].offset, p->outputs[i].nbytes};
  struct wd_error herr = {0};
  if (b->ops->slab_hash(b->ctx, t->slab, ranges, n, d, &herr) != 0) {
    /* The set is served all the same, without digests: its scrubs answer UNSUPPORTED, pointing here. */
    log_msg(LOG_WARN, "%s: no digests for the set being loaded (its scrubs are refused): %s", t->name, herr.msg);
    goto fail;
  }
  const unsigned char (*src)[WD_DIGEST_BYTES] = copy_digests(t);
  for (size_t i = 0; src != NULL && i < n; i++) {
    if (memcmp(src[i], d[i], WD_DIGEST_BYTES) == 0) continue;
    log_msg(LOG_ERROR, "%s: tensor '%s' copied from device %d's copy differs from that copy's digests", t->name,
            p->outputs[i].name, t->source_device);
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM,
                 "%s: tensor '%s' as copied from device %d's copy of the set differs from the digest that copy "
                 "recorded at its load (the copy went wrong, or the source changed since); load it again",
                 t->name, p->outputs[i].name, t->source_device);
    goto fail;
  }
  for (size_t i = 0; i < n; i++) {
    const unsigned char *want = whole_tensor_digest(t->ck, &p->outputs[i]);
    if (want == NULL || memcmp(want, d[i], WD_DIGEST_BYTES) == 0) continue;
    char w[2 * WD_DIGEST_BYTES + 1], g[2 * WD_DIGEST_BYTES + 1];
    mf_hex(want, WD_DIGEST_BYTES, w);
    mf_hex(d[i], WD_DIGEST_BYTES, g);
    log_msg(LOG_ERROR, "%s: tensor '%s' loaded as %s, the manifest says %s", t->name, p->outputs[i].name, g, w);
    rc = err_set(err, WEIGHTD_E_BAD_CHECKSUM, "%s: tensor '%s' as loaded differs from %s (xxh3-128 %s, not %s)",
                 t->name, p->outputs[i].name, MF_FILE_NAME, g, w);
    goto fail;
  }
  free(ranges);
  t->digests = d;
  return 0;
fail:
  free(ranges);
  free(d);
  return rc;
}
