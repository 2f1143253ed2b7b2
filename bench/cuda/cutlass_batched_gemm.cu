// CUTLASS's own batched GEMM (GemmUniversal, kBatched: one TMA descriptor per operand, the batch
// a coordinate) with the tile, cluster and schedule of nodrop's grouped kernel, for
// grouped_matmul_bench.cu's equal-group cases: what the pointer-array machinery of the grouped
// kernel (a descriptor rewritten whenever a CTA's tile changes group) costs against the same
// tile without it. bf16 in and out, float32 accumulation, the engine's tile order (along M,
// swizzle 1).
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <type_traits>

#include "cutlass_batched_gemm.h"

namespace {

template <bool kPingpong, int kTileM, int kTileN, int kClusterM, int kClusterN, class LayoutA,
          class LayoutB>
struct BatchedGemm {
  using Element = cutlass::bfloat16_t;
  using LayoutD = cutlass::layout::RowMajor;
  using Tile = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using MainloopSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                              cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, Element,
      LayoutD, 8, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB,
      8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // D_l [rows, n] = A_l [rows, k] B_l [k, n] for l < batch, each operand's batches packed.
  static bool run(const void* a, const void* b, void* d, int rows, int n, int k, int batch,
                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
    args.problem_shape = {rows, n, k, batch};
    args.mainloop.ptr_A = static_cast<const Element*>(a);
    args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, {rows, k, batch});
    args.mainloop.ptr_B = static_cast<const Element*>(b);
    args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, {n, k, batch});
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = cutlass::make_cute_packed_stride(StrideD{}, {rows, n, batch});
    args.epilogue.ptr_D = static_cast<Element*>(d);
    args.epilogue.dD = cutlass::make_cute_packed_stride(StrideD{}, {rows, n, batch});
    args.hw_info.device_id = 0;
    args.hw_info.sm_count =
        cutlass::KernelHardwareInfo::query_device_multiprocessor_count(args.hw_info.device_id);
    using Raster = typename Kernel::TileScheduler::RasterOrderOptions;
    args.scheduler.raster_order = Raster::AlongM;
    args.scheduler.max_swizzle_size = 1;
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return false;
    return gemm.run(stream) == cutlass::Status::kSuccess;
  }
};

// Row-major A; B row-major ([K, N]: the forward's weights) or column-major (the input
// gradient's, read as [N, K] transposed).
template <bool kPingpong, int kTileM, int kTileN, int kClusterM, int kClusterN>
bool run_tile(bool b_transposed, const void* a, const void* b, void* d, int rows, int n, int k,
              int batch, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using Row = cutlass::layout::RowMajor;
  using Col = cutlass::layout::ColumnMajor;
  return b_transposed
             ? BatchedGemm<kPingpong, kTileM, kTileN, kClusterM, kClusterN, Row, Col>::run(
                   a, b, d, rows, n, k, batch, workspace, workspace_bytes, stream)
             : BatchedGemm<kPingpong, kTileM, kTileN, kClusterM, kClusterN, Row, Row>::run(
                   a, b, d, rows, n, k, batch, workspace, workspace_bytes, stream);
}

}  // namespace

bool cutlass_batched_gemm(BatchedTile tile, bool b_transposed, const void* a, const void* b,
                          void* d, int rows, int n, int k, int batch, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  switch (tile) {
    case BatchedTile::kPingpong128x128x64Cluster1x2:
      return run_tile<true, 128, 128, 1, 2>(b_transposed, a, b, d, rows, n, k, batch, workspace,
                                         workspace_bytes, stream);
    case BatchedTile::kCooperative128x256x64Cluster1x1:
      return run_tile<false, 128, 256, 1, 1>(b_transposed, a, b, d, rows, n, k, batch, workspace,
                                          workspace_bytes, stream);
    case BatchedTile::kCooperative128x256x64Cluster2x1:
      return run_tile<false, 128, 256, 2, 1>(b_transposed, a, b, d, rows, n, k, batch, workspace,
                                             workspace_bytes, stream);
    case BatchedTile::kCooperative128x256x64Cluster1x2:
      return run_tile<false, 128, 256, 1, 2>(b_transposed, a, b, d, rows, n, k, batch, workspace,
                                             workspace_bytes, stream);
  }
  return false;
}
