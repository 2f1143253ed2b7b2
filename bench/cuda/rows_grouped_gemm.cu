// A prototype of the grouped GEMM's rows form (D = A B_g over each group's rows; A and D packed
// by group, B [G, k, n]) with one TMA descriptor per operand: A's spans all rows and a tile may
// start at any row, B's is 3-D with the group as its third coordinate. The engine's
// pointer-array kernel instead rewrites a CTA's descriptors whenever its next tile lies in
// another group, which at 128 groups is nearly every tile
// (bench/results/2026-12-03-h200-grouped-vs-batched). grouped_matmul_bench.cu times this beside
// it to measure what that costs.
//
// It runs CUTLASS's own sm90 warp-specialized kernels (GemmUniversal) and mainloop collective and
// replaces three parts:
//   - the tile scheduler walks the groups' row tiles, reading the group offsets on the device;
//   - the mainloop's A tensor is indexed by first row instead of by row tile;
//   - the epilogue stores from registers and masks the rows past the group's end, where a TMA
//     store, which clips only at the tensor's edge, would overwrite the next group's first rows.
// A second epilogue, for groups of whole row tiles only, is CUTLASS's TMA store with D indexed
// by row tile: it measures what the register stores cost against the same kernel otherwise.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "engine/cuda/grouped_matmul/cutlass_gemm.cuh"
#include "rows_grouped_gemm.h"

namespace rows_gemm {

using namespace cute;
using cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
using cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;

constexpr int kMaxGroups = 1024;  // one thread block scans the group sizes

// Row offsets of the groups (groups + 1 of them) from their sizes.
__global__ void __launch_bounds__(kMaxGroups)
    group_offsets_kernel(const int32_t* sizes, int groups, int64_t* offsets) {
  using Scan = cub::BlockScan<int64_t, kMaxGroups>;
  __shared__ typename Scan::TempStorage scan;
  const int g = threadIdx.x;
  const int64_t size = g < groups ? sizes[g] : 0;
  int64_t first_row;
  Scan(scan).ExclusiveSum(size, first_row);
  if (g < groups) offsets[g] = first_row;
  if (g == groups - 1) offsets[groups] = first_row + size;
}

// Selects Scheduler in GemmUniversal (the specialisation of TileSchedulerSelector below).
struct SchedulerTag {};

struct SchedulerArguments {
  // Read by GemmUniversal; the scheduler has one tile order (along M within a group).
  int max_swizzle_size = 1;
  cutlass::gemm::kernel::detail::RasterOrderOptions raster_order =
      cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;
  const int64_t* offsets = nullptr;  // groups + 1 row offsets, on the device
  int groups = 0;
};

struct SchedulerParams : PersistentTileSchedulerSm90Params {
  const int64_t* offsets = nullptr;
  int32_t groups = 0;
  int32_t column_units = 0;  // clusters of column tiles across n
  int32_t clusters = 0;      // in the persistent grid
};

// Persistent: cluster c takes work units c, c + clusters, ...; a unit is one row tile of one
// group against a cluster's column tiles, units ordered by group, then column unit, then row
// tile. Each thread walks the groups forward from where its last unit was, as CUTLASS's group
// scheduler does, since its units only increase.
template <class TileShape, class ClusterShape>
class Scheduler : public PersistentTileSchedulerSm90 {
  static constexpr int kTileM = size<0>(TileShape{});
  static constexpr int kTileN = size<1>(TileShape{});
  static constexpr int kClusterN = size<1>(ClusterShape{});
  static_assert(size<0>(ClusterShape{}) == 1 && size<2>(ClusterShape{}) == 1,
                "clusters only along n: a cluster's CTAs share one group's row tile");

 public:
  using Params = SchedulerParams;
  using Arguments = SchedulerArguments;
  using WorkTileInfo = PersistentTileSchedulerSm90::WorkTileInfo;

  template <class ProblemShapeMNKL, class TileShape_, class ClusterShape_>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape_, ClusterShape_,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* = nullptr, uint32_t = 1,
                                        uint32_t = 1) {
    Params params;
    params.raster_order_ = RasterOrder::AlongM;
    params.log_swizzle_size_ = 0;
    params.offsets = args.offsets;
    params.groups = args.groups;
    const int64_t rows = get<0>(problem), n = get<1>(problem);
    const int64_t column_tiles = (n + kTileN - 1) / kTileN;
    params.column_units = static_cast<int32_t>((column_tiles + kClusterN - 1) / kClusterN);
    // At most one partial row tile per group beyond the rows' own.
    const int64_t most_units = ((rows + kTileM - 1) / kTileM + args.groups) * params.column_units;
    const int64_t fit = hw_info.max_active_clusters > 0 ? hw_info.max_active_clusters
                                                        : hw_info.sm_count / kClusterN;
    params.clusters = static_cast<int32_t>(std::max<int64_t>(1, std::min(fit, most_units)));
    return params;
  }

