// Benchmark of the FP8 blockwise-scaled grouped matmul (forward, ragged rows) against the bf16
// grouped matmul of the same shapes (rhs transposed too, its automatic tile), printed as a
// markdown table.
//
//   nodrop_cuda_fp8_bench [--iters=50] [--warmup=5]
//
// Group sizes are equal shares moved about at random, as a router's counts are (DeepGEMM's
// shapes: equal groups). Each timing is
// the median of `iters` single calls timed with CUDA events after `warmup` calls. The scales are
// all one and the E4M3 values finite: the timing does not depend on the values.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "nodrop/engine_cuda.h"

namespace {

using Sizes = std::vector<int32_t>;

void check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}
void check(const nodrop::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, status.message().c_str());
  std::exit(1);
}
#define CHECK(expr) check((expr), #expr)

struct Shape {
  const char* name;
  int64_t M, K, N, G;  // rows (tokens x top-k), hidden, expert width, experts
  bool equal_groups;   // every group M / G rows, not a router's spread
};

// Forward GEMMs of grouped_matmul_bench.cu's shapes (K and N multiples of 128).
const Shape kShapes[] = {
    {"Mixtral-8x7B", 16384, 4096, 14336, 8, false},
    {"Qwen3-30B-A3B", 131072, 2048, 768, 128, false},
    {"DeepSeek-V3 EP8 rank", 8192, 7168, 2048, 32, false},
    {"DeepSeek-V3 EP8 rank down", 8192, 2048, 7168, 32, false},
    {"Mixtral-8x7B 2k tokens", 4096, 4096, 14336, 8, false},
    {"Qwen3-30B-A3B 2k tokens", 16384, 2048, 768, 128, false},
    {"Mixtral-8x7B layer gate+up", 16384, 4096, 28672, 8, false},
    {"Mixtral-8x7B layer down", 16384, 14336, 4096, 8, false},
    // DeepGEMM's published grouped (contiguous layout) shapes: 4 groups of 8192 rows.
    {"DeepGEMM 4x8192 N4096 K7168", 32768, 7168, 4096, 4, true},
    {"DeepGEMM 4x8192 N7168 K2048", 32768, 2048, 7168, 4, true},
};

// Equal shares moved about at random (grouped_matmul_bench.cu's router-like sizes).
Sizes router_like_sizes(int64_t M, int64_t G) {
  Sizes sizes(G, static_cast<int32_t>(M / G));
  for (int64_t g = 0; g < M % G; ++g) ++sizes[g];
  std::mt19937 rng(7);
  const int32_t spread = std::max<int32_t>(1, static_cast<int32_t>(3 * std::sqrt(M / G)));
  for (int64_t i = 0; i < G; ++i) {
    const int64_t from = rng() % G, to = rng() % G;
    const int32_t moved = std::min<int32_t>(sizes[from], rng() % spread);
    sizes[from] -= moved;
    sizes[to] += moved;
  }
  return sizes;
}

__device__ uint32_t hash(uint64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 0x9E3779B9u ^ static_cast<uint32_t>(i >> 32) ^ seed;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  return x;
}

// E4M3 bytes of magnitude at most 1.875 (exponent field <= 7): never NaN.
__global__ void fill_e4m3(uint8_t* data, int64_t count, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    data[i] = static_cast<uint8_t>(hash(i, seed) & 0xBF);
  }
}

__global__ void fill_bf16(__nv_bfloat16* data, int64_t count, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    data[i] = __float2bfloat16(static_cast<float>(hash(i, seed) & 0xFFFF) / 32768.f - 1.f);
  }
}

__global__ void fill_ones(float* data, int64_t count) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    data[i] = 1.f;
  }
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  return p;
}

