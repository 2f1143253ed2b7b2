// CUDA FP8 grouped matmuls: ragged rows and ragged contraction, each blockwise-scaled and
// tensorwise-scaled (fp8_blockwise.cuh says what each form computes and the scale layouts): argument
// checks, workspace layout, the setup kernel that builds the group table from the group sizes on
// the device, and the two launches of a call (setup kernel, then the CUTLASS kernel of the call's
// form and tile, fp8_blockwise_gemm.cuh or fp8_tensorwise_gemm.cuh), all on the caller's
// stream.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>

#include "engine/cuda/grouped_matmul/fp8_blockwise.cuh"
#include "engine/cuda/grouped_matmul/group_scan.cuh"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace detail {
namespace {

constexpr int64_t kOutBytes = 2;  // bfloat16

__host__ __device__ int64_t scale_blocks(int64_t extent) {
  return (extent + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
}

// One group's GEMM of form F: shape, operand pointers and strides, and its scales: the scale
// pointers and layouts of a blockwise form (the packed layouts CUTLASS rebuilds from the shape
// anyway, see fp8_blockwise.cuh), the one alpha of a tensorwise form.
template <Fp8GemmForm F>
__device__ void write_fp8_group(const Fp8GroupTable& t, int64_t g, int64_t begin, int64_t rows,
                                int64_t first_block, int64_t M, int64_t K, int64_t N,
                                const Fp8Operands& ops) {
  const auto* lhs = static_cast<const uint8_t*>(ops.lhs);  // one byte per E4M3 element
  const auto* rhs = static_cast<const uint8_t*>(ops.rhs);
  auto* out = static_cast<char*>(ops.out);
  int64_t gemm_m, gemm_k;
  if constexpr (is_contraction(F)) {
    // lhs_t [K, P] and rhs_t [N, P]: the group's rows are columns 128 * first_block onwards.
    // An empty group gets no tiles (CUTLASS 4.2 cannot contract over 0): the fill zeroes out[g].
    const int64_t P = kFp8Block * fp8_contract_blocks(M, t.num_groups);
    const int64_t column = first_block * kFp8Block;
    gemm_m = rows > 0 ? K : 0;
    gemm_k = rows;
    t.ptr_a[g] = lhs + column;
    t.ptr_b[g] = rhs + column;
    t.ptr_d[g] = out + g * K * N * kOutBytes;           // out[g] [K, N]
    t.stride_a[g] = cute::make_stride(P, cute::_1{}, cute::_0{});
    t.stride_b[g] = cute::make_stride(P, cute::_1{}, cute::_0{});
    if constexpr (F == Fp8GemmForm::kContractTensorwise) {
      t.alpha[g] = ops.lhs_scales[0] * ops.rhs_scales[0];
    } else {
      t.ptr_sfa[g] = ops.lhs_scales + first_block * K;  // lhs_scales[first_block:, :] [., K]
      t.ptr_sfb[g] = ops.rhs_scales + first_block * N;  // rhs_scales[first_block:, :] [., N]
    }
  } else {
    gemm_m = rows;  // an empty group gets M_g = 0, hence no tiles
    gemm_k = K;
    t.ptr_a[g] = lhs + begin * K;              // lhs_g [M_g, K]
    t.ptr_b[g] = rhs + g * N * K;              // rhs[g] [N, K]
    t.ptr_d[g] = out + begin * N * kOutBytes;  // out_g [M_g, N]
    t.stride_a[g] = cute::make_stride(K, cute::_1{}, cute::_0{});
    t.stride_b[g] = cute::make_stride(K, cute::_1{}, cute::_0{});
    if constexpr (F == Fp8GemmForm::kRowsTensorwise) {
      t.alpha[g] = ops.lhs_scales[0] * ops.rhs_scales[g];
    } else {
      const int64_t KB = scale_blocks(K), NB = scale_blocks(N);
      t.ptr_sfa[g] = ops.lhs_scales + begin * KB;   // lhs_scales[begin:, :] [M_g, KB]
      t.ptr_sfb[g] = ops.rhs_scales + g * NB * KB;  // rhs_scales[g] [NB, KB]
    }
  }
  t.shapes[g] = cute::make_shape(int(gemm_m), int(N), int(gemm_k));
  t.stride_d[g] = cute::make_stride(N, cute::_1{}, cute::_0{});
  if constexpr (!is_tensorwise(F)) {
    using Config = typename Fp8Scales<F>::Config;
    const auto problem = cute::make_shape(int(gemm_m), int(N), int(gemm_k), 1);
    static_cast<Fp8LayoutSFA<F>*>(t.layout_sfa)[g] = Config::tile_atom_to_shape_SFA(problem);
    static_cast<Fp8LayoutSFB<F>*>(t.layout_sfb)[g] = Config::tile_atom_to_shape_SFB(problem);
  }
}

// One launch per call: block 0 builds the table, the other blocks zero what no tile writes.
template <Fp8GemmForm F>
__global__ void __launch_bounds__(kSetupThreads)
    prepare_fp8_blockwise(const int32_t* __restrict__ group_sizes, int64_t M, int64_t K, int64_t N,
                          Fp8Operands ops, Fp8GroupTable table) {
  __shared__ union {
    GroupScanStorage scan;
    typename SizeSum::TempStorage sum;
  } storage;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) table.offsets[0] = 0;
    scan_groups(group_sizes, table.num_groups, M, storage.scan,
                [&](int64_t g, int64_t begin, int64_t end, int64_t first_block) {
                  table.offsets[g + 1] = end;
                  write_fp8_group<F>(table, g, begin, end - begin, first_block, M, K, N, ops);
                });
    return;
  }
  const int64_t fill = blockIdx.x - 1, fills = gridDim.x - 1;
  if constexpr (is_contraction(F)) {
    zero_empty_groups(group_sizes, M, K, N, ops.out, kOutBytes, table.num_groups, fill, fills,
                      storage.sum);
  } else {
    zero_tail_rows(group_sizes, M, N, ops.out, kOutBytes, table.num_groups, fill, fills,
                   storage.sum);
  }
}

}  // namespace

