/*
 * slab_hash_cuda.cu - tensor digests (manifest.h's tree: XXH3-128 of each
 * leaf, then XXH3-128 of the leaf digests) of ranges of device memory,
 * bit-exact with mf_tensor_digest (the hash is xxh3.h's; this file spreads
 * it over a GPU).
 *
 * Why a tree. XXH3's block scramble makes one input one serial chain, so
 * one warp can hash one input and no more: with one warp per tensor, a
 * 778 MB tensor (Qwen3-4B's embedding) took 1.5 s on an H100 and held the
 * whole set's scrub to it. Cut into leaves of a fixed size, every leaf is
 * an input of its own: the leaves of all ranges together fill the device,
 * and what stays serial is the root pass over 16 bytes per leaf.
 *
 * Two kernels on one stream. The host side lists the leaves of all ranges
 * in one flat array of (offset, length) pairs: a range of at most
 * leaf_bytes is one leaf (its digest is the range's), a longer one its
 * leaves in order, so each range's leaves are a contiguous run. The leaf
 * kernel hashes one leaf per warp into a device array of canonical leaf
 * digests; the root kernel then takes one range per warp: a one-leaf range
 * copies its leaf's digest, a longer one hashes its run of leaf digests
 * (contiguous in that array) into its digest. The digests come back with
 * one copy and one synchronize.
 *
 * Within a warp (both kernels): an input of at most 240 bytes is hashed by
 * the warp's first thread (xxh3_128_with over global memory). A longer one
 * is hashed by all 32: thread t owns accumulator lane t % 8 and stripes
 * t / 8, t / 8 + 4, ... of each 1024-byte block; the partner word a lane
 * needs (its stripe's word lane ^ 1) comes from the neighbouring thread
 * (__shfl_xor_sync 1), and each block's four partial sums of a lane are
 * added across the warp (__shfl_xor_sync 8 and 16) before the lane's
 * scramble, so every thread of a lane holds the same accumulator. The
 * secret sits in shared memory.
 *
 * Memory: the leaf list, the runs, the leaf digests and the range digests
 * are one cudaMalloc of 32 bytes per leaf and per range (some 12 MiB for a
 * 94 GiB set's ~385k leaves), plain cudaMalloc since stream-ordered pools
 * are not on every device (MIG instances, older drivers); out of memory is
 * an error for the caller, never an abort.
 *
 * Who runs it: the cuda backend's slab_hash, on a daemon job thread (the
 * scrub worker, or a load's job once its copies are done), synchronously
 * on a stream of its own.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "slab_hash_cuda.h"
#include "xxh3.h"

#define WARPS_PER_BLOCK 4
/* Grids are at most this many blocks; their warps stride over the rest (a grid's size has a limit). */
#define MAX_BLOCKS 65535u

__constant__ unsigned char xxh3_secret_dev[XXH3_SECRET_BYTES] = XXH3_SECRET_INIT;

/* A little-endian 64-bit word at any address: one load when aligned. */
static __device__ __forceinline__ uint64_t load64(const unsigned char *p) {
  if (((uintptr_t)p & 7u) == 0) return *(const uint64_t *)p;
  return xxh3_read64(p);
}

/* The sum over the warp's four stripe groups of one lane (threads t, t^8, t^16, t^24). */
static __device__ __forceinline__ uint64_t group_sum(uint64_t v) {
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  return v;
}

/* Stripes [first, end) of one block (end - first <= 16) summed for this thread's lane, across the warp. */
static __device__ __forceinline__ uint64_t stripes_sum(const unsigned char *blk, unsigned first, unsigned end,
                                                       unsigned lane, unsigned grp, const unsigned char *k) {
  uint64_t sum = 0;
  for (unsigned base = first; base < end; base += 4) {
    unsigned s = base + grp;
    bool in = s < end;
    uint64_t own = in ? load64(blk + 64 * s + 8 * lane) : 0;
    uint64_t mate = __shfl_xor_sync(0xffffffffu, own, 1);
    if (in) sum += xxh3_lane_term(own, mate, xxh3_read64(k + 8 * s + 8 * lane));
  }
  return group_sum(sum);
}

