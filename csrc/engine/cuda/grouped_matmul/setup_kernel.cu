// The setup kernel of each grouped GEMM: the group table and the zero fill (setup_kernel.cuh).
#include "engine/cuda/grouped_matmul/setup_kernel.cuh"

#include <algorithm>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace nodrop::cuda::detail {
namespace {

constexpr int kSetupThreads = 256;
// Every zeroed region starts and ends on a multiple of 16 bytes (N % 8 == 0).
constexpr int64_t kVectorBytes = 16;

// One group's GEMM: its shape, operand pointers and strides, for form F.
template <GemmForm F>
__device__ void write_group(const GroupTable& t, int64_t g, int64_t begin, int64_t rows, int64_t K,
                            int64_t N, const Operands& ops) {
  using Strides = FormStrides<F>;
  const char* lhs = static_cast<const char*>(ops.lhs);
  const char* rhs = static_cast<const char*>(ops.rhs);
  char* out = static_cast<char*>(ops.out);
  auto* stride_a = static_cast<typename Strides::A*>(t.stride_a);
  auto* stride_b = static_cast<typename Strides::B*>(t.stride_b);
  auto* stride_d = static_cast<typename Strides::D*>(t.stride_d);
  if constexpr (F == GemmForm::kContract) {
    // An empty group gets M = 0, hence no tiles: zero_empty_groups writes its output.
    t.shapes[g] = cute::make_shape(int(rows > 0 ? K : 0), int(N), int(rows));
    t.ptr_a[g] = lhs + begin * K * ops.in_size;  // lhs_g^T: (k, r) at (begin + r) * K + k
    t.ptr_b[g] = rhs + begin * N * ops.in_size;  // rhs_g:   (n, r) at (begin + r) * N + n
    t.ptr_d[g] = out + g * K * N * ops.out_size;
    stride_a[g] = cute::make_stride(cute::_1{}, K, cute::_0{});
    stride_b[g] = cute::make_stride(cute::_1{}, N, cute::_0{});
  } else {
    t.shapes[g] = cute::make_shape(int(rows), int(N), int(K));
    t.ptr_a[g] = lhs + begin * K * ops.in_size;
    t.ptr_b[g] = rhs + g * K * N * ops.in_size;
    t.ptr_d[g] = out + begin * N * ops.out_size;
    stride_a[g] = cute::make_stride(K, cute::_1{}, cute::_0{});
    if constexpr (F == GemmForm::kRows) {  // rhs[g] [K, N]: (n, k) at k * N + n
      stride_b[g] = cute::make_stride(cute::_1{}, N, cute::_0{});
    } else {  // rhs[g] [N, K]: (n, k) at n * K + k
      stride_b[g] = cute::make_stride(K, cute::_1{}, cute::_0{});
    }
  }
  stride_d[g] = cute::make_stride(N, cute::_1{}, cute::_0{});
}

using SizeScan = cub::BlockScan<int64_t, kSetupThreads>;
using SizeSum = cub::BlockReduce<int64_t, kSetupThreads>;

// Block 0 builds the table. Each thread takes a run of consecutive groups; one block-wide scan of
// the run totals gives every group its clamped offset: min(M, sum of max(0, size) before it)
// equals the running total clamped at M step by step, because the sizes added are never negative.
template <GemmForm F>
__device__ void build_group_table(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K,
                                  int64_t N, const Operands& ops, const GroupTable& table,
                                  typename SizeScan::TempStorage& scan_storage) {
  const int64_t G = table.num_groups;
  const int64_t per_thread = (G + kSetupThreads - 1) / kSetupThreads;
  const int64_t first = min(G, int64_t(threadIdx.x) * per_thread);
  const int64_t last = min(G, first + per_thread);
  int64_t run_total = 0;
  for (int64_t g = first; g < last; ++g) run_total += max(group_sizes[g], 0);
  int64_t total_before = 0;
  SizeScan(scan_storage).ExclusiveSum(run_total, total_before);
  if (threadIdx.x == 0) table.offsets[0] = 0;
  for (int64_t g = first; g < last; ++g) {
    const int64_t begin = min(M, total_before);
    total_before += max(group_sizes[g], 0);
    const int64_t end = min(M, total_before);
    table.offsets[g + 1] = end;
    write_group<F>(table, g, begin, end - begin, K, N, ops);
  }
}

// Sum of max(0, group_sizes[g]) over g in [0, end), known to every thread of the block.
__device__ int64_t rows_before(const int32_t* __restrict__ group_sizes, int64_t end,
                               typename SizeSum::TempStorage& sum_storage) {
  int64_t partial = 0;
  for (int64_t g = threadIdx.x; g < end; g += kSetupThreads) partial += max(group_sizes[g], 0);
  __shared__ int64_t total;
  const int64_t block_total = SizeSum(sum_storage).Sum(partial);
  if (threadIdx.x == 0) total = block_total;
  __syncthreads();
  return total;
}

// Fill block `fill` of `fills`: zeroes its share of rows [min(M, total rows), M) of out
// [M, N], which no group owns.
__device__ void zero_tail_rows(const int32_t* __restrict__ group_sizes, int64_t M, int64_t N,
                               const Operands& ops, int64_t G, int64_t fill, int64_t fills,
                               typename SizeSum::TempStorage& sum_storage) {
  const int64_t row_vectors = N * ops.out_size / kVectorBytes;
  const int64_t begin = min(M, rows_before(group_sizes, G, sum_storage)) * row_vectors;
  const int64_t end = M * row_vectors;
  uint4* vectors = static_cast<uint4*>(ops.out);
  const int64_t step = fills * kSetupThreads;
  for (int64_t i = begin + fill * kSetupThreads + threadIdx.x; i < end; i += step) {
    vectors[i] = make_uint4(0, 0, 0, 0);
  }
}

// Fill block `fill` of `fills`: zeroes out[g] [K, N] of every group without rows within its
// contiguous share of out [G, K, N]. CUTLASS 4.2 cannot run a GEMM with K = 0, so the table
// gives such groups no tiles at all.
__device__ void zero_empty_groups(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K,
                                  int64_t N, const Operands& ops, int64_t G, int64_t fill,
                                  int64_t fills, typename SizeSum::TempStorage& sum_storage) {
  const int64_t group_vectors = K * N * ops.out_size / kVectorBytes;
  const int64_t all_vectors = G * group_vectors;
  const int64_t share = (all_vectors + fills - 1) / fills;
  const int64_t lo = fill * share;
  const int64_t hi = min(all_vectors, lo + share);
  if (lo >= hi) return;  // the whole block: lo and hi do not depend on the thread
  uint4* vectors = static_cast<uint4*>(ops.out);
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

// One launch per grouped GEMM: block 0 builds the table, the other blocks zero the outputs that
// no GEMM tile writes (rows past the groups, or the weight gradient of an empty group). Every
// fill block reads the group sizes itself, so no block waits for another.
template <GemmForm F>
__global__ void __launch_bounds__(kSetupThreads)
    prepare_grouped_gemm(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K, int64_t N,
                         Operands ops, GroupTable table) {
  __shared__ union {
    typename SizeScan::TempStorage scan;
    typename SizeSum::TempStorage sum;
  } storage;
  if (blockIdx.x == 0) {
    build_group_table<F>(group_sizes, M, K, N, ops, table, storage.scan);
    return;
  }
  const int64_t fill = blockIdx.x - 1, fills = gridDim.x - 1;
  if constexpr (F == GemmForm::kContract) {
    zero_empty_groups(group_sizes, M, K, N, ops, table.num_groups, fill, fills, storage.sum);
  } else {
    zero_tail_rows(group_sizes, M, N, ops, table.num_groups, fill, fills, storage.sum);
  }
}

// Enough blocks to cover `bytes` with one 16-byte store per thread, at most `cap`.
unsigned fill_blocks(int64_t bytes, int64_t cap) {
  const int64_t per_block = kSetupThreads * kVectorBytes;
  return static_cast<unsigned>(std::clamp<int64_t>((bytes + per_block - 1) / per_block, 1, cap));
}

}  // namespace

cudaError_t launch_prepare_grouped_gemm(GemmForm form, const int32_t* group_sizes, int64_t M,
                                        int64_t K, int64_t N, const Operands& ops,
                                        const GroupTable& table, cudaStream_t stream) {
  // The bytes the fill blocks may have to zero: every row of out, or every group's [K, N].
  const int64_t out_bytes =
      (form == GemmForm::kContract ? table.num_groups * K : M) * N * ops.out_size;
  const unsigned blocks = 1 + fill_blocks(out_bytes, 4 * int64_t(table.sm_count));
  switch (form) {
    case GemmForm::kRows:
      prepare_grouped_gemm<GemmForm::kRows>
          <<<blocks, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
    case GemmForm::kRowsTransposed:
      prepare_grouped_gemm<GemmForm::kRowsTransposed>
          <<<blocks, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
    case GemmForm::kContract:
      prepare_grouped_gemm<GemmForm::kContract>
          <<<blocks, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
  }
  return cudaGetLastError();
}

}  // namespace nodrop::cuda::detail