cudaError_t launch_prepare_fp8_blockwise(Fp8GemmForm form, const int32_t* group_sizes, int64_t M,
                                         int64_t K, int64_t N, const Fp8Operands& ops,
                                         const Fp8GroupTable& table, cudaStream_t stream) {
  // The bytes the fill blocks may have to zero: every row of out, or every group's [K, N].
  const int64_t out_bytes = (is_contraction(form) ? table.num_groups * K : M) * N * kOutBytes;
  const unsigned blocks = 1 + fill_blocks(out_bytes, 4 * int64_t(table.sm_count));
  switch (form) {
    case Fp8GemmForm::kRows:
      prepare_fp8_blockwise<Fp8GemmForm::kRows>
          <<<blocks, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
    case Fp8GemmForm::kContract:
      prepare_fp8_blockwise<Fp8GemmForm::kContract>
          <<<blocks, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
    case Fp8GemmForm::kRowsTensorwise:
      prepare_fp8_blockwise<Fp8GemmForm::kRowsTensorwise>
          <<<blocks, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
    case Fp8GemmForm::kContractTensorwise:
      prepare_fp8_blockwise<Fp8GemmForm::kContractTensorwise>
          <<<blocks, kSetupThreads, 0, stream>>>(group_sizes, M, K, N, ops, table);
      break;
  }
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
      layout_sfa, layout_sfb, alpha, gemm;
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
  // Both forms' layouts have these sizes (fp8_blockwise.cuh asserts it).
  layout.layout_sfa = take(groups * sizeof(detail::Fp8LayoutSFA<detail::Fp8GemmForm::kRows>));
  layout.layout_sfb = take(groups * sizeof(detail::Fp8LayoutSFB<detail::Fp8GemmForm::kRows>));
  layout.alpha = take(groups * sizeof(float));
  layout.gemm = take(kGemmWorkspaceBytes);
  layout.bytes = end + kAlignment;
  return layout;
}