template <typename Run>
double median_ms(int iters, int warmup, cudaStream_t stream, Run run) {
  for (int i = 0; i < warmup; ++i) run();
  std::vector<cudaEvent_t> events(2 * iters);
  for (auto& event : events) CHECK(cudaEventCreate(&event));
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(events[2 * i], stream));
    run();
    CHECK(cudaEventRecord(events[2 * i + 1], stream));
  }
  CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) CHECK(cudaEventElapsedTime(&ms[i], events[2 * i], events[2 * i + 1]));
  for (auto& event : events) CHECK(cudaEventDestroy(event));
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 50, warmup = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--iters=", 8) == 0) {
      iters = std::max(1, std::atoi(argv[i] + 8));
    } else if (std::strncmp(argv[i], "--warmup=", 9) == 0) {
      warmup = std::max(0, std::atoi(argv[i] + 9));
    } else {
      std::fprintf(stderr, "usage: %s [--iters=N] [--warmup=N]\n", argv[0]);
      return 2;
    }
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  std::printf("| shape | M | K | N | G | bf16 ms | bf16 TFLOP/s | fp8 ms | fp8 TFLOP/s | speedup |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Shape& s : kShapes) {
    const int64_t KB = (s.K + 127) / 128, NB = (s.N + 127) / 128;
    auto* lhs8 = static_cast<uint8_t*>(device_alloc(s.M * s.K));
    auto* rhs8 = static_cast<uint8_t*>(device_alloc(s.G * s.N * s.K));
    auto* lhs_scales = static_cast<float*>(device_alloc(s.M * KB * sizeof(float)));
    auto* rhs_scales = static_cast<float*>(device_alloc(s.G * NB * KB * sizeof(float)));
    auto* lhs16 = static_cast<__nv_bfloat16*>(device_alloc(s.M * s.K * 2));
    auto* rhs16 = static_cast<__nv_bfloat16*>(device_alloc(s.G * s.N * s.K * 2));
    void* out = device_alloc(s.M * s.N * 2);
    auto* sizes = static_cast<int32_t*>(device_alloc(s.G * sizeof(int32_t)));
    const size_t ws8_bytes = nodrop::cuda::grouped_matmul_fp8_blockwise_workspace_bytes(s.G);
    const size_t ws16_bytes = nodrop::cuda::grouped_matmul_workspace_bytes(s.G);
    void* ws8 = device_alloc(ws8_bytes);
    void* ws16 = device_alloc(ws16_bytes);
    fill_e4m3<<<1024, 256, 0, stream>>>(lhs8, s.M * s.K, 1);
    fill_e4m3<<<1024, 256, 0, stream>>>(rhs8, s.G * s.N * s.K, 2);
    fill_ones<<<256, 256, 0, stream>>>(lhs_scales, s.M * KB);
    fill_ones<<<256, 256, 0, stream>>>(rhs_scales, s.G * NB * KB);
    fill_bf16<<<1024, 256, 0, stream>>>(lhs16, s.M * s.K, 3);
    fill_bf16<<<1024, 256, 0, stream>>>(rhs16, s.G * s.N * s.K, 4);
    CHECK(cudaGetLastError());
    const Sizes host_sizes =
        s.equal_groups ? Sizes(s.G, static_cast<int32_t>(s.M / s.G)) : router_like_sizes(s.M, s.G);
    CHECK(cudaMemcpyAsync(sizes, host_sizes.data(), s.G * sizeof(int32_t),
                          cudaMemcpyHostToDevice, stream));
    const double bf16_ms = median_ms(iters, warmup, stream, [&] {
      CHECK(nodrop::cuda::grouped_matmul(lhs16, rhs16, nodrop::DType::kBFloat16, sizes, s.M, s.K,
                                         s.N, s.G, /*transpose_rhs=*/true, out,
                                         nodrop::DType::kBFloat16, ws16, ws16_bytes, stream));
    });
    const double fp8_ms = median_ms(iters, warmup, stream, [&] {
      CHECK(nodrop::cuda::grouped_matmul_fp8_blockwise(lhs8, lhs_scales, rhs8, rhs_scales, sizes,
                                                       s.M, s.K, s.N, s.G, out, ws8, ws8_bytes,
                                                       stream));
    });
    const double tflop = 2.0 * s.M * s.N * s.K * 1e-12;
    std::printf("| %s | %lld | %lld | %lld | %lld | %.3f | %.0f | %.3f | %.0f | %.2fx |\n", s.name,
                static_cast<long long>(s.M), static_cast<long long>(s.K),
                static_cast<long long>(s.N), static_cast<long long>(s.G), bf16_ms,
                tflop / (bf16_ms * 1e-3), fp8_ms, tflop / (fp8_ms * 1e-3), bf16_ms / fp8_ms);
    std::fflush(stdout);
    for (void* p : {static_cast<void*>(lhs8), static_cast<void*>(rhs8),
                    static_cast<void*>(lhs_scales), static_cast<void*>(rhs_scales),
                    static_cast<void*>(lhs16), static_cast<void*>(rhs16), out,
                    static_cast<void*>(sizes), ws8, ws16}) {
      CHECK(cudaFree(p));
    }
  }
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
