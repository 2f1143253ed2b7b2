// The FP8 (E4M3) grouped GEMMs, blockwise-scaled and tensorwise-scaled, each in two forms: ragged
// rows (the forward and the input gradient) and ragged contraction (the weight gradient). The
// group table that their setup kernel writes on the device and their CUTLASS kernels read, and
// the launches.
//
// kRows:     out_g [M_g, N] (bf16) = sum over k blocks kb of (lhs_g[:, kb] @ rhs[g][:, kb]^T)
//                                    * lhs_scale[row, kb] * rhs_scale[g, n / 128, kb]
// kContract: out[g] [K, N] (bf16) = sum over the group's row blocks b of
//                                    (lhs_t[:, b] @ rhs_t[:, b]^T) * lhs_scale[b, k] * rhs_scale[b, n]
// kRowsTensorwise: out_g [M_g, N] (bf16) = (lhs_g @ rhs[g]^T) * alpha[g],
//                  alpha[g] = lhs_scale[0] * rhs_scale[g] (written by the setup kernel),
// kContractTensorwise: out[g] [K, N] (bf16) = (lhs_t_g @ rhs_t_g^T) * alpha[g],
//                  alpha[g] = lhs_scale[0] * rhs_scale[0], kContract's operands,
// the blockwise forms accumulated in float32: CUTLASS's sm90 blockwise mainloop
// (sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp) runs each 128-deep k
// block's wgmmas into a temporary accumulator and adds it, times the two scales, to the main one
// (the DeepSeek-V3 recipe); the tensorwise forms as the kernel's tile says
// (fp8_tensorwise_gemm.cuh: fast or promoted accumulation), scaled once in the epilogue.
//
// kRows scale layouts (both K-major: the k blocks of one row, or of one 128-row block of rhs[g],
// are contiguous), KB = ceil(K / 128), NB = ceil(N / 128):
//   lhs_scales [M, KB]     float32 row-major: lhs_scales[m * KB + kb] scales lhs[m, kb*128 ...]
//   rhs_scales [G, NB, KB] float32 row-major: rhs_scales[(g * NB + nb) * KB + kb] scales
//                          rhs[g, nb*128 ..., kb*128 ...]
// In CUTLASS's terms these are Sm90BlockwiseScaleConfig<1, 128, 128, K, K> layouts. K-major is
// what lets a group's scales be a plain slice of lhs_scales: CUTLASS 4.2's grouped collective
// rebuilds each group's scale layout from its problem shape (M_g, N, K) as the packed layout
// tile_atom_to_shape_SFA/SFB, ignoring the layout_SFA/SFB arrays. Packed K-major over M_g rows
// has row stride KB whatever M_g is, so the group's scales start at lhs_scales + offset_g * KB.
//
// kContract scale layouts (quantize_fp8_transposed's): lhs_scales [PB, K], rhs_scales [PB, N],
// one row per 128-row block of the contraction. There the contraction is ragged and the output
// rows are not, so the MN-major packed layout (Sm90BlockwiseScaleConfig<1, 1, 128, MN, MN>) has
// block stride K (or N) whatever the group's rows: its scales start at row first_block_g.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include <cute/layout.hpp>
#include <cutlass/detail/blockwise_scale_layout.hpp>

#include "engine/cuda/grouped_matmul/group_table.cuh"
#include "nodrop/engine.h"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda::detail {

// Elements of lhs / rhs that one scale covers along K, and rows of rhs[g] along N (kRows).
constexpr int64_t kFp8ScaleBlock = kFp8Block;
constexpr int kScaleBlock = static_cast<int>(kFp8ScaleBlock);

enum class Fp8GemmForm : int32_t {
  kRows,      // A = lhs_g [M_g, K], B = rhs[g] [N, K], D = out_g [M_g, N]
  kContract,  // A = lhs_t_g [K, rows_g], B = rhs_t_g [N, rows_g], D = out[g] [K, N]
  kRowsTensorwise,      // kRows' operands, one scale per operand (alpha[g]) instead of blocks
  kContractTensorwise,  // kContract's operands, one scale per operand (alpha[g])
};

constexpr bool is_contraction(Fp8GemmForm form) {
  return form == Fp8GemmForm::kContract || form == Fp8GemmForm::kContractTensorwise;
}
constexpr bool is_tensorwise(Fp8GemmForm form) {
  return form == Fp8GemmForm::kRowsTensorwise || form == Fp8GemmForm::kContractTensorwise;
}

