// FP8 (E4M3) quantisation on the GPU: one warp per block of a row, the block's amax reduced
// with warp shuffles (max is exact, so the order does not matter), then every element scaled
// and rounded by the hardware's float32 -> E4M3 conversion (nearest even, saturating).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kE4M3Max = 448.0f;
constexpr int kWarpsPerBlock = 8;

__device__ float to_float(float v) { return v; }
__device__ float to_float(__half v) { return __half2float(v); }
__device__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
quantize_fp8_kernel(const T* __restrict__ x, int64_t M, int64_t C, int64_t block,
                    int64_t blocks_per_row, uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t warp = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.y;
  if (warp >= M * blocks_per_row) return;
  const int lane = threadIdx.x;
  const int64_t row = warp / blocks_per_row, b = warp % blocks_per_row;
  const int64_t begin = row * C + b * block;
  const int64_t size = min(block, C - b * block);
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = lane; i < size; i += 32) {
    const float v = to_float(x[begin + i]);
    finite = finite && isfinite(v);
    amax = fmaxf(amax, fabsf(v));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
  }
  finite = __all_sync(kFullMask, finite);
  // As the CPU engine and nodrop.ops.fp8: times the float32 reciprocal of 448.
  float s = __fmul_rn(amax, 1.0f / kE4M3Max);
  s = !finite ? __int_as_float(0x7fc00000) : (s > 0.0f ? s : 1.0f);
  if (lane == 0) scale[warp] = s;
  const float inverse = __frcp_rn(s);
  for (int64_t i = lane; i < size; i += 32) {
    float v = __fmul_rn(to_float(x[begin + i]), inverse);
    v = isnan(v) ? v : fminf(fmaxf(v, -kE4M3Max), kE4M3Max);
    q[begin + i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}

Status fail(const std::string& what) { return Status::Error("quantize_fp8: " + what); }

}  // namespace

Status quantize_fp8(const void* x, DType dtype, int64_t M, int64_t C, int64_t block, uint8_t* q,
                    float* scale, cudaStream_t stream) {
  if (M < 0 || C < 0) return fail("negative shape");
  if (block < 1) return fail("block must be at least 1, got " + std::to_string(block));
  const int64_t blocks_per_row = (C + block - 1) / block;
  const int64_t warps = M * blocks_per_row;
  if (warps == 0) return Status::Ok();
  if (x == nullptr || q == nullptr || scale == nullptr) return fail("a buffer is null");
  const dim3 threads(32, kWarpsPerBlock);
  const unsigned grid = unsigned((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  switch (dtype) {
    case DType::kFloat32:
      quantize_fp8_kernel<<<grid, threads, 0, stream>>>(static_cast<const float*>(x), M, C, block,
                                                        blocks_per_row, q, scale);
      break;
    case DType::kFloat16:
      quantize_fp8_kernel<<<grid, threads, 0, stream>>>(static_cast<const __half*>(x), M, C,
                                                        block, blocks_per_row, q, scale);
      break;
    case DType::kBFloat16:
      quantize_fp8_kernel<<<grid, threads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), M,
                                                        C, block, blocks_per_row, q, scale);
      break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? Status::Ok() : fail(cudaGetErrorString(error));
}

}  // namespace nodrop::cuda
