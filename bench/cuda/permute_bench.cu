// Benchmark of the CUDA routing and permutation kernels: GB/s of permute (permute_rows) and
// un-permute (unpermute with the router weights, and its backward gather_row_dots) at
// T*k = 65536 rows of H = 4096 bfloat16, each next to cudaMemcpyAsync device-to-device of the
// same bytes; permute_rows_fp8 against permute_rows and quantize_fp8 apart, and with a given
// scale; then the times of sort_by_expert and of the router kernels.
//
//   nodrop_cuda_permute_bench [--iters=100] [--warmup=10]
//
// Each timing is the median of `iters` single calls timed with CUDA events after `warmup` calls.
// Consecutive calls use different copies of every buffer, together larger than L2, so no call
// starts with its data in L2. Bandwidth counts the bytes read plus the bytes written: a copy of
// n bytes moves 2n, and permuting n bytes of rows moves 2n too.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "nodrop/engine_cuda.h"

namespace {

using nodrop::DType;
using nodrop::RouterConfig;
using nodrop::ScoreFunction;

using nodrop_bench::check;

constexpr int64_t kSlots = 65536;  // T*k rows
constexpr int64_t kHidden = 4096;
constexpr int64_t kRowBytes = kHidden * 2;  // bfloat16
constexpr int kCopies = 2;                  // of each row buffer: every one is over 60 MB
constexpr int64_t kL2Bytes = 60 << 20;

int g_iters = 100, g_warmup = 10;
cudaStream_t g_stream;

// A device buffer, freed at exit of scope.
struct Device {
  void* ptr = nullptr;
  explicit Device(size_t bytes) { CHECK(cudaMalloc(&ptr, std::max<size_t>(bytes, 1))); }
  ~Device() { cudaFree(ptr); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

// Values in [-1, 1) from a hash of the index: never zeros, never timed on trivial data.
__global__ void fill_bf16(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2bfloat16(float(h >> 8) / float(1 << 23) - 1.0f);
  }
}
void fill(void* bf16, int64_t n, uint32_t seed) {
  fill_bf16<<<1024, 256, 0, g_stream>>>(static_cast<__nv_bfloat16*>(bf16), n, seed);
  CHECK(cudaGetLastError());
}

template <typename T>
void upload(T* device, const std::vector<T>& host) {
  CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
}

// Median microseconds of call(i) over g_iters calls, i counting up from 0 (warm-up included).
template <typename Call>
double median_us(Call&& call) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  int i = 0;
  for (; i < g_warmup; ++i) call(i);
  std::vector<float> ms(g_iters);
  for (float& t : ms) {
    CHECK(cudaEventRecord(start, g_stream));
    call(i++);
    CHECK(cudaEventRecord(stop, g_stream));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventElapsedTime(&t, start, stop));
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return 1e3 * ms[ms.size() / 2];
}

// Median microseconds of a device-to-device copy of `bytes`, between buffers of `kCopies` pairs.
double memcpy_us(int64_t bytes) {
  Device src(kCopies * bytes), dst(kCopies * bytes);
  fill(src.ptr, kCopies * bytes / 2, 1);
  return median_us([&](int i) {
    const int64_t offset = (i % kCopies) * bytes;
    CHECK(cudaMemcpyAsync(dst.as<char>() + offset, src.as<char>() + offset, bytes,
                          cudaMemcpyDeviceToDevice, g_stream));
  });
}

// k distinct experts per token, uniform: a router's choice over balanced experts.
std::vector<int32_t> random_ids(int64_t T, int64_t k, int64_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> experts(E), ids(T * k);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::copy(experts.begin(), experts.begin() + k, ids.begin() + t * k);
  }
  return ids;
}

// row_map and group sizes from the CUDA sort.
void sort_on_device(const std::vector<int32_t>& ids, int64_t T, int64_t k, int64_t E,
                    int32_t* row_map, int32_t* group_sizes) {
  Device d_ids(ids.size() * sizeof(int32_t));
  upload(d_ids.as<int32_t>(), ids);
  const size_t workspace_bytes = nodrop::cuda::sort_by_expert_workspace_bytes(T, k, E);
  Device workspace(workspace_bytes);
  CHECK(nodrop::cuda::sort_by_expert(d_ids.as<int32_t>(), T, k, E, row_map, group_sizes,
                                     workspace.ptr, workspace_bytes, g_stream));
  CHECK(cudaStreamSynchronize(g_stream));
}

