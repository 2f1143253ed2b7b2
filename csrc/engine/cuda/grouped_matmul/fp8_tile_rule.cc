// Which kernel and tile order an FP8 blockwise grouped GEMM call gets, from its static shapes, and
// the kernels' names. Host code only.
#include <cstdint>

#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {

const char* fp8_gemm_tile_name(Fp8GemmTile tile) {
  switch (tile) {
    case Fp8GemmTile::kAuto: return "auto";
#define NODROP_FP8_GEMM_TILE(name, schedule, m, n, k, cluster_m, cluster_n) \
  case Fp8GemmTile::name: return #schedule " " #m "x" #n "x" #k ", cluster " #cluster_m "x" #cluster_n;
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_GEMM_TILE
  }
  return "unknown";
}

const char* fp8_gemm_tile_id(Fp8GemmTile tile) {
  switch (tile) {
    case Fp8GemmTile::kAuto: return "auto";
#define NODROP_FP8_GEMM_TILE(name, schedule, m, n, k, cluster_m, cluster_n) \
  case Fp8GemmTile::name: return #schedule "_" #m "x" #n "x" #k "_" #cluster_m "x" #cluster_n;
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_GEMM_TILE
  }
  return "unknown";
}

// The candidates of fp8_tiles.def are not measured yet: every shape keeps the configuration of
// the first kernel until a benchmark of all of them (nodrop_cuda_fp8_bench --configs=all) says
// which wins where. The shapes are the hook for that rule.
Fp8GemmSchedule grouped_matmul_fp8_schedule(int64_t /*M*/, int64_t /*K*/, int64_t /*N*/,
                                            int64_t /*G*/) {
  return Fp8GemmSchedule(Fp8GemmTile::kCooperative128x128x128Cluster1x1, GemmRaster::kAlongM,
                         /*swizzle=*/1);
}

}  // namespace nodrop::cuda
