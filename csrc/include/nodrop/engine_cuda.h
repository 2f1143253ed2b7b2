// nodrop CUDA engine (Hopper, sm_90a): the engine functions of engine.h on device pointers.
//
// Same contracts as the nodrop::cpu functions of the same names, with these differences:
//   - Every pointer is device memory; all work is queued on `stream` and nothing waits for it.
//     Group sizes are read only on the device: no copy to the host, no stream sync, no
//     allocation, so a call can be captured into a CUDA graph and replayed with new group sizes.
//   - Invalid group sizes are always clamped as clamp_group_offsets says (negative counts as
//     zero, the running total stops at M); there is no checked mode, which would need a host read.
//   - The caller passes a device workspace of at least grouped_matmul_workspace_bytes(G) bytes
//     (any alignment); it is scratch for one call and may be reused once the call has run.
//   - Inputs are bfloat16 or float16 (lhs and rhs alike); the output is the input dtype or
//     float32; accumulation is float32. K and N must be multiples of 8 and lhs, rhs and out
//     16-byte aligned (TMA moves 16-byte rows); anything else is an error Status.
//   - Deterministic: each output element is computed by one thread block, in a fixed order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "nodrop/engine.h"

namespace nodrop::cuda {

// The CUTLASS grouped-GEMM kernel a call runs: schedule, tile (rows x cols x depth) and cluster
// (rows x cols of CTAs that share operand tiles through TMA multicast). CUTLASS rounds each group's
// tile count up to whole clusters, so a cluster along the ragged rows would run empty tiles.
// kAuto picks from the static shapes (grouped_matmul_tile); the others exist so that tests and
// benchmarks can pin one.
enum class GemmTile : int32_t {
  kAuto = 0,
  kPingpong128x128x64Cluster1x2 = 1,     // warpgroups alternate tiles, hiding the epilogue
  kPingpong128x128x64Cluster2x1 = 2,     // the same where the column tiles do not pair up
  kPingpong128x128x64Cluster1x1 = 3,     // the same where neither the rows nor columns do
  kCooperative128x256x64Cluster1x1 = 4,  // two warpgroups share a tile: long contractions
  kCooperative256x192x64Cluster1x2 = 5,  // the widest: short weight gradients, output-bound
};
inline constexpr GemmTile kGemmTiles[] = {
    GemmTile::kPingpong128x128x64Cluster1x2, GemmTile::kPingpong128x128x64Cluster2x1,
    GemmTile::kPingpong128x128x64Cluster1x1, GemmTile::kCooperative128x256x64Cluster1x1,
    GemmTile::kCooperative256x192x64Cluster1x2};

const char* gemm_tile_name(GemmTile tile);

// The tile kAuto resolves to, chosen from benchmarks of every tile on H200, short ones
// (bench/results/2026-11-29-h200-gemm-tiles) and at the power limit
// (bench/results/2026-11-30-h200-sustained-tiles). The GEMM of each group is (rows x cols) with a
// contraction of `depth`: for grouped_matmul rows are the group's (ragged, on average M / G),
// cols N and depth K; for grouped_matmul_contract rows are K, cols N, depth the group's rows.
GemmTile grouped_matmul_tile(int64_t M, int64_t K, int64_t N, int64_t G, bool contract);

// How CUTLASS's persistent tile scheduler walks the output tiles of a group: along M (consecutive
// tiles share a column of B, and a wave reads the group's whole A) or along N (they share a row
// block of A, and a wave reads the whole B), `swizzle` (1, 2, 4 or 8) tiles wide. kAuto walks
// along M except for a weight gradient whose A (K x the group's rows) is both the larger operand
// and over half the L2 cache, which would not stay resident for the next column.
enum class GemmRaster : int32_t { kAuto = 0, kAlongM = 1, kAlongN = 2 };
const char* gemm_raster_name(GemmRaster raster);

// The raster order kAuto resolves to, for inputs of `in_bytes` each on a GPU with `l2_bytes` of L2.
GemmRaster grouped_matmul_raster(int64_t M, int64_t K, int64_t N, int64_t G, bool contract,
                                 int64_t in_bytes, int64_t l2_bytes);

// The kernel and tile order of one call. Implicit from a GemmTile so a call can pin just the tile.
struct GemmSchedule {
  GemmSchedule(GemmTile tile = GemmTile::kAuto, GemmRaster raster = GemmRaster::kAuto,
               int swizzle = 1)
      : tile(tile), raster(raster), swizzle(swizzle) {}
  GemmTile tile;
  GemmRaster raster;
  int swizzle;
};

// Device workspace bytes that one call of either function below needs for G groups.
size_t grouped_matmul_workspace_bytes(int64_t G);

// out[M, N] = for each group g: lhs[rows_g] @ rhs[g]   (rhs [G, K, N])
//   or, with transpose_rhs:      lhs[rows_g] @ rhs[g]^T (rhs [G, N, K]).
// Rows past the last group are zero.
Status grouped_matmul(const void* lhs, const void* rhs, DType in_dtype, const int32_t* group_sizes,
                      int64_t M, int64_t K, int64_t N, int64_t G, bool transpose_rhs, void* out,
                      DType out_dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                      GemmSchedule schedule = {});

// Ragged contraction (the weight gradient): out[g] = lhs[rows_g]^T @ rhs[rows_g] -> [G, K, N],
// with lhs [M, K] and rhs [M, N]; an empty group gives zeros.
Status grouped_matmul_contract(const void* lhs, const void* rhs, DType in_dtype,
                               const int32_t* group_sizes, int64_t M, int64_t K, int64_t N,
                               int64_t G, void* out, DType out_dtype, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream,
                               GemmSchedule schedule = {});

}  // namespace nodrop::cuda
