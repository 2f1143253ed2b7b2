// The CUTLASS kernels of the FP8 tensorwise grouped GEMMs (fp8_blockwise.cuh, forms
// kRowsTensorwise and kContractTensorwise, one kernel for both): CUTLASS's sm90 pointer-array FP8
// kernels (as in its example 57, hopper_grouped_gemm) and D = alpha[g] * acc, alpha read per
// group from the table on the device. One configuration per line of fp8_tensorwise_tiles.def;
// include this header only from the generated instantiation files (generate_instantiations.py).
//
// Fast accumulation: the wgmmas of a tile add into one float32 accumulator over all of K, with
// the tensor cores' own rounding of those sums (the FP8 MMA keeps fewer mantissa bits than an
// FFMA; DeepSeek-V3 measured the error growing with K). One accumulator per output is what lets a
// consumer warpgroup own 64x256 (cooperative 128x256) or 128x128 (pingpong). Promoted: each
// 128-deep block's sums are added into a second accumulator with FFMAs, as the blockwise kernels
// do, so that rounding never spans more than 128 products.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "engine/cuda/grouped_matmul/fp8_blockwise_gemm.cuh"

namespace nodrop::cuda::detail {

template <Fp8TensorwiseTile T>
struct Fp8TensorwiseTileConfig;
#define NODROP_FP8_TENSORWISE_TILE(name, schedule, m, n, k, cluster_m, cluster_n, accumulation) \
  template <>                                                                                     \
  struct Fp8TensorwiseTileConfig<Fp8TensorwiseTile::name>                                         \
      : Fp8TileSpec<m, n, k, std::string_view(#schedule) == "pingpong", cluster_m, cluster_n,     \
                    std::string_view(#accumulation) == "fast" ? Fp8Accumulation::kFast            \
                                                              : Fp8Accumulation::kPromoted> {};
#include "engine/cuda/grouped_matmul/fp8_tensorwise_tiles.def"
#undef NODROP_FP8_TENSORWISE_TILE

// The epilogue stores in 128x64 subtiles where the tile is cooperative, as the bf16 kernel of
// that shape does (cutlass_gemm.cuh); CUTLASS's own choice for pingpong.
template <class Tile>
using Fp8TensorwiseEpilogueTile =
    std::conditional_t<std::is_same_v<typename Tile::EpilogueSchedule,
                                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>,
                       cute::Shape<cute::_128, cute::_64>,
                       cutlass::epilogue::collective::EpilogueTileAuto>;

template <Fp8TensorwiseTile T>
struct Fp8TensorwiseGemm {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using ElementAccumulator = float;
  using LayoutA = cutlass::layout::RowMajor;     // lhs_g [M_g, K]: K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // rhs[g] [N, K] as B (K x N): K-major
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentIn = 16;  // TMA moves 16-byte units: 16 E4M3 elements
  static constexpr int kAlignmentOut = 16 / sizeof(ElementD);
  using Tile = Fp8TensorwiseTileConfig<T>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<GroupShape>;

  // D = alpha * acc with alpha per group (fp8_tensorwise_arguments); no C operand (void).
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tile::Shape,
      typename Tile::Cluster, Fp8TensorwiseEpilogueTile<Tile>, ElementAccumulator,
      ElementAccumulator, void, LayoutD*, kAlignmentOut, ElementD, LayoutD*, kAlignmentOut,
      typename Tile::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignmentIn,
      ElementB, LayoutB*, kAlignmentIn, ElementAccumulator, typename Tile::Shape,
      typename Tile::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tile::MainloopSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // The setup kernel writes these types; CUTLASS must read the same.
  static_assert(std::is_same_v<typename Kernel::InternalStrideA, StrideKMajor>);
  static_assert(std::is_same_v<typename Kernel::InternalStrideB, StrideKMajor>);
  static_assert(std::is_same_v<typename Kernel::InternalStrideD, StrideKMajor>);
};

template <Fp8TensorwiseTile T>
Status run_fp8_tensorwise_gemm(const Fp8GroupTable& table, cudaStream_t stream) {
  using Config = Fp8TensorwiseGemm<T>;
  auto args = fp8_group_arguments<Config>(table);
  // alpha[g] for the tiles of group g: the scalar broadcast reads alpha_ptr[g * dAlpha's L stride]
  // with the group as its L coordinate.
  args.epilogue.thread.alpha_ptr = table.alpha;
  args.epilogue.thread.dAlpha = {cute::_0{}, cute::_0{}, 1};
  const std::string kernel =
      std::string("FP8 tensorwise grouped GEMM (") + fp8_tensorwise_tile_name(T) + ")";
  return launch_gemm<typename Config::Gemm>(args, table.gemm_workspace,
                                            table.gemm_workspace_bytes, kernel, stream);
}

}  // namespace nodrop::cuda::detail
