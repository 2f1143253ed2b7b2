// The CUTLASS kernels of the FP8 blockwise-scaled grouped GEMM (fp8_blockwise.cuh): CUTLASS's
// example 68 (hopper_fp8_warp_specialized_grouped_gemm_with_blockwise_scaling) with the problem
// shapes, pointers and scale layouts on the device only, as the bf16 path (cutlass_gemm.cuh).
// One configuration per (form, line of fp8_tiles.def); include this header only from the
// generated instantiation files (generate_instantiations.py).
//
// What all configurations share:
//   - Depth 128 = the scale block along K: one A scale per row and one B scale per 128 columns
//     for each k tile, the finest promotion interval the mainloop allows (4 wgmmas of depth 32).
//   - 128 columns = the B scale block along N (kRows): one B scale per tile. The weight
//     gradient (kContract) scales each row and each column (1 x 128 blocks along the contraction
//     on both sides): 128 A and 128 B scales per k tile, multiplied per accumulator element.
//   - A consumer warpgroup owns 64x128 of the tile: the mainloop holds two float32 accumulators
//     (wgmma's and the scaled sum), 128 registers of the 232 a consumer thread gets.
// The kernels (which shape gets which: fp8_tile_rule.cc, measured with nodrop_cuda_fp8_bench
// --configs=all):
//   - cooperative 128x128x128, cluster 1x1: two consumer warpgroups on one tile; no cluster, so
//     no group's tiles are rounded up to whole clusters.
//   - cluster 1x2: example 68's choice. A pair of column tiles shares its A tile through TMA
//     multicast, halving A's L2 reads; nothing runs empty when a group's column tiles pair up.
//   - pingpong 64x128x128: two consumer warpgroups on two tiles, taking turns at the mainloop,
//     so one's epilogue runs under the other's wgmmas (the scale promotion does not: it is
//     inside the mainloop); tiles of 64 rows halve the rows run empty at the end of each
//     ragged group (many small groups: Qwen3). Costs 1.5x the operand bytes per flop of a
//     128x128 tile.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/float8.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "engine/cuda/grouped_matmul/cutlass_gemm.cuh"  // max_active_clusters
#include "engine/cuda/grouped_matmul/fp8_blockwise.cuh"

namespace nodrop::cuda::detail {

// How a kernel's mainloop keeps its float32 sums: kBlockwise, each 128-deep block's wgmma sums
// times that block's scales added into a second accumulator (these kernels); the tensorwise
// kernels' (fp8_tensorwise_gemm.cuh) kFast, one accumulator over all of K, so a consumer
// warpgroup may own twice the blockwise share, and kPromoted, the blockwise mainloop's second
// accumulator without the scales.
enum class Fp8Accumulation { kBlockwise, kFast, kPromoted };

template <int TileM, int TileN, int TileK, bool Pingpong, int ClusterM, int ClusterN,
          Fp8Accumulation Accumulation = Fp8Accumulation::kBlockwise>
struct Fp8TileSpec {
  using Shape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  template <class PingpongSchedule, class CooperativeSchedule>
  using Pick = std::conditional_t<Pingpong, PingpongSchedule, CooperativeSchedule>;
  // CUTLASS's builder gives FP8 operands on the plain pointer-array schedules its promoting
  // mainloop (MainloopSm90ArrayTmaGmmaWarpSpecializedFP8, one promotion per 4 wgmmas of depth 32).
  using MainloopSchedule = std::conditional_t<
      Accumulation == Fp8Accumulation::kFast,
      Pick<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum>,
      std::conditional_t<
          Accumulation == Fp8Accumulation::kPromoted,
          Pick<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>,
          Pick<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>>>;
  using EpilogueSchedule = Pick<cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  // One consumer warpgroup's share of the tile (see above): at most 128 accumulator registers a
  // thread for one accumulator, 192 for two (96 each: the promoted 64x192).
  static_assert((Pingpong ? TileM : TileM / 2) * TileN <=
                    (Accumulation == Fp8Accumulation::kFast ? 128 : 96) * 128,
                "a consumer warpgroup's accumulators would spill");
};

template <Fp8GemmTile T>
struct Fp8TileConfig;
#define NODROP_FP8_GEMM_TILE(name, schedule, m, n, k, cluster_m, cluster_n)                       \
  template <>                                                                                   \
  struct Fp8TileConfig<Fp8GemmTile::name>                                                       \
      : Fp8TileSpec<m, n, k, std::string_view(#schedule) == "pingpong", cluster_m, cluster_n> { \
  };
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_GEMM_TILE

// The epilogue stores a tile in rounds of this subtile, each behind a barrier of the consumer
// warpgroups. CUTLASS's automatic choice for the cooperative kernels is 128x32, four rounds per
// 128x128 tile; 128x64 takes two, for one mainloop stage fewer (5 of 6). It made DeepSeek-V3
// EP8's weight gradients, two K blocks a tile, 7-12% faster and Mixtral's input gradient 6%,
// costing Qwen3's input gradient 4% (docs/performance.md, FP8 epilogue subtile).
template <Fp8GemmTile T>
using Fp8EpilogueTile =
    std::conditional_t<T == Fp8GemmTile::kCooperative128x128x128Cluster1x1 ||
                           T == Fp8GemmTile::kCooperative128x128x128Cluster1x2,
                       cute::Shape<cute::_128, cute::_64>,
                       cutlass::epilogue::collective::EpilogueTileAuto>;

template <Fp8GemmForm F, Fp8GemmTile T>
struct Fp8BlockwiseGemm {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using ElementAccumulator = float;
  using LayoutA = cutlass::layout::RowMajor;     // lhs_g [M_g, K] (lhs_t_g [K, rows]): K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // rhs[g] [N, K] (rhs_t_g) as B (K x N): K-major
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentIn = 16;  // TMA moves 16-byte units: 16 E4M3 elements
  static constexpr int kAlignmentOut = 16 / sizeof(ElementD);
  using Tile = Fp8TileConfig<T>;
  using LayoutSFA = Fp8LayoutSFA<F>;
  using LayoutSFB = Fp8LayoutSFB<F>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<GroupShape>;

