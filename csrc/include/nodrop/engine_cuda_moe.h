// nodrop CUDA engine (Hopper, sm_90a): routing and token permutation, the engine functions of
// engine.h other than the grouped matmul (that one is in engine_cuda.h).
//
// Same contracts as the nodrop::cpu functions of the same names, with these differences:
//   - Every pointer is device memory; all work is queued on `stream` and nothing waits for it:
//     no host read of device data, no stream sync, no allocation, so every call can be captured
//     into a CUDA graph. A returned error is an argument error or a failed launch.
//   - No checked mode (it would need a host read): out-of-range expert ids are always dropped.
//   - Deterministic without floating-point atomics: the same inputs give the same bytes.
//   - scatter_rows zeroes the rows [n, T*k), n being the number of in-range row_map entries.
//     For a row_map from sort_by_expert those are exactly the rows no slot maps to, as on the
//     CPU. Any other row_map is safe too (entries outside [0, T*k) are skipped, nothing is
//     written out of bounds), but a row below n that no slot maps to keeps its old bytes, and
//     two slots mapping to one row write it in an unspecified order.
//   - Row copies use 16-byte accesses when a row is a multiple of 16 bytes and the buffers are
//     16-byte aligned, element accesses otherwise; any alignment of the element type works.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "nodrop/engine.h"

namespace nodrop::cuda {

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
Status scatter_rows(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                    int64_t T, int64_t k, int64_t H, void* dst, cudaStream_t stream);

// dst[T, H]: dst[t] = sum_s weight[t, s] * src[row_map[t*k+s]], summed in float32 in slot
// order with the CPU's roundings (a product, then a sum), so the result is the CPU's bit for bit.
Status gather_rows(const void* src, DType dtype, const int32_t* row_map, const float* weights,
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

}  // namespace nodrop::cuda
