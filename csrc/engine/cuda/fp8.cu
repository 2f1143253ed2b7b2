// FP8 (E4M3) quantisation on the GPU. quantize_fp8: one warp per block of a row, the block's
// amax reduced with warp shuffles (max is exact, so the order does not matter).
// quantize_fp8_transposed: one thread block per 128-row block and 64 columns, staged in shared
// memory, each column's amax reduced over the block's rows and written as one 128-byte run of the
// transposed copy. Both scale and round every element alike (block_scale, to_e4m3): by the
// hardware's float32 -> E4M3 conversion (nearest even, saturating).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "engine/cuda/grouped_matmul/group_scan.cuh"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kE4M3Max = 448.0f;
constexpr int kWarpsPerBlock = 8;

__device__ float to_float(float v) { return v; }
__device__ float to_float(__half v) { return __half2float(v); }
__device__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// A block's scale from its amax, as the CPU engine and nodrop.ops.fp8: times the float32
// reciprocal of 448; 1 for a block of zeros, NaN for a block holding a NaN or an inf.
__device__ float block_scale(float amax, bool finite) {
  const float s = __fmul_rn(amax, 1.0f / kE4M3Max);
  return !finite ? __int_as_float(0x7fc00000) : (s > 0.0f ? s : 1.0f);
}

