// The grouped GEMM's tile rules (csrc/engine/cuda/grouped_matmul/tile_rule.cc, fp8_tile_rule.cc):
// host code, so these run in ctest without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <iterator>
#include <set>
#include <string>
#include <utility>

#include "nodrop/engine_cuda.h"

namespace {

using nodrop::cuda::GemmRaster;
using nodrop::cuda::GemmTile;

// Memory bandwidths in bytes a second: the H200's rule is the one measured on most shapes.
constexpr int64_t kH200 = int64_t{4'800'000'000'000};
constexpr int64_t kH100 = int64_t{3'350'000'000'000};

// Every tile of tiles.def has a distinct name and id, and kAuto is none of them.
TEST(TileList, NamesAndIdsAreDistinct) {
  std::set<std::string> names, ids;
  for (GemmTile tile : nodrop::cuda::kGemmTiles) {
    EXPECT_NE(tile, GemmTile::kAuto);
    names.insert(nodrop::cuda::gemm_tile_name(tile));
    ids.insert(nodrop::cuda::gemm_tile_id(tile));
  }
  EXPECT_EQ(names.size(), std::size(nodrop::cuda::kGemmTiles));
  EXPECT_EQ(ids.size(), std::size(nodrop::cuda::kGemmTiles));
  EXPECT_STREQ(nodrop::cuda::gemm_tile_name(GemmTile::kPingpong128x128x64Cluster1x2),
               "pingpong 128x128x64, cluster 1x2");
  EXPECT_STREQ(nodrop::cuda::gemm_tile_id(GemmTile::kCooperative256x192x64Cluster1x2),
               "cooperative_256x192x64_1x2");
}

// CUTLASS rounds each group's tiles up to whole clusters and runs the extra tiles empty. The
// automatic choice pairs column tiles (1x2) whenever they pair up, and otherwise never takes a
// cluster that would waste more than an eighth of the tiles.
TEST(TileRule, AutoClusterWastesLittle) {
  using nodrop::cuda::grouped_matmul_tile;
  auto waste = [](int64_t tiles, int64_t cluster) {
    return static_cast<double>((tiles + cluster - 1) / cluster * cluster - tiles) / tiles;
  };
  for (int64_t M : {64, 1024, 4096, 131072}) {
    for (int64_t K : {64, 1408, 2048, 7168}) {
      for (int64_t N : {8, 384, 768, 1408, 14336}) {
        for (int64_t G : {0, 1, 8, 128}) {
          SCOPED_TRACE(std::to_string(M) + " " + std::to_string(K) + " " + std::to_string(N) +
                       " " + std::to_string(G));
          const int64_t col_tiles = (N + 127) / 128, row_tiles = (K + 127) / 128;
          for (auto [contract, bandwidth] :
               {std::pair{false, kH200}, {true, kH200}, {false, kH100}, {true, kH100}}) {
            const GemmTile tile = grouped_matmul_tile(M, K, N, G, contract, bandwidth);
            EXPECT_NE(tile, GemmTile::kAuto);
            if (tile == GemmTile::kPingpong128x128x64Cluster1x2) {
              EXPECT_LE(waste(col_tiles, 2), 0.125);
            }
            if (tile == GemmTile::kPingpong128x128x64Cluster2x1 && contract) {
              EXPECT_LE(waste(row_tiles, 2), 0.125);
            }
            if (tile == GemmTile::kCooperative256x192x64Cluster1x2) {
              EXPECT_LE(waste((N + 191) / 192, 2), 0.125);
            }
            const bool pingpong = tile != GemmTile::kCooperative128x256x64Cluster1x1 &&
                                  tile != GemmTile::kCooperative256x192x64Cluster1x2;
            if (col_tiles % 2 == 0 && pingpong) {
              EXPECT_EQ(tile, GemmTile::kPingpong128x128x64Cluster1x2);
            }
          }
        }
      }
    }
  }
}

// At the power limit the cooperative tile also takes a contraction of 2048 over at most two row
// tiles per group against many column tiles; other contractions of 2048 stay on ping-pong.
TEST(TileRule, AutoCooperativeWhereWeightsOutweighRows) {
  using nodrop::cuda::grouped_matmul_tile;
  // DeepSeek-V3, one EP8 rank: the input gradient contracts 2048 over 256 rows per group
  // against 7168 columns.
  EXPECT_EQ(grouped_matmul_tile(8192, 2048, 7168, 32, false, kH200),
            GemmTile::kCooperative128x256x64Cluster1x1);
  // The mixtral preset's down-projection input gradient: 8192 rows per group.
  EXPECT_EQ(grouped_matmul_tile(65536, 2048, 5632, 8, false, kH200),
            GemmTile::kPingpong128x128x64Cluster1x2);
  // Qwen3-30B-A3B at 2k tokens: 128 rows per group, but only 768 columns.
  EXPECT_EQ(grouped_matmul_tile(16384, 2048, 768, 128, false, kH200),
            GemmTile::kPingpong128x128x64Cluster1x2);
  // A weight gradient is never taken by this rule: one contracting 2048 rows per group into
  // 2048 x 7168 stays on ping-pong.
  EXPECT_EQ(grouped_matmul_tile(65536, 2048, 7168, 32, true, kH200),
            GemmTile::kPingpong128x128x64Cluster1x2);
}

// Below the H200's memory bandwidth, forwards and input gradients of at least 1024 rows per group
// run on the cooperative tile, which reads fewer operand bytes per FLOP; weight gradients, small
// groups and a GPU whose bandwidth CUDA does not report keep the H200's rule.
TEST(TileRule, AutoCooperativeWhereOperandBound) {
  using nodrop::cuda::grouped_matmul_tile;
  constexpr GemmTile kCooperative = GemmTile::kCooperative128x256x64Cluster1x1;
  // The mixtral preset's gate+up forward and down-projection input gradient (8192 rows per
  // group), Qwen3-30B-A3B's forward and input gradient (1024), DeepSeek-V2-Lite's (1536).
  for (auto [M, K, N, G] : {std::array<int64_t, 4>{65536, 2048, 11264, 8},
                            {65536, 2048, 5632, 8}, {131072, 2048, 768, 128},
                            {131072, 768, 2048, 128}, {98304, 2048, 1408, 64},
                            {98304, 1408, 2048, 64}}) {
    SCOPED_TRACE(std::to_string(M) + " " + std::to_string(K) + " " + std::to_string(N));
    EXPECT_EQ(grouped_matmul_tile(M, K, N, G, false, kH100), kCooperative);
    EXPECT_NE(grouped_matmul_tile(M, K, N, G, false, kH200), kCooperative);
    EXPECT_NE(grouped_matmul_tile(M, K, N, G, false, 0), kCooperative);
    EXPECT_EQ(grouped_matmul_tile(M, K, N, G, true, kH100),
              grouped_matmul_tile(M, K, N, G, true, kH200));
  }
  // Qwen3-30B-A3B at 2k tokens: 128 rows per group stay on ping-pong.
  EXPECT_EQ(grouped_matmul_tile(16384, 2048, 768, 128, false, kH100),
            GemmTile::kPingpong128x128x64Cluster1x2);
}

// Walking along N pays only for a weight gradient whose A operand (K x the group's rows) is the
// larger one and would not stay in the L2 (H200: 60 MiB) while the scheduler walks a column.
TEST(TileRule, AutoRasterWalksAlongNOnlyForLargeWeightGradientA) {
  using nodrop::cuda::grouped_matmul_raster;
  const int64_t l2 = int64_t{60} << 20;
  // Mixtral layer, 16384 tokens x top-2 over 8 experts: the down projection's weight gradient
  // contracts 4096 rows per group against K = 14336 (A is 112 MiB).
  EXPECT_EQ(grouped_matmul_raster(32768, 14336, 4096, 8, true, 2, l2), GemmRaster::kAlongN);
  // Its gate/up weight gradient: A (K = 4096) is the smaller operand.
  EXPECT_EQ(grouped_matmul_raster(32768, 4096, 28672, 8, true, 2, l2), GemmRaster::kAlongM);
  // The same down projection on a GPU whose L2 holds twice A.
  EXPECT_EQ(grouped_matmul_raster(32768, 14336, 4096, 8, true, 2, 4 * l2), GemmRaster::kAlongM);
  // A few rows per group: A is small whatever K is.
  EXPECT_EQ(grouped_matmul_raster(2048, 14336, 4096, 8, true, 2, l2), GemmRaster::kAlongM);
  // Forward and input gradient never walk along N.
  EXPECT_EQ(grouped_matmul_raster(32768, 14336, 4096, 8, false, 2, l2), GemmRaster::kAlongM);
  // No groups: no division by zero, and the default order.
  EXPECT_EQ(grouped_matmul_raster(0, 14336, 4096, 0, true, 2, l2), GemmRaster::kAlongM);
}

// Every tile of fp8_tiles.def has a distinct name and id, and kAuto is none of them.
TEST(Fp8TileList, NamesAndIdsAreDistinct) {
  using nodrop::cuda::Fp8GemmTile;
  std::set<std::string> names, ids;
  for (Fp8GemmTile tile : nodrop::cuda::kFp8GemmTiles) {
    EXPECT_NE(tile, Fp8GemmTile::kAuto);
    names.insert(nodrop::cuda::fp8_gemm_tile_name(tile));
    ids.insert(nodrop::cuda::fp8_gemm_tile_id(tile));
  }
  EXPECT_EQ(names.size(), std::size(nodrop::cuda::kFp8GemmTiles));
  EXPECT_EQ(ids.size(), std::size(nodrop::cuda::kFp8GemmTiles));
  EXPECT_STREQ(nodrop::cuda::fp8_gemm_tile_id(Fp8GemmTile::kPingpong64x128x128Cluster1x1),
               "pingpong_64x128x128_1x1");
}

// The same for fp8_tensorwise_tiles.def.
TEST(Fp8TensorwiseTileList, NamesAndIdsAreDistinct) {
  using nodrop::cuda::Fp8TensorwiseTile;
  std::set<std::string> names, ids;
  for (Fp8TensorwiseTile tile : nodrop::cuda::kFp8TensorwiseTiles) {
    EXPECT_NE(tile, Fp8TensorwiseTile::kAuto);
    names.insert(nodrop::cuda::fp8_tensorwise_tile_name(tile));
    ids.insert(nodrop::cuda::fp8_tensorwise_tile_id(tile));
  }
  EXPECT_EQ(names.size(), std::size(nodrop::cuda::kFp8TensorwiseTiles));
  EXPECT_EQ(ids.size(), std::size(nodrop::cuda::kFp8TensorwiseTiles));
  EXPECT_STREQ(
      nodrop::cuda::fp8_tensorwise_tile_id(Fp8TensorwiseTile::kCooperative128x256x128Cluster1x2),
      "cooperative_128x256x128_1x2_fast");
  EXPECT_STREQ(nodrop::cuda::fp8_tensorwise_tile_name(
                   Fp8TensorwiseTile::kCooperative128x128x128Cluster1x2Promoted),
               "cooperative 128x128x128, cluster 1x2, promoted accumulation");
}

// Each tile says how it accumulates, and the list holds both kinds.
TEST(Fp8TensorwiseTileList, TilesOfBothAccumulations) {
  using nodrop::cuda::Fp8TensorwiseTile;
  int fast = 0;
  for (Fp8TensorwiseTile tile : nodrop::cuda::kFp8TensorwiseTiles) {
    const std::string id = nodrop::cuda::fp8_tensorwise_tile_id(tile);
    const bool is_fast = nodrop::cuda::fp8_tensorwise_tile_fast_accumulation(tile);
    EXPECT_EQ(id.substr(id.rfind('_') + 1), is_fast ? "fast" : "promoted") << id;
    fast += is_fast;
  }
  EXPECT_GT(fast, 0);
  EXPECT_LT(fast, static_cast<int>(std::size(nodrop::cuda::kFp8TensorwiseTiles)));
  EXPECT_FALSE(nodrop::cuda::fp8_tensorwise_tile_fast_accumulation(Fp8TensorwiseTile::kAuto));
}

// The tensorwise rule (fp8_tile_rule.cc) on the benchmark's shapes: pingpong where groups average
// at most 128 rows or the 128x256 tile's column tiles do not pair up, else the cooperative tile;
// always along M, swizzle 1.
TEST(Fp8TensorwiseTileRule, PicksTheMeasuredScheduleByShape) {
  using nodrop::cuda::Fp8TensorwiseTile;
  const Fp8TensorwiseTile pingpong = Fp8TensorwiseTile::kPingpong128x128x128Cluster1x2;
  const Fp8TensorwiseTile cooperative = Fp8TensorwiseTile::kCooperative128x256x128Cluster1x2;
  struct Case {
    int64_t M, K, N, G;
    Fp8TensorwiseTile tile;
  };
  for (const Case& c : {Case{16384, 2048, 768, 128, pingpong},       // 128 rows a group
                        Case{131072, 2048, 768, 128, pingpong},      // 3 column tiles of 256
                        Case{131072, 2048, 1536, 128, cooperative},  // Qwen3's gate+up
                        Case{8192, 7168, 2048, 32, cooperative},     // DeepSeek-V3 EP8 rank
                        Case{16384, 14336, 4096, 8, cooperative},    // Mixtral's down
                        Case{32768, 2048, 7168, 4, cooperative},     // DeepGEMM's N 7168
                        Case{0, 128, 128, 0, pingpong}}) {           // no groups, 1 column tile
    const auto schedule = nodrop::cuda::grouped_matmul_fp8_tensorwise_schedule(
        c.M, c.K, c.N, c.G, /*fast_accumulation=*/true);
    EXPECT_EQ(schedule.tile, c.tile) << c.M << "x" << c.K << "x" << c.N << ", G " << c.G;
    EXPECT_EQ(schedule.raster, GemmRaster::kAlongM) << c.M << "x" << c.K << "x" << c.N;
    EXPECT_EQ(schedule.swizzle, 1) << c.M << "x" << c.K << "x" << c.N;
  }
}

// Every tensorwise rule, both forms and accumulations, picks a tile of the accumulation asked
// for, in a resolved order: promoted, along N with swizzle 4, the 128x128 tile on a 1x2 cluster
// for the input gradient and the 128x192 on a 2x1 cluster for the weight gradient (measured).
TEST(Fp8TensorwiseTileRule, PicksATileOfTheAccumulationAskedFor) {
  using nodrop::cuda::Fp8TensorwiseTile;
  struct Shape {
    int64_t M, K, N, G;
  };
  for (const Shape& s : {Shape{16384, 2048, 768, 128}, Shape{131072, 2048, 768, 128},
                         Shape{8192, 7168, 2048, 32}, Shape{16384, 14336, 4096, 8},
                         Shape{16384, 4096, 14336, 8}, Shape{0, 128, 128, 0}}) {
    for (bool fast : {false, true}) {
      for (const auto& schedule :
           {nodrop::cuda::grouped_matmul_fp8_tensorwise_schedule(s.M, s.K, s.N, s.G, fast),
            nodrop::cuda::grouped_matmul_fp8_tensorwise_contract_schedule(s.M, s.K, s.N, s.G,
                                                                          fast)}) {
        EXPECT_EQ(nodrop::cuda::fp8_tensorwise_tile_fast_accumulation(schedule.tile), fast)
            << s.M << "x" << s.K << "x" << s.N << ", G " << s.G;
        EXPECT_NE(schedule.raster, GemmRaster::kAuto);
        EXPECT_NE(schedule.swizzle, 0);
      }
    }
  }
  for (const auto& schedule :
       {nodrop::cuda::grouped_matmul_fp8_tensorwise_schedule(16384, 2048, 768, 128, false),
        nodrop::cuda::grouped_matmul_fp8_tensorwise_schedule(16384, 4096, 14336, 8, false)}) {
    EXPECT_EQ(schedule.tile, Fp8TensorwiseTile::kCooperative128x128x128Cluster1x2Promoted);
    EXPECT_EQ(schedule.raster, GemmRaster::kAlongN);
    EXPECT_EQ(schedule.swizzle, 4);
  }
  for (const auto& schedule :
       {nodrop::cuda::grouped_matmul_fp8_tensorwise_contract_schedule(16384, 4096, 14336, 8,
                                                                      false),
        nodrop::cuda::grouped_matmul_fp8_tensorwise_contract_schedule(131072, 2048, 768, 128,
                                                                      false)}) {
    EXPECT_EQ(schedule.tile, Fp8TensorwiseTile::kCooperative128x192x128Cluster2x1Promoted);
    EXPECT_EQ(schedule.raster, GemmRaster::kAlongN);
    EXPECT_EQ(schedule.swizzle, 4);
  }
  EXPECT_EQ(
      nodrop::cuda::grouped_matmul_fp8_tensorwise_contract_schedule(131072, 2048, 768, 128, true)
          .tile,
      Fp8TensorwiseTile::kPingpong128x128x128Cluster1x2);
}

// The measured rule (fp8_tile_rule.cc) on the benchmark's shapes.
TEST(Fp8TileRule, PicksTheMeasuredScheduleByShape) {
  using nodrop::cuda::Fp8GemmTile;
  struct Case {
    int64_t M, K, N, G;
    Fp8GemmTile tile;
    GemmRaster raster;
    int swizzle;
  };
  const Fp8GemmTile pingpong = Fp8GemmTile::kPingpong64x128x128Cluster1x1;
  const Fp8GemmTile one = Fp8GemmTile::kCooperative128x128x128Cluster1x1;
  const Fp8GemmTile pair = Fp8GemmTile::kCooperative128x128x128Cluster1x2;
  for (const Case& c : {
           Case{16384, 2048, 768, 128, pingpong, GemmRaster::kAlongN, 4},   // 128 rows a group
           Case{131072, 2048, 768, 128, pair, GemmRaster::kAlongM, 4},      // Qwen3
           Case{16384, 4096, 14336, 8, pair, GemmRaster::kAlongM, 4},       // Mixtral
           Case{8192, 7168, 2048, 32, one, GemmRaster::kAlongM, 1},         // K above 4096
           Case{16384, 14336, 4096, 8, one, GemmRaster::kAlongM, 1},        // Mixtral down
           Case{98304, 2048, 1408, 64, one, GemmRaster::kAlongM, 1},        // 11 column tiles
           Case{0, 128, 128, 0, one, GemmRaster::kAlongM, 1}}) {            // no groups
    const auto schedule = nodrop::cuda::grouped_matmul_fp8_schedule(c.M, c.K, c.N, c.G);
    EXPECT_EQ(schedule.tile, c.tile) << c.M << "x" << c.K << "x" << c.N << ", G " << c.G;
    EXPECT_EQ(schedule.raster, c.raster) << c.M << "x" << c.K << "x" << c.N;
    EXPECT_EQ(schedule.swizzle, c.swizzle) << c.M << "x" << c.K << "x" << c.N;
  }
}

// The weight gradient's rule names a tile that has a weight-gradient kernel (fp8_tiles.def's
// NODROP_FP8_CONTRACT_TILE lines), in a resolved order, for every shape measured.
TEST(Fp8TileRule, ContractScheduleHasAWeightGradientKernel) {
  using nodrop::cuda::Fp8GemmTile;
  const Fp8GemmTile contract_tiles[] = {
#define NODROP_FP8_GEMM_TILE(...)
#define NODROP_FP8_CONTRACT_TILE(name) Fp8GemmTile::name,
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_CONTRACT_TILE
#undef NODROP_FP8_GEMM_TILE
  };
  const int64_t shapes[][4] = {{16384, 14336, 4096, 8},  {16384, 28672, 4096, 8},
                               {131072, 768, 2048, 128}, {8192, 2048, 7168, 32},
                               {8192, 7168, 2048, 32},   {0, 128, 128, 0}};
  for (const auto& [M, K, N, G] : shapes) {
    const auto schedule = nodrop::cuda::grouped_matmul_fp8_contract_schedule(M, K, N, G);
    EXPECT_NE(std::find(std::begin(contract_tiles), std::end(contract_tiles), schedule.tile),
              std::end(contract_tiles))
        << M << "x" << K << "x" << N;
    EXPECT_NE(schedule.raster, nodrop::cuda::GemmRaster::kAuto);
    EXPECT_NE(schedule.swizzle, 0);
  }
}

}  // namespace