  static bool can_implement(Arguments const& args) {
    return args.offsets != nullptr && args.groups > 0;
  }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, ProblemShape,
                                   cutlass::KernelHardwareInfo const&,
                                   uint32_t, uint32_t = 1, uint32_t = 1) {
    return 0;
  }

  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t,
                                              uint32_t = 1, uint32_t = 1,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  template <class ProblemShape, class BlockShape, class ClusterShape_>
  static dim3 get_grid_shape(Params const& params, ProblemShape, BlockShape, ClusterShape_,
                             cutlass::KernelHardwareInfo, Arguments = Arguments{}, bool = true) {
    return dim3(params.clusters, kClusterN, 1);
  }

  // Keeps only what the walk needs: the producer warp runs it in 40 registers.
  CUTLASS_DEVICE explicit Scheduler(Params const& params)
      : offsets_(params.offsets), groups_(params.groups), column_units_(params.column_units) {
    unit_ = blockIdx.x;  // the cluster's index: clusters span only blockIdx.y
    cta_column_ = blockIdx.y;
    load_group();
  }

  template <class ClusterShape_>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape_) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() {
    while (group_ < groups_ && unit_ >= group_first_unit_ + group_units_) {
      group_first_unit_ += group_units_;
      ++group_;
      load_group();
    }
    if (group_ >= groups_) return WorkTileInfo::invalid_work_tile();
    // Fewer than 2^31 units in a group: 32-bit division.
    const int32_t unit = static_cast<int32_t>(unit_ - group_first_unit_);
    const int32_t row_tile = unit % row_tiles_, column_unit = unit / row_tiles_;
    // M_idx is the tile's first row (RowsMainloop and RowsEpilogue read it so).
    return {static_cast<int32_t>(first_row_ + int64_t(row_tile) * kTileM),
            static_cast<int32_t>(column_unit * kClusterN + cta_column_), group_, true};
  }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) {
    unit_ += int64_t(gridDim.x) * count;
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, Pipeline&, PipelineState) {
    return fetch_next_work(work);
  }

 private:
  CUTLASS_DEVICE void load_group() {
    if (group_ >= groups_) return;
    first_row_ = offsets_[group_];
    row_tiles_ = (offsets_[group_ + 1] - first_row_ + kTileM - 1) / kTileM;
    group_units_ = int64_t(row_tiles_) * column_units_;
  }

  const int64_t* offsets_;
  int32_t groups_;
  int32_t column_units_;
  int64_t unit_ = 0;
  int32_t cta_column_ = 0;
  int32_t group_ = 0;
  int64_t group_first_unit_ = 0;
  int64_t group_units_ = 0;
  int64_t first_row_ = 0;
  int32_t row_tiles_ = 1;
};

}  // namespace rows_gemm

