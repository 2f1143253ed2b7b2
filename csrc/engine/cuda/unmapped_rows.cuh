// The rows of a permuted buffer that no slot maps to: for a row_map from sort_by_expert, the rows
// [n, T*k), n being the number of in-range row_map entries (out-of-range ids are in no group).
// permute_rows and permute_rows_fp8 fill them before they scatter.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cub/block/block_reduce.cuh>

namespace nodrop::cuda::detail {

constexpr int kFillThreads = 1024;

// The number of SMs, which fill_unmapped_rows launches one thread block on each of.
inline cudaError_t sm_count(int* count) {
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

// Sets rows [n, slots) of dst (rows of `per_row` elements) to `value`, or to *given where given
// is not null (a value in device memory). Every thread block counts n on its own, so no
// workspace is needed; row_map is small next to the rows.
template <typename C>
__global__ void __launch_bounds__(kFillThreads)
    fill_unmapped_rows(const int32_t* __restrict__ row_map, int64_t slots, int64_t per_row,
                       C value, C* __restrict__ dst, const C* __restrict__ given = nullptr) {
  using Reduce = cub::BlockReduce<int32_t, kFillThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ int32_t mapped;
  int32_t count = 0;
#pragma unroll 8
  for (int64_t i = threadIdx.x; i < slots; i += kFillThreads) {
    count += row_map[i] >= 0 && row_map[i] < slots;
  }
  count = Reduce(storage).Sum(count);
  if (threadIdx.x == 0) mapped = count;
  __syncthreads();
  const int64_t end = slots * per_row;
  if (given != nullptr) value = *given;
  for (int64_t c = mapped * per_row + int64_t(blockIdx.x) * kFillThreads + threadIdx.x; c < end;
       c += int64_t(gridDim.x) * kFillThreads) {
    dst[c] = value;
  }
}

}  // namespace nodrop::cuda::detail
