/*
 * slab_hash_cuda.h - the XXH3-128 kernel over ranges of device memory
 * (slab_hash_cuda.cu), for the cuda backend's slab_hash and its GPU test.
 */
#ifndef WD_SLAB_HASH_CUDA_H
#define WD_SLAB_HASH_CUDA_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Writes the XXH3-128 digest (seed 0, canonical) of device bytes
 * base[offs[2i], offs[2i] + offs[2i+1]) into out[16i, 16i + 16) for i < n,
 * with offs and out in host memory: the pairs go to the device, the kernel
 * runs on the current device's stream s, and the digests come back before
 * it returns. cudaSuccess or the first CUDA error.
 */
cudaError_t xxh3_cuda_ranges(const void *base, const uint64_t *offs, size_t n, unsigned char *out, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
