// Device code that every kernel reading group sizes shares (the bf16 and FP8 setup kernels, the
// FP8 weight-gradient quantiser): the clamped group offsets, the FP8 contraction's block numbering
// (engine.h), and the zero fills of what no GEMM tile writes. Included by .cu files only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "nodrop/engine.h"

namespace nodrop::cuda::detail {

constexpr int kSetupThreads = 256;
// Every zeroed region starts and ends on a multiple of 16 bytes (N % 8 == 0 for 2-byte outputs).
constexpr int64_t kVectorBytes = 16;

using SizeScan = cub::BlockScan<int64_t, kSetupThreads>;
using SizeSum = cub::BlockReduce<int64_t, kSetupThreads>;

struct GroupScanStorage {
  typename SizeScan::TempStorage rows;
  typename SizeScan::TempStorage blocks;
};

// Calls fn(g, begin, end, first_block) for each group of this thread's run of consecutive groups,
// all groups being covered once by a block of kSetupThreads threads (which must all call it).
// [begin, end) are the group's rows clamped as clamp_group_offsets does: min(M, sum of max(0,
// size) before it) equals the running total clamped at M step by step, because the sizes added
// are never negative. first_block numbers the group's first 128-row block as engine.h says.
template <typename Fn>
__device__ void scan_groups(const int32_t* __restrict__ group_sizes, int64_t G, int64_t M,
                            GroupScanStorage& storage, Fn fn) {
  const int64_t per_thread = (G + kSetupThreads - 1) / kSetupThreads;
  const int64_t first = min(G, int64_t(threadIdx.x) * per_thread);
  const int64_t last = min(G, first + per_thread);
  int64_t run_rows = 0;
  for (int64_t g = first; g < last; ++g) run_rows += max(group_sizes[g], 0);
  int64_t rows_before = 0;
  SizeScan(storage.rows).ExclusiveSum(run_rows, rows_before);
  // The run's blocks, from its clamped rows.
  int64_t run_blocks = 0;
  for (int64_t g = first, total = rows_before; g < last; ++g) {
    const int64_t begin = min(M, total);
    total += max(group_sizes[g], 0);
    run_blocks += (min(M, total) - begin + kFp8Block - 1) / kFp8Block;
  }
  int64_t blocks_before = 0;
  SizeScan(storage.blocks).ExclusiveSum(run_blocks, blocks_before);
  for (int64_t g = first; g < last; ++g) {
    const int64_t begin = min(M, rows_before);
    rows_before += max(group_sizes[g], 0);
    const int64_t end = min(M, rows_before);
    fn(g, begin, end, blocks_before);
    blocks_before += (end - begin + kFp8Block - 1) / kFp8Block;
  }
}

// Sum of max(0, group_sizes[g]) over g in [0, end), known to every thread of the block.
__device__ inline int64_t rows_before(const int32_t* __restrict__ group_sizes, int64_t end,
                                      typename SizeSum::TempStorage& sum_storage) {
  int64_t partial = 0;
  for (int64_t g = threadIdx.x; g < end; g += kSetupThreads) partial += max(group_sizes[g], 0);
  __shared__ int64_t total;
  const int64_t block_total = SizeSum(sum_storage).Sum(partial);
  if (threadIdx.x == 0) total = block_total;
  __syncthreads();
  return total;
}

// Fill block `fill` of `fills`: zeroes its share of rows [min(M, total rows), M) of out [M, N]
// (elements of out_size bytes), which no group owns.
__device__ inline void zero_tail_rows(const int32_t* __restrict__ group_sizes, int64_t M,
                                      int64_t N, void* out, int64_t out_size, int64_t G,
                                      int64_t fill, int64_t fills,
                                      typename SizeSum::TempStorage& sum_storage) {
  const int64_t row_vectors = N * out_size / kVectorBytes;
  const int64_t begin = min(M, rows_before(group_sizes, G, sum_storage)) * row_vectors;
  const int64_t end = M * row_vectors;
  uint4* vectors = static_cast<uint4*>(out);
  const int64_t step = fills * kSetupThreads;
  for (int64_t i = begin + fill * kSetupThreads + threadIdx.x; i < end; i += step) {
    vectors[i] = make_uint4(0, 0, 0, 0);
  }
}

// Fill block `fill` of `fills`: zeroes out[g] [K, N] of every group without rows within its
// contiguous share of out [G, K, N]. CUTLASS 4.2 cannot run a GEMM with K = 0, so the setup
// kernels give such groups no tiles at all.
__device__ inline void zero_empty_groups(const int32_t* __restrict__ group_sizes, int64_t M,
                                         int64_t K, int64_t N, void* out, int64_t out_size,
                                         int64_t G, int64_t fill, int64_t fills,
                                         typename SizeSum::TempStorage& sum_storage) {
  const int64_t group_vectors = K * N * out_size / kVectorBytes;
  const int64_t all_vectors = G * group_vectors;
  const int64_t share = (all_vectors + fills - 1) / fills;
  const int64_t lo = fill * share;
  const int64_t hi = min(all_vectors, lo + share);
  if (lo >= hi) return;  // the whole block: lo and hi do not depend on the thread
  uint4* vectors = static_cast<uint4*>(out);
  int64_t g = lo / group_vectors;
  int64_t begin = rows_before(group_sizes, g, sum_storage);  // unclamped: empty once past M
  for (; g * group_vectors < hi; ++g) {
    const int64_t rows = max(group_sizes[g], 0);
    const bool empty = rows == 0 || begin >= M;
    begin += rows;
    if (!empty) continue;
    const int64_t to = min(hi, (g + 1) * group_vectors);
    for (int64_t i = max(lo, g * group_vectors) + threadIdx.x; i < to; i += kSetupThreads) {
      vectors[i] = make_uint4(0, 0, 0, 0);
    }
  }
}

// Blocks of kSetupThreads threads that cover `bytes` with one 16-byte store per thread, at most
// `cap`, at least 1.
inline unsigned fill_blocks(int64_t bytes, int64_t cap) {
  const int64_t per_block = kSetupThreads * kVectorBytes;
  const int64_t blocks = (bytes + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

}  // namespace nodrop::cuda::detail