// GemmUniversal takes its scheduler from this selector, by tag.
namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages, class Problem>
struct TileSchedulerSelector<rows_gemm::SchedulerTag, ArchTag, TileShape, ClusterShape, Stages,
                             Problem> {
  using Scheduler = rows_gemm::Scheduler<TileShape, ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace rows_gemm {

// CUTLASS's mainloop with A indexed by row: load_init's A tensor takes the tile's first row
// where CUTLASS's takes its row tile, and ignores the group coordinate (A has one descriptor
// over every group's rows; rows read past a group's end only feed rows the epilogue drops).
template <class Base>
struct RowsMainloop : Base {
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& problem,
                                typename Base::Params const& params) const {
    auto inputs = Base::load_init(problem, params);
    Tensor by_tile = get<0>(inputs);  // (BLK_M, BLK_K, row tiles, k tiles, l)
    auto stride = by_tile.stride();
    auto by_row = make_layout(
        make_shape(get<0>(by_tile.shape()), get<1>(by_tile.shape()), get<0>(problem),
                   get<3>(by_tile.shape()), get<3>(problem)),
        make_stride(get<0>(stride), get<1>(stride), get<0>(stride), get<3>(stride), Int<0>{}));
    return cute::make_tuple(make_tensor(by_tile.data(), by_row), get<1>(inputs));
  }
};

// Stores a tile from the accumulators, the rows past its group's end masked. Run by CUTLASS's
// adapter for epilogues without shared memory (Sm90TmaWarpSpecializedAdapter).
template <class Element>
struct RowsEpilogue {
  using ElementOutput = Element;
  // Named by GemmUniversalAdapter only: the stores below convert the accumulators themselves.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 2, float, float>;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementC = Element;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using ElementD = Element;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  struct Arguments {
    Element* ptr_D = nullptr;          // [rows, n] row-major
    const int64_t* offsets = nullptr;  // groups + 1 row offsets, on the device
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem, Arguments const& args) {
    return args.ptr_D != nullptr && args.offsets != nullptr && get<1>(problem) % 8 == 0;
  }

  CUTLASS_HOST_DEVICE explicit RowsEpilogue(Params const& params,
                                            SharedStorage const& = SharedStorage())
      : params(params) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem, BlockShapeMNK block_shape,
                                 BlockCoordMNKL block_coord,
                                 Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    // Each thread holds its values in pairs of adjacent columns (the innermost mode of an sm90
    // MMA's accumulator fragment): one 4-byte store per pair.
    static_assert(size<0, 0>(FrgLayout{}) == 2);
    const int64_t n = get<1>(problem);
    const int64_t first_row = get<0>(block_coord);
    const int64_t first_column = int64_t(get<1>(block_coord)) * size<1>(block_shape);
    const int64_t rows =
        cute::min(int64_t(size<0>(block_shape)),
                  params.offsets[get<3>(block_coord) + 1] - first_row);
    const int64_t columns = n - first_column;
    Tensor coords = tiled_mma.get_thread_slice(thread_idx)
                        .partition_C(make_identity_tensor(take<0, 2>(block_shape)));
    static_assert(decltype(size(coords))::value == decltype(size(accumulators))::value);
    Element* tile = params.ptr_D + first_row * n + first_column;
    using Pair = cutlass::Array<Element, 2>;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); i += 2) {
      const int r = get<0>(coords(i)), c = get<1>(coords(i));
      if (r < rows && c < columns) {
        Pair pair;
        pair[0] = Element(accumulators(i));
        pair[1] = Element(accumulators(i + 1));
        *reinterpret_cast<Pair*>(tile + r * n + c) = pair;
      }
    }
  }

  Params params;
};

// CUTLASS's TMA epilogue with D indexed by row tile: the scheduler's M_idx is the tile's first
// row, a whole row tile's where every group is (the caller's promise), and D has one descriptor
// over every group's rows, so the group coordinate is dropped.
template <class Base, int kTileM>
struct RowsTmaEpilogue : Base {
  using Base::Base;

  template <class Coord>
  CUTLASS_DEVICE static auto by_row_tile(Coord coord) {
    return make_coord(get<0>(coord) / kTileM, get<1>(coord), get<2>(coord), 0);
  }

  template <class LoadPipeline, class LoadState, class Problem, class TileShapeMNK, class Coord,
            class TiledMma>
  CUTLASS_DEVICE auto load(LoadPipeline pipeline, LoadState state, Problem problem,
                           TileShapeMNK tile_shape, Coord coord, TiledMma tiled_mma,
                           int thread_idx, typename Base::TensorStorage& storage,
                           int subtile_idx = -1) {
    return Base::load(pipeline, state, problem, tile_shape, by_row_tile(coord), tiled_mma,
                      thread_idx, storage, subtile_idx);
  }

  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState,
            class Problem, class TileShapeMNK, class Coord, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state,
                            StorePipeline store_pipeline, StoreState store_state, Problem problem,
                            TileShapeMNK tile_shape, Coord coord,
                            Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma,
                            int thread_idx, typename Base::TensorStorage& storage,
                            int subtile_idx = -1) {
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem,
                       tile_shape, by_row_tile(coord), accumulators, tiled_mma, thread_idx,
                       storage, subtile_idx);
  }
};

