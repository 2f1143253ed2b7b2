// Benchmark of the CUDA AdamW step (engine_cuda.h, adamw_update) on one parameter of 2^28
// float32 elements, in place as the trainer runs it, against cudaMemcpyAsync device-to-device
// (the card's streaming ceiling), and against prototypes of the same kernel that load 2 or 4
// float4 of each array per thread before computing (more bytes in flight per thread; the
// engine's kernel cannot move a later load above an earlier store, since its outputs may be
// its inputs).
//
//   nodrop_cuda_adamw_bench [--iters=20] [--warmup=3]
//
// Each timing is the median of `iters` calls timed with CUDA events after `warmup` calls; the
// arrays (1 GiB each) are far larger than L2. Bandwidth counts the bytes read plus written: the
// step reads param, grad, mu, nu and writes param, mu, nu (28 bytes per element, 26 with a
// bfloat16 gradient, as the trainer passes for weights computed in bfloat16).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.h"
#include "engine/adamw_element.h"
#include "nodrop/engine_cuda.h"

namespace {

using nodrop_bench::check;

constexpr int64_t kElements = int64_t{1} << 28;
constexpr int kThreads = 256;
int g_iters = 20, g_warmup = 3;

// The engine's kernel with kUnroll float4 of each array loaded before any is computed or stored
// (the same chunks, the same sums in another order).
template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    unrolled_adamw(float* param, const float* grad, float* mu, float* nu, const float* scalars,
                   nodrop::AdamWConfig c, int64_t chunk, float* partials) {
  const nodrop::AdamWScalars s{scalars[0], scalars[1], scalars[2], scalars[3]};
  const bool clip = nodrop::adamw_clips(s, c);
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  const int64_t end = std::min<int64_t>(begin + chunk, c.num_elements);
  float sums[nodrop::kAdamWSums] = {};
  constexpr int64_t kStep = 4 * kThreads * kUnroll;
  int64_t j = begin;
  for (; j + kStep <= end; j += kStep) {
    float4 p[kUnroll], g[kUnroll], m[kUnroll], v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t at = j + 4 * (threadIdx.x + u * kThreads);
      p[u] = *reinterpret_cast<const float4*>(param + at);
      g[u] = *reinterpret_cast<const float4*>(grad + at);
      m[u] = *reinterpret_cast<const float4*>(mu + at);
      v[u] = *reinterpret_cast<const float4*>(nu + at);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      nodrop::adamw_element(p[u].x, g[u].x, m[u].x, v[u].x, s, c, clip, sums);
      nodrop::adamw_element(p[u].y, g[u].y, m[u].y, v[u].y, s, c, clip, sums);
      nodrop::adamw_element(p[u].z, g[u].z, m[u].z, v[u].z, s, c, clip, sums);
      nodrop::adamw_element(p[u].w, g[u].w, m[u].w, v[u].w, s, c, clip, sums);
      const int64_t at = j + 4 * (threadIdx.x + u * kThreads);
      *reinterpret_cast<float4*>(param + at) = p[u];
      *reinterpret_cast<float4*>(mu + at) = m[u];
      *reinterpret_cast<float4*>(nu + at) = v[u];
    }
  }
  for (j += threadIdx.x; j < end; j += kThreads) {
    float pj = param[j], mj = mu[j], vj = nu[j];
    nodrop::adamw_element(pj, grad[j], mj, vj, s, c, clip, sums);
    param[j] = pj;
    mu[j] = mj;
    nu[j] = vj;
  }
  __shared__ float block_sums[nodrop::kAdamWSums];
  if (threadIdx.x < nodrop::kAdamWSums) block_sums[threadIdx.x] = 0.0f;
  __syncthreads();
  for (int k = 0; k < nodrop::kAdamWSums; ++k) atomicAdd(&block_sums[k], sums[k]);
  __syncthreads();
  if (threadIdx.x < nodrop::kAdamWSums) {
    partials[int64_t(blockIdx.x) * nodrop::kAdamWSums + threadIdx.x] = block_sums[threadIdx.x];
  }
}

