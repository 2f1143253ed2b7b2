// CUDA FP8 blockwise-scaled grouped matmul, ragged rows (fp8_blockwise.cuh says what it computes
// and the scale layouts): argument checks, workspace layout, the setup kernel that builds the
// group table from the group sizes on the device, and the two launches of a call (setup kernel,
// then the CUTLASS kernel of the call's tile, fp8_blockwise_gemm.cuh), all on the caller's stream.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "engine/cuda/grouped_matmul/fp8_blockwise.cuh"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace detail {
namespace {

constexpr int kSetupThreads = 256;
constexpr int64_t kVectorBytes = 16;  // zero fill: N % 8 == 0 makes a bf16 row whole vectors
constexpr int64_t kOutBytes = 2;      // bfloat16

int64_t scale_blocks(int64_t extent) { return (extent + kFp8ScaleBlock - 1) / kFp8ScaleBlock; }

// One group's GEMM: shape, operand and scale pointers, strides and scale layouts.
__device__ void write_fp8_group(const Fp8GroupTable& t, int64_t g, int64_t begin, int64_t rows,
                                int64_t K, int64_t N, const Fp8Operands& ops) {
  const int64_t KB = (K + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const int64_t NB = (N + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const auto* lhs = static_cast<const uint8_t*>(ops.lhs);  // one byte per E4M3 element
  const auto* rhs = static_cast<const uint8_t*>(ops.rhs);
  auto* out = static_cast<char*>(ops.out);
  // An empty group gets M_g = 0, hence no tiles.
  t.shapes[g] = cute::make_shape(int(rows), int(N), int(K));
  t.ptr_a[g] = lhs + begin * K;      // lhs_g [M_g, K]
  t.ptr_b[g] = rhs + g * N * K;      // rhs[g] [N, K]
  t.ptr_d[g] = out + begin * N * kOutBytes;  // out_g [M_g, N]
  t.ptr_sfa[g] = ops.lhs_scales + begin * KB;   // lhs_scales[begin:, :] [M_g, KB]
  t.ptr_sfb[g] = ops.rhs_scales + g * NB * KB;  // rhs_scales[g] [NB, KB]
  t.stride_a[g] = cute::make_stride(K, cute::_1{}, cute::_0{});
  t.stride_b[g] = cute::make_stride(K, cute::_1{}, cute::_0{});
  t.stride_d[g] = cute::make_stride(N, cute::_1{}, cute::_0{});
  // The packed K-major layouts of the group's scales, as example 68 builds them on the host:
  // (row, kb) at row * KB + kb for A, (n / 128, kb) at (n / 128) * KB + kb for B.
  const auto problem = cute::make_shape(int(rows), int(N), int(K), 1);
  t.layout_sfa[g] = Fp8ScaleConfig::tile_atom_to_shape_SFA(problem);
  t.layout_sfb[g] = Fp8ScaleConfig::tile_atom_to_shape_SFB(problem);
}

using SizeScan = cub::BlockScan<int64_t, kSetupThreads>;
using SizeSum = cub::BlockReduce<int64_t, kSetupThreads>;

// Block 0 builds the table, as build_group_table in setup_kernel.cu: each thread takes a run of
// consecutive groups, one block-wide scan of the run totals gives each group its clamped offset.
__device__ void build_fp8_table(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K,
                                int64_t N, const Fp8Operands& ops, const Fp8GroupTable& table,
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
    write_fp8_group(table, g, begin, end - begin, K, N, ops);
  }
}

// Fill block `fill` of `fills`: zeroes its share of rows [min(M, total rows), M) of out [M, N],
// which no group owns (the bf16 path's zero_tail_rows).
__device__ void zero_fp8_tail_rows(const int32_t* __restrict__ group_sizes, int64_t M, int64_t N,
                                   void* out, int64_t G, int64_t fill, int64_t fills,
                                   typename SizeSum::TempStorage& sum_storage) {
  int64_t partial = 0;
  for (int64_t g = threadIdx.x; g < G; g += kSetupThreads) partial += max(group_sizes[g], 0);
  __shared__ int64_t total;
  const int64_t block_total = SizeSum(sum_storage).Sum(partial);
  if (threadIdx.x == 0) total = block_total;
  __syncthreads();
  const int64_t row_vectors = N * kOutBytes / kVectorBytes;
  const int64_t begin = min(M, total) * row_vectors;
  const int64_t end = M * row_vectors;
  uint4* vectors = static_cast<uint4*>(out);
  const int64_t step = fills * kSetupThreads;
  for (int64_t i = begin + fill * kSetupThreads + threadIdx.x; i < end; i += step) {
    vectors[i] = make_uint4(0, 0, 0, 0);
  }
}

__global__ void __launch_bounds__(kSetupThreads)
    prepare_fp8_blockwise(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K, int64_t N,
                          Fp8Operands ops, Fp8GroupTable table) {
  __shared__ union {
    typename SizeScan::TempStorage scan;
    typename SizeSum::TempStorage sum;
  } storage;
  if (blockIdx.x == 0) {
    build_fp8_table(group_sizes, M, K, N, ops, table, storage.scan);
    return;
  }
  zero_fp8_tail_rows(group_sizes, M, N, ops.out, table.num_groups, blockIdx.x - 1,
                     gridDim.x - 1, storage.sum);
}

}  // namespace

cudaError_t launch_prepare_fp8_blockwise(const int32_t* group_sizes, int64_t M, int64_t K,
                                         int64_t N, const Fp8Operands& ops,
                                         const Fp8GroupTable& table, cudaStream_t stream) {
  const int64_t out_bytes = M * N * kOutBytes;
  const int64_t per_block = kSetupThreads * kVectorBytes;
  const unsigned fills = static_cast<unsigned>(
      std::clamp<int64_t>((out_bytes + per_block - 1) / per_block, 1, 4 * int64_t(table.sm_count)));
  prepare_fp8_blockwise<<<1 + fills, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops,
                                                                  table);
  return cudaGetLastError();
}

}  // namespace detail

