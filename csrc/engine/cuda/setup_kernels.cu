// Group-table setup and zero-fill kernels (see setup_kernels.cuh).
#include "engine/cuda/setup_kernels.cuh"

#include <algorithm>

#include <cub/block/block_scan.cuh>

namespace nodrop::cuda::detail {
namespace {

constexpr int kSetupThreads = 1024;
constexpr int kFillThreads = 256;
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

// Each thread takes a run of consecutive groups; one block-wide scan of the run totals gives
// every group its clamped offset: min(M, sum of max(0, size) before it) equals the running
// total clamped at M step by step, because the sizes added are never negative.
template <GemmForm F>
__global__ void __launch_bounds__(kSetupThreads)
    build_group_table(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K, int64_t N,
                      Operands ops, GroupTable table) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int64_t G = table.num_groups;
  const int64_t per_thread = (G + kSetupThreads - 1) / kSetupThreads;
  const int64_t first = min(G, int64_t(threadIdx.x) * per_thread);
  const int64_t last = min(G, first + per_thread);
  int64_t run_total = 0;
  for (int64_t g = first; g < last; ++g) run_total += max(group_sizes[g], 0);
  int64_t total_before = 0;
  Scan(scan_storage).ExclusiveSum(run_total, total_before);
  if (threadIdx.x == 0) table.offsets[0] = 0;
  for (int64_t g = first; g < last; ++g) {
    const int64_t begin = min(M, total_before);
    total_before += max(group_sizes[g], 0);
    const int64_t end = min(M, total_before);
    table.offsets[g + 1] = end;
    write_group<F>(table, g, begin, end - begin, K, N, ops);
  }
}

__global__ void __launch_bounds__(kFillThreads)
    zero_tail_rows(const int64_t* __restrict__ rows_used, int64_t M, int64_t row_bytes, char* out) {
  const int64_t begin = *rows_used * row_bytes / kVectorBytes;
  const int64_t end = M * row_bytes / kVectorBytes;
  uint4* vectors = reinterpret_cast<uint4*>(out);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * blockDim.x + threadIdx.x; i < end; i += step) {
    vectors[i] = make_uint4(0, 0, 0, 0);
  }
}

// blockIdx.x is the group; blockIdx.y splits its output.
__global__ void __launch_bounds__(kFillThreads)
    zero_empty_groups(const int64_t* __restrict__ offsets, int64_t group_bytes, char* out) {
  const int64_t g = blockIdx.x;
  if (offsets[g + 1] != offsets[g]) return;
  uint4* vectors = reinterpret_cast<uint4*>(out + g * group_bytes);
  const int64_t count = group_bytes / kVectorBytes;
  const int64_t step = int64_t(gridDim.y) * blockDim.x;
  for (int64_t i = blockIdx.y * blockDim.x + threadIdx.x; i < count; i += step) {
    vectors[i] = make_uint4(0, 0, 0, 0);
  }
}

// Enough blocks to cover `bytes` with one 16-byte store per thread, at most `cap`.
unsigned fill_blocks(int64_t bytes, int64_t cap) {
  const int64_t per_block = kFillThreads * kVectorBytes;
  return static_cast<unsigned>(std::clamp<int64_t>((bytes + per_block - 1) / per_block, 1, cap));
}

}  // namespace

cudaError_t launch_build_group_table(GemmForm form, const int32_t* group_sizes, int64_t M,
                                     int64_t K, int64_t N, const Operands& ops,
                                     const GroupTable& table, cudaStream_t stream) {
  switch (form) {
    case GemmForm::kRows:
      build_group_table<GemmForm::kRows>
          <<<1, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
    case GemmForm::kRowsTransposed:
      build_group_table<GemmForm::kRowsTransposed>
          <<<1, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
    case GemmForm::kContract:
      build_group_table<GemmForm::kContract>
          <<<1, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
  }
  return cudaGetLastError();
}

cudaError_t launch_zero_tail_rows(const GroupTable& table, int64_t M, int64_t row_bytes, void* out,
                                  cudaStream_t stream) {
  const unsigned blocks = fill_blocks(M * row_bytes, 4 * int64_t(table.sm_count));
  zero_tail_rows<<<blocks, kFillThreads, 0, stream>>>(table.offsets + table.num_groups, M,
                                                      row_bytes, static_cast<char*>(out));
  return cudaGetLastError();
}

cudaError_t launch_zero_empty_groups(const GroupTable& table, int64_t group_bytes, void* out,
                                     cudaStream_t stream) {
  const dim3 grid(table.num_groups, fill_blocks(group_bytes, 64));
  zero_empty_groups<<<grid, kFillThreads, 0, stream>>>(table.offsets, group_bytes,
                                                       static_cast<char*>(out));
  return cudaGetLastError();
}

}  // namespace nodrop::cuda::detail
