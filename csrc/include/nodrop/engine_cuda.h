// nodrop CUDA engine (Hopper, sm_90a): the functions of engine_cpu.h on device pointers.
//
// Same contracts as the nodrop::cpu functions of the same names, with these differences:
//   - Every pointer is device memory; all work is queued on `stream` and nothing waits for it:
//     no host read of device data (group sizes and expert ids are read only on the device), no
//     stream sync, no allocation, so every call can be captured into a CUDA graph and replayed
//     with new group sizes. A returned error is an argument error or a failed launch.
//   - No checked mode, which would need a host read: invalid group sizes are always clamped as
//     clamp_group_offsets says (negative counts as zero, the running total stops at M), and
//     out-of-range expert ids are always dropped.
//   - Workspaces are passed in by the caller, sized by the *_workspace_bytes functions (any
//     alignment); one is scratch for one call and may be reused once the call has run.
//   - Deterministic without floating-point atomics: the same inputs give the same bytes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "nodrop/engine.h"

namespace nodrop::cuda {

// ---- grouped matmul (grouped_matmul/) ----------------------------------------------------------
//   - Inputs are bfloat16 or float16 (lhs and rhs alike); the output is the input dtype or
//     float32; accumulation is float32. K and N must be multiples of 8 and lhs, rhs and out
//     16-byte aligned (TMA moves 16-byte rows); anything else is an error Status.
//   - Each output element is computed by one thread block, in a fixed order.

// The CUTLASS grouped-GEMM kernel a call runs, one per line of grouped_matmul/tiles.def (which
// says what the fields mean). kAuto picks from the static shapes (grouped_matmul_tile); the
// others exist so that tests and benchmarks can pin one.
enum class GemmTile : int32_t {
  kAuto = 0,
#define NODROP_GEMM_TILE(name, ...) name,
#include "engine/cuda/grouped_matmul/tiles.def"
#undef NODROP_GEMM_TILE
};
inline constexpr GemmTile kGemmTiles[] = {
#define NODROP_GEMM_TILE(name, ...) GemmTile::name,
#include "engine/cuda/grouped_matmul/tiles.def"
#undef NODROP_GEMM_TILE
};

// "pingpong 128x128x64, cluster 1x2" for printing, and "pingpong_128x128x64_1x2" for file and
// test names.
const char* gemm_tile_name(GemmTile tile);
const char* gemm_tile_id(GemmTile tile);

// The tile kAuto resolves to (tile_rule.cc says from which measurements) on a GPU whose memory
// moves `memory_bandwidth` bytes a second. The GEMM of each group is (rows x cols) with a
// contraction of `depth`: for grouped_matmul rows are the group's (ragged, on average M / G),
// cols N and depth K; for grouped_matmul_contract rows are K, cols N, depth the group's rows.
GemmTile grouped_matmul_tile(int64_t M, int64_t K, int64_t N, int64_t G, bool contract,
                             int64_t memory_bandwidth);

// Below this memory bandwidth (bytes a second: the H100's 3.35e12 is, the H200's 4.8e12 is not)
// forwards and input gradients of many rows per group leave ping-pong for the cooperative tile.
inline constexpr int64_t kPingpongMemoryBandwidth = int64_t{4'000'000'000'000};

// The peak memory bandwidth of `device` in bytes a second, from its memory clock and bus width;
// 0 where CUDA does not report them. Host queries only, on the first call for a device; later
// calls return what it found.
int64_t memory_bandwidth(int device);

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

// ---- FP8 blockwise-scaled grouped matmul (grouped_matmul/fp8_blockwise*.cu) ----------------------
//   The DeepSeek-V3 recipe: ragged rows (the forward and the input gradient) here, ragged
//   contraction (the weight gradient) in grouped_matmul_fp8_blockwise_contract below. Inputs are float8_e4m3 with
//   float32 scales of 1x128 blocks (lhs, along K) and 128x128 blocks (rhs); the output is
//   bfloat16; products accumulate in float32, each 128-deep k block scaled as it is added.
//   KB = ceil(K / 128), NB = ceil(N / 128):
//     lhs        [M, K]        E4M3, row-major (K contiguous)
//     lhs_scales [M, KB]       float32, row-major: lhs_scales[m, kb] scales lhs[m, 128kb : 128kb+128]
//     rhs        [G, N, K]     E4M3, row-major: each expert's weight transposed (K contiguous;
//                              Hopper's FP8 wgmma needs both operands K-major)
//     rhs_scales [G, NB, KB]   float32, row-major: rhs_scales[g, nb, kb] scales the block
//                              rhs[g, 128nb : 128nb+128, 128kb : 128kb+128]
//     out        [M, N]        bfloat16, row-major
//   out[rows_g] = sum_kb (lhs[rows_g, kb-block] @ rhs[g][:, kb-block]^T) * lhs_scales[rows_g, kb]
//                 * rhs_scales[g, n / 128, kb]; rows past the last group are zero.
//   K must be a multiple of 16 and N of 8; lhs, rhs and out 16-byte aligned, scales 4-byte
//   aligned; anything else is an error Status. Same device-only, graph-safe, deterministic rules
//   as grouped_matmul.

// The CUTLASS kernel a call runs, one per line of grouped_matmul/fp8_tiles.def (which says what
// the fields mean and which shapes are legal). kAuto picks from the static shapes
// (grouped_matmul_fp8_schedule); the others exist so that tests and benchmarks can pin one.
enum class Fp8GemmTile : int32_t {
  kAuto = 0,
#define NODROP_FP8_GEMM_TILE(name, ...) name,
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_GEMM_TILE
};
inline constexpr Fp8GemmTile kFp8GemmTiles[] = {
#define NODROP_FP8_GEMM_TILE(name, ...) Fp8GemmTile::name,
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_GEMM_TILE
};

// "cooperative 128x128x128, cluster 1x2" for printing, "cooperative_128x128x128_1x2" for file
// and test names.
const char* fp8_gemm_tile_name(Fp8GemmTile tile);
const char* fp8_gemm_tile_id(Fp8GemmTile tile);

// The kernel and tile order of one FP8 call: raster as GemmRaster says, `swizzle` 1, 2, 4 or 8
// tiles wide, or 0 for the automatic choice. Implicit from an Fp8GemmTile.
struct Fp8GemmSchedule {
  Fp8GemmSchedule(Fp8GemmTile tile = Fp8GemmTile::kAuto, GemmRaster raster = GemmRaster::kAuto,
                  int swizzle = 0)
      : tile(tile), raster(raster), swizzle(swizzle) {}
  Fp8GemmTile tile;
  GemmRaster raster;
  int swizzle;
};

// The schedule that a call's automatic fields resolve to (fp8_tile_rule.cc, chosen by
// measurement): pingpong 64x128 for groups of at most 128 rows on average, cooperative 1x1 for
// K above 4096 or an odd number of column tiles, else cooperative on a 1x2 cluster.
Fp8GemmSchedule grouped_matmul_fp8_schedule(int64_t M, int64_t K, int64_t N, int64_t G);
// The same for the weight gradient, grouped_matmul_fp8_blockwise_contract (M rows in G groups
// contracted into G outputs of K x N).
Fp8GemmSchedule grouped_matmul_fp8_contract_schedule(int64_t M, int64_t K, int64_t N, int64_t G);

// Device workspace bytes that one grouped_matmul_fp8_blockwise call needs for G groups.
size_t grouped_matmul_fp8_blockwise_workspace_bytes(int64_t G);

Status grouped_matmul_fp8_blockwise(const void* lhs, const float* lhs_scales, const void* rhs,
                                    const float* rhs_scales, const int32_t* group_sizes,
                                    int64_t M, int64_t K, int64_t N, int64_t G, void* out,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream,
                                    Fp8GemmSchedule schedule = {});

// The weight gradient (ragged contraction) on FP8 operands: engine_cpu.h's
// grouped_matmul_fp8_blockwise_contract, operands from quantize_fp8_transposed. Each group's GEMM
// is out[g] (K x N) = lhs_t_g (K x its rows) * rhs_t_g^T with 1 x 128 scales along the rows on
// both sides, applied per k block. N must be a multiple of 8; lhs_t, rhs_t and out 16-byte
// aligned, scales 4-byte aligned. The workspace is grouped_matmul_fp8_blockwise_workspace_bytes(G).
Status grouped_matmul_fp8_blockwise_contract(const void* lhs_t, const float* lhs_scales,
                                             const void* rhs_t, const float* rhs_scales,
                                             const int32_t* group_sizes, int64_t M, int64_t K,
                                             int64_t N, int64_t G, void* out, void* workspace,
                                             size_t workspace_bytes, cudaStream_t stream,
                                             Fp8GemmSchedule schedule = {});

// ---- FP8 grouped matmuls with one scale per tensor (grouped_matmul/fp8_blockwise.cu) ----------
//   The tensorwise recipe's GEMMs. grouped_matmul_fp8_tensorwise (its forward and input gradient):
//   engine_cpu.h's grouped_matmul_fp8_tensorwise, out_g = (lhs_g @ rhs[g]^T) * (lhs_scale[0] *
//   rhs_scales[g]) in bfloat16, lhs [M, K] and rhs [G, N, K] E4M3 as for
//   grouped_matmul_fp8_blockwise, lhs_scale [1] and rhs_scales [G] float32 on the device.
//   grouped_matmul_fp8_tensorwise_contract (its weight gradient): engine_cpu.h's function of that
//   name, out[g] [K, N] = (lhs_t_g @ rhs_t_g^T) * (lhs_scale[0] * rhs_scale[0]), operands laid
//   out as for grouped_matmul_fp8_blockwise_contract, one scale [1] each. Same rules, alignment,
//   errors and workspace (grouped_matmul_fp8_blockwise_workspace_bytes) as the blockwise
//   functions of the same form.
//   With one scale per operand nothing inside the contraction needs scaling; the product of the
//   scales is applied once in the epilogue. fast_accumulation picks how the float32 sums are kept:
//     - true: the tensor cores' own sums over all of K ("fast accumulation", what Transformer
//       Engine runs its FP8 forward GEMMs with and torch._scaled_grouped_mm offers as
//       use_fast_accum): one accumulator per output, so a consumer warpgroup can hold 64x256;
//     - false: each 128-deep block's wgmma sums added into a second float32 accumulator with
//       FFMAs ("promoted"; Transformer Engine's split accumulator, its default for both
//       gradients): the tensor cores' coarser rounding never spans more than 128 products.
//   A schedule's tile must accumulate as fast_accumulation says (Fp8TensorwiseTile).

// The CUTLASS kernel a call runs, one per line of grouped_matmul/fp8_tensorwise_tiles.def, each
// with its accumulation. kAuto picks from the static shapes and the accumulation
// (grouped_matmul_fp8_tensorwise_schedule, grouped_matmul_fp8_tensorwise_contract_schedule).
enum class Fp8TensorwiseTile : int32_t {
  kAuto = 0,
#define NODROP_FP8_TENSORWISE_TILE(name, ...) name,
#include "engine/cuda/grouped_matmul/fp8_tensorwise_tiles.def"
#undef NODROP_FP8_TENSORWISE_TILE
};
inline constexpr Fp8TensorwiseTile kFp8TensorwiseTiles[] = {
#define NODROP_FP8_TENSORWISE_TILE(name, ...) Fp8TensorwiseTile::name,
#include "engine/cuda/grouped_matmul/fp8_tensorwise_tiles.def"
#undef NODROP_FP8_TENSORWISE_TILE
};

// "cooperative 128x256x128, cluster 1x2, fast accumulation" and
// "cooperative_128x256x128_1x2_fast", as for Fp8GemmTile.
const char* fp8_tensorwise_tile_name(Fp8TensorwiseTile tile);
const char* fp8_tensorwise_tile_id(Fp8TensorwiseTile tile);
// Whether the tile's kernel accumulates fast (false for kAuto and unknown values).
bool fp8_tensorwise_tile_fast_accumulation(Fp8TensorwiseTile tile);

// The kernel and tile order of one tensorwise call, as Fp8GemmSchedule.
struct Fp8TensorwiseSchedule {
  Fp8TensorwiseSchedule(Fp8TensorwiseTile tile = Fp8TensorwiseTile::kAuto,
                        GemmRaster raster = GemmRaster::kAuto, int swizzle = 0)
      : tile(tile), raster(raster), swizzle(swizzle) {}
  Fp8TensorwiseTile tile;
  GemmRaster raster;
  int swizzle;
};

// The schedules that a tensorwise call's automatic fields resolve to (fp8_tile_rule.cc): ragged
// rows, and the ragged contraction (M rows in G groups contracted into G outputs of K x N).
Fp8TensorwiseSchedule grouped_matmul_fp8_tensorwise_schedule(int64_t M, int64_t K, int64_t N,
                                                             int64_t G, bool fast_accumulation);
Fp8TensorwiseSchedule grouped_matmul_fp8_tensorwise_contract_schedule(int64_t M, int64_t K,
                                                                      int64_t N, int64_t G,
                                                                      bool fast_accumulation);

Status grouped_matmul_fp8_tensorwise(const void* lhs, const float* lhs_scale, const void* rhs,
                                     const float* rhs_scales, const int32_t* group_sizes,
                                     int64_t M, int64_t K, int64_t N, int64_t G,
                                     bool fast_accumulation, void* out, void* workspace,
                                     size_t workspace_bytes, cudaStream_t stream,
                                     Fp8TensorwiseSchedule schedule = {});

Status grouped_matmul_fp8_tensorwise_contract(const void* lhs_t, const float* lhs_scale,
                                              const void* rhs_t, const float* rhs_scale,
                                              const int32_t* group_sizes, int64_t M, int64_t K,
                                              int64_t N, int64_t G, bool fast_accumulation,
                                              void* out, void* workspace, size_t workspace_bytes,
                                              cudaStream_t stream,
                                              Fp8TensorwiseSchedule schedule = {});

// ---- routing and token permutation (permute.cu, router.cu) -------------------------------------
//   - permute_rows zeroes the rows [n, T*k), n being the number of in-range row_map entries.
//     For a row_map from sort_by_expert those are exactly the rows no slot maps to, as on the
//     CPU. Any other row_map is safe too (entries outside [0, T*k) are skipped, nothing is
//     written out of bounds), but a row below n that no slot maps to keeps its old bytes, and
//     two slots mapping to one row write it in an unspecified order.
//   - Row copies use 16-byte accesses when a row is a multiple of 16 bytes and the buffers are
//     16-byte aligned, element accesses otherwise; any alignment of the element type works.

// The largest num_experts that sort_by_expert and the router take.
constexpr int64_t kMaxExperts = 1024;

// Device workspace bytes that sort_by_expert needs for these shapes (any alignment).
size_t sort_by_expert_workspace_bytes(int64_t T, int64_t k, int64_t E);

// Counting sort of the T*k (token, slot) pairs by expert into (expert, token, slot) order:
// fills row_map [T*k] and group_sizes [E]; out-of-range ids get row_map -1 and count nowhere.
// E <= kMaxExperts.
Status sort_by_expert(const int32_t* ids, int64_t T, int64_t k, int64_t E, int32_t* row_map,
                      int32_t* group_sizes, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream);

// dst[T*k, H]: dst[row_map[t*k+s]] = weight[t, s] * src[t] (weight 1 when weights is null).
Status permute_rows(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                    int64_t T, int64_t k, int64_t H, void* dst, cudaStream_t stream);

// dst[T, H]: dst[t] = sum_s weight[t, s] * src[row_map[t*k+s]], summed in float32 in slot
// order with the CPU's roundings (a product, then a sum), so the result is the CPU's bit for bit.
Status unpermute(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                 int64_t T, int64_t k, int64_t H, void* dst, cudaStream_t stream);

// out[T, k] float32: out[t, s] = <a[t], rows[row_map[t*k+s]]>, accumulated in float64 in a
// fixed order; zero for an out-of-range entry.
Status gather_row_dots(const void* a, const void* rows, DType dtype, const int32_t* row_map,
                       int64_t T, int64_t k, int64_t H, float* out, cudaStream_t stream);

// logits [T, E] float32, expert_bias [E] or null -> weights [T, k] float32, ids [T, k] int32.
// Computed in float32 (the CPU uses float64): weights agree to float32 rounding, and ids agree
// except between selection scores within float32 rounding of each other. Exact ties go to the
// lower expert index, as on the CPU; NaN scores rank below every number. E <= kMaxExperts.
Status topk_router(const float* logits, const float* expert_bias, const RouterConfig& config,
                   float* weights, int32_t* ids, cudaStream_t stream);

// Gradient of topk_router's weights with respect to the logits, in float32.
Status topk_router_grad(const float* logits, const int32_t* ids, const float* grad_weights,
                        const RouterConfig& config, float* grad_logits, cudaStream_t stream);

// ---- FP8 (fp8.cu) ------------------------------------------------------------------------------

// x [M, C] -> q [M, C] E4M3 bytes, scale [M, ceil(C / block)] float32: bitwise the CPU's
// quantize_fp8 (the same float32 operations; E4M3 rounding to nearest even). Blocks of 128 with
// C % 8 == 0 (the recipe's): 16-byte loads, four blocks per half warp in flight.
Status quantize_fp8(const void* x, DType dtype, int64_t M, int64_t C, int64_t block, uint8_t* q,
                    float* scale, cudaStream_t stream);

// engine_cpu.h's permute_rows_fp8 (bitwise the same dst, q and scale): half a warp per 128-block
// of a token, read once and written to each of its k rows. 16-byte accesses where H % 8 == 0
// and src and dst are 16-byte and q 8-byte aligned, element accesses otherwise. given_scale is
// null or in device memory.
Status permute_rows_fp8(const void* src, DType dtype, const int32_t* row_map, int64_t T,
                        int64_t k, int64_t H, const float* given_scale, void* dst, uint8_t* q,
                        float* scale, cudaStream_t stream);

// engine_cpu.h's quantize_fp8_transposed (bitwise the same q_t and scale): one thread block per
// 128-row block and 128-column tiles, read row by row and written transposed through shared
// memory. given_scale is null or in device memory.
Status quantize_fp8_transposed(const void* x, DType dtype, const int32_t* group_sizes, int64_t M,
                               int64_t C, int64_t G, const float* given_scale, uint8_t* q_t,
                               float* scale, cudaStream_t stream);

// engine_cpu.h's transpose_fp8_codes (bitwise the same q_t): quantize_fp8_transposed's kernel
// on the codes, moved as bytes.
Status transpose_fp8_codes(const uint8_t* q, const int32_t* group_sizes, int64_t M, int64_t C,
                           int64_t G, uint8_t* q_t, cudaStream_t stream);

// engine_cpu.h's quantize_fp8_weights and quantize_fp8_weights_transposed (bitwise the same
// codes and scales): one thread block per 128 x 128 block of an expert's weight, read row by
// row and written in place, or transposed through shared memory. given_scale is null or G
// float32 in device memory.
Status quantize_fp8_weights(const void* w, DType dtype, int64_t G, int64_t K, int64_t N,
                            const float* given_scale, uint8_t* q, float* scale,
                            cudaStream_t stream);
Status quantize_fp8_weights_transposed(const void* w, DType dtype, int64_t G, int64_t K,
                                       int64_t N, const float* given_scale, uint8_t* q_t,
                                       float* scale, cudaStream_t stream);

// ---- AdamW (adamw.cu) ---------------------------------------------------------------------------

// engine_cpu.h's adamw_update on the GPU: one thread block per chunk, four elements per access
// (16 bytes of each float32 array, 8 of a 16-bit gradient) where every array is aligned to its
// access. The same float32 operations per element; each chunk's sums are added in a fixed order
// (so a call repeats bit for bit) that differs from the CPU's.
Status adamw_update(const float* param, const void* grad, DType grad_dtype, const float* mu,
                    const float* nu, const float* scalars, const AdamWConfig& config,
                    float* param_out, float* mu_out, float* nu_out, float* partials,
                    cudaStream_t stream);

}  // namespace nodrop::cuda
