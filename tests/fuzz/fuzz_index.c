/*
 * fuzz_index.c - libFuzzer target: the readers of a checkpoint directory's
 * JSON files. The same input goes to the index reader (ckpt_index_parse)
 * and, when that accepts it, to the index check against a small in-memory
 * checkpoint whose shards are the files it names (each holding one of three
 * fixed tensor sets); and to the config.json reader (mcfg_parse) with every
 * field asked for.
 *
 * Oracles besides the sanitizers: an accepted index has sorted, distinct
 * names and sorted, distinct, safe files; an index the check accepts names
 * every tensor of the shards exactly once, each in the shard that holds it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_ckpt.h"
#include "modelcfg.h"
#include "pathutil.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const struct fx_tensor set_a[] = {{"a", "F32", 4, 2, 2}, {"b", "U8", 1, 3, 0}};
static const struct fx_tensor set_b[] = {{"c", "BF16", 2, 4, 0}};
static const struct fx_tensor set_c[] = {{"d", "I8", 1, 1, 0}, {"e", "F16", 2, 2, 1}, {"f", "U8", 1, 0, 0}};
static const struct fx_tensor *const sets[] = {set_a, set_b, set_c};
static const size_t set_n[] = {2, 1, 3};
#define MAX_SHARDS 6

static void check_index(const struct ckpt_index *ix) {
  for (size_t i = 0; i + 1 < ix->nentries; i++)
    if (strcmp(ix->entries[i].name, ix->entries[i + 1].name) >= 0) abort();
  for (size_t i = 0; i < ix->nfiles; i++)
    if (!path_rel_is_safe(ix->files[i]) || (i > 0 && strcmp(ix->files[i - 1], ix->files[i]) >= 0)) abort();
  for (size_t i = 0; i < ix->nentries; i++)
    if (ix->entries[i].file >= ix->nfiles || strcmp(ix->files[ix->entries[i].file], ix->entries[i].path) != 0) abort();
  if (ix->nfiles > MAX_SHARDS) return;
  const struct fx_tensor *s[MAX_SHARDS];
  size_t n[MAX_SHARDS];
  for (size_t i = 0; i < ix->nfiles; i++) {
    s[i] = sets[i % 3];
    n[i] = set_n[i % 3];
  }
  struct fz_ckpt f;
  struct wd_error err = {0};
  if (fz_make(&f, ix->nfiles, (const char *const *)ix->files, s, n, ix, &err) == 0) {
    if (f.c->ntensors != ix->nentries) abort();
    for (size_t i = 0; i < ix->nentries; i++) {
      const struct ckpt_ref *r = ckpt_tensor_find(f.c, ix->entries[i].name);
      if (r == NULL || r->shard != ix->entries[i].file) abort();
    }
  } else if (err.msg[0] == '\0') {
    abort();
  }
  fz_free(&f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct ckpt_index *ix = NULL;
  struct wd_error err = {0};
  if (ckpt_index_parse((const char *)data, size, &ix, &err) == 0) check_index(ix);
  else if (err.msg[0] == '\0') abort();
  ckpt_index_free(ix);

  struct mcfg *cfg = NULL;
  if (mcfg_parse((const char *)data, size, "config.json", &cfg, &err) == 0) {
    for (int fld = 0; fld < MCFG_NFIELDS; fld++) {
      int64_t v;
      (void)mcfg_get(cfg, (enum mcfg_field)fld, "fuzzing", &v, &err);
    }
  }
  mcfg_free(cfg);
  return 0;
}