namespace {

using detail::Fp8GroupTable;

constexpr size_t kAlignment = 128;  // of every workspace array; TMA descriptors need 64
constexpr int kMaxSmCount = 256;    // the GEMM workspace is sized for this many SMs
// Per SM, CUTLASS keeps its own copy of each TMA descriptor it patches per group (A and B for the
// mainloop, D for the epilogue); 8 per SM leaves room over the 4 the bf16 kernels need, and
// run_fp8_blockwise_gemm checks CUTLASS's own count against it.
constexpr size_t kTensorMapBytes = 128;
constexpr size_t kTensorMapsPerSm = 8;
constexpr size_t kGemmWorkspaceBytes = kMaxSmCount * kTensorMapsPerSm * kTensorMapBytes;

size_t round_up(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Byte offsets of the workspace arrays from the aligned workspace start.
struct WorkspaceLayout {
  size_t offsets, shapes, ptr_a, ptr_b, ptr_d, ptr_sfa, ptr_sfb, stride_a, stride_b, stride_d,
      layout_sfa, layout_sfb, gemm;
  size_t bytes;  // including the slack for aligning an unaligned workspace pointer
};

WorkspaceLayout workspace_layout(int64_t G) {
  const size_t groups = G > 0 ? static_cast<size_t>(G) : 0;
  size_t end = 0;
  auto take = [&end](size_t bytes) {
    const size_t start = end;
    end = round_up(end + bytes, kAlignment);
    return start;
  };
  WorkspaceLayout layout;
  layout.offsets = take((groups + 1) * sizeof(int64_t));
  layout.shapes = take(groups * sizeof(detail::GroupShape));
  layout.ptr_a = take(groups * sizeof(void*));
  layout.ptr_b = take(groups * sizeof(void*));
  layout.ptr_d = take(groups * sizeof(void*));
  layout.ptr_sfa = take(groups * sizeof(float*));
  layout.ptr_sfb = take(groups * sizeof(float*));
  layout.stride_a = take(groups * sizeof(detail::StrideKMajor));
  layout.stride_b = take(groups * sizeof(detail::StrideKMajor));
  layout.stride_d = take(groups * sizeof(detail::StrideKMajor));
  layout.layout_sfa = take(groups * sizeof(detail::Fp8LayoutSFA));
  layout.layout_sfb = take(groups * sizeof(detail::Fp8LayoutSFB));
  layout.gemm = take(kGemmWorkspaceBytes);
  layout.bytes = end + kAlignment;
  return layout;
}

Fp8GroupTable make_table(void* workspace, int64_t G, int device, int sm_count,
                         const Fp8GemmSchedule& schedule) {
  const WorkspaceLayout layout = workspace_layout(G);
  char* base =
      reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(workspace), kAlignment));
  Fp8GroupTable table;
  table.num_groups = static_cast<int32_t>(G);
  table.offsets = reinterpret_cast<int64_t*>(base + layout.offsets);
  table.shapes = reinterpret_cast<detail::GroupShape*>(base + layout.shapes);
  table.ptr_a = reinterpret_cast<const void**>(base + layout.ptr_a);
  table.ptr_b = reinterpret_cast<const void**>(base + layout.ptr_b);
  table.ptr_d = reinterpret_cast<void**>(base + layout.ptr_d);
  table.ptr_sfa = reinterpret_cast<const float**>(base + layout.ptr_sfa);
  table.ptr_sfb = reinterpret_cast<const float**>(base + layout.ptr_sfb);
  table.stride_a = reinterpret_cast<detail::StrideKMajor*>(base + layout.stride_a);
  table.stride_b = reinterpret_cast<detail::StrideKMajor*>(base + layout.stride_b);
  table.stride_d = reinterpret_cast<detail::StrideKMajor*>(base + layout.stride_d);
  table.layout_sfa = reinterpret_cast<detail::Fp8LayoutSFA*>(base + layout.layout_sfa);
  table.layout_sfb = reinterpret_cast<detail::Fp8LayoutSFB*>(base + layout.layout_sfb);
  table.gemm_workspace = base + layout.gemm;
  table.gemm_workspace_bytes = kGemmWorkspaceBytes;
  table.device = device;
  table.sm_count = sm_count < kMaxSmCount ? sm_count : kMaxSmCount;
  table.raster = schedule.raster;
  table.swizzle = schedule.swizzle;
  return table;
}