/*
 * The XXH3-128 digest of p[0..len), canonical, written to out by thread 0
 * of the calling warp; every thread of the warp calls it with the same
 * arguments (t: the thread's index in the warp; k: the secret).
 */
static __device__ void warp_xxh3(const unsigned char *p, uint64_t len, const unsigned char *k, unsigned t,
                                 unsigned char *out) {
  unsigned lane = t % 8, grp = t / 8;
  if (len <= 240) {
    if (t == 0) xxh3_canonical(xxh3_128_with(p, len, k), out);
    return;
  }
  uint64_t acc = xxh3_lane_init(lane);
  uint64_t blocks = xxh3_full_blocks(len);
  uint64_t scramble_key = xxh3_read64(k + XXH3_SCRAMBLE_KEY + 8 * lane);
  for (uint64_t b = 0; b < blocks; b++) {
    acc += stripes_sum(p + b * XXH3_BLOCK, 0, XXH3_STRIPES_PER_BLOCK, lane, grp, k);
    acc = xxh3_lane_scramble(acc, scramble_key);
  }
  unsigned stripes = (unsigned)((len - blocks * XXH3_BLOCK - 1) / XXH3_STRIPE);
  acc += stripes_sum(p + blocks * XXH3_BLOCK, 0, stripes, lane, grp, k);
  const unsigned char *end = p + len - XXH3_STRIPE;
  acc += xxh3_lane_term(load64(end + 8 * lane), load64(end + 8 * (lane ^ 1)),
                        xxh3_read64(k + XXH3_LAST_STRIPE_KEY + 8 * lane));
  uint64_t lanes[8];
  for (unsigned i = 0; i < 8; i++) lanes[i] = __shfl_sync(0xffffffffu, acc, i);
  if (t == 0) xxh3_canonical(xxh3_merge(lanes, len, k), out);
}

/* The secret from constant into shared memory, for the whole block. */
static __device__ __forceinline__ void secret_load(unsigned char *k) {
  for (unsigned i = threadIdx.x; i < XXH3_SECRET_BYTES; i += blockDim.x) k[i] = xxh3_secret_dev[i];
  __syncthreads();
}

/* Leaf i's digest (leaves[2i] its offset from base, leaves[2i+1] its length) into digests[16i, 16i + 16). */
__global__ void xxh3_leaf_kernel(const unsigned char *base, const uint64_t *leaves, size_t nleaves,
                                 unsigned char *digests) {
  __shared__ unsigned char k[XXH3_SECRET_BYTES];
  secret_load(k);
  size_t stride = (size_t)gridDim.x * WARPS_PER_BLOCK;
  /* The loop's bound is the same for the whole warp: no shuffle misses a thread. */
  for (size_t i = (size_t)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32; i < nleaves; i += stride) {
    warp_xxh3(base + leaves[2 * i], leaves[2 * i + 1], k, threadIdx.x % 32, digests + 16 * i);
    __syncwarp(); /* a short leaf ran on thread 0 alone: the warp meets again before the next one */
  }
}

/*
 * Range r's digest into out[16r, 16r + 16) from its run of leaf digests
 * (runs[2r] the first leaf, runs[2r+1] how many): the leaf's own when one,
 * else XXH3-128 of the run's bytes.
 */
__global__ void xxh3_root_kernel(const uint64_t *runs, size_t n, const unsigned char *digests, unsigned char *out) {
  __shared__ unsigned char k[XXH3_SECRET_BYTES];
  secret_load(k);
  size_t stride = (size_t)gridDim.x * WARPS_PER_BLOCK;
  unsigned t = threadIdx.x % 32;
  for (size_t r = (size_t)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32; r < n; r += stride) {
    const unsigned char *run = digests + 16 * runs[2 * r];
    uint64_t count = runs[2 * r + 1];
    if (count == 1) {
      if (t < 16) out[16 * r + t] = run[t];
    } else {
      warp_xxh3(run, 16 * count, k, t, out + 16 * r);
    }
    __syncwarp();
  }
}

