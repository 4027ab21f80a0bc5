/*
 * test_xxh3_cuda.c - the scrub kernel (daemon/backend/slab_hash_cuda.cu)
 * against libxxhash: every case of xxh3_cases.h (edge lengths 0 to 4 MiB + 1
 * at every alignment, random lengths and offsets) hashed in one launch over
 * a buffer of random bytes in device memory, each digest compared with
 * XXH3_128bits of the same host bytes; then one byte flipped on the device
 * changes exactly the digests of the cases that cover it. Skipped (77)
 * where no GPU is present.
 */
#include "testutil.h"

#include <cuda_runtime.h>
#include <xxhash.h>

#include "manifest.h"
#include "slab_hash_cuda.h"
#include "xxh3_cases.h"

static unsigned char *buf, *dev;
static uint64_t *offs;
static unsigned char *got;
static size_t n;

static void want_digest(size_t i, unsigned char out[16]) { mf_digest(buf + offs[2 * i], (size_t)offs[2 * i + 1], out); }

static void test_kernel_matches_libxxhash(void) {
  CHECK(xxh3_cuda_ranges(dev, offs, n, got, 0) == cudaSuccess);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char want[16];
    want_digest(i, want);
    if (memcmp(want, got + 16 * i, 16) != 0 && bad++ < 10)
      fprintf(stderr, "length %" PRIu64 " at offset %" PRIu64 " differs\n", offs[2 * i + 1], offs[2 * i]);
  }
  CHECK(bad == 0);
}

static void test_flipped_byte_changes_the_covering_digests(void) {
  size_t at = (3u << 20) + 12345;
  unsigned char b = buf[at] ^ 0x01;
  CHECK(cudaMemcpy(dev + at, &b, 1, cudaMemcpyHostToDevice) == cudaSuccess);
  unsigned char *after = malloc(16 * n);
  CHECK(after != NULL && xxh3_cuda_ranges(dev, offs, n, after, 0) == cudaSuccess);
  for (size_t i = 0; after != NULL && i < n; i++) {
    bool covers = offs[2 * i] <= at && at < offs[2 * i] + offs[2 * i + 1];
    CHECK((memcmp(after + 16 * i, got + 16 * i, 16) != 0) == covers);
  }
  free(after);
  CHECK(cudaMemcpy(dev + at, buf + at, 1, cudaMemcpyHostToDevice) == cudaSuccess);
}

int main(void) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) SKIP_ALL("no GPU");
  n = xxh3_case_count();
  buf = malloc(XXH3_BUF_BYTES);
  offs = malloc(2 * n * sizeof *offs);
  got = malloc(16 * n);
  if (buf == NULL || offs == NULL || got == NULL) return 1;
  xxh3_case_fill(buf);
  for (size_t i = 0; i < n; i++) xxh3_case(i, &offs[2 * i], &offs[2 * i + 1]);
  if (cudaMalloc((void **)&dev, XXH3_BUF_BYTES) != cudaSuccess ||
      cudaMemcpy(dev, buf, XXH3_BUF_BYTES, cudaMemcpyHostToDevice) != cudaSuccess) {
    fprintf(stderr, "cannot put the test bytes on the GPU\n");
    return 1;
  }
  RUN(test_kernel_matches_libxxhash);
  RUN(test_flipped_byte_changes_the_covering_digests);
  cudaFree(dev);
  free(buf);
  free(offs);
  free(got);
  return tu_finish();
}
