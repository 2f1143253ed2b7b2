// Which kernel and tile order an FP8 grouped GEMM call gets, from its static shapes, and the
// kernels' names. Host code only.
#include <cstdint>
#include <string_view>

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

const char* fp8_tensorwise_tile_name(Fp8TensorwiseTile tile) {
  switch (tile) {
    case Fp8TensorwiseTile::kAuto: return "auto";
#define NODROP_FP8_TENSORWISE_TILE(name, schedule, m, n, k, cluster_m, cluster_n, accumulation) \
  case Fp8TensorwiseTile::name:                                                                 \
    return #schedule " " #m "x" #n "x" #k ", cluster " #cluster_m "x" #cluster_n               \
                     ", " #accumulation " accumulation";
#include "engine/cuda/grouped_matmul/fp8_tensorwise_tiles.def"
#undef NODROP_FP8_TENSORWISE_TILE
  }
  return "unknown";
}

const char* fp8_tensorwise_tile_id(Fp8TensorwiseTile tile) {
  switch (tile) {
    case Fp8TensorwiseTile::kAuto: return "auto";
#define NODROP_FP8_TENSORWISE_TILE(name, schedule, m, n, k, cluster_m, cluster_n, accumulation) \
  case Fp8TensorwiseTile::name:                                                                 \
    return #schedule "_" #m "x" #n "x" #k "_" #cluster_m "x" #cluster_n "_" #accumulation;
#include "engine/cuda/grouped_matmul/fp8_tensorwise_tiles.def"
#undef NODROP_FP8_TENSORWISE_TILE
  }
  return "unknown";
}