template <bool kPingpong, int kTileN, int kClusterN, class LayoutB, bool kTmaStore>
struct RowsGemm {
  using Element = cutlass::bfloat16_t;
  using Tile = Shape<_128, Int<kTileN>, _64>;
  using Cluster = Shape<_1, Int<kClusterN>, _1>;
  using MainloopSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using LayoutD = cutlass::layout::RowMajor;
  using TmaEpilogue = RowsTmaEpilogue<
      typename cutlass::epilogue::collective::CollectiveBuilder<
          cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
          cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8,
          Element, LayoutD, 8,
          std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                             cutlass::epilogue::TmaWarpSpecializedCooperative>,
          cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp,
      128>;
  using Epilogue = std::conditional_t<
      kTmaStore, TmaEpilogue,
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<RowsEpilogue<Element>>>;
  // The TMA epilogue's shared memory comes out of the mainloop's stages; the register one has
  // none.
  static constexpr int kEpilogueSmem = kTmaStore ? sizeof(typename Epilogue::SharedStorage) : 0;
  using Mainloop = RowsMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8,
      Element, LayoutB, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>,
      MainloopSchedule>::CollectiveOp>;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                           SchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static bool run(const void* a, const void* b, void* d, const int64_t* offsets, int rows, int n,
                  int k, int groups, cudaStream_t stream) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
    args.problem_shape = {rows, n, k, groups};
    args.mainloop.ptr_A = static_cast<const Element*>(a);
    // A's descriptor gets a group mode too (CUTLASS's collective makes every operand 3-D), which
    // RowsMainloop never moves along.
    args.mainloop.dA = cutlass::make_cute_packed_stride(StrideA{}, {rows, k, groups});
    args.mainloop.ptr_B = static_cast<const Element*>(b);
    args.mainloop.dB = cutlass::make_cute_packed_stride(StrideB{}, {n, k, groups});
    if constexpr (kTmaStore) {
      using StrideD = typename Kernel::StrideD;
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = cutlass::make_cute_packed_stride(StrideD{}, {rows, n, groups});
      args.epilogue.ptr_D = static_cast<Element*>(d);
      args.epilogue.dD = args.epilogue.dC;
    } else {
      args.epilogue.ptr_D = static_cast<Element*>(d);
      args.epilogue.offsets = offsets;
    }
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
    args.hw_info.max_active_clusters =
        nodrop::cuda::detail::max_active_clusters<Kernel, Cluster>(device);
    args.scheduler.offsets = offsets;
    args.scheduler.groups = groups;
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    if (Gemm::get_workspace_size(args) != 0) return false;
    if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return false;
    return gemm.run(stream) == cutlass::Status::kSuccess;
  }
};

template <bool kPingpong, int kTileN, int kClusterN, class LayoutB>
bool run_store(RowsStore store, const void* a, const void* b, void* d, const int64_t* offsets,
               int rows, int n, int k, int groups, cudaStream_t stream) {
  return store == RowsStore::kTmaWholeRowTiles
             ? RowsGemm<kPingpong, kTileN, kClusterN, LayoutB, true>::run(a, b, d, offsets, rows,
                                                                         n, k, groups, stream)
             : RowsGemm<kPingpong, kTileN, kClusterN, LayoutB, false>::run(a, b, d, offsets, rows,
                                                                          n, k, groups, stream);
}

template <bool kPingpong, int kTileN, int kClusterN>
bool run_tile(RowsStore store, bool b_transposed, const void* a, const void* b, void* d,
              const int64_t* offsets, int rows, int n, int k, int groups, cudaStream_t stream) {
  using Row = cutlass::layout::RowMajor;
  using Col = cutlass::layout::ColumnMajor;
  return b_transposed ? run_store<kPingpong, kTileN, kClusterN, Col>(store, a, b, d, offsets,
                                                                     rows, n, k, groups, stream)
                      : run_store<kPingpong, kTileN, kClusterN, Row>(store, a, b, d, offsets,
                                                                     rows, n, k, groups, stream);
}

}  // namespace rows_gemm

size_t rows_grouped_gemm_workspace_bytes(int groups) {
  return static_cast<size_t>(groups + 1) * sizeof(int64_t);
}

bool rows_grouped_gemm(RowsTile tile, RowsStore store, bool b_transposed, const void* a,
                       const void* b, void* d, const int32_t* group_sizes, int rows, int n, int k,
                       int groups, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (groups < 1 || groups > rows_gemm::kMaxGroups ||
      workspace_bytes < rows_grouped_gemm_workspace_bytes(groups)) {
    return false;
  }
  auto* offsets = static_cast<int64_t*>(workspace);
  rows_gemm::group_offsets_kernel<<<1, rows_gemm::kMaxGroups, 0, stream>>>(group_sizes, groups,
                                                                           offsets);
  if (cudaGetLastError() != cudaSuccess) return false;
  switch (tile) {
    case RowsTile::kPingpong128x128x64Cluster1x2:
      return rows_gemm::run_tile<true, 128, 2>(store, b_transposed, a, b, d, offsets, rows, n, k,
                                               groups, stream);
    case RowsTile::kCooperative128x256x64Cluster1x1:
      return rows_gemm::run_tile<false, 256, 1>(store, b_transposed, a, b, d, offsets, rows, n, k,
                                                groups, stream);
  }
  return false;
}