// v times the reciprocal of its block's scale, saturated to +-448 (a NaN stays NaN), in E4M3.
__device__ uint8_t to_e4m3(float v, float inverse) {
  v = __fmul_rn(v, inverse);
  v = isnan(v) ? v : fminf(fmaxf(v, -kE4M3Max), kE4M3Max);
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// Four consecutive elements as float32, in one 8-byte (16-bit types) or 16-byte load; p must be
// aligned to 4 elements.
__device__ void load4(const float* p, float v[4]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
}
template <typename T>
__device__ void load4(const T* p, float v[4]) {  // __half, __nv_bfloat16
  const uint2 a = *reinterpret_cast<const uint2*>(p);
  const T* h = reinterpret_cast<const T*>(&a);
  for (int i = 0; i < 4; ++i) v[i] = to_float(h[i]);
}

// True when every 4-element group starting at a multiple of 4 of x's rows of C elements is one
// aligned vector: C % 4 == 0 and x aligned to 4 elements.
bool vectorizable(const void* x, DType dtype, int64_t C) {
  return C % 4 == 0 && reinterpret_cast<uintptr_t>(x) % (4 * dtype_size(dtype)) == 0;
}

// One warp per block of a row. kVector (block 128, vectorizable x, q 4-byte aligned): each lane
// holds 4 consecutive elements, read in one load and written as 4 bytes; else the lanes stride
// over the block.
template <typename T, bool kVector>
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
  float v[4] = {};
  if constexpr (kVector) {
    if (4 * lane < size) load4(x + begin + 4 * lane, v);  // size is a multiple of 4
    for (int i = 0; i < 4; ++i) {
      finite = finite && isfinite(v[i]);
      amax = fmaxf(amax, fabsf(v[i]));
    }
  } else {
    for (int64_t i = lane; i < size; i += 32) {
      const float value = to_float(x[begin + i]);
      finite = finite && isfinite(value);
      amax = fmaxf(amax, fabsf(value));
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
  }
  const float s = block_scale(amax, __all_sync(kFullMask, finite));
  if (lane == 0) scale[warp] = s;
  const float inverse = __frcp_rn(s);
  if constexpr (kVector) {
    if (4 * lane < size) {
      uint32_t codes = 0;
      for (int i = 0; i < 4; ++i) codes |= uint32_t(to_e4m3(v[i], inverse)) << (8 * i);
      *reinterpret_cast<uint32_t*>(q + begin + 4 * lane) = codes;
    }
  } else {
    for (int64_t i = lane; i < size; i += 32) {
      q[begin + i] = to_e4m3(to_float(x[begin + i]), inverse);
    }
  }
}

// quantize_fp8_transposed: 128 rows (one block of the contraction) by kColumns columns per
// thread block; each column is handled by kParts threads of kRowsPerPart rows each.
constexpr int kBlockRows = static_cast<int>(kFp8Block);
constexpr int kColumns = 64;
constexpr int kTransposeThreads = detail::kSetupThreads;  // scan_groups' block size
constexpr int kParts = kTransposeThreads / kColumns;
constexpr int kRowsPerPart = kBlockRows / kParts;
static_assert(kRowsPerPart % 16 == 0, "each thread writes whole 16-byte runs of E4M3");

template <typename T, bool kVector>
__global__ void __launch_bounds__(kTransposeThreads)
quantize_fp8_transposed_kernel(const T* __restrict__ x, const int32_t* __restrict__ group_sizes,
                               int64_t M, int64_t C, int64_t G, int64_t P,
                               uint8_t* __restrict__ q_t, float* __restrict__ scale) {
  __shared__ detail::GroupScanStorage scan_storage;
  __shared__ int64_t block_begin, block_rows;
  __shared__ float tile[kBlockRows][kColumns + 1];  // + 1: the column reads spread over banks
  __shared__ float part_amax[kParts][kColumns];
  __shared__ bool part_finite[kParts][kColumns];
  const int64_t b = blockIdx.x, c0 = int64_t(blockIdx.y) * kColumns;
  const int t = threadIdx.x;

  // Which rows block b holds (none past the groups' blocks).
  if (t == 0) block_rows = 0;
  __syncthreads();
  detail::scan_groups(group_sizes, G, M, scan_storage,
                      [&](int64_t, int64_t begin, int64_t end, int64_t first_block) {
                        const int64_t blocks = (end - begin + kBlockRows - 1) / kBlockRows;
                        if (b >= first_block && b < first_block + blocks) {
                          block_begin = begin + (b - first_block) * kBlockRows;
                          block_rows = min(int64_t(kBlockRows), end - block_begin);
                        }
                      });
  __syncthreads();
  const int64_t rows = block_rows, begin = block_begin;

  // Rows in, 64 consecutive columns per row (128-byte reads of bfloat16); kVector (x
  // vectorizable): 4 columns per load.
  if constexpr (kVector) {
    constexpr int kVectors = kColumns / 4;
    for (int i = t; i < kBlockRows * kVectors; i += kTransposeThreads) {
      const int r = i / kVectors, c = 4 * (i % kVectors);
      float v[4] = {};
      if (r < rows && c0 + c < C) load4(x + (begin + r) * C + c0 + c, v);  // C % 4 == 0
      for (int j = 0; j < 4; ++j) tile[r][c + j] = v[j];
    }
  } else {
    for (int i = t; i < kBlockRows * kColumns; i += kTransposeThreads) {
      const int r = i / kColumns, c = i % kColumns;
      tile[r][c] = r < rows && c0 + c < C ? to_float(x[(begin + r) * C + c0 + c]) : 0.0f;
    }
  }
  __syncthreads();

  // A warp takes 32 consecutive columns of one part: conflict-free column reads.
  const int c = t % kColumns, part = t / kColumns, r0 = part * kRowsPerPart;
  float amax = 0.0f;
  bool finite = true;
  for (int r = r0; r < r0 + kRowsPerPart; ++r) {
    finite = finite && isfinite(tile[r][c]);
    amax = fmaxf(amax, fabsf(tile[r][c]));
  }
  part_amax[part][c] = amax;
  part_finite[part][c] = finite;
  __syncthreads();
  for (int p = 0; p < kParts; ++p) {
    amax = fmaxf(amax, part_amax[p][c]);
    finite = finite && part_finite[p][c];
  }
  if (c0 + c >= C) return;
  const float s = block_scale(amax, finite);
  if (part == 0) scale[b * C + c0 + c] = s;
  const float inverse = __frcp_rn(s);
  // The part's rows of column c, one run of q_t's row c; rows past the block are 0 (even where
  // the scale is NaN).
  alignas(16) uint8_t codes[kRowsPerPart];
#pragma unroll
  for (int j = 0; j < kRowsPerPart; ++j) {
    codes[j] = r0 + j < rows ? to_e4m3(tile[r0 + j][c], inverse) : uint8_t{0};
  }
  uint4* out = reinterpret_cast<uint4*>(q_t + (c0 + c) * P + b * kBlockRows + r0);
#pragma unroll
  for (int v = 0; v < kRowsPerPart / 16; ++v) out[v] = reinterpret_cast<const uint4*>(codes)[v];
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
  const bool vector = block == 128 && vectorizable(x, dtype, C) &&
                      reinterpret_cast<uintptr_t>(q) % 4 == 0;
  auto launch = [&](auto typed_x) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed_x)>>;
    if (vector) {
      quantize_fp8_kernel<T, true>
          <<<grid, threads, 0, stream>>>(typed_x, M, C, block, blocks_per_row, q, scale);
    } else {
      quantize_fp8_kernel<T, false>
          <<<grid, threads, 0, stream>>>(typed_x, M, C, block, blocks_per_row, q, scale);
    }
  };
  switch (dtype) {
    case DType::kFloat32: launch(static_cast<const float*>(x)); break;
    case DType::kFloat16: launch(static_cast<const __half*>(x)); break;
    case DType::kBFloat16: launch(static_cast<const __nv_bfloat16*>(x)); break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? Status::Ok() : fail(cudaGetErrorString(error));
}