// The scale granularities and layouts of each form (see above).
template <Fp8GemmForm F>
struct Fp8Scales;
template <>
struct Fp8Scales<Fp8GemmForm::kRows> {
  using Config = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock,
                                                           cute::GMMA::Major::K,
                                                           cute::GMMA::Major::K>;
};
template <>
struct Fp8Scales<Fp8GemmForm::kContract> {
  using Config = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, kScaleBlock,
                                                           cute::GMMA::Major::MN,
                                                           cute::GMMA::Major::MN>;
};
template <Fp8GemmForm F>
using Fp8LayoutSFA = decltype(Fp8Scales<F>::Config::deduce_layoutSFA());
template <Fp8GemmForm F>
using Fp8LayoutSFB = decltype(Fp8Scales<F>::Config::deduce_layoutSFB());
// One workspace array serves both forms' layouts.
static_assert(sizeof(Fp8LayoutSFA<Fp8GemmForm::kRows>) ==
              sizeof(Fp8LayoutSFA<Fp8GemmForm::kContract>));
static_assert(sizeof(Fp8LayoutSFB<Fp8GemmForm::kRows>) ==
              sizeof(Fp8LayoutSFB<Fp8GemmForm::kContract>));

// Device arrays inside the workspace, one entry per group (offsets has G + 1). A, B and D are all
// K-major in every form (each a row-major matrix whose rows hold the contraction). layout_sfa and
// layout_sfb hold Fp8LayoutSFA<F> and Fp8LayoutSFB<F> of a blockwise call's form; alpha is the
// tensorwise forms' per-group scale (the other arrays of scales are unused there).
struct Fp8GroupTable {
  int32_t num_groups = 0;
  int64_t* offsets = nullptr;  // clamped row offsets: group g owns rows [offsets[g], offsets[g+1])
  GroupShape* shapes = nullptr;  // (M_g, N, K)
  const void** ptr_a = nullptr;
  const void** ptr_b = nullptr;
  void** ptr_d = nullptr;
  const float** ptr_sfa = nullptr;
  const float** ptr_sfb = nullptr;
  StrideKMajor* stride_a = nullptr;
  StrideKMajor* stride_b = nullptr;
  StrideKMajor* stride_d = nullptr;
  void* layout_sfa = nullptr;
  void* layout_sfb = nullptr;
  float* alpha = nullptr;
  void* gemm_workspace = nullptr;  // CUTLASS's per-SM copies of the TMA descriptors
  size_t gemm_workspace_bytes = 0;
  int device = 0;
  int sm_count = 0;
  GemmRaster raster = GemmRaster::kAlongM;  // resolved: never kAuto
  int swizzle = 1;                          // resolved: 1, 2, 4 or 8
};

// The operands of one call (device pointers), as the public functions take them.
struct Fp8Operands {
  // The tensorwise forms' operands are those of the blockwise form of the same shape.
  const void* lhs;          // kRows: [M, K];  kContract: lhs_t [K, P]  (float8_e4m3)
  const float* lhs_scales;  // kRows: [M, KB]; kContract: [PB, K]; tensorwise: [1]
  const void* rhs;          // kRows: [G, N, K]; kContract: rhs_t [N, P] (E4M3)
  const float* rhs_scales;  // kRows: [G, NB, KB]; kContract: [PB, N]; kRowsTensorwise: [G];
                            // kContractTensorwise: [1]
  void* out;                // kRows: [M, N]; kContract: [G, K, N] (bfloat16)
};

// One launch that fills the table of form F from group_sizes [G] on the device (clamping invalid
// sizes as clamp_group_offsets does) and zeroes what no tile writes: rows [offsets[G], M) of out
// (the rows forms), or out[g] of each group without rows (the contractions). Requires N % 8 == 0
// (whole 16-byte vectors per row). Defined in fp8_blockwise.cu.
cudaError_t launch_prepare_fp8_blockwise(Fp8GemmForm form, const int32_t* group_sizes, int64_t M,
                                         int64_t K, int64_t N, const Fp8Operands& ops,
                                         const Fp8GroupTable& table, cudaStream_t stream);

// Runs the CUTLASS kernel of form F and tile T over the table on `stream`; groups without rows
// get no tiles. Defined in fp8_blockwise_gemm.cuh, instantiated once per (form, tile) in its own
// generated file (generate_instantiations.py).
template <Fp8GemmForm F, Fp8GemmTile T>
Status run_fp8_blockwise_gemm(const Fp8GroupTable& table, cudaStream_t stream);

// The same for the tensorwise forms (either table runs on each kernel): fp8_tensorwise_gemm.cuh,
// one generated file per tile.
template <Fp8TensorwiseTile T>
Status run_fp8_tensorwise_gemm(const Fp8GroupTable& table, cudaStream_t stream);

}  // namespace nodrop::cuda::detail