void print_bandwidth(const char* op, int64_t k, double us, int64_t bytes, double copy_us) {
  const double gbps = bytes / us * 1e-3, copy_gbps = bytes / copy_us * 1e-3;
  std::printf("%-24s %3lld %6lld %10.1f %10.0f %10.1f %10.0f %9.1f%%\n", op, (long long)k,
              (long long)(kSlots / k), us, gbps, copy_us, copy_gbps, 100.0 * gbps / copy_gbps);
}

void bench_row_movers() {
  std::printf("Row movers: T*k = %lld rows, H = %lld, bfloat16 (GB/s = bytes read + written)\n",
              (long long)kSlots, (long long)kHidden);
  std::printf("%-24s %3s %6s %10s %10s %10s %10s %10s\n", "op", "k", "T", "us", "GB/s",
              "memcpy us", "memcpy GB/s", "of memcpy");
  const int64_t E = 128;
  for (int64_t k : {1, 2, 8}) {
    const int64_t T = kSlots / k;
    Device row_map(kSlots * sizeof(int32_t)), sizes(E * sizeof(int32_t));
    sort_on_device(random_ids(T, k, E, 7), T, k, E, row_map.as<int32_t>(), sizes.as<int32_t>());
    std::vector<float> host_weights(kSlots);
    std::mt19937 rng(8);
    for (float& w : host_weights) w = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
    Device weights(kSlots * sizeof(float)), dots(kSlots * sizeof(float));
    upload(weights.as<float>(), host_weights);
    const int64_t token_bytes = T * kRowBytes, row_bytes = kSlots * kRowBytes;
    Device tokens(kCopies * token_bytes), rows(kCopies * row_bytes), out(kCopies * token_bytes);
    fill(tokens.ptr, kCopies * T * kHidden, 2);
    fill(rows.ptr, kCopies * kSlots * kHidden, 3);
    auto token_copy = [&](const Device& d, int i) {
      return d.as<char>() + (i % kCopies) * token_bytes;
    };
    auto row_copy = [&](int i) { return rows.as<char>() + (i % kCopies) * row_bytes; };

    // permute: read each token row k times, write every permuted row once
    const double scatter = median_us([&](int i) {
      CHECK(nodrop::cuda::permute_rows(token_copy(tokens, i), DType::kBFloat16,
                                       row_map.as<int32_t>(), nullptr, T, k, kHidden, row_copy(i),
                                       g_stream));
    });
    print_bandwidth("permute (scatter)", k, scatter, 2 * row_bytes, memcpy_us(row_bytes));

    // un-permute: read every permuted row once, write each token row once
    const int64_t gather_bytes = row_bytes + token_bytes;
    const double copy = memcpy_us(gather_bytes / 2);
    const double gather = median_us([&](int i) {
      CHECK(nodrop::cuda::unpermute(row_copy(i), DType::kBFloat16, row_map.as<int32_t>(),
                                    weights.as<float>(), T, k, kHidden, token_copy(out, i),
                                    g_stream));
    });
    print_bandwidth("un-permute (gather)", k, gather, gather_bytes, copy);

    // un-permute's backward for the weights: read every permuted row and each token row k times
    const double row_dots = median_us([&](int i) {
      CHECK(nodrop::cuda::gather_row_dots(token_copy(tokens, i), row_copy(i), DType::kBFloat16,
                                          row_map.as<int32_t>(), T, k, kHidden, dots.as<float>(),
                                          g_stream));
    });
    print_bandwidth("row dots (gather bwd)", k, row_dots, 2 * row_bytes, memcpy_us(row_bytes));
  }
}

