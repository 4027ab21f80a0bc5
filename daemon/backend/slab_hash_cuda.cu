/*
 * slab_hash_cuda.cu - XXH3-128 of ranges of device memory, bit-exact with
 * libxxhash (the algorithm is xxh3.h's; this file spreads it over a GPU).
 *
 * One warp hashes one range. A range of at most 240 bytes is hashed by the
 * warp's first thread (xxh3_128_with over global memory). A longer one is
 * hashed by all 32: thread t owns accumulator lane t % 8 and stripes
 * t / 8, t / 8 + 4, ... of each 1024-byte block; the partner word a lane
 * needs (its stripe's word lane ^ 1) comes from the neighbouring thread
 * (__shfl_xor_sync 1), and each block's four partial sums of a lane are
 * added across the warp (__shfl_xor_sync 8 and 16) before the lane's
 * scramble, so every thread of a lane holds the same accumulator. The
 * blocks of one range follow one another (XXH3's scramble is a chain), so
 * one range runs at the speed one warp can read; many ranges (a set's
 * tensors) fill the device. The secret sits in shared memory.
 *
 * Who runs it: the cuda backend's slab_hash, on a daemon job thread (the
 * scrub worker, or a load's job once its copies are done), synchronously
 * on a stream of its own.
 */
#include <stdint.h>

#include "slab_hash_cuda.h"
#include "xxh3.h"

#define WARPS_PER_BLOCK 4

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

__global__ void xxh3_ranges_kernel(const unsigned char *base, const uint64_t *offs, size_t n, unsigned char *out) {
  __shared__ unsigned char k[XXH3_SECRET_BYTES];
  for (unsigned i = threadIdx.x; i < XXH3_SECRET_BYTES; i += blockDim.x) k[i] = xxh3_secret_dev[i];
  __syncthreads();
  size_t r = (size_t)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32;
  if (r >= n) return; /* the whole warp leaves together: no shuffle misses a thread */
  unsigned t = threadIdx.x % 32, lane = t % 8, grp = t / 8;
  const unsigned char *p = base + offs[2 * r];
  uint64_t len = offs[2 * r + 1];
  if (len <= 240) {
    if (t == 0) xxh3_canonical(xxh3_128_with(p, len, k), out + 16 * r);
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
  if (t == 0) xxh3_canonical(xxh3_merge(lanes, len, k), out + 16 * r);
}

extern "C" cudaError_t xxh3_cuda_ranges(const void *base, const uint64_t *offs, size_t n, unsigned char *out,
                                        cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  uint64_t *d_offs = NULL;
  unsigned char *d_out = NULL;
  /* Plain cudaMalloc: stream-ordered pools are not on every device (MIG instances, older drivers). */
  cudaError_t e = cudaMalloc((void **)&d_offs, n * 2 * sizeof *d_offs);
  if (e == cudaSuccess) e = cudaMalloc((void **)&d_out, n * 16);
  if (e == cudaSuccess) e = cudaMemcpyAsync(d_offs, offs, n * 2 * sizeof *d_offs, cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) {
    size_t blocks = (n + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
    xxh3_ranges_kernel<<<(unsigned)blocks, 32 * WARPS_PER_BLOCK, 0, s>>>((const unsigned char *)base, d_offs, n,
                                                                         d_out);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpyAsync(out, d_out, n * 16, cudaMemcpyDeviceToHost, s);
  cudaError_t g = cudaStreamSynchronize(s);
  cudaFree(d_out); /* NULL-safe */
  cudaFree(d_offs);
  return e != cudaSuccess ? e : g;
}