// The schedule of one call with its automatic fields resolved (grouped_matmul_fp8_schedule).
Fp8GemmSchedule resolve_schedule(Fp8GemmSchedule schedule, int64_t M, int64_t K, int64_t N,
                                 int64_t G) {
  const Fp8GemmSchedule automatic = grouped_matmul_fp8_schedule(M, K, N, G);
  if (schedule.tile == Fp8GemmTile::kAuto) schedule.tile = automatic.tile;
  if (schedule.raster == GemmRaster::kAuto) schedule.raster = automatic.raster;
  if (schedule.swizzle == 0) schedule.swizzle = automatic.swizzle;
  return schedule;
}

Status run_tile(Fp8GemmTile tile, const Fp8GroupTable& table, cudaStream_t stream) {
  switch (tile) {
#define NODROP_FP8_GEMM_TILE(name, ...) \
  case Fp8GemmTile::name: return detail::run_fp8_blockwise_gemm<Fp8GemmTile::name>(table, stream);
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_GEMM_TILE
    case Fp8GemmTile::kAuto: break;  // resolved by the caller
  }
  return Status::Error("grouped_matmul_fp8_blockwise: no kernel for tile " +
                       std::to_string(static_cast<int32_t>(tile)));
}

// Elements of a [dims...] tensor, or -1 past 2^60, so that byte counts cannot overflow either.
int64_t elements(std::initializer_list<int64_t> dims) {
  constexpr int64_t kLimit = int64_t{1} << 60;
  int64_t count = 1;
  for (int64_t dim : dims) {
    if (__builtin_mul_overflow(count, dim, &count) || count > kLimit) return -1;
  }
  return count;
}

struct Buffer {
  const char* name;
  const void* data;
  int64_t elements;
  int64_t alignment;  // bytes
};

Status fail(const char* fn, const std::string& what) {
  return Status::Error(std::string(fn) + ": " + what);
}

Status cuda_status(const char* fn, const char* step, cudaError_t error) {
  if (error == cudaSuccess) return Status::Ok();
  return fail(fn, std::string(step) + ": " + cudaGetErrorString(error));
}

Status check_schedule(const char* fn, const Fp8GemmSchedule& schedule) {
  const auto tile = static_cast<int32_t>(schedule.tile);
  if (tile < 0 || tile > static_cast<int32_t>(std::size(kFp8GemmTiles))) {
    return fail(fn, "schedule.tile = " + std::to_string(tile) + " is not an Fp8GemmTile");
  }
  const auto raster = static_cast<int32_t>(schedule.raster);
  if (raster < 0 || raster > static_cast<int32_t>(GemmRaster::kAlongN)) {
    return fail(fn, "schedule.raster = " + std::to_string(raster) + " is not a GemmRaster");
  }
  const int swizzle = schedule.swizzle;
  if (swizzle != 0 && swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8) {
    return fail(fn, "schedule.swizzle = " + std::to_string(swizzle) +
                        " must be 1, 2, 4 or 8 (0: automatic)");
  }
  return Status::Ok();
}

}  // namespace

