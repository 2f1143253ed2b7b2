// Which kernel and tile order a grouped GEMM call gets, from its static shapes and the GPU's memory
// bandwidth and L2 size: the rules the H200 measurements settled, and one from the H100's
// (docs/performance.md). Host code only, unit-tested by tests/cpp/tile_rule_test.cc without a GPU.
#include <algorithm>
#include <cstdint>

#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {

const char* gemm_raster_name(GemmRaster raster) {
  switch (raster) {
    case GemmRaster::kAuto: return "auto";
    case GemmRaster::kAlongM: return "along M";
    case GemmRaster::kAlongN: return "along N";
  }
  return "unknown";
}

const char* gemm_tile_name(GemmTile tile) {
  switch (tile) {
    case GemmTile::kAuto: return "auto";
#define NODROP_GEMM_TILE(name, schedule, m, n, k, cluster_m, cluster_n) \
  case GemmTile::name: return #schedule " " #m "x" #n "x" #k ", cluster " #cluster_m "x" #cluster_n;
#include "engine/cuda/grouped_matmul/tiles.def"
#undef NODROP_GEMM_TILE
  }
  return "unknown";
}

const char* gemm_tile_id(GemmTile tile) {
  switch (tile) {
    case GemmTile::kAuto: return "auto";
#define NODROP_GEMM_TILE(name, schedule, m, n, k, cluster_m, cluster_n) \
  case GemmTile::name: return #schedule "_" #m "x" #n "x" #k "_" #cluster_m "x" #cluster_n;
#include "engine/cuda/grouped_matmul/tiles.def"
#undef NODROP_GEMM_TILE
  }
  return "unknown";
}

// From the H200 benchmark of every tile at thirteen MoE shapes and three routings (the tile
// decisions in docs/performance.md):
//   - A long contraction (over 2048, ragged or not) favours the cooperative 128x256 tile, whose
//     operand tiles feed twice the math per byte. A very short one (a weight gradient of at most
//     256 rows per group) is bound by writing its K x N output: there wide tiles pay fewer
//     prologues and epilogues, and at most 128 rows the 256x192 tile with its 1x2 cluster beats
//     the 128x256 one by 4-9%. Everything else runs faster on ping-pong 128x128, whose two
//     warpgroups hide each other's epilogue.
//   - At the power limit, which a training step reaches within a second, one more case favours
//     the cooperative tile (timed at the power limit, docs/performance.md): a contraction of 2048
//     over at most two row tiles per group against many column tiles, where the weights
//     outweigh the rows read (DeepSeek-V3's input gradient on one EP8 rank, in three runs: 3-9%
//     faster with uniform and router-like sizes, from 1% slower to 2% faster with Zipf). Other
//     contractions of 2048 did not gain.
//   - A 2-CTA cluster (multicast) beats none by a few percent, unless CUTLASS's rounding of each
//     group's tiles up to whole clusters runs too many tiles empty. 1x2 wastes nothing when the
//     column tiles pair up, else one column tile in `col_tiles`; 2x1 wastes nothing on a weight
//     gradient's static, even row tiles, and on ragged rows half a tile per group on average.
//   - Ping-pong's 128x128 tile reads a third more operand bytes per FLOP than the cooperative
//     128x256 one. On an H100 (3.35 TB/s of HBM against the H200's 4.8) the cooperative tile ran
//     forwards and input gradients of 1024 to 8192 rows per group 4-30% faster in the kernel
//     benchmark, and the training steps of the presets 0.8-2.0% faster
//     (bench/results/2026-12-07-step-trace/); on the H200 the two were within 3% on those
//     shapes. Weight gradients keep ping-pong where it won on both.
GemmTile grouped_matmul_tile(int64_t M, int64_t K, int64_t N, int64_t G, bool contract,
                             int64_t memory_bandwidth) {
  const int64_t rows_per_group = M / (G > 0 ? G : 1);
  const int64_t depth = contract ? rows_per_group : K;
  auto tiles = [](int64_t extent, int64_t tile) {
    return extent > tile ? (extent + tile - 1) / tile : int64_t{1};
  };
  const int64_t wide_col_tiles = tiles(N, 192);
  if (contract && depth <= 128 && (wide_col_tiles % 2 == 0 || wide_col_tiles >= 8)) {
    return GemmTile::kCooperative256x192x64Cluster1x2;
  }
  const int64_t col_tiles = tiles(N, 128);
  const bool weights_outweigh_rows =
      !contract && depth >= 2048 && rows_per_group <= 256 && col_tiles >= 32;
  const bool operand_bound = !contract && rows_per_group >= 1024 && memory_bandwidth > 0 &&
                             memory_bandwidth < kPingpongMemoryBandwidth;
  if (depth > 2048 || (contract && depth <= 256) || weights_outweigh_rows || operand_bound) {
    return GemmTile::kCooperative128x256x64Cluster1x1;
  }
  if (col_tiles % 2 == 0) return GemmTile::kPingpong128x128x64Cluster1x2;
  const double waste_1x2 = 1.0 / col_tiles;
  const int64_t row_tiles = tiles(contract ? K : rows_per_group, 128);
  const double waste_2x1 = contract ? (row_tiles % 2 == 0 ? 0.0 : 1.0 / row_tiles)
                                    : 0.5 / row_tiles;
  if (std::min(waste_1x2, waste_2x1) > 0.125) return GemmTile::kPingpong128x128x64Cluster1x1;
  return waste_2x1 < waste_1x2 ? GemmTile::kPingpong128x128x64Cluster2x1
                               : GemmTile::kPingpong128x128x64Cluster1x2;
}

// From the raster sweep (docs/performance.md, raster order): walking
// along N made the Mixtral layer's down-projection weight gradient 7-11% faster; no other case
// gained consistently.
GemmRaster grouped_matmul_raster(int64_t M, int64_t K, int64_t N, int64_t G, bool contract,
                                 int64_t in_bytes, int64_t l2_bytes) {
  const int64_t a_bytes = K * (M / (G > 0 ? G : 1)) * in_bytes;
  const bool walk_n = contract && K > N && 2 * a_bytes > l2_bytes;
  return walk_n ? GemmRaster::kAlongN : GemmRaster::kAlongM;
}

}  // namespace nodrop::cuda