bool fp8_tensorwise_tile_fast_accumulation(Fp8TensorwiseTile tile) {
  switch (tile) {
    case Fp8TensorwiseTile::kAuto: return false;
#define NODROP_FP8_TENSORWISE_TILE(name, schedule, m, n, k, cluster_m, cluster_n, accumulation) \
  case Fp8TensorwiseTile::name: return std::string_view(#accumulation) == "fast";
#include "engine/cuda/grouped_matmul/fp8_tensorwise_tiles.def"
#undef NODROP_FP8_TENSORWISE_TILE
  }
  return false;
}

// Measured on an H200 (nodrop_cuda_fp8_bench --configs=all, one run,
// bench/results/2026-12-02-h200-fp8-round/), against the cooperative 1x1 kernel along M:
//   - groups of at most 128 rows on average: pingpong 64x128, along N, swizzle 4, 1.18x (Qwen3's
//     2k tokens, 128 rows per group): its 64-row tiles halve the rows a group's last tile runs
//     empty;
//   - K above 4096: cooperative 1x1 along M; the 1x2 cluster lost 4% at K 7168 (DeepSeek-V3 EP8
//     rank) and 9% at K 14336 (Mixtral's down projection);
//   - otherwise cooperative on a 1x2 cluster, along M, swizzle 4, 1.01-1.15x (Mixtral, Qwen3,
//     DeepSeek-V3's down projection, 2k tokens of Mixtral), where the column tiles pair up (an
//     odd count would run an empty tile per row of tiles, as the bf16 rule avoids).
Fp8GemmSchedule grouped_matmul_fp8_schedule(int64_t M, int64_t K, int64_t N, int64_t G) {
  if (G > 0 && M <= 128 * G) {
    return Fp8GemmSchedule(Fp8GemmTile::kPingpong64x128x128Cluster1x1, GemmRaster::kAlongN,
                           /*swizzle=*/4);
  }
  const bool column_tiles_pair_up = (N + 127) / 128 % 2 == 0;
  if (K > 4096 || !column_tiles_pair_up) {
    return Fp8GemmSchedule(Fp8GemmTile::kCooperative128x128x128Cluster1x1, GemmRaster::kAlongM,
                           /*swizzle=*/1);
  }
  return Fp8GemmSchedule(Fp8GemmTile::kCooperative128x128x128Cluster1x2, GemmRaster::kAlongM,
                         /*swizzle=*/4);
}

// The weight gradient's: cooperative 128x128 on a 1x2 cluster, along N, swizzle 4. Measured on an
// H200 (nodrop_cuda_fp8_bench --mode=training --configs=all, bench/results/
// 2026-12-02-h200-fp8-wgrad/) against the 1x1 cluster along M and N and the 1x2 cluster along M:
// fastest on Mixtral, its layer's gate+up (1.14x the 1x1 along M), Qwen3 and DeepSeek-V3's two
// EP8 rank shapes, and within 1.4% of the fastest (the 1x1 along N) on Mixtral's down
// projection. The 1x1 cluster's weight-gradient kernel was dropped for it.
Fp8GemmSchedule grouped_matmul_fp8_contract_schedule(int64_t /*M*/, int64_t /*K*/, int64_t /*N*/,
                                                     int64_t /*G*/) {
  return Fp8GemmSchedule(Fp8GemmTile::kCooperative128x128x128Cluster1x2, GemmRaster::kAlongN,
                         /*swizzle=*/4);
}

// The tensorwise kernels with fast accumulation, measured on an H100 (nodrop_cuda_fp8_bench
// --configs=all, one run, bench/results/2026-12-07-fp8-tensorwise/), each kernel along M with
// swizzle 1:
//   - pingpong 128x128 where the cooperative 128x256 tile's column tiles do not pair up on its
//     1x2 cluster (an odd count runs an empty tile per row of tiles: Qwen3's N 768, 1092 against
//     792 TFLOP/s) or where groups average at most 128 rows (Qwen3's 2k tokens: 477 against
//     439);
//   - otherwise the cooperative 128x256: faster or level on 9 of the 10 other shapes (DeepSeek-V3's
//     rank shapes, Mixtral's layer, Qwen3's layer, DeepGEMM's), by up to 39% (Mixtral's down
//     projection), and 8% slower on Mixtral's 14336-wide forward;
//   - along M with swizzle 1: swizzle 4 was slower for the cooperative kernel on 7 of 8 shapes
//     and level for pingpong; along N lost on all but DeepGEMM's N 4096 (1.6% faster).
// With promoted accumulation, cooperative 128x128 on a 1x2 cluster, along N with swizzle 4: no
// other promoted tile was faster on most shapes (128x192 on either cluster: 0.84-1.25x of it,
// bench/results/2026-12-07-fp8-promoted-wide-tile/); measured on an H100 as the input gradient (nodrop_cuda_fp8_bench
// --mode=training --configs=all, bench/results/2026-12-07-fp8-tensorwise-gradients/), along N
// with swizzle 4 was faster than along M with swizzle 1 on 7 of 12 shapes (by up to 12%), level
// on 2 and slower on 3 (by up to 11%, Mixtral's down projection).
Fp8TensorwiseSchedule grouped_matmul_fp8_tensorwise_schedule(int64_t M, int64_t /*K*/,
                                                             int64_t N, int64_t G,
                                                             bool fast_accumulation) {
  if (!fast_accumulation) {
    return Fp8TensorwiseSchedule(Fp8TensorwiseTile::kCooperative128x128x128Cluster1x2Promoted,
                                 GemmRaster::kAlongN, /*swizzle=*/4);
  }
  const bool small_groups = G > 0 && M <= 128 * G;
  const bool column_tiles_pair_up = (N + 255) / 256 % 2 == 0;
  const Fp8TensorwiseTile tile = small_groups || !column_tiles_pair_up
                                     ? Fp8TensorwiseTile::kPingpong128x128x128Cluster1x2
                                     : Fp8TensorwiseTile::kCooperative128x256x128Cluster1x2;
  return Fp8TensorwiseSchedule(tile, GemmRaster::kAlongM, /*swizzle=*/1);
}

// The tensorwise weight gradient's, each group's output [K, N] tiled as the ragged rows' [M_g, N]:
// promoted, cooperative 128x192 on a 2x1 cluster along N with swizzle 4, 1.05-1.13x the
// blockwise weight gradient's tile and order (128x128 on a 1x2 cluster, along N, swizzle 4) on
// all 12 shapes of one H100 run (nodrop_cuda_fp8_bench --mode=training --configs=all,
// bench/results/2026-12-07-fp8-promoted-wide-tile/), the fastest promoted kernel on 8 of them
// and within 12% of it on the others (Mixtral's down projection, where the same tile along M
// was fastest); fast, the cooperative 128x256 where its column tiles pair up, else pingpong
// 128x128, both along N with swizzle 4 as the blockwise weight gradient.
Fp8TensorwiseSchedule grouped_matmul_fp8_tensorwise_contract_schedule(int64_t /*M*/,
                                                                      int64_t /*K*/, int64_t N,
                                                                      int64_t /*G*/,
                                                                      bool fast_accumulation) {
  Fp8TensorwiseTile tile = Fp8TensorwiseTile::kCooperative128x192x128Cluster2x1Promoted;
  if (fast_accumulation) {
    tile = (N + 255) / 256 % 2 == 0 ? Fp8TensorwiseTile::kCooperative128x256x128Cluster1x2
                                    : Fp8TensorwiseTile::kPingpong128x128x128Cluster1x2;
  }
  return Fp8TensorwiseSchedule(tile, GemmRaster::kAlongN, /*swizzle=*/4);
}

}  // namespace nodrop::cuda
