/*
 * fuzz_ckpt.h - in-memory checkpoints for the fuzz targets: shards made from
 * fixture tensor lists (tests/fixture.h's bytes, never a file), parsed with
 * the real header validator and joined by the real name table and index
 * check, so that a target drives the same code ckpt_open does.
 */
#ifndef WD_FUZZ_CKPT_H
#define WD_FUZZ_CKPT_H

#include <stdio.h>
#include <stdlib.h>

#include "checkpoint.h"
#include "fixture.h"

/* A checkpoint and the images its shards were parsed from (data[i]: shard i's data section). */
struct fz_ckpt {
  struct ckpt *c;
  unsigned char **images;
  const unsigned char **data;
};

/* Stops the run: the fixtures are fixed, so a failure here is a bug in the target or the code. */
__attribute__((noreturn)) static inline void fz_die(const char *what, const char *why) {
  fprintf(stderr, "fuzz fixture: %s: %s\n", what, why);
  abort();
}

/*
 * Makes an n-shard checkpoint; shard i is called rels[i] and holds
 * sets[i][0..counts[i]). Returns 0, or the code of the header validator (the
 * fixture is broken: fz_die) and of ckpt_tables_build against ix (NULL: no
 * index), with err filled; fz_free releases what was made in every case.
 */
static inline int fz_make(struct fz_ckpt *f, size_t n, const char *const *rels, const struct fx_tensor *const *sets,
                          const size_t *counts, const struct ckpt_index *ix, struct wd_error *err) {
  memset(f, 0, sizeof *f);
  f->c = calloc(1, sizeof *f->c);
  f->images = calloc(n ? n : 1, sizeof *f->images);
  f->data = calloc(n ? n : 1, sizeof *f->data);
  if (f->c == NULL || f->images == NULL || f->data == NULL || (f->c->shards = calloc(n ? n : 1, sizeof *f->c->shards)) == NULL)
    fz_die("checkpoint", "out of memory");
  f->c->layout = ix != NULL ? CKPT_INDEX : CKPT_SINGLE;
  for (size_t i = 0; i < n; i++) {
    struct ckpt_shard *s = &f->c->shards[i];
    size_t len = 0;
    s->fd = -1;
    f->c->nshards++;
    if ((s->rel = strdup(rels[i])) == NULL || fx_st_bytes(sets[i], counts[i], &f->images[i], &len) != 0)
      fz_die(rels[i], "out of memory");
    s->size = len;
    if (st_header_parse(f->images[i], len, len, rels[i], &s->hdr, err) != 0) fz_die(rels[i], err->msg);
    f->data[i] = f->images[i] + s->hdr->data_start;
  }
  return ckpt_tables_build(f->c, ix, err);
}

static inline void fz_free(struct fz_ckpt *f) {
  size_t n = f->c != NULL ? f->c->nshards : 0;
  ckpt_free(f->c);
  for (size_t i = 0; i < n; i++) free(f->images[i]);
  free(f->images);
  free(f->data);
  memset(f, 0, sizeof *f);
}

#endif
