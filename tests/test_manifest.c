/*
 * test_manifest.c - the manifest module (common/manifest.h): a digester fed
 * in pieces of any size gives the digests of one whole pass (chunk, tensor
 * and file digests, SHA-256), equal to one-shot digests of the same bytes
 * (tensor digests: trees, against tree_oracle.h, at the leaf edges);
 * a written manifest parses back to the same digests and content id; and a
 * manifest that differs from the files in any way the format can say is
 * refused with BAD_CHECKSUM naming what differs.
 */
#include "testutil.h"

#include "checkpoint.h"
#include "fixture.h"
#include "manifest.h"
#include "sha256.h"
#include "tree_oracle.h"

static const struct fx_tensor TENSORS[] = {
    {"a", "BF16", 2, 1500, 1024},  /* 3,072,000 bytes: crosses no chunk */
    {"b", "F32", 4, 700, 1000},    /* 2,800,000: crosses the first chunk boundary */
    {"empty", "U8", 1, 0, 0},
    {"c", "U8", 1, 3000001, 0},    /* odd length, crosses the second */
    /* The tree's edges: one leaf, one byte less and more, several leaves with a short last one. */
    {"one", "U8", 1, 1, 0},
    {"t240", "U8", 1, 240, 0},
    {"t241", "U8", 1, 241, 0},
    {"leaf_less", "U8", 1, MF_LEAF_BYTES - 1, 0},
    {"leaf", "U8", 1, MF_LEAF_BYTES, 0},
    {"leaf_more", "U8", 1, MF_LEAF_BYTES + 1, 0},
    {"leaves", "U8", 1, 3 * MF_LEAF_BYTES + 17, 0},
};
#define NT (sizeof TENSORS / sizeof TENSORS[0])

struct fixture {
  char *dir;
  struct ckpt *ck;
  unsigned char *bytes;
  size_t len;
};

static int fixture_open(struct fixture *f) {
  memset(f, 0, sizeof *f);
  f->dir = fx_tmpdir("manifest");
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/model.safetensors", f->dir);
  struct wd_error err = {0};
  if (fx_st_bytes(TENSORS, NT, &f->bytes, &f->len) != 0 || fx_write_st(p, TENSORS, NT) != 0) return -1;
  return ckpt_open(f->dir, NULL, &f->ck, &err);
}

static void fixture_close(struct fixture *f) {
  ckpt_free(f->ck);
  free(f->bytes);
  if (f->dir != NULL) fx_rmtree(f->dir);
  free(f->dir);
}

/* The digests of the fixture's one shard, fed in pieces of `piece` bytes (0: irregular pieces). */
static struct mf_manifest *digest(const struct fixture *f, size_t piece) {
  struct mf_manifest *m = mf_new(f->ck);
  struct mf_digester *d = m != NULL ? mf_digester_new(f->ck, m, 0, true) : NULL;
  if (d == NULL) {
    mf_free(m);
    return NULL;
  }
  size_t sizes[] = {1, 7, 4096, 65537, 1u << 20, 3, 4194304, 12345};
  for (size_t off = 0, k = 0; off < f->len; k++) {
    size_t n = piece != 0 ? piece : sizes[k % (sizeof sizes / sizeof sizes[0])];
    if (n > f->len - off) n = f->len - off;
    mf_digester_feed(d, f->bytes + off, n);
    off += n;
  }
  if (mf_digester_end(d) != 0) {
    mf_free(m);
    return NULL;
  }
  mf_finish(m);
  return m;
}