Status quantize_fp8_transposed(const void* x, DType dtype, const int32_t* group_sizes, int64_t M,
                               int64_t C, int64_t G, uint8_t* q_t, float* scale,
                               cudaStream_t stream) {
  auto fail = [](const std::string& what) {
    return Status::Error("quantize_fp8_transposed: " + what);
  };
  if (M < 0 || C < 0 || G < 0) {
    return fail("M, C and G must not be negative, got M = " + std::to_string(M) + ", C = " +
                std::to_string(C) + ", G = " + std::to_string(G));
  }
  const int64_t PB = fp8_contract_blocks(M, G), P = PB * kFp8Block;
  if (PB == 0 || C == 0) return Status::Ok();
  if (q_t == nullptr || scale == nullptr) return fail("q_t or scale is null");
  if (M > 0 && x == nullptr) return fail("x is null");
  if (G > 0 && group_sizes == nullptr) return fail("group_sizes is null");
  if (reinterpret_cast<uintptr_t>(q_t) % 16 != 0) return fail("q_t must be 16-byte aligned");
  const int64_t column_tiles = (C + kColumns - 1) / kColumns;
  if (PB > INT32_MAX || column_tiles > 65535) {
    return fail("too large: " + std::to_string(PB) + " row blocks by " +
                std::to_string(column_tiles) + " column tiles (at most 65535)");
  }
  const dim3 grid{static_cast<unsigned>(PB), static_cast<unsigned>(column_tiles)};
  const bool vector = vectorizable(x, dtype, C);
  auto launch = [&](auto typed_x) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed_x)>>;
    if (vector) {
      quantize_fp8_transposed_kernel<T, true>
          <<<grid, kTransposeThreads, 0, stream>>>(typed_x, group_sizes, M, C, G, P, q_t, scale);
    } else {
      quantize_fp8_transposed_kernel<T, false>
          <<<grid, kTransposeThreads, 0, stream>>>(typed_x, group_sizes, M, C, G, P, q_t, scale);
    }
  };
  switch (dtype) {
    case DType::kFloat32: launch(static_cast<const float*>(x)); break;
    case DType::kFloat16: launch(static_cast<const __half*>(x)); break;
    case DType::kBFloat16: launch(static_cast<const __nv_bfloat16*>(x)); break;
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? Status::Ok() : fail(cudaGetErrorString(error));
}

}  // namespace nodrop::cuda