static unsigned grid_for(size_t warps) {
  size_t blocks = (warps + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
  return blocks > MAX_BLOCKS ? MAX_BLOCKS : (unsigned)blocks;
}

extern "C" cudaError_t xxh3_cuda_tree(const void *base, const uint64_t *offs, size_t n, uint64_t leaf_bytes,
                                      unsigned char *out, cudaStream_t s, char *what, size_t what_len) {
  if (what_len > 0) what[0] = '\0';
  if (n == 0) return cudaSuccess;
  if (leaf_bytes == 0) {
    snprintf(what, what_len, "the digest kernels' leaf size (0)");
    return cudaErrorInvalidValue;
  }
  size_t nleaves = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t len = offs[2 * i + 1];
    nleaves += len <= leaf_bytes ? 1 : (size_t)((len + leaf_bytes - 1) / leaf_bytes);
  }
  /* One host list (leaves, then runs) goes over in one copy; the device buffer adds both kinds of digests. */
  size_t list_bytes = 16 * (nleaves + n), dev_bytes = 2 * list_bytes;
  uint64_t *list = (uint64_t *)malloc(list_bytes);
  if (list == NULL) {
    snprintf(what, what_len, "host memory for the digest kernels' list of %zu leaves", nleaves);
    return cudaErrorMemoryAllocation;
  }
  uint64_t *leaves = list, *runs = list + 2 * nleaves;
  for (size_t i = 0, j = 0; i < n; i++) {
    uint64_t off = offs[2 * i], len = offs[2 * i + 1];
    runs[2 * i] = j;
    do {
      uint64_t k = len < leaf_bytes ? len : leaf_bytes;
      leaves[2 * j] = off;
      leaves[2 * j + 1] = k;
      j++;
      off += k;
      len -= k;
    } while (len > 0);
    runs[2 * i + 1] = j - runs[2 * i];
  }
  unsigned char *dev = NULL;
  cudaError_t e = cudaMalloc((void **)&dev, dev_bytes);
  if (e != cudaSuccess) {
    snprintf(what, what_len, "cudaMalloc of %zu bytes for the digest kernels (%zu leaves, %zu ranges)", dev_bytes,
             nleaves, n);
    free(list);
    return e;
  }
  uint64_t *d_leaves = (uint64_t *)dev, *d_runs = d_leaves + 2 * nleaves;
  unsigned char *d_leaf_digests = dev + list_bytes, *d_out = d_leaf_digests + 16 * nleaves;
  e = cudaMemcpyAsync(dev, list, list_bytes, cudaMemcpyHostToDevice, s);
  if (e != cudaSuccess) snprintf(what, what_len, "copying the digest kernels' leaf list to the device");
  if (e == cudaSuccess) {
    xxh3_leaf_kernel<<<grid_for(nleaves), 32 * WARPS_PER_BLOCK, 0, s>>>((const unsigned char *)base, d_leaves,
                                                                       nleaves, d_leaf_digests);
    if ((e = cudaGetLastError()) != cudaSuccess)
      snprintf(what, what_len, "the leaf digest kernel (%zu leaves)", nleaves);
  }
  if (e == cudaSuccess) {
    xxh3_root_kernel<<<grid_for(n), 32 * WARPS_PER_BLOCK, 0, s>>>(d_runs, n, d_leaf_digests, d_out);
    if ((e = cudaGetLastError()) != cudaSuccess) snprintf(what, what_len, "the root digest kernel (%zu ranges)", n);
  }
  if (e == cudaSuccess && (e = cudaMemcpyAsync(out, d_out, 16 * n, cudaMemcpyDeviceToHost, s)) != cudaSuccess)
    snprintf(what, what_len, "copying the digests back from the device");
  cudaError_t g = cudaStreamSynchronize(s);
  if (e == cudaSuccess && g != cudaSuccess)
    snprintf(what, what_len, "the digest kernels (%zu leaves, %zu ranges), at the synchronize", nleaves, n);
  cudaFree(dev);
  free(list);
  return e != cudaSuccess ? e : g;
}
