// Scratch experiment: main's GroupedGemm with the epilogue tile as a parameter.
#pragma once
#include <cstdio>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include "engine/cuda/group_table.cuh"

namespace exp_epi {
using namespace nodrop::cuda::detail;
template <int TM, int TN, bool Pingpong, int CM, int CN, int EM, int EN>  // EM == 0: EpilogueTileAuto
struct Variant {
  using ElementIn = cutlass::bfloat16_t;
  using ElementOut = cutlass::bfloat16_t;
  using Shape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using MainloopSchedule = std::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using EpiTile = std::conditional_t<EM == 0, cutlass::epilogue::collective::EpilogueTileAuto, cute::Shape<cute::Int<(EM ? EM : 1)>, cute::Int<(EN ? EN : 1)>>>;
  using LayoutD = cutlass::layout::RowMajor;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Shape, Cluster, EpiTile, float, float, void, LayoutD*, 8, ElementOut, LayoutD*, 8,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, cutlass::layout::ColumnMajor*, 8, ElementIn, cutlass::layout::RowMajor*, 8, float, Shape, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>, MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<GroupShape>, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static int stages() { return CollectiveMainloop::DispatchPolicy::Stages; }
  static int run(const GroupTable& table, bool along_n, cudaStream_t stream);
};

template <int TM, int TN, bool P, int CM, int CN, int EM, int EN>
int Variant<TM, TN, P, CM, CN, EM, EN>::run(const GroupTable& table, bool along_n, cudaStream_t stream) {
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {table.num_groups, table.shapes, nullptr};
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
  using RasterOrder = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = 1;
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (Gemm::get_workspace_size(args) > table.gemm_workspace_bytes) return 2;
  Gemm gemm;
  if (gemm.initialize(args, table.gemm_workspace, stream) != cutlass::Status::kSuccess) return 3;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 4;
  return 0;
}
}  // namespace exp_epi
