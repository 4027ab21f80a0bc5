/*
 * test_xxh3_cuda.c - the scrub kernels (daemon/backend/slab_hash_cuda.cu)
 * against mf_tensor_digest (libxxhash on the host): every case of
 * xxh3_cases.h (the plain cases, edge lengths 0 to 4 MiB + 1 at every
 * alignment and random lengths and offsets; and the tree cases, the leaf
 * edges, several leaves with a short last one, random lengths of a few MiB,
 * at unaligned offsets) hashed in one call over a buffer of random bytes in
 * device memory, each digest compared with the host's of the same bytes;
 * then one byte flipped on the device changes exactly the digests of the
 * cases that cover it; then more leaves and more ranges than one grid's
 * warps (the kernels' strides). Skipped (77) where no GPU is present.
 */
#include "testutil.h"

#include <cuda_runtime.h>

#include "manifest.h"
#include "slab_hash_cuda.h"
#include "xxh3_cases.h"

static unsigned char *buf, *dev;
static uint64_t *offs;
static unsigned char *got;
static size_t n;

/* The kernels over ranges (host pairs) into out, with the failing step printed. */
static cudaError_t digests(const uint64_t *ranges, size_t count, unsigned char *out) {
  char what[160];
  cudaError_t e = xxh3_cuda_tree(dev, ranges, count, MF_LEAF_BYTES, out, 0, what, sizeof what);
  if (e != cudaSuccess) fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e;
}

/* Ranges whose digests differ from mf_tensor_digest of the same host bytes (the first few printed). */
static size_t count_bad(const uint64_t *ranges, size_t count, const unsigned char *d) {
  size_t bad = 0;
  for (size_t i = 0; i < count; i++) {
    unsigned char want[16];
    CHECK_EQ_INT(mf_tensor_digest(buf + ranges[2 * i], (size_t)ranges[2 * i + 1], want), 0);
    if (memcmp(want, d + 16 * i, 16) != 0 && bad++ < 10)
      fprintf(stderr, "length %" PRIu64 " at offset %" PRIu64 " differs\n", ranges[2 * i + 1], ranges[2 * i]);
  }
  return bad;
}

static void test_kernels_match_the_host(void) {
  CHECK(digests(offs, n, got) == cudaSuccess);
  CHECK(count_bad(offs, n, got) == 0);
}

static void test_flipped_byte_changes_the_covering_digests(void) {
  size_t at = (3u << 20) + 12345;
  unsigned char b = buf[at] ^ 0x01;
  CHECK(cudaMemcpy(dev + at, &b, 1, cudaMemcpyHostToDevice) == cudaSuccess);
  unsigned char *after = malloc(16 * n);
  CHECK(after != NULL && digests(offs, n, after) == cudaSuccess);
  for (size_t i = 0; after != NULL && i < n; i++) {
    bool covers = offs[2 * i] <= at && at < offs[2 * i] + offs[2 * i + 1];
    CHECK((memcmp(after + 16 * i, got + 16 * i, 16) != 0) == covers);
  }
  free(after);
  CHECK(cudaMemcpy(dev + at, buf + at, 1, cudaMemcpyHostToDevice) == cudaSuccess);
}

/*
 * 300,000 short ranges (one leaf each), then 270,000 short ones followed by
 * 40 ranges of 8 MiB (32 leaves each, 1,280 in all) and two of 80 leaves
 * (a root over 1,280 bytes of leaf digests, past one 1 KiB block): more
 * warps' work than the kernels' largest grid (65,535 blocks of 4 warps),
 * with the long ranges last, so both kernels' strides reach multi-leaf work.
 */
static void test_more_work_than_one_grid(void) {
  size_t count = 300000;
  uint64_t *r = malloc(2 * count * sizeof *r);
  unsigned char *d = malloc(16 * count);
  CHECK(r != NULL && d != NULL);
  if (r == NULL || d == NULL) goto done;
  uint64_t s = 0x2545F4914F6CDD1Dull;
  for (size_t i = 0; i < count; i++) {
    r[2 * i + 1] = xxh3_case_rand(&s) % 600;
    r[2 * i] = xxh3_case_rand(&s) % (XXH3_BUF_BYTES - r[2 * i + 1] + 1);
  }
  CHECK(digests(r, count, d) == cudaSuccess);
  CHECK(count_bad(r, count, d) == 0);
  size_t k = 270000;
  for (size_t i = 0; i < 40; i++, k++) {
    r[2 * k] = i % 64;
    r[2 * k + 1] = 32 * MF_LEAF_BYTES;
  }
  for (size_t i = 0; i < 2; i++, k++) {
    r[2 * k] = 3 * i;
    r[2 * k + 1] = 80 * MF_LEAF_BYTES - 17 * i;
  }
  CHECK(digests(r, k, d) == cudaSuccess);
  CHECK(count_bad(r, k, d) == 0);
done:
  free(r);
  free(d);
}

int main(void) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) SKIP_ALL("no GPU");
  size_t plain = xxh3_case_count();
  n = plain + xxh3_tree_case_count();
  buf = malloc(XXH3_BUF_BYTES);
  offs = malloc(2 * n * sizeof *offs);
  got = malloc(16 * n);
  if (buf == NULL || offs == NULL || got == NULL) return 1;
  xxh3_case_fill(buf);
  for (size_t i = 0; i < plain; i++) xxh3_case(i, &offs[2 * i], &offs[2 * i + 1]);
  for (size_t i = plain; i < n; i++) xxh3_tree_case(i - plain, &offs[2 * i], &offs[2 * i + 1]);
  if (cudaMalloc((void **)&dev, XXH3_BUF_BYTES) != cudaSuccess ||
      cudaMemcpy(dev, buf, XXH3_BUF_BYTES, cudaMemcpyHostToDevice) != cudaSuccess) {
    fprintf(stderr, "cannot put the test bytes on the GPU\n");
    return 1;
  }
  RUN(test_kernels_match_the_host);
  RUN(test_flipped_byte_changes_the_covering_digests);
  RUN(test_more_work_than_one_grid);
  cudaFree(dev);
  free(buf);
  free(offs);
  free(got);
  return tu_finish();
}