Fp8GroupTable make_table(void* workspace, int64_t G, int device, int sm_count, GemmRaster raster,
                         int swizzle) {
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
  table.layout_sfa = base + layout.layout_sfa;
  table.layout_sfb = base + layout.layout_sfb;
  table.alpha = reinterpret_cast<float*>(base + layout.alpha);
  table.gemm_workspace = base + layout.gemm;
  table.gemm_workspace_bytes = kGemmWorkspaceBytes;
  table.device = device;
  table.sm_count = sm_count < kMaxSmCount ? sm_count : kMaxSmCount;
  table.raster = raster;
  table.swizzle = swizzle;
  return table;
}

// The schedule of one call (Fp8GemmSchedule or Fp8TensorwiseSchedule) with its automatic fields
// resolved from `automatic`.
template <class Schedule>
Schedule resolve_schedule(Schedule schedule, const Schedule& automatic) {
  if (schedule.tile == decltype(schedule.tile)::kAuto) schedule.tile = automatic.tile;
  if (schedule.raster == GemmRaster::kAuto) schedule.raster = automatic.raster;
  if (schedule.swizzle == 0) schedule.swizzle = automatic.swizzle;
  return schedule;
}

// The instantiated kernel of form F and `tile` (fp8_tiles.def).
template <detail::Fp8GemmForm F>
Status run_tile(const char* fn, Fp8GemmTile tile, const Fp8GroupTable& table,
                cudaStream_t stream) {
  using detail::Fp8GemmForm;
  if constexpr (F == Fp8GemmForm::kRows) {
    switch (tile) {
#define NODROP_FP8_GEMM_TILE(name, ...) \
  case Fp8GemmTile::name:               \
    return detail::run_fp8_blockwise_gemm<Fp8GemmForm::kRows, Fp8GemmTile::name>(table, stream);
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_GEMM_TILE
      case Fp8GemmTile::kAuto: break;  // resolved by the caller
    }
  } else {
    switch (tile) {
#define NODROP_FP8_GEMM_TILE(name, ...)
#define NODROP_FP8_CONTRACT_TILE(name) \
  case Fp8GemmTile::name:              \
    return detail::run_fp8_blockwise_gemm<Fp8GemmForm::kContract, Fp8GemmTile::name>(table, stream);
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_CONTRACT_TILE
#undef NODROP_FP8_GEMM_TILE
      default: break;
    }
  }
  return Status::Error(std::string(fn) + ": no kernel for tile " + fp8_gemm_tile_name(tile) +
                       (F == Fp8GemmForm::kContract ? " (NODROP_FP8_CONTRACT_TILE)" : ""));
}

// The instantiated tensorwise kernel of `tile` (fp8_tensorwise_tiles.def), for either form.
Status run_tile(const char* fn, Fp8TensorwiseTile tile, const Fp8GroupTable& table,
                cudaStream_t stream) {
  switch (tile) {
#define NODROP_FP8_TENSORWISE_TILE(name, ...) \
  case Fp8TensorwiseTile::name:               \
    return detail::run_fp8_tensorwise_gemm<Fp8TensorwiseTile::name>(table, stream);
#include "engine/cuda/grouped_matmul/fp8_tensorwise_tiles.def"
#undef NODROP_FP8_TENSORWISE_TILE
    case Fp8TensorwiseTile::kAuto: break;  // resolved by the caller
  }
  return Status::Error(std::string(fn) + ": no kernel for tile " + fp8_tensorwise_tile_name(tile));
}

