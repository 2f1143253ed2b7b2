// Scratch: weight-gradient (contract form) grouped GEMM, epilogue-tile variants, timed in turns at the power limit.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>
#include <cuda_bf16.h>
#include "variant.cuh"
#include "engine/cuda/setup_kernels.cuh"
#include "nodrop/engine_cuda.h"
using namespace nodrop::cuda::detail;
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { std::printf("%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1);} } while (0)

__global__ void fill(__nv_bfloat16* d, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    d[i] = __float2bfloat16(float(h & 0xFFFFFF) / float(1 << 23) - 1.f);
  }
}
struct Shape { const char* name; int64_t M, K, N, G; };
std::vector<int32_t> sizes_for(const char* kind, int64_t M, int64_t G) {
  std::vector<int32_t> s(G, int32_t(M / G)); s[0] += int32_t(M - M / G * G);
  if (!std::strcmp(kind, "zipf")) {
    double t = 0; for (int64_t g = 0; g < G; ++g) t += 1.0 / (g + 1);
    int64_t a = 0; for (int64_t g = 0; g < G; ++g) a += s[g] = int32_t(M / (g + 1) / t);
    s[0] += int32_t(M - a);
  } else if (!std::strcmp(kind, "router")) {
    std::mt19937 rng(7); int32_t spread = std::max<int32_t>(1, int32_t(3 * std::sqrt(M / G)));
    for (int64_t i = 0; i < G; ++i) { int64_t f = rng() % G, t = rng() % G; int32_t m = std::min<int32_t>(s[f], rng() % spread); s[f] -= m; s[t] += m; }
  }
  return s;
}
using V0 = exp_epi::Variant<128, 256, false, 1, 1, 0, 0>;
using V1 = exp_epi::Variant<128, 256, false, 1, 1, 128, 64>;
using V2 = exp_epi::Variant<128, 256, false, 1, 1, 128, 128>;
using V3 = exp_epi::Variant<128, 256, false, 2, 1, 128, 64>;
using V4 = exp_epi::Variant<128, 128, true, 1, 2, 0, 0>;
using V5 = exp_epi::Variant<128, 128, true, 1, 2, 64, 64>;
using V6 = exp_epi::Variant<128, 128, true, 1, 2, 64, 128>;
struct Var { const char* name; int stages; std::function<int(const GroupTable&, bool, cudaStream_t)> run; };

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 40, rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  std::vector<Var> vars = {{"coop 1x1 epi auto(128x32)", V0::stages(), V0::run}, {"coop 1x1 epi 128x64", V1::stages(), V1::run},
                           {"coop 1x1 epi 128x128", V2::stages(), V2::run}, {"coop 2x1 epi 128x64", V3::stages(), V3::run},
                           {"pingpong 1x2 epi auto(64x32)", V4::stages(), V4::run}, {"pingpong 1x2 epi 64x64", V5::stages(), V5::run},
                           {"pingpong 1x2 epi 64x128", V6::stages(), V6::run}};
  for (auto& v : vars) std::printf("# %s: %d mainloop stages\n", v.name, v.stages);
  const Shape shapes[] = {{"DeepSeek-V3 EP8", 8192, 7168, 2048, 32}, {"Mixtral", 16384, 4096, 14336, 8},
                          {"Qwen3", 131072, 2048, 768, 128}, {"DeepSeek-V2-Lite", 98304, 2048, 1408, 64}};
  int dev = 0, sms = 0, l2 = 0; CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)); CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  cudaStream_t st; CHECK(cudaStreamCreate(&st));
  std::printf("shape,sizes,variant,median_ms,tflops,vs_first,bitwise_equal\n");
  for (const Shape& s : shapes) {
    __nv_bfloat16 *x, *dy, *out, *ref; int32_t* dsz; char* ws;
    CHECK(cudaMalloc(&x, s.M * s.K * 2)); CHECK(cudaMalloc(&dy, s.M * s.N * 2));
    CHECK(cudaMalloc(&out, s.G * s.K * s.N * 2)); CHECK(cudaMalloc(&ref, s.G * s.K * s.N * 2));
    CHECK(cudaMalloc(&dsz, s.G * 4)); CHECK(cudaMalloc(&ws, 1 << 22));
    fill<<<1024, 256>>>(x, s.M * s.K, 1); fill<<<1024, 256>>>(dy, s.M * s.N, 2);
    // The table, laid out as main's make_table does (the arrays need only be 128-byte aligned and disjoint).
    GroupTable t; char* p = ws; auto take = [&](size_t b) { char* r = p; p += (b + 127) / 128 * 128; return r; };
    t.num_groups = int(s.G); t.offsets = (int64_t*)take((s.G + 1) * 8); t.shapes = (GroupShape*)take(s.G * 12);
    t.ptr_a = (const void**)take(s.G * 8); t.ptr_b = (const void**)take(s.G * 8); t.ptr_d = (void**)take(s.G * 8);
    t.stride_a = take(s.G * 24); t.stride_b = take(s.G * 24); t.stride_d = take(s.G * 24);
    t.gemm_workspace = take(256 * 4 * 128); t.gemm_workspace_bytes = 256 * 4 * 128; t.device = dev; t.sm_count = sms;
    const bool along_n = nodrop::cuda::grouped_matmul_raster(s.M, s.K, s.N, s.G, true, 2, l2) == nodrop::cuda::GemmRaster::kAlongN;
    for (const char* kind : {"uniform", "zipf", "router"}) {
      std::vector<int32_t> h = sizes_for(kind, s.M, s.G);
      CHECK(cudaMemcpy(dsz, h.data(), s.G * 4, cudaMemcpyHostToDevice));
      Operands ops{x, dy, out, 2, 2};
      CHECK(launch_prepare_grouped_gemm(GemmForm::kContract, dsz, s.M, s.K, s.N, ops, t, st));
      std::vector<std::vector<float>> ms(vars.size());
      std::vector<int> equal(vars.size(), 1);
      for (size_t v = 0; v < vars.size(); ++v) {  // correctness: bitwise against the first variant
        CHECK(cudaMemsetAsync(out, 0xFF, s.G * s.K * s.N * 2, st));
        int rc = vars[v].run(t, along_n, st); if (rc) { std::printf("# %s failed %d\n", vars[v].name, rc); return 1; }
        CHECK(cudaStreamSynchronize(st));
        if (v == 0) CHECK(cudaMemcpy(ref, out, s.G * s.K * s.N * 2, cudaMemcpyDeviceToDevice));
        else { std::vector<uint16_t> a(s.G * s.K * s.N), b(a.size());
               CHECK(cudaMemcpy(a.data(), out, a.size() * 2, cudaMemcpyDeviceToHost)); CHECK(cudaMemcpy(b.data(), ref, b.size() * 2, cudaMemcpyDeviceToHost));
               equal[v] = a == b; }
      }
      cudaEvent_t e0, e1; CHECK(cudaEventCreate(&e0)); CHECK(cudaEventCreate(&e1));
      auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 1.5)  // heat
        for (auto& v : vars) { for (int i = 0; i < 5; ++i) v.run(t, along_n, st); CHECK(cudaStreamSynchronize(st)); }
      for (int r = 0; r < rounds; ++r)
        for (size_t k = 0; k < vars.size(); ++k) {
          size_t v = r % 2 ? vars.size() - 1 - k : k;
          CHECK(cudaEventRecord(e0, st));
          for (int i = 0; i < iters; ++i) vars[v].run(t, along_n, st);
          CHECK(cudaEventRecord(e1, st)); CHECK(cudaEventSynchronize(e1));
          float m; CHECK(cudaEventElapsedTime(&m, e0, e1)); ms[v].push_back(m / iters);
        }
      double first = 0;
      for (size_t v = 0; v < vars.size(); ++v) {
        std::sort(ms[v].begin(), ms[v].end()); double med = ms[v][ms[v].size() / 2]; if (v == 0) first = med;
        std::printf("%s,%s,%s,%.4f,%.1f,%.3f,%s\n", s.name, kind, vars[v].name, med, 2.0 * s.M * s.K * s.N / med * 1e-9, first / med, equal[v] ? "yes" : "NO");
      }
      std::fflush(stdout);
    }
    cudaFree(x); cudaFree(dy); cudaFree(out); cudaFree(ref); cudaFree(dsz); cudaFree(ws);
  }
}