// The blockwise FP8 recipe's permute: permute_rows then quantize_fp8 of the rows (two passes over
// the rows) against permute_rows_fp8 (each token read once, quantised once, its bfloat16 row,
// codes and scales written to its k rows); and permute_rows_fp8 with a given scale (the
// tensorwise recipe's: no amax per block). Bandwidth counts the fused kernel's bytes: tokens
// read once, rows, codes and scales written.
void bench_permute_fp8() {
  std::printf("\nPermute with the rows' FP8 quantisation: T*k = %lld rows, H = %lld, bfloat16\n",
              (long long)kSlots, (long long)kHidden);
  std::printf("%3s %6s %14s %10s %10s %10s %10s %15s %12s\n", "k", "T", "unfused us",
              "fused us", "speedup", "fused GB/s", "of memcpy", "given scale us", "of memcpy");
  const int64_t E = 128, blocks = kHidden / nodrop::kFp8Block;
  for (int64_t k : {1, 2, 8}) {
    const int64_t T = kSlots / k;
    Device row_map(kSlots * sizeof(int32_t)), sizes(E * sizeof(int32_t));
    sort_on_device(random_ids(T, k, E, 7), T, k, E, row_map.as<int32_t>(), sizes.as<int32_t>());
    const int64_t token_bytes = T * kRowBytes, row_bytes = kSlots * kRowBytes;
    const int64_t q_bytes = kSlots * kHidden, scale_bytes = kSlots * blocks * 4;
    Device tokens(kCopies * token_bytes), rows(kCopies * row_bytes), q(kCopies * q_bytes),
        scale(kCopies * scale_bytes);
    fill(tokens.ptr, kCopies * T * kHidden, 2);
    auto at = [](const Device& d, int64_t bytes, int i) {
      return d.as<char>() + (i % kCopies) * bytes;
    };
    const double unfused = median_us([&](int i) {
      CHECK(nodrop::cuda::permute_rows(at(tokens, token_bytes, i), DType::kBFloat16,
                                       row_map.as<int32_t>(), nullptr, T, k, kHidden,
                                       at(rows, row_bytes, i), g_stream));
      CHECK(nodrop::cuda::quantize_fp8(at(rows, row_bytes, i), DType::kBFloat16, kSlots, kHidden,
                                       nodrop::kFp8Block,
                                       reinterpret_cast<uint8_t*>(at(q, q_bytes, i)),
                                       reinterpret_cast<float*>(at(scale, scale_bytes, i)),
                                       g_stream));
    });
    Device given_scale(sizeof(float));
    const float one_scale = 0.01f;
    CHECK(cudaMemcpy(given_scale.ptr, &one_scale, sizeof(float), cudaMemcpyHostToDevice));
    auto fused_us = [&](const float* given) {
      return median_us([&](int i) {
        CHECK(nodrop::cuda::permute_rows_fp8(
            at(tokens, token_bytes, i), DType::kBFloat16, row_map.as<int32_t>(), T, k, kHidden,
            given, at(rows, row_bytes, i), reinterpret_cast<uint8_t*>(at(q, q_bytes, i)),
            reinterpret_cast<float*>(at(scale, scale_bytes, i)), g_stream));
      });
    };
    const double fused = fused_us(nullptr), given = fused_us(given_scale.as<float>());
    const int64_t bytes = token_bytes + row_bytes + q_bytes + scale_bytes;
    const double copy_us = memcpy_us(bytes / 2);
    std::printf("%3lld %6lld %14.1f %10.1f %9.2fx %10.0f %9.1f%% %15.1f %11.1f%%\n",
                (long long)k, (long long)T, unfused, fused, unfused / fused,
                bytes / fused * 1e-3, 100.0 * copy_us / fused, given, 100.0 * copy_us / given);
  }
}

void bench_sort() {
  std::printf("\nsort_by_expert (three kernels)\n%-10s %6s %4s %10s\n", "T", "k", "E", "us");
  for (int64_t T : {8192, 16384, 131072}) {
    for (int64_t E : {128, 256}) {
      const int64_t k = 8;
      const std::vector<int32_t> ids = random_ids(T, k, E, 9);
      // Enough copies of ids to exceed L2 (ids are small).
      const int copies = int(std::max<int64_t>(2, 2 * kL2Bytes / (T * k * 4)));
      Device d_ids(copies * T * k * sizeof(int32_t)), row_map(T * k * sizeof(int32_t)),
          sizes(E * sizeof(int32_t));
      for (int c = 0; c < copies; ++c) upload(d_ids.as<int32_t>() + c * T * k, ids);
      const size_t workspace_bytes = nodrop::cuda::sort_by_expert_workspace_bytes(T, k, E);
      Device workspace(workspace_bytes);
      const double us = median_us([&](int i) {
        CHECK(nodrop::cuda::sort_by_expert(d_ids.as<int32_t>() + (i % copies) * T * k, T, k, E,
                                           row_map.as<int32_t>(), sizes.as<int32_t>(),
                                           workspace.ptr, workspace_bytes, g_stream));
      });
      std::printf("%-10lld %6lld %4lld %10.1f\n", (long long)T, (long long)k, (long long)E, us);
    }
  }
}

