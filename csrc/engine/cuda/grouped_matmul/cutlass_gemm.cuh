// The CUTLASS 3.x sm90 pointer-array grouped GEMM behind run_grouped_gemm (group_table.cuh).
//
// Problem shapes live only on the device (host shapes nullptr): the kernel is persistent, each
// CTA walks the groups' tiles itself and patches its TMA descriptors in shared memory whenever
// the group changes, with the pointers and strides of the GroupTable. Include this header only
// from the generated instantiation files (generate_instantiations.py).
#pragma once

#include <atomic>
#include <string>
#include <string_view>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "engine/cuda/grouped_matmul/group_table.cuh"

namespace nodrop::cuda::detail {

template <DType D>
struct CutlassElement;
template <>
struct CutlassElement<DType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<DType::kFloat16> {
  using type = cutlass::half_t;
};
template <>
struct CutlassElement<DType::kFloat32> {
  using type = float;
};

// CUTLASS layout tags of A (M x K) and B (K x N): RowMajor A and ColumnMajor B are K-major.
template <GemmForm F>
struct FormLayouts;
template <>
struct FormLayouts<GemmForm::kRows> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct FormLayouts<GemmForm::kRowsTransposed> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct FormLayouts<GemmForm::kContract> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

template <int TileM, int TileN, int TileK, bool Pingpong, int ClusterM, int ClusterN>
struct TileSpec {
  using Shape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using MainloopSchedule =
      std::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      std::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

template <GemmTile T>
struct TileConfig;
#define NODROP_GEMM_TILE(name, schedule, m, n, k, cluster_m, cluster_n)                    \
  template <>                                                                             \
  struct TileConfig<GemmTile::name>                                                       \
      : TileSpec<m, n, k, std::string_view(#schedule) == "pingpong", cluster_m, cluster_n> { \
  };
#include "engine/cuda/grouped_matmul/tiles.def"
#undef NODROP_GEMM_TILE

// The epilogue stores a tile in rounds of this subtile, each behind a barrier of the consumer
// warpgroups. CUTLASS's automatic choice for the cooperative kernel is 128x32: eight rounds per
// 128x256 tile. With a 16-bit output, 128x64 takes four rounds in the same shared memory as
// 128x32 of float32, so the mainloop keeps its four stages, and the results are bitwise the same.
//   - Weight gradients over few rows per group store a whole tile every four k-blocks, so there
//     the rounds cost about as much as the math: 128x64 made DeepSeek-V3 EP8's 9-12% faster.
//   - Forward and input gradients, timed in turns against CUTLASS's choice at Mixtral and
//     DeepSeek-V3 EP8 with uniform and Zipf sizes: 0.93-1.05x the time per kernel, 0.982-0.998x
//     for the two together. (docs/performance.md, epilogue subtile.)
template <DType Out, GemmTile T>
using EpilogueTile =
    std::conditional_t<Out != DType::kFloat32 && T == GemmTile::kCooperative128x256x64Cluster1x1,
                       cute::Shape<cute::_128, cute::_64>,
                       cutlass::epilogue::collective::EpilogueTileAuto>;

template <GemmForm F, DType In, DType Out, GemmTile T>
struct GroupedGemm {
  using ElementIn = typename CutlassElement<In>::type;
  using ElementOut = typename CutlassElement<Out>::type;
  using ElementAccumulator = float;
  using LayoutA = typename FormLayouts<F>::A;
  using LayoutB = typename FormLayouts<F>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentIn = 16 / sizeof(ElementIn);  // TMA moves 16-byte units
  static constexpr int kAlignmentOut = 16 / sizeof(ElementOut);
  using Tile = TileConfig<T>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<GroupShape>;

  // D = acc: no C operand (void), alpha 1 and beta 0 by default.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tile::Shape,
      typename Tile::Cluster, EpilogueTile<Out, T>, ElementAccumulator,
      ElementAccumulator, void, LayoutD*, kAlignmentOut, ElementOut, LayoutD*, kAlignmentOut,
      typename Tile::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignmentIn,
      ElementIn, LayoutB*, kAlignmentIn, ElementAccumulator, typename Tile::Shape,
      typename Tile::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tile::MainloopSchedule>::CollectiveOp;