size_t grouped_matmul_fp8_blockwise_workspace_bytes(int64_t G) {
  return workspace_layout(G).bytes;
}

Status grouped_matmul_fp8_blockwise(const void* lhs, const float* lhs_scales, const void* rhs,
                                    const float* rhs_scales, const int32_t* group_sizes,
                                    int64_t M, int64_t K, int64_t N, int64_t G, void* out,
                                    void* workspace, size_t workspace_bytes,
                                    cudaStream_t stream, Fp8GemmSchedule schedule) {
  constexpr const char* fn = "grouped_matmul_fp8_blockwise";
  if (Status status = check_schedule(fn, schedule); !status.ok()) return status;
  const std::pair<const char*, int64_t> dims[] = {{"M", M}, {"K", K}, {"N", N}, {"G", G}};
  for (const auto& [name, value] : dims) {
    if (value < 0 || value > INT32_MAX) {  // CUTLASS's problem shapes are int
      return fail(fn, std::string(name) + " = " + std::to_string(value) + " is outside [0, 2^31)");
    }
  }
  if (K % 16 != 0) {
    return fail(fn, "K = " + std::to_string(K) +
                        " must be a multiple of 16 (TMA moves 16-byte rows of E4M3): pad it");
  }
  if (N % 8 != 0) {
    return fail(fn, "N = " + std::to_string(N) +
                        " must be a multiple of 8 (TMA moves 16-byte rows of bfloat16): pad it");
  }
  const int64_t KB = detail::scale_blocks(K), NB = detail::scale_blocks(N);
  const Buffer buffers[] = {
      {"lhs", lhs, elements({M, K}), 16},
      {"lhs_scales", lhs_scales, elements({M, KB}), 4},
      {"rhs", rhs, elements({G, N, K}), 16},
      {"rhs_scales", rhs_scales, elements({G, NB, KB}), 4},
      {"out", out, elements({M, N}), 16},
  };
  for (const Buffer& buffer : buffers) {
    if (buffer.elements < 0) return fail(fn, std::string(buffer.name) + " has over 2^60 elements");
    if (buffer.elements == 0) continue;
    if (buffer.data == nullptr) return fail(fn, std::string(buffer.name) + " is null");
    if (reinterpret_cast<uintptr_t>(buffer.data) % buffer.alignment != 0) {
      return fail(fn, std::string(buffer.name) + " must be " + std::to_string(buffer.alignment) +
                          "-byte aligned");
    }
  }
  if (G > 0 && group_sizes == nullptr) return fail(fn, "group_sizes is null");
  const size_t needed = grouped_matmul_fp8_blockwise_workspace_bytes(G);
  if (workspace == nullptr || workspace_bytes < needed) {
    return fail(fn, "workspace has " + std::to_string(workspace_bytes) + " bytes, needs " +
                        std::to_string(needed) + " (grouped_matmul_fp8_blockwise_workspace_bytes)");
  }
  if (M == 0 || N == 0) return Status::Ok();
  if (K == 0 || G == 0) {  // nothing to contract, or no group owns a row
    return cuda_status(fn, "cudaMemsetAsync",
                       cudaMemsetAsync(out, 0, M * N * detail::kOutBytes, stream));
  }
  int device = 0, sm_count = 0;
  Status status = cuda_status(fn, "cudaGetDevice", cudaGetDevice(&device));
  if (status.ok()) {
    status = cuda_status(
        fn, "cudaDeviceGetAttribute",
        cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  }
  if (!status.ok()) return status;
  schedule = resolve_schedule(schedule, M, K, N, G);
  const Fp8GroupTable table = make_table(workspace, G, device, sm_count, schedule);
  const detail::Fp8Operands ops{lhs, lhs_scales, rhs, rhs_scales, out};
  status = cuda_status(
      fn, "setup kernel",
      detail::launch_prepare_fp8_blockwise(group_sizes, M, K, N, ops, table, stream));
  if (!status.ok()) return status;
  return run_tile(schedule.tile, table, stream);
}

}  // namespace nodrop::cuda
