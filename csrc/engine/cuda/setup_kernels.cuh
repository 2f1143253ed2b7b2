// The small kernels around the CUTLASS GEMM: one builds the group table from the group sizes,
// two zero the outputs that no GEMM tile writes. All read the group sizes on the device only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/cuda/group_table.cuh"

namespace nodrop::cuda::detail {

// The operands of one call, as byte pointers and element sizes.
struct Operands {
  const void* lhs;
  const void* rhs;
  void* out;
  int64_t in_size;   // bytes per lhs / rhs element
  int64_t out_size;  // bytes per out element
};

// Fills table.offsets, shapes, pointers and strides for the call's form from group_sizes [G]
// (one thread block; clamps invalid sizes as clamp_group_offsets does).
cudaError_t launch_build_group_table(GemmForm form, const int32_t* group_sizes, int64_t M,
                                     int64_t K, int64_t N, const Operands& ops,
                                     const GroupTable& table, cudaStream_t stream);

// Zeroes rows [offsets[G], M) of out [M, row_bytes]: no group owns them.
cudaError_t launch_zero_tail_rows(const GroupTable& table, int64_t M, int64_t row_bytes, void* out,
                                  cudaStream_t stream);

// Zeroes out[g] (group_bytes each) for every group without rows: CUTLASS 4.2 cannot run a
// GEMM with K = 0, so the table gives such groups no tiles at all.
cudaError_t launch_zero_empty_groups(const GroupTable& table, int64_t group_bytes, void* out,
                                     cudaStream_t stream);

}  // namespace nodrop::cuda::detail