  // The wider epilogue subtile must not cost the mainloop a stage.
  static_assert(!std::is_same_v<EpilogueTile<Out, T>, cute::Shape<cute::_128, cute::_64>> ||
                CollectiveMainloop::DispatchPolicy::Stages >= 4);

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // The setup kernel writes FormStrides<F>; CUTLASS must read the same types.
  static_assert(std::is_same_v<typename Kernel::InternalStrideA, typename FormStrides<F>::A>);
  static_assert(std::is_same_v<typename Kernel::InternalStrideB, typename FormStrides<F>::B>);
  static_assert(std::is_same_v<typename Kernel::InternalStrideD, typename FormStrides<F>::D>);
};

// How many clusters of this kernel fit on the device at once, asked once per device: a
// persistent grid larger than that would leave some clusters waiting for a second wave.
// Zero (the query failed) makes CUTLASS fall back to its own estimate.
template <class Kernel, class ClusterShape>
int max_active_clusters(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // zero-initialized: not asked yet
  if (device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  const void* kernel = reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>);
  const int smem_bytes = Kernel::SharedStorageSize;
  int clusters = 0;
  cudaLaunchAttribute cluster_dims = {};
  cluster_dims.id = cudaLaunchAttributeClusterDimension;
  cluster_dims.val.clusterDim.x = cute::size<0>(ClusterShape{});
  cluster_dims.val.clusterDim.y = cute::size<1>(ClusterShape{});
  cluster_dims.val.clusterDim.z = cute::size<2>(ClusterShape{});
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(cute::size<0>(ClusterShape{}), cute::size<1>(ClusterShape{}),
                        cute::size<2>(ClusterShape{}));  // one cluster
  config.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
  config.dynamicSmemBytes = smem_bytes;
  config.attrs = &cluster_dims;
  config.numAttrs = 1;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();  // the failed query must not surface as a later launch's error
    return 0;
  }
  if (device < kMaxDevices) cache[device].store(clusters, std::memory_order_relaxed);
  return clusters;
}

// The last steps of every CUTLASS launch (the bf16 and FP8 grouped GEMMs): can_implement, the
// reserved workspace against CUTLASS's need, initialize and run. Errors start with `kernel`.
template <class Gemm>
Status launch_gemm(const typename Gemm::Arguments& args, void* workspace, size_t workspace_bytes,
                   const std::string& kernel, cudaStream_t stream) {
  auto fail = [&kernel](const char* step, cutlass::Status status) {
    return Status::Error(kernel + ": CUTLASS " + step + " failed: " +
                         cutlass::cutlassGetStatusString(status));
  };
  cutlass::Status status = Gemm::can_implement(args);
  if (status != cutlass::Status::kSuccess) return fail("can_implement", status);
  if (Gemm::get_workspace_size(args) > workspace_bytes) {
    return Status::Error(kernel + ": CUTLASS needs " +
                         std::to_string(Gemm::get_workspace_size(args)) +
                         " workspace bytes, more than the " + std::to_string(workspace_bytes) +
                         " reserved");
  }
  Gemm gemm;
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) return fail("initialize", status);
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) return fail("launch", status);
  return Status::Ok();
}

template <GemmForm F, DType In, DType Out, GemmTile T>
Status run_grouped_gemm(const GroupTable& table, cudaStream_t stream) {
  using Config = GroupedGemm<F, In, Out, T>;
  using Gemm = typename Config::Gemm;
  using Kernel = typename Config::Kernel;
  using ElementIn = typename Config::ElementIn;
  using ElementOut = typename Config::ElementOut;

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {table.num_groups, table.shapes, /*host_problem_shapes=*/nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const ElementIn**>(table.ptr_a);
  args.mainloop.dA = static_cast<typename Kernel::InternalStrideA*>(table.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const ElementIn**>(table.ptr_b);
  args.mainloop.dB = static_cast<typename Kernel::InternalStrideB*>(table.stride_b);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = reinterpret_cast<ElementOut**>(table.ptr_d);
  args.epilogue.dD = static_cast<typename Kernel::InternalStrideD*>(table.stride_d);
  args.hw_info.device_id = table.device;
  args.hw_info.sm_count = table.sm_count;
  args.hw_info.max_active_clusters =
      max_active_clusters<Kernel, typename Config::Tile::Cluster>(table.device);
  using RasterOrder = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order =
      table.raster == GemmRaster::kAlongN ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = table.swizzle;

  return launch_gemm<Gemm>(args, table.gemm_workspace, table.gemm_workspace_bytes,
                           "grouped GEMM", stream);
}

}  // namespace nodrop::cuda::detail
