/*
 * fuzz_manifest.c - libFuzzer target: the manifest reader (mf_parse), which
 * reads weightd.manifest.json from beside a checkpoint's index, a file
 * whoever may write into a model root can make. Each input is parsed
 * against a fixed in-memory checkpoint of two shards (tests/fixture.h
 * bytes, the real header validator), whose true manifest is the seed.
 *
 * Oracles besides the sanitizers: a refusal names what was wrong (a
 * message); an accepted manifest describes the fixture (its layout id, its
 * shards' sizes, chunk and tensor counts), is self-consistent (each file's
 * digest and the content id follow from its chunk digests, as mf_finish
 * derives them), and writes back (mf_write) as text that parses again to
 * the same digests.
 *
 * WD_FUZZ_MANIFEST_SEED=PATH in the environment writes the fixture's true
 * manifest to PATH at start (how corpus/manifest/valid was made) and exits.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_ckpt.h"
#include "manifest.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const struct fx_tensor set_a[] = {{"a", "F32", 4, 3, 5}, {"b", "U8", 1, 300, 0}, {"e", "U8", 1, 0, 0}};
static const struct fx_tensor set_b[] = {{"c", "BF16", 2, 40, 0}};
static const struct fx_tensor *const sets[] = {set_a, set_b};
static const size_t set_n[] = {3, 1};
static const char *const rels[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};

static struct fz_ckpt fixture;
static struct ckpt_index *fixture_index; /* kept: the checkpoint's tables were built against it */

/* The fixture's true manifest, digested from its shard images. */
static struct mf_manifest *true_manifest(void) {
  struct mf_manifest *m = mf_new(fixture.c);
  if (m == NULL) fz_die("manifest", "out of memory");
  for (uint32_t i = 0; i < fixture.c->nshards; i++) {
    struct mf_digester *d = mf_digester_new(fixture.c, m, i, false);
    if (d == NULL) fz_die("digester", "out of memory");
    mf_digester_feed(d, fixture.images[i], (size_t)fixture.c->shards[i].size);
    if (mf_digester_end(d) != 0) fz_die("digester", "not every byte was fed");
  }
  mf_finish(m);
  return m;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  static const char index[] = "{\"weight_map\": {\"a\": \"model-00001-of-00002.safetensors\", "
                              "\"b\": \"model-00001-of-00002.safetensors\", \"e\": \"model-00001-of-00002.safetensors\", "
                              "\"c\": \"model-00002-of-00002.safetensors\"}}";
  struct wd_error err = {0};
  if (ckpt_index_parse(index, sizeof index - 1, &fixture_index, &err) != 0) fz_die("index", err.msg);
  if (fz_make(&fixture, 2, rels, sets, set_n, fixture_index, &err) != 0) fz_die("checkpoint", err.msg);
  if (ckpt_layout_id(fixture.c, fixture.c->layout_id) != 0) fz_die("layout id", "out of memory");
  /* The true manifest is accepted (else the seed, and every mutation of it, would test only refusals). */
  struct mf_manifest *m = true_manifest(), *back = NULL;
  size_t len = 0;
  char *text = mf_write(m, fixture.c, &len);
  if (text == NULL) fz_die("manifest", "out of memory");
  if (mf_parse(text, len, fixture.c, MF_FILE_NAME, &back, &err) != 0) fz_die("true manifest", err.msg);
  mf_free(back);
  const char *seed = getenv("WD_FUZZ_MANIFEST_SEED");
  if (seed != NULL) {
    FILE *f = fopen(seed, "w");
    if (f == NULL || fwrite(text, 1, len, f) != len || fclose(f) != 0) fz_die(seed, "cannot write");
    exit(0);
  }
  free(text);
  mf_free(m);
  return 0;
}

/* Whether a and b hold the same digests for the fixture. */
static bool same(const struct mf_manifest *a, const struct mf_manifest *b) {
  if (a->nfiles != b->nfiles || memcmp(a->content_id, b->content_id, CKPT_ID_BYTES) != 0) return false;
  for (size_t i = 0; i < a->nfiles; i++) {
    const struct mf_file *x = &a->files[i], *y = &b->files[i];
    if (x->size != y->size || x->nchunks != y->nchunks || x->ntensors != y->ntensors ||
        memcmp(x->digest, y->digest, MF_DIGEST_BYTES) != 0 ||
        memcmp(x->chunks, y->chunks, x->nchunks * MF_DIGEST_BYTES) != 0 ||
        (x->ntensors > 0 && memcmp(x->tensors, y->tensors, x->ntensors * MF_DIGEST_BYTES) != 0))
      return false;
  }
  return true;
}

static void check_accepted(const struct mf_manifest *m) {
  const struct ckpt *c = fixture.c;
  if (memcmp(m->layout_id, c->layout_id, CKPT_ID_BYTES) != 0 || m->nfiles != c->nshards) abort();
  for (size_t i = 0; i < m->nfiles; i++) {
    const struct mf_file *f = &m->files[i];
    if (f->size != c->shards[i].size || f->nchunks != (f->size + MF_CHUNK_BYTES - 1) / MF_CHUNK_BYTES ||
        f->ntensors != c->shards[i].hdr->ntensors)
      abort();
    struct mf_file g = *f; /* the file digest as its chunks give it */
    mf_file_finish(&g);
    if (memcmp(g.digest, f->digest, MF_DIGEST_BYTES) != 0) abort();
  }
  unsigned char id[CKPT_ID_BYTES];
  mf_content_id(m->layout_id, m->files, m->nfiles, id);
  if (memcmp(id, m->content_id, CKPT_ID_BYTES) != 0) abort();
  size_t len = 0;
  char *text = mf_write(m, c, &len);
  if (text == NULL) abort();
  struct mf_manifest *again = NULL;
  struct wd_error err = {0};
  if (mf_parse(text, len, c, "rewritten", &again, &err) != 0 || !same(m, again)) abort();
  mf_free(again);
  free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct mf_manifest *m = NULL;
  struct wd_error err = {0};
  int rc = mf_parse((const char *)data, size, fixture.c, MF_FILE_NAME, &m, &err);
  if (rc == 0) check_accepted(m);
  else if (err.msg[0] == '\0' || m != NULL) abort();
  mf_free(m);
  return 0;
}