static void test_pieces_do_not_matter(void) {
  struct fixture f;
  CHECK(fixture_open(&f) == 0);
  struct mf_manifest *one = digest(&f, f.len), *odd = digest(&f, 0), *bytes1 = NULL;
  CHECK(one != NULL && odd != NULL);
  if (one != NULL && odd != NULL) {
    const struct mf_file *a = &one->files[0], *b = &odd->files[0];
    CHECK(a->nchunks == (f.len + MF_CHUNK_BYTES - 1) / MF_CHUNK_BYTES && a->nchunks >= 3);
    CHECK(memcmp(a->chunks, b->chunks, (size_t)a->nchunks * MF_DIGEST_BYTES) == 0);
    CHECK(a->ntensors == NT && memcmp(a->tensors, b->tensors, NT * MF_DIGEST_BYTES) == 0);
    CHECK(memcmp(a->digest, b->digest, MF_DIGEST_BYTES) == 0);
    CHECK(memcmp(a->sha256, b->sha256, MF_SHA256_BYTES) == 0 && a->has_sha256);
    CHECK(memcmp(one->content_id, odd->content_id, CKPT_ID_BYTES) == 0);
    /* Against one-shot digests of the same bytes. */
    unsigned char want[MF_DIGEST_BYTES];
    for (uint64_t k = 0; k < a->nchunks; k++) {
      size_t lo = (size_t)(k * MF_CHUNK_BYTES), n = f.len - lo < MF_CHUNK_BYTES ? f.len - lo : MF_CHUNK_BYTES;
      mf_digest(f.bytes + lo, n, want);
      CHECK(memcmp(want, a->chunks[k], MF_DIGEST_BYTES) == 0);
    }
    const struct st_header *h = f.ck->shards[0].hdr;
    size_t trees = 0;
    for (size_t t = 0; t < h->ntensors; t++) {
      const unsigned char *p = f.bytes + h->data_start + h->tensors[t].begin;
      size_t len = (size_t)(h->tensors[t].end - h->tensors[t].begin);
      CHECK_EQ_INT(tree_oracle(p, len, want), 0);
      CHECK(memcmp(want, a->tensors[t], MF_DIGEST_BYTES) == 0);
      unsigned char one_shot[MF_DIGEST_BYTES];
      CHECK_EQ_INT(mf_tensor_digest(p, len, one_shot), 0);
      CHECK(memcmp(one_shot, a->tensors[t], MF_DIGEST_BYTES) == 0);
      trees += len > MF_LEAF_BYTES;
    }
    CHECK(trees == 5); /* a, b, c, leaf_more and leaves: the odd pieces cut their leaves anywhere */
    struct sha256 s;
    unsigned char sw[MF_SHA256_BYTES];
    sha256_init(&s);
    sha256_update(&s, f.bytes, f.len);
    sha256_final(&s, sw);
    CHECK(memcmp(sw, a->sha256, MF_SHA256_BYTES) == 0);
  }
  /* A byte changed: its chunk and its tensor differ, nothing else. */
  f.bytes[f.len - 10] ^= 1;
  CHECK((bytes1 = digest(&f, 0)) != NULL);
  if (one != NULL && bytes1 != NULL) {
    CHECK(mf_chunks_differ(one, bytes1, 0, NULL, NULL) == 1);
    CHECK(memcmp(one->files[0].chunks[one->files[0].nchunks - 1], bytes1->files[0].chunks[one->files[0].nchunks - 1],
                 MF_DIGEST_BYTES) != 0);
    size_t differ = 0;
    for (size_t t = 0; t < NT; t++) differ += memcmp(one->files[0].tensors[t], bytes1->files[0].tensors[t], MF_DIGEST_BYTES) != 0;
    CHECK(differ == 1);
    CHECK(memcmp(one->content_id, bytes1->content_id, CKPT_ID_BYTES) != 0);
  }
  mf_free(one);
  mf_free(odd);
  mf_free(bytes1);
  fixture_close(&f);
}

static void test_short_feed_is_an_error(void) {
  struct fixture f;
  CHECK(fixture_open(&f) == 0);
  struct mf_manifest *m = mf_new(f.ck);
  struct mf_digester *d = mf_digester_new(f.ck, m, 0, false);
  mf_digester_feed(d, f.bytes, f.len - 1);
  CHECK(mf_digester_end(d) == WEIGHTD_E_INVALID);
  mf_free(m);
  fixture_close(&f);
}

/* Parses text (after replacing the first `from` by `to`, when given) and expects BAD_CHECKSUM with `why`. */
static void expect_refused(const struct fixture *f, const char *text, const char *from, const char *to, const char *why) {
  char *t = strdup(text);
  if (from != NULL) {
    char *at = strstr(t, from);
    CHECK(at != NULL && strlen(from) == strlen(to));
    if (at != NULL) memcpy(at, to, strlen(to));
  }
  struct mf_manifest *m = NULL;
  struct wd_error err = {0};
  CHECK_EQ_INT(mf_parse(t, strlen(t), f->ck, "M", &m, &err), WEIGHTD_E_BAD_CHECKSUM);
  CHECK(m == NULL);
  CHECK_STR_CONTAINS(err.msg, why);
  free(t);
}

