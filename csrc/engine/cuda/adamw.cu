// CUDA AdamW step (engine_cuda.h): one thread block per chunk of the elements, each thread
// updating four elements per access and summing the update's statistics, the block
// adding its threads' sums in a fixed order. Outputs may alias inputs (each element is read and
// written by one thread), so nothing is __restrict__.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "engine/adamw_element.h"
#include "engine/cuda/launch_status.cuh"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The gradient's element types and their four-element loads: 16 bytes of float32, 8 of a
// 16-bit type (widening to float32 is exact).
__device__ float widen(float x) { return x; }
__device__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ float widen(__half x) { return __half2float(x); }

template <typename G>
struct alignas(4 * sizeof(G)) Four {
  G x, y, z, w;
};

template <typename G>
__device__ void update_one(const float* param, const G* grad, const float* mu, const float* nu,
                           int64_t j, const AdamWScalars& s, const AdamWConfig& c, bool clip,
                           float* param_out, float* mu_out, float* nu_out, float* sums) {
  float p = param[j], m = mu[j], v = nu[j];
  adamw_element(p, widen(grad[j]), m, v, s, c, clip, sums);
  param_out[j] = p;
  mu_out[j] = m;
  nu_out[j] = v;
}

template <typename G, bool kVector>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const float* param, const G* grad, const float* mu, const float* nu,
                 const float* scalars, AdamWConfig c, int64_t chunk, float* param_out,
                 float* mu_out, float* nu_out, float* partials) {
  const AdamWScalars s{scalars[0], scalars[1], scalars[2], scalars[3]};
  const bool clip = adamw_clips(s, c);
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < c.num_elements ? begin + chunk : c.num_elements;
  float sums[kAdamWSums] = {};
  int64_t tail = begin;  // the first element left to the scalar loop
  if (kVector && begin < end) {
    tail = begin + (end - begin) / 4 * 4;  // begin is a multiple of 4 (adamw_chunk)
    for (int64_t j = begin + 4 * int64_t(threadIdx.x); j < tail; j += 4 * kThreads) {
      float4 p = *reinterpret_cast<const float4*>(param + j);
      const Four<G> g = *reinterpret_cast<const Four<G>*>(grad + j);
      float4 m = *reinterpret_cast<const float4*>(mu + j);
      float4 v = *reinterpret_cast<const float4*>(nu + j);
      adamw_element(p.x, widen(g.x), m.x, v.x, s, c, clip, sums);
      adamw_element(p.y, widen(g.y), m.y, v.y, s, c, clip, sums);
      adamw_element(p.z, widen(g.z), m.z, v.z, s, c, clip, sums);
      adamw_element(p.w, widen(g.w), m.w, v.w, s, c, clip, sums);
      *reinterpret_cast<float4*>(param_out + j) = p;
      *reinterpret_cast<float4*>(mu_out + j) = m;
      *reinterpret_cast<float4*>(nu_out + j) = v;
    }
  }
  for (int64_t j = tail + threadIdx.x; j < end; j += kThreads) {
    update_one(param, grad, mu, nu, j, s, c, clip, param_out, mu_out, nu_out, sums);
  }

  __shared__ float warp_sums[kAdamWSums][kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int k = 0; k < kAdamWSums; ++k) {
    float x = sums[k];
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
    if (lane == 0) warp_sums[k][warp] = x;
  }
  __syncthreads();
  if (threadIdx.x < kAdamWSums) {
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += warp_sums[threadIdx.x][w];
    partials[int64_t(blockIdx.x) * kAdamWSums + threadIdx.x] = total;
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename G>
void launch(const float* param, const G* grad, const float* mu, const float* nu,
            const float* scalars, const AdamWConfig& config, float* param_out, float* mu_out,
            float* nu_out, float* partials, cudaStream_t stream) {
  const int64_t chunk = adamw_chunk(config.num_elements, config.num_partials);
  const bool vector = aligned(param, 16) && aligned(grad, sizeof(Four<G>)) && aligned(mu, 16) &&
                      aligned(nu, 16) && aligned(param_out, 16) && aligned(mu_out, 16) &&
                      aligned(nu_out, 16);
  const dim3 grid(unsigned(config.num_partials));
  if (vector) {
    adamw_kernel<G, true><<<grid, kThreads, 0, stream>>>(
        param, grad, mu, nu, scalars, config, chunk, param_out, mu_out, nu_out, partials);
  } else {
    adamw_kernel<G, false><<<grid, kThreads, 0, stream>>>(
        param, grad, mu, nu, scalars, config, chunk, param_out, mu_out, nu_out, partials);
  }
}

}  // namespace

Status adamw_update(const float* param, const void* grad, DType grad_dtype, const float* mu,
                    const float* nu, const float* scalars, const AdamWConfig& config,
                    float* param_out, float* mu_out, float* nu_out, float* partials,
                    cudaStream_t stream) {
  constexpr const char* fn = "adamw_update";
  Status status = validate_adamw_config(config);
  if (!status.ok()) return status;
  status = validate_adamw_grad_dtype(grad_dtype);
  if (!status.ok()) return status;
  if (config.num_partials > INT32_MAX) {
    return Status::Error(std::string(fn) + ": num_partials must be at most 2^31 - 1, got " +
                         std::to_string(config.num_partials));
  }
  switch (grad_dtype) {
    case DType::kFloat32:
      launch(param, static_cast<const float*>(grad), mu, nu, scalars, config, param_out, mu_out,
             nu_out, partials, stream);
      break;
    case DType::kBFloat16:
      launch(param, static_cast<const __nv_bfloat16*>(grad), mu, nu, scalars, config, param_out,
             mu_out, nu_out, partials, stream);
      break;
    case DType::kFloat16:
      launch(param, static_cast<const __half*>(grad), mu, nu, scalars, config, param_out, mu_out,
             nu_out, partials, stream);
      break;
  }
  return launch_status(fn);
}

}  // namespace nodrop::cuda
