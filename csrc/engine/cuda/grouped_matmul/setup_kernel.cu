// The setup kernel of each grouped GEMM: the group table and the zero fill (setup_kernel.cuh).
#include "engine/cuda/grouped_matmul/setup_kernel.cuh"

#include "engine/cuda/grouped_matmul/group_scan.cuh"

namespace nodrop::cuda::detail {
namespace {

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

// Block 0 builds the table: scan_groups gives every group its clamped rows.
template <GemmForm F>
__device__ void build_group_table(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K,
                                  int64_t N, const Operands& ops, const GroupTable& table,
                                  GroupScanStorage& scan_storage) {
  if (threadIdx.x == 0) table.offsets[0] = 0;
  scan_groups(group_sizes, table.num_groups, M, scan_storage,
              [&](int64_t g, int64_t begin, int64_t end, int64_t /*first_block*/) {
                table.offsets[g + 1] = end;
                write_group<F>(table, g, begin, end - begin, K, N, ops);
              });
}

// One launch per grouped GEMM: block 0 builds the table, the other blocks zero the outputs that
// no GEMM tile writes (rows past the groups, or the weight gradient of an empty group). Every
// fill block reads the group sizes itself, so no block waits for another.
template <GemmForm F>
__global__ void __launch_bounds__(kSetupThreads)
    prepare_grouped_gemm(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K, int64_t N,
                         Operands ops, GroupTable table) {
  __shared__ union {
    GroupScanStorage scan;
    typename SizeSum::TempStorage sum;
  } storage;
  if (blockIdx.x == 0) {
    build_group_table<F>(group_sizes, M, K, N, ops, table, storage.scan);
    return;
  }
  const int64_t fill = blockIdx.x - 1, fills = gridDim.x - 1;
  if constexpr (F == GemmForm::kContract) {
    zero_empty_groups(group_sizes, M, K, N, ops.out, ops.out_size, table.num_groups, fill, fills,
                      storage.sum);
  } else {
    zero_tail_rows(group_sizes, M, N, ops.out, ops.out_size, table.num_groups, fill, fills,
                   storage.sum);
  }
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
