/*
 * slab_hash_cuda.h - the tensor digest kernels over ranges of device memory
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
 * Writes the tree digest of device bytes base[offs[2i], offs[2i] +
 * offs[2i+1]) into out[16i, 16i + 16) for i < n: manifest.h's tensor
 * digest with leaves of leaf_bytes (MF_LEAF_BYTES gives mf_tensor_digest's;
 * a range of at most leaf_bytes is plain XXH3-128, seed 0), canonical.
 * offs and out are host memory: the leaf list goes to the device, the
 * kernels run on the current device's stream s, and the digests come back
 * before it returns. cudaSuccess, or the first CUDA error with `what`
 * (what_len bytes, may be 0) naming the step that failed: the allocation
 * and its size, the leaf or the root kernel, a copy.
 */
cudaError_t xxh3_cuda_tree(const void *base, const uint64_t *offs, size_t n, uint64_t leaf_bytes, unsigned char *out,
                           cudaStream_t s, char *what, size_t what_len);

#ifdef __cplusplus
}
#endif

#endif