struct RouterShape {
  const char* name;
  int64_t E, k;
  ScoreFunction fn;
  int64_t num_groups, topk_groups;
  bool renormalize, bias;
};

void bench_router() {
  const int64_t T = 16384;
  std::printf("\nRouter, T = %lld tokens (GB/s = logits read + outputs written)\n", (long long)T);
  std::printf("%-34s %10s %10s %10s %10s\n", "shape", "fwd us", "fwd GB/s", "bwd us", "bwd GB/s");
  const RouterShape shapes[] = {
      {"softmax E=128 k=8", 128, 8, ScoreFunction::kSoftmax, 1, 1, false, false},
      {"softmax E=256 k=8", 256, 8, ScoreFunction::kSoftmax, 1, 1, false, false},
      {"sigmoid E=256 k=8 groups 8/4 + bias", 256, 8, ScoreFunction::kSigmoid, 8, 4, true, true},
  };
  for (const RouterShape& s : shapes) {
    RouterConfig c;
    c.num_tokens = T;
    c.num_experts = s.E;
    c.k = s.k;
    c.score_function = s.fn;
    c.num_groups = s.num_groups;
    c.topk_groups = s.topk_groups;
    c.renormalize = s.renormalize;
    const int64_t logit_count = T * s.E, slot_count = T * s.k;
    const int copies = int(std::max<int64_t>(2, 2 * kL2Bytes / (logit_count * 4)));
    std::vector<float> host(copies * logit_count), bias(s.E);
    std::mt19937 rng(10);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : host) x = normal(rng);
    for (float& b : bias) b = 0.1f * normal(rng);
    Device logits(host.size() * sizeof(float)), d_bias(s.E * sizeof(float));
    Device weights(slot_count * sizeof(float)), ids(slot_count * sizeof(int32_t));
    Device grad_weights(slot_count * sizeof(float)), grad_logits(logit_count * sizeof(float));
    upload(logits.as<float>(), host);
    upload(d_bias.as<float>(), bias);
    CHECK(cudaMemset(grad_weights.ptr, 0x3c, slot_count * sizeof(float)));  // 0.0115 each
    auto logits_copy = [&](int i) { return logits.as<float>() + (i % copies) * logit_count; };
    const double fwd = median_us([&](int i) {
      CHECK(nodrop::cuda::topk_router(logits_copy(i), s.bias ? d_bias.as<float>() : nullptr, c,
                                      weights.as<float>(), ids.as<int32_t>(), g_stream));
    });
    const double bwd = median_us([&](int i) {
      CHECK(nodrop::cuda::topk_router_grad(logits_copy(i), ids.as<int32_t>(),
                                           grad_weights.as<float>(), c, grad_logits.as<float>(),
                                           g_stream));
    });
    const double fwd_bytes = logit_count * 4.0 + slot_count * 8.0;
    const double bwd_bytes = logit_count * 8.0 + slot_count * 8.0;
    std::printf("%-34s %10.1f %10.0f %10.1f %10.0f\n", s.name, fwd, fwd_bytes / fwd * 1e-3, bwd,
                bwd_bytes / bwd * 1e-3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--iters=", 8) == 0) {
      g_iters = std::max(1, std::atoi(argv[i] + 8));
    } else if (std::strncmp(argv[i], "--warmup=", 9) == 0) {
      g_warmup = std::max(0, std::atoi(argv[i] + 9));
    } else {
      std::fprintf(stderr, "usage: %s [--iters=N] [--warmup=N]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; median of %d calls after %d warm-up calls\n\n", prop.name,
              prop.multiProcessorCount, g_iters, g_warmup);
  CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  bench_row_movers();
  bench_permute_fp8();
  bench_sort();
  bench_router();
  CHECK(cudaStreamDestroy(g_stream));
  return 0;
}