template <typename F>
float median_ms(F&& call) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < g_warmup + g_iters; ++i) {
    CHECK(cudaEventRecord(start));
    call();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= g_warmup) times.push_back(ms);
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::sscanf(argv[i], "--iters=%d", &g_iters) == 1) continue;
    if (std::sscanf(argv[i], "--warmup=%d", &g_warmup) == 1) continue;
    std::fprintf(stderr, "usage: %s [--iters=N] [--warmup=N]\n", argv[0]);
    return 2;
  }
  const size_t bytes = kElements * sizeof(float);
  float *param, *grad, *mu, *nu, *scalars, *partials;
  for (float** p : {&param, &grad, &mu, &nu}) {
    CHECK(cudaMalloc(p, bytes));
    CHECK(cudaMemset(*p, 0, bytes));  // zeros: finite, and every step the same work
  }
  const int64_t num_partials = 8192;
  CHECK(cudaMalloc(&scalars, 4 * sizeof(float)));
  CHECK(cudaMalloc(&partials, num_partials * nodrop::kAdamWSums * sizeof(float)));
  const float host_scalars[4] = {-3e-4f, 0.5f, 0.271f, 0.142625f};
  CHECK(cudaMemcpy(scalars, host_scalars, sizeof(host_scalars), cudaMemcpyHostToDevice));
  nodrop::AdamWConfig config;
  config.num_elements = kElements;
  config.num_partials = num_partials;
  config.weight_decay = 0.1f;
  config.max_grad_norm = 1.0f;
  const int64_t chunk = nodrop::adamw_chunk(kElements, num_partials);
  const double copy_bytes = 2.0 * bytes;

  std::printf("| kernel | ms | TB/s | of the copy |\n| --- | ---: | ---: | ---: |\n");
  const float copy = median_ms([&] {
    CHECK(cudaMemcpyAsync(mu, param, bytes, cudaMemcpyDeviceToDevice));
  });
  const double copy_tbs = copy_bytes / copy / 1e9;
  std::printf("| cudaMemcpyAsync D2D, 1 GiB | %.3f | %.2f | 1.00x |\n", copy, copy_tbs);
  auto row = [&](const char* name, float ms, double bytes_per_element = 28.0) {
    const double tbs = bytes_per_element * kElements / ms / 1e9;
    std::printf("| %s | %.3f | %.2f | %.2fx |\n", name, ms, tbs, tbs / copy_tbs);
  };
  row("engine adamw_update (in place)", median_ms([&] {
        CHECK(nodrop::cuda::adamw_update(param, grad, nodrop::DType::kFloat32, mu, nu, scalars,
                                         config, param, mu, nu, partials, nullptr));
      }));
  // grad's first half read as 2^28 bfloat16 zeros.
  row("engine adamw_update (in place), bfloat16 gradient", median_ms([&] {
        CHECK(nodrop::cuda::adamw_update(param, grad, nodrop::DType::kBFloat16, mu, nu,
                                         scalars, config, param, mu, nu, partials, nullptr));
      }), 26.0);
  row("prototype, 1 float4 per array in flight", median_ms([&] {
        unrolled_adamw<1><<<num_partials, kThreads>>>(param, grad, mu, nu, scalars, config,
                                                       chunk, partials);
      }));
  row("prototype, 2 float4 per array in flight", median_ms([&] {
        unrolled_adamw<2><<<num_partials, kThreads>>>(param, grad, mu, nu, scalars, config,
                                                       chunk, partials);
      }));
  row("prototype, 4 float4 per array in flight", median_ms([&] {
        unrolled_adamw<4><<<num_partials, kThreads>>>(param, grad, mu, nu, scalars, config,
                                                       chunk, partials);
      }));
  CHECK(cudaGetLastError());
  return 0;
}