static void test_written_parses_back_and_differences_are_named(void) {
  struct fixture f;
  CHECK(fixture_open(&f) == 0);
  struct mf_manifest *m = digest(&f, 0), *back = NULL;
  size_t len = 0;
  char *text = m != NULL ? mf_write(m, f.ck, &len) : NULL;
  CHECK(text != NULL && len == strlen(text) && text[len - 1] == '\n');
  struct wd_error err = {0};
  CHECK(text != NULL && mf_parse(text, len, f.ck, "M", &back, &err) == 0);
  if (back != NULL) {
    CHECK(memcmp(back->content_id, m->content_id, CKPT_ID_BYTES) == 0);
    CHECK(memcmp(back->files[0].chunks, m->files[0].chunks, (size_t)m->files[0].nchunks * MF_DIGEST_BYTES) == 0);
    CHECK(memcmp(back->files[0].tensors, m->files[0].tensors, NT * MF_DIGEST_BYTES) == 0);
    CHECK(!back->files[0].has_sha256); /* never in the file */
  }
  if (text != NULL) {
    char hex[2 * MF_DIGEST_BYTES + 1], other[2 * MF_DIGEST_BYTES + 1];
    mf_hex(m->files[0].chunks[1], MF_DIGEST_BYTES, hex);
    snprintf(other, sizeof other, "%s", hex);
    other[0] = other[0] == '0' ? '1' : '0';
    /* A chunk digest changed: the file digest no longer follows from the chunks. */
    expect_refused(&f, text, hex, other, "model.safetensors: the digest does not follow from the chunk digests");
    char lid[2 * CKPT_ID_BYTES + 1], lother[2 * CKPT_ID_BYTES + 1];
    mf_hex(m->layout_id, CKPT_ID_BYTES, lid);
    snprintf(lother, sizeof lother, "%s", lid);
    lother[5] = lother[5] == 'a' ? 'b' : 'a';
    expect_refused(&f, text, lid, lother, "M: describes another layout");
    mf_hex(m->content_id, CKPT_ID_BYTES, lid);
    snprintf(lother, sizeof lother, "%s", lid);
    lother[0] = lother[0] == 'a' ? 'b' : 'a';
    expect_refused(&f, text, lid, lother, "the content_id does not follow");
    expect_refused(&f, text, "\"version\":2", "\"version\":3", "version is 3, not 2");
    /* A manifest of the plain tensor digests: the operator is told to write it again. */
    expect_refused(&f, text, "\"version\":2", "\"version\":1", "version is 1, not 2");
    expect_refused(&f, text, "\"version\":2", "\"version\":1", "write it again with `weightctl manifest`");
    expect_refused(&f, text, "\"leaf_bytes\":262144", "\"leaf_bytes\":262145", "leaf_bytes is 262145, not 262144");
    expect_refused(&f, text, "\"leaf_bytes\":", "\"leaf_bytez\":", "leaf_bytes is missing, not 262144");
    expect_refused(&f, text, "xxh3-128", "xxh3-064", "hash is not");
    expect_refused(&f, text, "\"chunk_bytes\":4194304", "\"chunk_bytes\":4194305", "chunk_bytes is 4194305, not 4194304");
    expect_refused(&f, text, "\"name\":\"model", "\"name\":\"xodel", "does not name model.safetensors");
    char size[40], osize[40];
    snprintf(size, sizeof size, "\"size\":%zu", f.len);
    snprintf(osize, sizeof osize, "\"size\":%zu", f.len + 1);
    if (strlen(size) == strlen(osize)) expect_refused(&f, text, size, osize, "model.safetensors: size ");
    expect_refused(&f, text, "\"files\":[{", "\"filez\":[{", "\"files\" is not an array of the checkpoint's 1 shard");
    /* A digest with a digit that is not hex (the first chunk's): the chunk list is refused. */
    mf_hex(m->files[0].chunks[0], MF_DIGEST_BYTES, hex);
    snprintf(other, sizeof other, "%s", hex);
    other[3] = 'g';
    expect_refused(&f, text, hex, other, "\"chunks\" is not");
    expect_refused(&f, "[1]", NULL, NULL, "not a weightd manifest");
    expect_refused(&f, "{\"format\":", NULL, NULL, "M: not JSON");
    expect_refused(&f, "\xff\xfe", NULL, NULL, "not UTF-8");
  }
  free(text);
  mf_free(m);
  mf_free(back);
  fixture_close(&f);
}

int main(void) {
  RUN(test_pieces_do_not_matter);
  RUN(test_short_feed_is_an_error);
  RUN(test_written_parses_back_and_differences_are_named);
  return tu_finish();
}