// The number of kernels and the name of the schedule's tile type, for check_call.
size_t tile_count(const Fp8GemmSchedule&) { return std::size(kFp8GemmTiles); }
size_t tile_count(const Fp8TensorwiseSchedule&) { return std::size(kFp8TensorwiseTiles); }
const char* tile_type(const Fp8GemmSchedule&) { return "an Fp8GemmTile"; }
const char* tile_type(const Fp8TensorwiseSchedule&) { return "an Fp8TensorwiseTile"; }

// The automatic schedule of form F (fp8_tile_rule.cc); fast_accumulation is the tensorwise
// forms'.
template <detail::Fp8GemmForm F>
auto automatic_schedule(int64_t M, int64_t K, int64_t N, int64_t G, bool fast_accumulation) {
  using detail::Fp8GemmForm;
  if constexpr (F == Fp8GemmForm::kRows) return grouped_matmul_fp8_schedule(M, K, N, G);
  if constexpr (F == Fp8GemmForm::kContract) {
    return grouped_matmul_fp8_contract_schedule(M, K, N, G);
  }
  if constexpr (F == Fp8GemmForm::kRowsTensorwise) {
    return grouped_matmul_fp8_tensorwise_schedule(M, K, N, G, fast_accumulation);
  }
  if constexpr (F == Fp8GemmForm::kContractTensorwise) {
    return grouped_matmul_fp8_tensorwise_contract_schedule(M, K, N, G, fast_accumulation);
  }
}

