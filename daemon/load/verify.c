/*
 * verify.c - a load's file bytes checked against the checkpoint's manifest
 * (the `verify` setting on_load; manifest.h): every MF_CHUNK_BYTES chunk of
 * the shard files that the load's plan reads from is read again through the
 * load's own source and digested, and a chunk whose digest is not the
 * manifest's fails the load with BAD_CHECKSUM naming the file and its bytes.
 * A chunk is read whole even where the plan reads a part of it (a column
 * slice, one expert), since the manifest knows whole chunks only.
 *
 * What it checks is the files, read again after the load: a read that went
 * wrong only during the fill itself is not caught (the copies are not
 * digested as they pass). The load's ready watermark stays at zero until the
 * check is done (hold_ready), so no early attacher uses bytes before.
 *
 * Threads: the chunks are tasks on the fill pool (ld_pool_run), each reading
 * into one of this run's buffers (one per fill thread and one for the caller,
 * aligned for the source; a free list under the run's lock)
 * or digesting the mapping itself when the source maps; the first failure
 * is kept under the same lock, and later tasks stop early. Reads from a
 * mapping run under the fault guard: a shard truncated meanwhile is FAULT.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/fault.h"
#include "base/log.h"
#include "internal.h"
#include "manifest.h"

struct verify_run {
  struct ld_target *t;
  const struct ld_source *src;
  const struct mf_manifest *m;
  struct { uint32_t shard; uint64_t chunk; } *chunks;
  size_t nchunks;
  pthread_mutex_t lock;
  unsigned char **free_bufs; /* buffers no task holds now */
  size_t nfree;
  uint64_t checked, mismatches;
  int rc;
  struct wd_error err;
};

struct chunk_read {
  const struct ld_source *src;
  struct ld_read rq;
  const unsigned char *map; /* the shard's mapping, or NULL: read into rq.dst */
  unsigned char digest[MF_DIGEST_BYTES];
  struct wd_error err;
};

static int digest_chunk(void *arg) {
  struct chunk_read *c = arg;
  if (c->map != NULL) {
    mf_digest(c->map + c->rq.off, (size_t)c->rq.width, c->digest);
    return 0;
  }
  int rc = ld_source_read(c->src, &c->rq, &c->err);
  if (rc == 0) mf_digest(c->rq.dst, (size_t)c->rq.width, c->digest);
  return rc;
}

static void fail(struct verify_run *v, int rc, const struct wd_error *err) {
  pthread_mutex_lock(&v->lock);
  if (v->rc == 0) {
    v->rc = rc;
    v->err = *err;
  }
  pthread_mutex_unlock(&v->lock);
}

static void verify_task(void *arg, size_t i) {
  struct verify_run *v = arg;
  pthread_mutex_lock(&v->lock);
  unsigned char *buf = v->rc == 0 && v->nfree > 0 ? v->free_bufs[--v->nfree] : NULL;
  bool stop = v->rc != 0;
  pthread_mutex_unlock(&v->lock);
  if (stop) return;
  uint32_t shard = v->chunks[i].shard;
  const struct ckpt_shard *s = &v->t->ck->shards[shard];
  uint64_t off = v->chunks[i].chunk * MF_CHUNK_BYTES;
  uint64_t len = s->size - off < MF_CHUNK_BYTES ? s->size - off : MF_CHUNK_BYTES;
  struct chunk_read c = {.src = v->src, .map = ld_source_map(v->src, shard)};
  c.rq = (struct ld_read){
      .shard = shard, .off = off, .width = len, .pitch = len, .height = 1, .dst = buf, .cancel = &v->t->cancel};
  struct wd_error err = {0};
  int rc = ld_check_cancel(v->t, &err);
  if (rc == 0 && c.map == NULL && buf == NULL) rc = err_set(&err, WEIGHTD_E_INTERNAL, "verify: no read buffer free");
  if (rc == 0) {
    rc = fault_call(digest_chunk, &c);
    if (rc == WEIGHTD_E_FAULT)
      err_set(&err, WEIGHTD_E_FAULT, "%s: %s: truncated or unreadable while it was verified", v->t->name, s->rel);
    else if (rc != 0)
      err = c.err;
  }
  if (rc == 0 && memcmp(c.digest, v->m->files[shard].chunks[v->chunks[i].chunk], MF_DIGEST_BYTES) != 0) {
    log_msg(LOG_ERROR, "%s: %s: bytes %llu-%llu differ from %s (verify on_load)", v->t->name, s->rel,
            (unsigned long long)off, (unsigned long long)(off + len - 1), MF_FILE_NAME);
    pthread_mutex_lock(&v->lock);
    v->mismatches++;
    pthread_mutex_unlock(&v->lock);
    rc = err_set(&err, WEIGHTD_E_BAD_CHECKSUM, "%s: %s: bytes %llu-%llu differ from %s", v->t->name, s->rel,
                 (unsigned long long)off, (unsigned long long)(off + len - 1), MF_FILE_NAME);
  }
  if (rc != 0 && rc != WEIGHTD_E_BAD_CHECKSUM) fail(v, rc, &err);
  pthread_mutex_lock(&v->lock);
  if (rc == 0 || rc == WEIGHTD_E_BAD_CHECKSUM) v->checked++;
  if (buf != NULL) v->free_bufs[v->nfree++] = buf;
  pthread_mutex_unlock(&v->lock);
  if (rc == WEIGHTD_E_BAD_CHECKSUM) fail(v, rc, &err);
}

