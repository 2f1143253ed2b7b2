// The FP8 (E4M3) blockwise-scaled grouped GEMM, ragged rows (forward): the group table that its
// setup kernel writes on the device and its CUTLASS kernel reads, and the two launches.
//
// out_g [M_g, N] (bf16) = sum over k blocks kb of (lhs_g[:, kb] @ rhs[g][:, kb]^T)
//                         * lhs_scale[row, kb] * rhs_scale[g, n / 128, kb]
// accumulated in float32: CUTLASS's sm90 blockwise mainloop
// (sm90_mma_array_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp) runs each 128-deep k
// block's wgmmas into a temporary accumulator and adds it, times the two scales, to the main one
// (the DeepSeek-V3 recipe).
//
// Scale layouts (both K-major: the k blocks of one row, or of one 128-row block of rhs[g], are
// contiguous), KB = ceil(K / 128), NB = ceil(N / 128):
//   lhs_scales [M, KB]     float32 row-major: lhs_scales[m * KB + kb] scales lhs[m, kb*128 ...]
//   rhs_scales [G, NB, KB] float32 row-major: rhs_scales[(g * NB + nb) * KB + kb] scales
//                          rhs[g, nb*128 ..., kb*128 ...]
// In CUTLASS's terms these are Sm90BlockwiseScaleConfig<1, 128, 128, K, K> layouts. K-major is
// what lets a group's scales be a plain slice of lhs_scales: CUTLASS 4.2's grouped collective
// rebuilds each group's scale layout from its problem shape (M_g, N, K) as the packed layout
// tile_atom_to_shape_SFA/SFB, ignoring the layout_SFA/SFB arrays. Packed K-major over M_g rows
// has row stride KB whatever M_g is, so the group's scales start at lhs_scales + offset_g * KB.
// (An M-major lhs_scales [KB, M] would need a k-block stride of M_g per group, i.e. scales
// stored group by group, which a quantiser would have to lay out from the group sizes.)
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

// Elements of lhs / rhs that one scale covers along K, and rows of rhs[g] along N.
constexpr int64_t kFp8ScaleBlock = 128;

// 1x128 scales of A (one per row per k block), 128x128 of B; both K-major (see above).
using Fp8ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
    1, static_cast<int>(kFp8ScaleBlock), static_cast<int>(kFp8ScaleBlock), cute::GMMA::Major::K,
    cute::GMMA::Major::K>;
using Fp8LayoutSFA = decltype(Fp8ScaleConfig::deduce_layoutSFA());
using Fp8LayoutSFB = decltype(Fp8ScaleConfig::deduce_layoutSFB());

// Device arrays inside the workspace, one entry per group (offsets has G + 1). A, B and D are all
// K-major (A = lhs_g [M_g, K], B = rhs[g] [N, K], D = out_g [M_g, N], each row-major).
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
  Fp8LayoutSFA* layout_sfa = nullptr;
  Fp8LayoutSFB* layout_sfb = nullptr;
  void* gemm_workspace = nullptr;  // CUTLASS's per-SM copies of the TMA descriptors
  size_t gemm_workspace_bytes = 0;
  int device = 0;
  int sm_count = 0;
  GemmRaster raster = GemmRaster::kAlongM;  // resolved: never kAuto
  int swizzle = 1;                          // resolved: 1, 2, 4 or 8
};

// The operands of one call (device pointers).
struct Fp8Operands {
  const void* lhs;         // [M, K] float8_e4m3
  const float* lhs_scales;  // [M, KB]
  const void* rhs;         // [G, N, K] float8_e4m3
  const float* rhs_scales;  // [G, NB, KB]
  void* out;               // [M, N] bfloat16
};

// One launch that fills the table from group_sizes [G] on the device (clamping invalid sizes as
// clamp_group_offsets does) and zeroes rows [offsets[G], M) of out, which no tile writes.
// Requires N % 8 == 0 (whole 16-byte vectors per row). Defined in fp8_blockwise.cu.
cudaError_t launch_prepare_fp8_blockwise(const int32_t* group_sizes, int64_t M, int64_t K,
                                         int64_t N, const Fp8Operands& ops,
                                         const Fp8GroupTable& table, cudaStream_t stream);

// Runs the CUTLASS kernel of tile T over the table on `stream`; groups without rows get no
// tiles. Defined in fp8_blockwise_gemm.cuh, instantiated once per tile in its own generated
// file (generate_instantiations.py).
template <Fp8GemmTile T>
Status run_fp8_blockwise_gemm(const Fp8GroupTable& table, cudaStream_t stream);

}  // namespace nodrop::cuda::detail