// A tensorwise call's pinned tile must accumulate as the call asks; the blockwise kernels have one
// accumulation.
Status check_accumulation(const char*, const Fp8GemmSchedule&, bool) { return Status::Ok(); }
Status check_accumulation(const char* fn, const Fp8TensorwiseSchedule& schedule,
                          bool fast_accumulation) {
  if (schedule.tile == Fp8TensorwiseTile::kAuto ||
      fp8_tensorwise_tile_fast_accumulation(schedule.tile) == fast_accumulation) {
    return Status::Ok();
  }
  return Status::Error(std::string(fn) + ": schedule.tile = " +
                       fp8_tensorwise_tile_name(schedule.tile) + " does not match " +
                       "fast_accumulation = " + (fast_accumulation ? "true" : "false"));
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

// The argument checks every form shares: the schedule's fields (and its tile's accumulation), the
// dims (CUTLASS's problem shapes are int), N, the buffers' presence and alignment, group_sizes
// and the workspace.
template <class Schedule>
Status check_call(const char* fn, const Schedule& schedule, bool fast_accumulation,
                  std::initializer_list<std::pair<const char*, int64_t>> dims, int64_t N,
                  std::initializer_list<Buffer> buffers, const int32_t* group_sizes, int64_t G,
                  const void* workspace, size_t workspace_bytes) {
  const auto tile = static_cast<int32_t>(schedule.tile);
  if (tile < 0 || tile > static_cast<int32_t>(tile_count(schedule))) {
    return fail(fn, "schedule.tile = " + std::to_string(tile) + " is not " + tile_type(schedule));
  }
  if (Status status = check_accumulation(fn, schedule, fast_accumulation); !status.ok()) {
    return status;
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
  for (const auto& [name, value] : dims) {
    if (value < 0 || value > INT32_MAX) {
      return fail(fn, std::string(name) + " = " + std::to_string(value) + " is outside [0, 2^31)");
    }
  }
  if (N % 8 != 0) {
    return fail(fn, "N = " + std::to_string(N) +
                        " must be a multiple of 8 (TMA moves 16-byte rows of bfloat16): pad it");
  }
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
  return Status::Ok();
}

// The two launches of a checked call with work to do: the setup kernel, then the CUTLASS kernel.
template <detail::Fp8GemmForm F, class Schedule>
Status launch(const char* fn, Schedule schedule, bool fast_accumulation,
              const detail::Fp8Operands& ops, const int32_t* group_sizes, int64_t M, int64_t K,
              int64_t N, int64_t G, void* workspace, cudaStream_t stream) {
  int device = 0, sm_count = 0;
  Status status = cuda_status(fn, "cudaGetDevice", cudaGetDevice(&device));
  if (status.ok()) {
    status = cuda_status(
        fn, "cudaDeviceGetAttribute",
        cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  }
  if (!status.ok()) return status;
  schedule = resolve_schedule(schedule, automatic_schedule<F>(M, K, N, G, fast_accumulation));
  const Fp8GroupTable table =
      make_table(workspace, G, device, sm_count, schedule.raster, schedule.swizzle);
  status = cuda_status(
      fn, "setup kernel",
      detail::launch_prepare_fp8_blockwise(F, group_sizes, M, K, N, ops, table, stream));
  if (!status.ok()) return status;
  if constexpr (detail::is_tensorwise(F)) {
    return run_tile(fn, schedule.tile, table, stream);
  } else {
    return run_tile<F>(fn, schedule.tile, table, stream);
  }
}

// A ragged-rows call (kRows or kRowsTensorwise) with its two scale arrays: the checks, the zero
// fill of the calls that contract nothing, else the launches.
template <detail::Fp8GemmForm F, class Schedule>
Status rows_call(const char* fn, const Schedule& schedule, bool fast_accumulation,
                 const void* lhs, Buffer lhs_scales, const void* rhs, Buffer rhs_scales,
                 const int32_t* group_sizes, int64_t M, int64_t K, int64_t N, int64_t G,
                 void* out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  Status status = check_call(fn, schedule, fast_accumulation,
                             {{"M", M}, {"K", K}, {"N", N}, {"G", G}}, N,
                             {{"lhs", lhs, elements({M, K}), 16}, lhs_scales,
                              {"rhs", rhs, elements({G, N, K}), 16}, rhs_scales,
                              {"out", out, elements({M, N}), 16}},
                             group_sizes, G, workspace, workspace_bytes);
  if (!status.ok()) return status;
  if (K % 16 != 0) {
    return fail(fn, "K = " + std::to_string(K) +
                        " must be a multiple of 16 (TMA moves 16-byte rows of E4M3): pad it");
  }
  if (M == 0 || N == 0) return Status::Ok();
  if (K == 0 || G == 0) {  // nothing to contract, or no group owns a row
    return cuda_status(fn, "cudaMemsetAsync",
                       cudaMemsetAsync(out, 0, M * N * detail::kOutBytes, stream));
  }
  const auto* lhs_scale_data = static_cast<const float*>(lhs_scales.data);
  const auto* rhs_scale_data = static_cast<const float*>(rhs_scales.data);
  return launch<F>(fn, schedule, fast_accumulation,
                   {lhs, lhs_scale_data, rhs, rhs_scale_data, out}, group_sizes, M, K, N, G,
                   workspace, stream);
}

// A ragged-contraction call (kContract or kContractTensorwise) of M rows in G groups, its
// operands padded to P = 128 * fp8_contract_blocks(M, G) columns, with its two scale arrays.
template <detail::Fp8GemmForm F, class Schedule>
Status contract_call(const char* fn, const Schedule& schedule, bool fast_accumulation,
                     const void* lhs_t, Buffer lhs_scales, const void* rhs_t, Buffer rhs_scales,
                     const int32_t* group_sizes, int64_t M, int64_t K, int64_t N, int64_t G,
                     void* out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const int64_t P = M >= 0 && G >= 0 ? fp8_contract_blocks(M, G) * kFp8Block : 0;
  Status status = check_call(fn, schedule, fast_accumulation,
                             {{"M", M}, {"K", K}, {"N", N}, {"G", G}, {"P", P}}, N,
                             {{"lhs_t", lhs_t, elements({K, P}), 16}, lhs_scales,
                              {"rhs_t", rhs_t, elements({N, P}), 16}, rhs_scales,
                              {"out", out, elements({G, K, N}), 16}},
                             group_sizes, G, workspace, workspace_bytes);
  if (!status.ok()) return status;
  if (G == 0 || K == 0 || N == 0) return Status::Ok();
  if (M == 0) {  // every group is empty
    return cuda_status(fn, "cudaMemsetAsync",
                       cudaMemsetAsync(out, 0, G * K * N * detail::kOutBytes, stream));
  }
  const auto* lhs_scale_data = static_cast<const float*>(lhs_scales.data);
  const auto* rhs_scale_data = static_cast<const float*>(rhs_scales.data);
  return launch<F>(fn, schedule, fast_accumulation,
                   {lhs_t, lhs_scale_data, rhs_t, rhs_scale_data, out}, group_sizes, M, K, N, G,
                   workspace, stream);
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
  const int64_t KB = detail::scale_blocks(K), NB = detail::scale_blocks(N);
  return rows_call<detail::Fp8GemmForm::kRows>(
      "grouped_matmul_fp8_blockwise", schedule, /*fast_accumulation=*/false, lhs,
      {"lhs_scales", lhs_scales, elements({M, KB}), 4}, rhs,
      {"rhs_scales", rhs_scales, elements({G, NB, KB}), 4}, group_sizes, M, K, N, G, out,
      workspace, workspace_bytes, stream);
}

Status grouped_matmul_fp8_tensorwise(const void* lhs, const float* lhs_scale, const void* rhs,
                                     const float* rhs_scales, const int32_t* group_sizes,
                                     int64_t M, int64_t K, int64_t N, int64_t G,
                                     bool fast_accumulation, void* out, void* workspace,
                                     size_t workspace_bytes, cudaStream_t stream,
                                     Fp8TensorwiseSchedule schedule) {
  return rows_call<detail::Fp8GemmForm::kRowsTensorwise>(
      "grouped_matmul_fp8_tensorwise", schedule, fast_accumulation, lhs,
      {"lhs_scale", lhs_scale, 1, 4}, rhs, {"rhs_scales", rhs_scales, G, 4}, group_sizes, M, K,
      N, G, out, workspace, workspace_bytes, stream);
}

Status grouped_matmul_fp8_blockwise_contract(const void* lhs_t, const float* lhs_scales,
                                             const void* rhs_t, const float* rhs_scales,
                                             const int32_t* group_sizes, int64_t M, int64_t K,
                                             int64_t N, int64_t G, void* out, void* workspace,
                                             size_t workspace_bytes, cudaStream_t stream,
                                             Fp8GemmSchedule schedule) {
  const int64_t PB = M >= 0 && G >= 0 ? fp8_contract_blocks(M, G) : 0;
  return contract_call<detail::Fp8GemmForm::kContract>(
      "grouped_matmul_fp8_blockwise_contract", schedule, /*fast_accumulation=*/false, lhs_t,
      {"lhs_scales", lhs_scales, elements({PB, K}), 4}, rhs_t,
      {"rhs_scales", rhs_scales, elements({PB, N}), 4}, group_sizes, M, K, N, G, out, workspace,
      workspace_bytes, stream);
}

Status grouped_matmul_fp8_tensorwise_contract(const void* lhs_t, const float* lhs_scale,
                                              const void* rhs_t, const float* rhs_scale,
                                              const int32_t* group_sizes, int64_t M, int64_t K,
                                              int64_t N, int64_t G, bool fast_accumulation,
                                              void* out, void* workspace, size_t workspace_bytes,
                                              cudaStream_t stream,
                                              Fp8TensorwiseSchedule schedule) {
  return contract_call<detail::Fp8GemmForm::kContractTensorwise>(
      "grouped_matmul_fp8_tensorwise_contract", schedule, fast_accumulation, lhs_t,
      {"lhs_scale", lhs_scale, 1, 4}, rhs_t, {"rhs_scale", rhs_scale, 1, 4}, group_sizes, M, K,
      N, G, out, workspace, workspace_bytes, stream);
}

}  // namespace nodrop::cuda