  // D = acc: no C operand (void), alpha 1 and beta 0 by default.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tile::Shape,
      typename Tile::Cluster, Fp8EpilogueTile<T>,
      ElementAccumulator, ElementAccumulator, void, LayoutD*, kAlignmentOut, ElementD, LayoutD*,
      kAlignmentOut, typename Tile::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentIn, ElementB,
      cute::tuple<LayoutB*, LayoutSFB*>, kAlignmentIn, ElementAccumulator,
      typename Tile::Shape, typename Tile::Cluster,
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
  static_assert(std::is_same_v<typename CollectiveMainloop::InternalLayoutSFA, LayoutSFA>);
  static_assert(std::is_same_v<typename CollectiveMainloop::InternalLayoutSFB, LayoutSFB>);
  // The scale granularity the mainloop reads from the layout types: 1x128 (A); 128x128 (B) for
  // kRows, 1x128 for kContract.
  static_assert(CollectiveMainloop::ScaleGranularityM == 1);
  static_assert(CollectiveMainloop::ScaleGranularityN ==
                (F == Fp8GemmForm::kRows ? kFp8ScaleBlock : 1));
  static_assert(CollectiveMainloop::ScaleGranularityK == kFp8ScaleBlock);
};

// The arguments every FP8 grouped kernel takes from the group table: the problem shapes, A, B
// and D, the device and the tile scheduler's walk. The caller adds the scales.
template <class Config>
typename Config::Gemm::Arguments fp8_group_arguments(const Fp8GroupTable& table) {
  typename Config::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {table.num_groups, table.shapes, /*host_problem_shapes=*/nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const typename Config::ElementA**>(table.ptr_a);
  args.mainloop.dA = table.stride_a;
  args.mainloop.ptr_B = reinterpret_cast<const typename Config::ElementB**>(table.ptr_b);
  args.mainloop.dB = table.stride_b;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = reinterpret_cast<typename Config::ElementD**>(table.ptr_d);
  args.epilogue.dD = table.stride_d;
  args.hw_info.device_id = table.device;
  args.hw_info.sm_count = table.sm_count;
  args.hw_info.max_active_clusters =
      max_active_clusters<typename Config::Kernel, typename Config::Tile::Cluster>(table.device);
  using RasterOrder = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order =
      table.raster == GemmRaster::kAlongN ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = table.swizzle;
  return args;
}

template <Fp8GemmForm F, Fp8GemmTile T>
Status run_fp8_blockwise_gemm(const Fp8GroupTable& table, cudaStream_t stream) {
  using Config = Fp8BlockwiseGemm<F, T>;
  auto args = fp8_group_arguments<Config>(table);
  args.mainloop.ptr_SFA = table.ptr_sfa;
  args.mainloop.layout_SFA = static_cast<typename Config::LayoutSFA*>(table.layout_sfa);
  args.mainloop.ptr_SFB = table.ptr_sfb;
  args.mainloop.layout_SFB = static_cast<typename Config::LayoutSFB*>(table.layout_sfb);
  const std::string kernel = std::string("FP8 blockwise grouped GEMM (") +
                             (F == Fp8GemmForm::kContract ? "weight gradient, " : "") +
                             fp8_gemm_tile_name(T) + ")";
  return launch_gemm<typename Config::Gemm>(args, table.gemm_workspace,
                                            table.gemm_workspace_bytes, kernel, stream);
}

}  // namespace nodrop::cuda::detail
