// The one small kernel before each CUTLASS grouped GEMM: it builds the group table from the
// group sizes and zeroes the outputs that no GEMM tile writes, reading the sizes on the device
// only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/cuda/grouped_matmul/group_table.cuh"

namespace nodrop::cuda::detail {

// The operands of one call, as byte pointers and element sizes.
struct Operands {
  const void* lhs;
  const void* rhs;
  void* out;
  int64_t in_size;   // bytes per lhs / rhs element
  int64_t out_size;  // bytes per out element
};

// One launch that fills table.offsets, shapes, pointers and strides for the call's form from
// group_sizes [G], clamping invalid sizes as clamp_group_offsets does, and zeroes what no tile
// writes: rows [offsets[G], M) of out [M, N] (kRows, kRowsTransposed), or out[g] [K, N] of
// every group without rows (kContract), to which the table gives no tiles.
cudaError_t launch_prepare_grouped_gemm(GemmForm form, const int32_t* group_sizes, int64_t M,
                                        int64_t K, int64_t N, const Operands& ops,
                                        const GroupTable& table, cudaStream_t stream);

}  // namespace nodrop::cuda::detail