int ld_verify(struct loader *ld, struct ld_target *t, const struct ld_source *src, struct wd_error *err) {
  const struct mf_manifest *m = t->ck->manifest;
  struct plan_range *ranges = NULL;
  size_t nranges = 0;
  int rc = plan_ranges(t->plan, t->ck, MF_CHUNK_BYTES, 0, &ranges, &nranges, err);
  if (rc != 0) return rc;
  struct verify_run v = {.t = t, .src = src, .m = m};
  for (size_t i = 0; i < nranges; i++) v.nchunks += (ranges[i].len + MF_CHUNK_BYTES - 1) / MF_CHUNK_BYTES;
  unsigned nbufs = ld_pool_threads(ld->pool) + 1; /* a task on every fill thread, and one on the caller's */
  v.chunks = calloc(v.nchunks ? v.nchunks : 1, sizeof *v.chunks);
  v.free_bufs = calloc(nbufs, sizeof *v.free_bufs);
  if (v.chunks == NULL || v.free_bufs == NULL) {
    rc = err_set(err, WEIGHTD_E_NOMEM, "out of memory");
    goto done;
  }
  size_t k = 0;
  bool maps = true;
  for (size_t i = 0; i < nranges; i++) {
    if (ld_source_map(src, ranges[i].shard) == NULL) maps = false;
    for (uint64_t c = ranges[i].off / MF_CHUNK_BYTES; c * MF_CHUNK_BYTES < ranges[i].off + ranges[i].len; c++) {
      v.chunks[k].shard = ranges[i].shard;
      v.chunks[k++].chunk = c;
    }
  }
  v.nchunks = k;
  /* A buffer per task that can run at once, aligned as the source reads fastest (O_DIRECT: straight in). */
  size_t align = src->align > 4096 ? (size_t)src->align : 4096;
  for (unsigned i = 0; !maps && i < nbufs; i++) {
    void *b = NULL;
    if (posix_memalign(&b, align, MF_CHUNK_BYTES) != 0) {
      rc = err_set(err, WEIGHTD_E_NOMEM, "verify: out of memory for %u read buffers of 4 MiB", nbufs);
      goto done;
    }
    v.free_bufs[v.nfree++] = b;
  }
  pthread_mutex_init(&v.lock, NULL);
  ld_pool_run(ld->pool, v.nchunks, verify_task, &v);
  pthread_mutex_destroy(&v.lock);
  rc = v.rc;
  if (rc != 0) *err = v.err;
  t->verified_chunks = v.checked;
  t->verify_mismatches = v.mismatches;
done:
  for (size_t i = 0; i < v.nfree; i++) free(v.free_bufs[i]);
  free(v.free_bufs);
  free(v.chunks);
  free(ranges);
  return rc;
}
