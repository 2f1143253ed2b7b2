// nodrop CPU engine (csrc/engine/cpu/): the engine's functions on host memory, with oneDNN for
// the GEMMs and the caller's ParallelRunner for threads. engine.h holds the conventions.
#pragma once

#include <cstdint>
#include <functional>

#include "nodrop/engine.h"

namespace nodrop {

// How the CPU engine runs work in parallel. The FFI layer hands it XLA's own intra-op thread pool,
// so nodrop's threads never compete with XLA's; a null runner runs everything on the calling
// thread (and lets oneDNN use its own OpenMP threads).
class ParallelRunner {
 public:
  virtual ~ParallelRunner() = default;
  virtual int64_t num_workers() const = 0;
  // Calls fn(i) once for every i in [0, n); returns when all calls have finished.
  virtual void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) = 0;
};

namespace cpu {

// out[M, N] = for each group g: lhs[rows_g] @ rhs[g]   (rhs [G, K, N])
//   or, with transpose_rhs:      lhs[rows_g] @ rhs[g]^T (rhs [G, N, K]).
// lhs and rhs share in_dtype; accumulation is float32; rows past the last group are zero.
Status grouped_matmul(const void* lhs, const void* rhs, DType in_dtype, const int32_t* group_sizes,
                      int64_t M, int64_t K, int64_t N, int64_t G, bool transpose_rhs, void* out,
                      DType out_dtype, bool checked, ParallelRunner* runner = nullptr);

// Ragged contraction (the weight gradient): out[g] = lhs[rows_g]^T @ rhs[rows_g] -> [G, K, N],
// with lhs [M, K] and rhs [M, N] sharing in_dtype; an empty group gives zeros.
Status grouped_matmul_contract(const void* lhs, const void* rhs, DType in_dtype,
                               const int32_t* group_sizes, int64_t M, int64_t K, int64_t N,
                               int64_t G, void* out, DType out_dtype, bool checked,
                               ParallelRunner* runner = nullptr);

// Counting sort of the T*k (token, slot) pairs by expert: fills row_map [T*k] and
// group_sizes [E]. Out-of-range ids are dropped (row_map -1, in no group) or, with `checked`,
// an error.
Status sort_by_expert(const int32_t* ids, int64_t T, int64_t k, int64_t E, bool checked,
                      int32_t* row_map, int32_t* group_sizes);

// dst[T*k, H]: dst[row_map[t*k+s]] = weight[t, s] * src[t] (weight 1 when weights is null);
// rows that no slot maps to are zero. Row-map entries outside [0, T*k) are skipped.
void permute_rows(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                  int64_t T, int64_t k, int64_t H, void* dst, ParallelRunner* runner = nullptr);

// dst[T, H]: dst[t] = sum_s weight[t, s] * src[row_map[t*k+s]] (weight 1 when weights is null),
// summed in float32 in slot order; entries outside [0, T*k) contribute nothing.
void unpermute(const void* src, DType dtype, const int32_t* row_map, const float* weights,
               int64_t T, int64_t k, int64_t H, void* dst, ParallelRunner* runner = nullptr);

// out[T, k] float32: out[t, s] = <a[t], rows[row_map[t*k+s]]>, zero for an out-of-range entry.
// a [T, H] and rows [T*k, H] share dtype.
void gather_row_dots(const void* a, const void* rows, DType dtype, const int32_t* row_map,
                     int64_t T, int64_t k, int64_t H, float* out,
                     ParallelRunner* runner = nullptr);

// logits [T, E] float32, expert_bias [E] or null -> weights [T, k] float32, ids [T, k] int32.
Status topk_router(const float* logits, const float* expert_bias, const RouterConfig& config,
                   float* weights, int32_t* ids, ParallelRunner* runner = nullptr);

// Gradient of topk_router's weights with respect to the logits (the choice of ids is piecewise
// constant): grad_logits [T, E] from logits, the forward's ids and grad_weights [T, k].
Status topk_router_grad(const float* logits, const int32_t* ids, const float* grad_weights,
                        const RouterConfig& config, float* grad_logits,
                        ParallelRunner* runner = nullptr);

// FP8 (E4M3) quantisation in blocks of 1 x block along each row (nodrop.ops.fp8's recipe):
// x [M, C] -> q [M, C] E4M3 bytes (float8_e4m3fn) and scale [M, ceil(C / block)] float32.
// A block's scale is amax(|x|) * float32(1 / 448): 1 where that is 0, NaN where the block holds
// a NaN or an inf. q = x * (1 / scale) in float32, saturated to +-448, rounded to nearest even.
Status quantize_fp8(const void* x, DType dtype, int64_t M, int64_t C, int64_t block, uint8_t* q,
                    float* scale, ParallelRunner* runner = nullptr);

// permute_rows (weights 1) and quantize_fp8 (blocks of 128) of its result in one call, each token
// quantised once: dst [T*k, H] in dtype, q [T*k, H] E4M3 bytes, scale [T*k, ceil(H / 128)]
// float32, bitwise quantize_fp8(permute_rows(src)). Rows that no slot maps to are zero, with
// zero codes and scale 1 (a zero row's quantisation). Row-map entries outside [0, T*k) are
// skipped. given_scale: null, or one float32 that every block takes instead of its own (the
// tensorwise recipe's scale, from an amax taken elsewhere), as quantize_fp8_transposed's: q =
// x * (1 / *given_scale) rounded alike, and every scale, unmapped rows' included, is
// *given_scale.
Status permute_rows_fp8(const void* src, DType dtype, const int32_t* row_map, int64_t T,
                        int64_t k, int64_t H, const float* given_scale, void* dst, uint8_t* q,
                        float* scale, ParallelRunner* runner = nullptr);

// The weight gradient's operand of the blockwise recipe: x [M, C] (float32, float16 or bfloat16)
// with group_sizes [G] (clamped as clamp_group_offsets; with `checked`, invalid sizes are an
// error) -> q_t [C, P] E4M3 bytes and scale [PB, C] float32, PB = fp8_contract_blocks(M, G),
// P = 128 * PB. Row r of group g, j-th row of its block b (engine.h numbers the blocks), lands in
// q_t[c, 128 * b + j] = x[r, c] * (1 / scale[b, c]) saturated and rounded as quantize_fp8, with
// scale[b, c] = amax of column c over the block's rows * float32(1 / 448) (1 where 0, NaN for a
// NaN or an inf). Every other element of q_t is 0 and every other scale 1: rows past the groups
// are read by nothing. given_scale: null, or one float32 that every block takes instead of its
// own (a tensorwise recipe's scale, from an amax taken elsewhere): q_t = x * (1 / *given_scale)
// rounded alike, and every scale, unused ones included, is *given_scale.
Status quantize_fp8_transposed(const void* x, DType dtype, const int32_t* group_sizes, int64_t M,
                               int64_t C, int64_t G, const float* given_scale, uint8_t* q_t,
                               float* scale, bool checked, ParallelRunner* runner = nullptr);

// quantize_fp8_transposed's q_t from codes already made: q [M, C] E4M3 bytes (the rows of a
// tensor quantised at one scale for all, say by quantize_fp8 or permute_rows_fp8 with that scale
// given) with group_sizes [G] (clamped and checked as quantize_fp8_transposed) -> q_t [C, P],
// the same codes in its layout, P = 128 * fp8_contract_blocks(M, G): the bytes
// quantize_fp8_transposed writes when given that scale, read from one byte an element instead
// of the float tensor. No scales: a tensorwise scale is the rows' one.
Status transpose_fp8_codes(const uint8_t* q, const int32_t* group_sizes, int64_t M, int64_t C,
                           int64_t G, uint8_t* q_t, bool checked,
                           ParallelRunner* runner = nullptr);

// The FP8 input gradient's weight operand (dout @ w[g]^T reads w[g] [K, N] as the "transposed
// weight" [N', K'] = [K, N]): quantize_fp8_weights_transposed's blocks and codes in w's own
// layout, q [G, K, N] E4M3 bytes and scale [G, KB, NB] float32, q[g, k, n] the code of w[g, k, n]
// and scale[g, kb, nb] the scale of its 128 x 128 block; given_scale as there (below).
Status quantize_fp8_weights(const void* w, DType dtype, int64_t G, int64_t K, int64_t N,
                            const float* given_scale, uint8_t* q, float* scale,
                            ParallelRunner* runner = nullptr);

// The FP8 forward's weight operand: each expert's weight transposed and quantised in one pass,
// w [G, K, N] (float32, float16 or bfloat16) -> q_t [G, N, K] E4M3 bytes and scale [G, NB, KB]
// float32, NB = ceil(N / 128), KB = ceil(K / 128): the layouts grouped_matmul_fp8_blockwise and
// grouped_matmul_fp8_tensorwise read as rhs (Hopper's FP8 wgmma reads both operands K-major).
// Without given_scale (the blockwise recipe), the 128 x 128 block w[g, 128 kb.., 128 nb..] gets
// scale[g, nb, kb] = its amax * float32(1 / 448) (1 where 0, NaN for a NaN or an inf) and
// q_t[g, n, k] = w[g, k, n] * (1 / scale[g, nb, kb]) saturated and rounded as quantize_fp8.
// given_scale: null, or G float32, expert g's every block at given_scale[g] (the tensorwise
// recipe's per-expert scale, from an amax taken elsewhere), no amax taken: every scale of expert
// g is given_scale[g].
Status quantize_fp8_weights_transposed(const void* w, DType dtype, int64_t G, int64_t K,
                                       int64_t N, const float* given_scale, uint8_t* q_t,
                                       float* scale, ParallelRunner* runner = nullptr);

// FP8 blockwise-scaled grouped matmul (the DeepSeek-V3 recipe's forward), the CUDA engine's
// grouped_matmul_fp8_blockwise on the CPU: the same layouts, rules and errors. KB = ceil(K/128),
// NB = ceil(N/128):
//   lhs [M, K] E4M3 bytes, lhs_scales [M, KB] float32 (1 x 128 blocks along K),
//   rhs [G, N, K] E4M3 bytes (each expert's weight transposed), rhs_scales [G, NB, KB] float32
//   (128 x 128 blocks), out [M, N] bfloat16.
// out[m, n] (m in group g) = sum over kb of (the float32 dot of lhs[m] and rhs[g, n] over k block
// kb) * (lhs_scales[m, kb] * rhs_scales[g, n / 128, kb]), added in float32 in kb order; rows past
// the groups are zero. K must be a multiple of 16 and N of 8, as on the GPU.
Status grouped_matmul_fp8_blockwise(const void* lhs, const float* lhs_scales, const void* rhs,
                                    const float* rhs_scales, const int32_t* group_sizes,
                                    int64_t M, int64_t K, int64_t N, int64_t G, void* out,
                                    bool checked, ParallelRunner* runner = nullptr);

// FP8 grouped matmul with one scale per tensor (the tensorwise recipe's forward), the CUDA
// engine's grouped_matmul_fp8_tensorwise on the CPU: the same layouts, rules and errors.
//   lhs [M, K] E4M3 bytes, lhs_scale [1] float32 (the whole of lhs), rhs [G, N, K] E4M3 bytes
//   (each expert's weight transposed), rhs_scales [G] float32 (one per expert), out [M, N]
//   bfloat16.
// out[m, n] (m in group g) = (the float32 dot of lhs[m] and rhs[g, n]) * (lhs_scale[0] *
// rhs_scales[g]); rows past the groups are zero. K must be a multiple of 16 and N of 8.
Status grouped_matmul_fp8_tensorwise(const void* lhs, const float* lhs_scale, const void* rhs,
                                     const float* rhs_scales, const int32_t* group_sizes,
                                     int64_t M, int64_t K, int64_t N, int64_t G, void* out,
                                     bool checked, ParallelRunner* runner = nullptr);

// The blockwise recipe's weight gradient, ragged contraction on FP8 operands: with lhs [M, K]
// and rhs [M, N] quantised by quantize_fp8_transposed (lhs_t [K, P], lhs_scales [PB, K],
// rhs_t [N, P], rhs_scales [PB, N]; the same group_sizes and M),
// out[g] [K, N] bfloat16 = sum over the blocks b of group g, in order, of
//   (the float32 dot of lhs_t[k, block b] and rhs_t[n, block b]) * (lhs_scales[b, k] *
//   rhs_scales[b, n]),
// added in float32, block b being the columns 128 * b + j of its rows j (a short block's other
// columns are not read, as the GPU contracts exactly each group's rows); an empty group gives
// zeros. N must be a multiple of 8, as on the GPU.
Status grouped_matmul_fp8_blockwise_contract(const void* lhs_t, const float* lhs_scales,
                                             const void* rhs_t, const float* rhs_scales,
                                             const int32_t* group_sizes, int64_t M, int64_t K,
                                             int64_t N, int64_t G, void* out, bool checked,
                                             ParallelRunner* runner = nullptr);

// The tensorwise recipe's weight gradient, ragged contraction on FP8 operands with one scale
// each: lhs_t [K, P] and rhs_t [N, P] laid out as for grouped_matmul_fp8_blockwise_contract
// (quantize_fp8_transposed with a given scale), lhs_scale [1] and rhs_scale [1] float32,
// out[g] [K, N] bfloat16 = (the float32 dot of lhs_t[k] and rhs_t[n] over the columns of group
// g's rows) * (lhs_scale[0] * rhs_scale[0]); an empty group gives zeros. The CUDA engine's
// function of this name, whose fast_accumulation changes only how its float32 sums round.
Status grouped_matmul_fp8_tensorwise_contract(const void* lhs_t, const float* lhs_scale,
                                              const void* rhs_t, const float* rhs_scale,
                                              const int32_t* group_sizes, int64_t M, int64_t K,
                                              int64_t N, int64_t G, void* out, bool checked,
                                              ParallelRunner* runner = nullptr);

// AdamW's step and its statistics (engine.h, AdamWConfig): param, mu, nu [n] float32, grad [n]
// of grad_dtype (float32, bfloat16 or float16), scalars [4] float32, partials
// [num_partials, kAdamWSums] float32. The outputs may be the inputs. Each chunk is summed in
// element order.
Status adamw_update(const float* param, const void* grad, DType grad_dtype, const float* mu,
                    const float* nu, const float* scalars, const AdamWConfig& config,
                    float* param_out, float* mu_out, float* nu_out, float* partials,
                    ParallelRunner* runner = nullptr);

}  // namespace cpu
}  // namespace nodrop
