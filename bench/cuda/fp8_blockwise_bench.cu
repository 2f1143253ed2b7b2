// Benchmark of the FP8 grouped matmuls (blockwise-scaled, and tensorwise with fast accumulation)
// against the bf16 grouped matmul of the same shapes, printed as markdown tables.
//
//   nodrop_cuda_fp8_bench [--mode=forward|training] [--iters=50] [--warmup=5]
//                         [--configs=auto|all] [--shapes=ID,...]
//
// --mode=forward (the default): the forward (ragged rows, rhs transposed in both precisions), on
// the blockwise kernels and on the tensorwise ones with fast accumulation (the recipe's forward).
// --mode=training: a layer's three GEMMs (forward, input gradient, weight gradient) in both
// precisions, the FP8 side with the engine's quantisation of the activations and output
// gradients (rows for the forward and input gradient, transposed for the weight gradient;
// the weights' 128 x 128 quantisation is not counted in the layer), and the quantisers'
// bandwidth against a device-to-device copy of the same input (the transposed quantiser's also
// from float32 inputs); the last two columns are the same layer with the weight gradient on the
// bf16 kernel instead (`--fp8-weight-gradient unquantised`: no transposed quantisation).
// A table of the weights' quantisers follows: each shape's bf16 experts w [G, K, N] into the
// forward's operand (quantize_fp8_weights_transposed: q_t [G, N, K]) and the input gradient's
// (quantize_fp8_weights: q [G, K, N], in place), with their 128 x 128 scales, blockwise and with
// a given scale per expert (the tensorwise recipe's), in ms and as GB/s read + written over a
// copy's of the same weights. A last table times the tensorwise recipe on the same operands: the
// forward with fast accumulation, both gradients promoted (its default) or fast, the weight
// gradient on the rows' codes re-laid (transpose_fp8_codes, also in the bandwidth table), or in
// bf16.
// --configs=all there times every weight-gradient kernel (NODROP_FP8_CONTRACT_TILE) in two
// orders, and every tensorwise kernel on both gradients in two orders.
//
// --configs=auto (the default) times the automatic schedule; --configs=all times every kernel of
// fp8_tiles.def and the fast ones of fp8_tensorwise_tiles.def (along M, swizzle 1), then the
// fastest of each with three other tile orders, and ends with the best per shape. --shapes keeps
// the shapes of those ids (the first column of kShapes). Group sizes are equal shares moved about at random, as a router's counts are
// (DeepGEMM's shapes: equal groups). Each timing is the median of `iters` single calls timed
// with CUDA events after `warmup` calls. The scales are all one and the E4M3 values finite: the
// timing does not depend on the values.
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
#include <utility>
#include <vector>

#include "check.h"
#include "nodrop/engine_cuda.h"

namespace {

using Sizes = std::vector<int32_t>;

using nodrop::cuda::GemmRaster;
using nodrop_bench::check;

struct Shape {
  const char* id;    // for --shapes
  const char* name;
  int64_t M, K, N, G;  // rows (tokens x top-k), hidden, expert width, experts
  bool equal_groups;   // every group M / G rows, not a router's spread
};

// Forward GEMMs of grouped_matmul_bench.cu's shapes (K and N multiples of 128).
const Shape kShapes[] = {
    {"mixtral", "Mixtral-8x7B", 16384, 4096, 14336, 8, false},
    {"qwen3", "Qwen3-30B-A3B", 131072, 2048, 768, 128, false},
    {"dsv3", "DeepSeek-V3 EP8 rank", 8192, 7168, 2048, 32, false},
    {"dsv3-down", "DeepSeek-V3 EP8 rank down", 8192, 2048, 7168, 32, false},
    {"mixtral-2k", "Mixtral-8x7B 2k tokens", 4096, 4096, 14336, 8, false},
    {"qwen3-2k", "Qwen3-30B-A3B 2k tokens", 16384, 2048, 768, 128, false},
    {"mixtral-gate-up", "Mixtral-8x7B layer gate+up", 16384, 4096, 28672, 8, false},
    {"mixtral-down", "Mixtral-8x7B layer down", 16384, 14336, 4096, 8, false},
    // Qwen3's layer as MoEBlock runs it; the down projection's forward has the shape of the
    // gate and up projection's input gradient (a short contraction into wide rows).
    {"qwen3-gate-up", "Qwen3-30B-A3B layer gate+up", 131072, 2048, 1536, 128, false},
    {"qwen3-down", "Qwen3-30B-A3B layer down", 131072, 768, 2048, 128, false},
    // DeepGEMM's published grouped (contiguous layout) shapes: 4 groups of 8192 rows.
    {"deepgemm-n4096", "DeepGEMM 4x8192 N4096 K7168", 32768, 7168, 4096, 4, true},
    {"deepgemm-n7168", "DeepGEMM 4x8192 N7168 K2048", 32768, 2048, 7168, 4, true},
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

__global__ void widen_bf16(const __nv_bfloat16* in, float* out, int64_t count) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = __bfloat162float(in[i]);
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

// The accumulation a tensorwise call on `schedule` asks for: its pinned tile's, else `automatic`.
bool accumulation_of(const nodrop::cuda::Fp8TensorwiseSchedule& schedule, bool automatic) {
  return schedule.tile == nodrop::cuda::Fp8TensorwiseTile::kAuto
             ? automatic
             : nodrop::cuda::fp8_tensorwise_tile_fast_accumulation(schedule.tile);
}

// The tensorwise kernels of one accumulation.
std::vector<nodrop::cuda::Fp8TensorwiseTile> tensorwise_tiles(bool fast) {
  std::vector<nodrop::cuda::Fp8TensorwiseTile> tiles;
  for (auto tile : nodrop::cuda::kFp8TensorwiseTiles) {
    if (nodrop::cuda::fp8_tensorwise_tile_fast_accumulation(tile) == fast) tiles.push_back(tile);
  }
  return tiles;
}

// Device buffers of one shape: both precisions' operands, the group sizes and the workspaces.
struct Problem {
  const Shape& s;
  uint8_t *lhs8, *rhs8;
  float *lhs_scales, *rhs_scales;
  __nv_bfloat16 *lhs16, *rhs16;
  void* out;  // [M, N] of the forward, [M, K] of the input gradient
  int32_t* sizes;
  Sizes host_sizes;
  size_t ws8_bytes, ws16_bytes;
  void *ws8, *ws16;
  // --mode=training only: the output gradient [M, N] in both precisions, rhs [G, K, N] in FP8
  // for the input gradient, the transposed operands of the weight gradient (engine.h's layout)
  // and its [G, N, K] output.
  __nv_bfloat16* dout16 = nullptr;
  uint8_t *dout8 = nullptr, *rhs8_t = nullptr, *lhs8_t = nullptr, *dout8_t = nullptr;
  float *dout_scales = nullptr, *lhs_t_scales = nullptr, *dout_t_scales = nullptr;
  void* grad = nullptr;
  int64_t P = 0;

  Problem(const Shape& shape, cudaStream_t stream, bool training) : s(shape) {
    const int64_t KB = (s.K + 127) / 128, NB = (s.N + 127) / 128;
    lhs8 = static_cast<uint8_t*>(device_alloc(s.M * s.K));
    rhs8 = static_cast<uint8_t*>(device_alloc(s.G * s.N * s.K));
    lhs_scales = static_cast<float*>(device_alloc(s.M * KB * sizeof(float)));
    rhs_scales = static_cast<float*>(device_alloc(s.G * NB * KB * sizeof(float)));
    lhs16 = static_cast<__nv_bfloat16*>(device_alloc(s.M * s.K * 2));
    rhs16 = static_cast<__nv_bfloat16*>(device_alloc(s.G * s.N * s.K * 2));
    out = device_alloc(s.M * std::max(s.N, s.K) * 2);
    sizes = static_cast<int32_t*>(device_alloc(s.G * sizeof(int32_t)));
    ws8_bytes = nodrop::cuda::grouped_matmul_fp8_blockwise_workspace_bytes(s.G);
    ws16_bytes = nodrop::cuda::grouped_matmul_workspace_bytes(s.G);
    ws8 = device_alloc(ws8_bytes);
    ws16 = device_alloc(ws16_bytes);
    fill_e4m3<<<1024, 256, 0, stream>>>(lhs8, s.M * s.K, 1);
    fill_e4m3<<<1024, 256, 0, stream>>>(rhs8, s.G * s.N * s.K, 2);
    fill_ones<<<256, 256, 0, stream>>>(lhs_scales, s.M * KB);
    fill_ones<<<256, 256, 0, stream>>>(rhs_scales, s.G * NB * KB);
    fill_bf16<<<1024, 256, 0, stream>>>(lhs16, s.M * s.K, 3);
    fill_bf16<<<1024, 256, 0, stream>>>(rhs16, s.G * s.N * s.K, 4);
    CHECK(cudaGetLastError());
    host_sizes =
        s.equal_groups ? Sizes(s.G, static_cast<int32_t>(s.M / s.G)) : router_like_sizes(s.M, s.G);
    CHECK(cudaMemcpyAsync(sizes, host_sizes.data(), s.G * sizeof(int32_t),
                          cudaMemcpyHostToDevice, stream));
    if (training) {
      const int64_t PB = nodrop::fp8_contract_blocks(s.M, s.G);
      P = PB * nodrop::kFp8Block;
      dout16 = static_cast<__nv_bfloat16*>(device_alloc(s.M * s.N * 2));
      dout8 = static_cast<uint8_t*>(device_alloc(s.M * s.N));
      dout_scales = static_cast<float*>(device_alloc(s.M * NB * sizeof(float)));
      rhs8_t = static_cast<uint8_t*>(device_alloc(s.G * s.K * s.N));
      lhs8_t = static_cast<uint8_t*>(device_alloc(s.K * P));
      dout8_t = static_cast<uint8_t*>(device_alloc(s.N * P));
      lhs_t_scales = static_cast<float*>(device_alloc(PB * s.K * sizeof(float)));
      dout_t_scales = static_cast<float*>(device_alloc(PB * s.N * sizeof(float)));
      grad = device_alloc(s.G * s.N * s.K * 2);
      fill_bf16<<<1024, 256, 0, stream>>>(dout16, s.M * s.N, 5);
      fill_e4m3<<<1024, 256, 0, stream>>>(rhs8_t, s.G * s.K * s.N, 6);
      CHECK(cudaGetLastError());
      // Real operands for the weight gradient: the quantisers' own output.
      quantize_rows(stream);
      quantize_transposed(stream);
    }
    CHECK(cudaStreamSynchronize(stream));
  }
  ~Problem() {
    // A kernel writing past its output would overwrite the allocations after it; the group sizes
    // are the one input whose corruption changes what the timed kernels do.
    Sizes after(s.G);
    CHECK(cudaMemcpy(after.data(), sizes, s.G * sizeof(int32_t), cudaMemcpyDeviceToHost));
    if (after != host_sizes) {
      std::fprintf(stderr, "shape %s: the group sizes changed while it ran\n", s.id);
      std::abort();
    }
    for (void* p : {static_cast<void*>(lhs8), static_cast<void*>(rhs8),
                    static_cast<void*>(lhs_scales), static_cast<void*>(rhs_scales),
                    static_cast<void*>(lhs16), static_cast<void*>(rhs16), out,
                    static_cast<void*>(sizes), ws8, ws16, static_cast<void*>(dout16),
                    static_cast<void*>(dout8), static_cast<void*>(rhs8_t),
                    static_cast<void*>(lhs8_t), static_cast<void*>(dout8_t),
                    static_cast<void*>(dout_scales), static_cast<void*>(lhs_t_scales),
                    static_cast<void*>(dout_t_scales), grad}) {
      if (p != nullptr) CHECK(cudaFree(p));
    }
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  void run_bf16(cudaStream_t stream) const {
    CHECK(nodrop::cuda::grouped_matmul(lhs16, rhs16, nodrop::DType::kBFloat16, sizes, s.M, s.K,
                                       s.N, s.G, /*transpose_rhs=*/true, out,
                                       nodrop::DType::kBFloat16, ws16, ws16_bytes, stream));
  }
  void run_fp8(const nodrop::cuda::Fp8GemmSchedule& schedule, cudaStream_t stream) const {
    CHECK(nodrop::cuda::grouped_matmul_fp8_blockwise(lhs8, lhs_scales, rhs8, rhs_scales, sizes,
                                                     s.M, s.K, s.N, s.G, out, ws8, ws8_bytes,
                                                     stream, schedule));
  }
  // The tensorwise scales are the first elements of the blockwise ones (all ones). A pinned tile
  // runs with its own accumulation, kAuto with `fast`.
  void run_fp8(const nodrop::cuda::Fp8TensorwiseSchedule& schedule, cudaStream_t stream,
               bool fast = true) const {
    CHECK(nodrop::cuda::grouped_matmul_fp8_tensorwise(lhs8, lhs_scales, rhs8, rhs_scales, sizes,
                                                      s.M, s.K, s.N, s.G,
                                                      accumulation_of(schedule, fast), out, ws8,
                                                      ws8_bytes, stream, schedule));
  }

  // --mode=training. The input gradient dout [M, N] @ rhs[g] [N, K]; the weight gradient of
  // rhs [G, N, K]: dout_g^T @ lhs_g.
  void run_bf16_dgrad(cudaStream_t stream) const {
    CHECK(nodrop::cuda::grouped_matmul(dout16, rhs16, nodrop::DType::kBFloat16, sizes, s.M, s.N,
                                       s.K, s.G, /*transpose_rhs=*/false, out,
                                       nodrop::DType::kBFloat16, ws16, ws16_bytes, stream));
  }
  void run_bf16_wgrad(cudaStream_t stream) const {
    CHECK(nodrop::cuda::grouped_matmul_contract(dout16, lhs16, nodrop::DType::kBFloat16, sizes,
                                                s.M, s.N, s.K, s.G, grad,
                                                nodrop::DType::kBFloat16, ws16, ws16_bytes,
                                                stream));
  }
  void quantize_rows(cudaStream_t stream) const {
    CHECK(nodrop::cuda::quantize_fp8(lhs16, nodrop::DType::kBFloat16, s.M, s.K, 128, lhs8,
                                     lhs_scales, stream));
    CHECK(nodrop::cuda::quantize_fp8(dout16, nodrop::DType::kBFloat16, s.M, s.N, 128, dout8,
                                     dout_scales, stream));
  }
  void quantize_transposed(cudaStream_t stream) const {
    CHECK(nodrop::cuda::quantize_fp8_transposed(lhs16, nodrop::DType::kBFloat16, sizes, s.M, s.K,
                                                s.G, nullptr, lhs8_t, lhs_t_scales, stream));
    CHECK(nodrop::cuda::quantize_fp8_transposed(dout16, nodrop::DType::kBFloat16, sizes, s.M,
                                                s.N, s.G, nullptr, dout8_t, dout_t_scales, stream));
  }
  // The tensorwise recipe's weight-gradient operands: the rows' codes re-laid by group.
  void relay_codes(cudaStream_t stream) const {
    CHECK(nodrop::cuda::transpose_fp8_codes(lhs8, sizes, s.M, s.K, s.G, lhs8_t, stream));
    CHECK(nodrop::cuda::transpose_fp8_codes(dout8, sizes, s.M, s.N, s.G, dout8_t, stream));
  }
  void run_fp8_dgrad(cudaStream_t stream) const {
    CHECK(nodrop::cuda::grouped_matmul_fp8_blockwise(dout8, dout_scales, rhs8_t, rhs_scales,
                                                     sizes, s.M, s.N, s.K, s.G, out, ws8,
                                                     ws8_bytes, stream));
  }
  void run_fp8_wgrad(const nodrop::cuda::Fp8GemmSchedule& schedule, cudaStream_t stream) const {
    CHECK(nodrop::cuda::grouped_matmul_fp8_blockwise_contract(
        dout8_t, dout_t_scales, lhs8_t, lhs_t_scales, sizes, s.M, s.N, s.K, s.G, grad, ws8,
        ws8_bytes, stream, schedule));
  }
  // The weights' quantisers: rhs16's values read as w [G, K, N] (the timing does not depend on
  // them) into the forward's operand rhs8 [G, N, K] (transposed) or the input gradient's rhs8_t
  // [G, K, N] (in place, --mode=training only), and rhs_scales ([G, NB, KB] or [G, KB, NB]);
  // given_scale null (blockwise: each block's amax) or G per-expert scales in device memory
  // (tensorwise). They overwrite the GEMMs' operands: run them after the GEMMs that read them.
  void quantize_weights(bool transposed, const float* given_scale, cudaStream_t stream) const {
    if (transposed) {
      CHECK(nodrop::cuda::quantize_fp8_weights_transposed(rhs16, nodrop::DType::kBFloat16, s.G,
                                                          s.K, s.N, given_scale, rhs8,
                                                          rhs_scales, stream));
    } else {
      CHECK(nodrop::cuda::quantize_fp8_weights(rhs16, nodrop::DType::kBFloat16, s.G, s.K, s.N,
                                               given_scale, rhs8_t, rhs_scales, stream));
    }
  }
  // The tensorwise recipe's gradients on the same operands (its scales: the first of each).
  void run_fp8_dgrad(const nodrop::cuda::Fp8TensorwiseSchedule& schedule, bool fast,
                     cudaStream_t stream) const {
    CHECK(nodrop::cuda::grouped_matmul_fp8_tensorwise(
        dout8, dout_scales, rhs8_t, rhs_scales, sizes, s.M, s.N, s.K, s.G,
        accumulation_of(schedule, fast), out, ws8, ws8_bytes, stream, schedule));
  }
  void run_fp8_wgrad(const nodrop::cuda::Fp8TensorwiseSchedule& schedule, bool fast,
                     cudaStream_t stream) const {
    CHECK(nodrop::cuda::grouped_matmul_fp8_tensorwise_contract(
        dout8_t, dout_t_scales, lhs8_t, lhs_t_scales, sizes, s.M, s.N, s.K, s.G,
        accumulation_of(schedule, fast), grad, ws8, ws8_bytes, stream, schedule));
  }
};

std::string schedule_name(const nodrop::cuda::Fp8GemmSchedule& schedule) {
  return std::string(nodrop::cuda::fp8_gemm_tile_name(schedule.tile)) + ", " +
         nodrop::cuda::gemm_raster_name(schedule.raster) + ", swizzle " +
         std::to_string(schedule.swizzle);
}
std::string schedule_name(const nodrop::cuda::Fp8TensorwiseSchedule& schedule) {
  return std::string("tensorwise ") + nodrop::cuda::fp8_tensorwise_tile_name(schedule.tile) +
         ", " + nodrop::cuda::gemm_raster_name(schedule.raster) + ", swizzle " +
         std::to_string(schedule.swizzle);
}

// Every kernel of one kind (the blockwise or the tensorwise tiles), then the fastest three more
// tile orders. The tiles, their automatic choice and the timing come from the caller.
template <class Schedule, class Tiles, class Time>
std::pair<Schedule, double> sweep(const Tiles& tiles, const Schedule& automatic, Time time,
                                  double* automatic_ms) {
  Schedule best;
  double best_ms = 0;
  auto consider = [&](const Schedule& schedule) {
    const double ms = time(schedule, schedule_name(schedule));
    if (best_ms == 0 || ms < best_ms) {
      best_ms = ms;
      best = schedule;
    }
    return ms;
  };
  for (auto tile : tiles) {
    const double ms = consider(Schedule(tile, GemmRaster::kAlongM, 1));
    if (tile == automatic.tile) *automatic_ms = ms;
  }
  const auto fastest = best.tile;
  const std::pair<GemmRaster, int> other_orders[] = {
      {GemmRaster::kAlongM, 4}, {GemmRaster::kAlongN, 1}, {GemmRaster::kAlongN, 4}};
  for (const auto& [raster, swizzle] : other_orders) consider(Schedule(fastest, raster, swizzle));
  return {best, best_ms};
}

bool selected(const Shape& s, const std::string& ids) {
  if (ids.empty()) return true;
  const std::string list = "," + ids + ",";
  return list.find("," + std::string(s.id) + ",") != std::string::npos;
}

struct Best {
  const Shape* shape;
  double bf16_tflops, default_tflops = 0, best_tflops = 0;
  std::string best_name;
  double tensorwise_default_tflops = 0, tensorwise_best_tflops = 0;
  std::string tensorwise_best_name;
};

// --mode=training: per shape, the three GEMMs of a layer in bf16 and in FP8 with the engine's
// quantisers, then the quantisers' bandwidth.
void run_training(int iters, int warmup, bool all_configs, const std::string& shape_ids,
                  cudaStream_t stream) {
  using nodrop::cuda::Fp8GemmSchedule;
  using nodrop::cuda::Fp8TensorwiseSchedule;
  struct Bandwidth {
    const Shape* shape;
    double rows_gbs, transposed_gbs, relaid_gbs, copy_gbs, transposed32_gbs, copy32_gbs;
  };
  struct WeightsBandwidth {  // [0] transposed, [1] in place; [.][0] blockwise, [.][1] tensorwise
    const Shape* shape;
    double ms[2][2], gbs[2][2], copy_gbs;
  };
  std::vector<WeightsBandwidth> weights_bandwidths;
  std::vector<Bandwidth> bandwidths;
  std::vector<std::string> tensorwise_rows, tensorwise_kernel_rows;
  std::printf("Forward, input gradient and weight gradient of one layer (ms; FP8 with its "
              "activation and output-gradient quantisation):\n\n");
  std::printf("| shape | M | K | N | G | bf16 fwd | bf16 dgrad | bf16 wgrad | bf16 total | "
              "fp8 quantise rows | fp8 quantise transposed | fp8 fwd | fp8 dgrad | fp8 wgrad | "
              "fp8 wgrad kernel | fp8 total | fp8 wgrad TFLOP/s | fp8 vs bf16 | "
              "fp8, bf16 wgrad: total | fp8, bf16 wgrad vs bf16 |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Shape& s : kShapes) {
    if (!selected(s, shape_ids)) continue;
    const Problem problem(s, stream, /*training=*/true);
    const double tflop = 2.0 * s.M * s.N * s.K * 1e-12;
    auto time = [&](auto run) { return median_ms(iters, warmup, stream, run); };
    const double bf16_fwd = time([&] { problem.run_bf16(stream); });
    const double bf16_dgrad = time([&] { problem.run_bf16_dgrad(stream); });
    const double bf16_wgrad = time([&] { problem.run_bf16_wgrad(stream); });
    const double rows_ms = time([&] { problem.quantize_rows(stream); });
    const double transposed_ms = time([&] { problem.quantize_transposed(stream); });
    const double relaid_ms = time([&] { problem.relay_codes(stream); });
    const double fp8_fwd = time([&] { problem.run_fp8(Fp8GemmSchedule{}, stream); });
    const double fp8_dgrad = time([&] { problem.run_fp8_dgrad(stream); });
    // The weight gradient's kernels: the automatic one, or all of them in two orders.
    std::vector<Fp8GemmSchedule> candidates = {Fp8GemmSchedule{}};
    if (all_configs) {
      candidates.clear();
#define NODROP_FP8_GEMM_TILE(...)
#define NODROP_FP8_CONTRACT_TILE(name)                                            \
  candidates.emplace_back(nodrop::cuda::Fp8GemmTile::name, GemmRaster::kAlongM, 1); \
  candidates.emplace_back(nodrop::cuda::Fp8GemmTile::name, GemmRaster::kAlongN, 4);
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_CONTRACT_TILE
#undef NODROP_FP8_GEMM_TILE
    }
    const Fp8GemmSchedule automatic =
        nodrop::cuda::grouped_matmul_fp8_contract_schedule(s.M, s.N, s.K, s.G);
    const double bf16_total = bf16_fwd + bf16_dgrad + bf16_wgrad;
    // --fp8-weight-gradient unquantised: no transposed quantisation, the bf16 weight gradient.
    const double unquantised_wgrad_total = rows_ms + fp8_fwd + fp8_dgrad + bf16_wgrad;
    for (const Fp8GemmSchedule& schedule : candidates) {
      const double fp8_wgrad = time([&] { problem.run_fp8_wgrad(schedule, stream); });
      const double fp8_total = rows_ms + transposed_ms + fp8_fwd + fp8_dgrad + fp8_wgrad;
      const std::string name =
          schedule.tile == nodrop::cuda::Fp8GemmTile::kAuto
              ? "auto: " + schedule_name(automatic)
              : schedule_name(schedule);
      std::printf("| %s | %lld | %lld | %lld | %lld | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | "
                  "%.3f | %.3f | %.3f | %s | %.3f | %.0f | %.2fx | %.3f | %.2fx |\n",
                  s.id, static_cast<long long>(s.M), static_cast<long long>(s.K),
                  static_cast<long long>(s.N), static_cast<long long>(s.G), bf16_fwd, bf16_dgrad,
                  bf16_wgrad, bf16_total, rows_ms, transposed_ms, fp8_fwd, fp8_dgrad, fp8_wgrad,
                  name.c_str(), fp8_total, tflop / (fp8_wgrad * 1e-3), bf16_total / fp8_total,
                  unquantised_wgrad_total, bf16_total / unquantised_wgrad_total);
      std::fflush(stdout);
    }
    // The tensorwise recipe on the same operands: the rows quantised, forward with fast
    // accumulation, both gradients promoted (its default), or fast too, on the rows' codes
    // re-laid for the weight gradient; or the weight gradient in bf16.
    const double tw_fwd = time([&] { problem.run_fp8(Fp8TensorwiseSchedule{}, stream, true); });
    double tw_grad[2][2];  // [fast][0: input gradient, 1: weight gradient]
    for (bool fast : {false, true}) {
      tw_grad[fast][0] = time([&] { problem.run_fp8_dgrad(Fp8TensorwiseSchedule{}, fast, stream); });
      tw_grad[fast][1] = time([&] { problem.run_fp8_wgrad(Fp8TensorwiseSchedule{}, fast, stream); });
    }
    const double tw_promoted = rows_ms + relaid_ms + tw_fwd + tw_grad[0][0] + tw_grad[0][1];
    const double tw_fast = rows_ms + relaid_ms + tw_fwd + tw_grad[1][0] + tw_grad[1][1];
    const double tw_bf16_wgrad = rows_ms + tw_fwd + tw_grad[0][0] + bf16_wgrad;
    char line[512];
    std::snprintf(line, sizeof(line),
                  "| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2fx | %.3f | %.3f | %.3f | "
                  "%.2fx | %.3f | %.2fx |",
                  s.id, bf16_total, relaid_ms, tw_fwd, tw_grad[0][0], tw_grad[0][1], tw_promoted,
                  bf16_total / tw_promoted, tw_grad[1][0], tw_grad[1][1], tw_fast,
                  bf16_total / tw_fast, tw_bf16_wgrad, bf16_total / tw_bf16_wgrad);
    tensorwise_rows.emplace_back(line);
    // --configs=all: every tensorwise kernel on both gradients, along M swizzle 1 and N swizzle 4.
    for (auto tile : all_configs ? std::vector<nodrop::cuda::Fp8TensorwiseTile>(
                                       std::begin(nodrop::cuda::kFp8TensorwiseTiles),
                                       std::end(nodrop::cuda::kFp8TensorwiseTiles))
                                 : std::vector<nodrop::cuda::Fp8TensorwiseTile>{}) {
      for (const auto& [raster, swizzle] :
           {std::pair{GemmRaster::kAlongM, 1}, std::pair{GemmRaster::kAlongN, 4}}) {
        const Fp8TensorwiseSchedule schedule(tile, raster, swizzle);
        const double dgrad = time([&] { problem.run_fp8_dgrad(schedule, false, stream); });
        const double wgrad = time([&] { problem.run_fp8_wgrad(schedule, false, stream); });
        std::snprintf(line, sizeof(line), "| %s | %s | %.3f | %.0f | %.3f | %.0f |", s.id,
                      schedule_name(schedule).c_str(), dgrad, tflop / (dgrad * 1e-3), wgrad,
                      tflop / (wgrad * 1e-3));
        tensorwise_kernel_rows.emplace_back(line);
      }
    }
    // Bandwidth: bytes read and written per second, against a copy of the same input; the
    // transposed quantiser also from float32 copies of the operands (a float32 model's).
    const double in_bytes = 2.0 * s.M * (s.K + s.N);
    const double rows_bytes = in_bytes + s.M * (s.K + s.N) * (1.0 + 4.0 / 128);
    const double P = double(problem.P), PB = P / 128;
    const double written_t = (s.K + s.N) * (P + 4.0 * PB);
    const auto copy_ms = [&](const void* lhs, const void* dout, int64_t bytes_per_element) {
      void* copy = device_alloc(static_cast<size_t>(bytes_per_element * s.M * (s.K + s.N)));
      const double ms = time([&] {
        CHECK(cudaMemcpyAsync(copy, lhs, bytes_per_element * s.M * s.K, cudaMemcpyDeviceToDevice,
                              stream));
        CHECK(cudaMemcpyAsync(static_cast<char*>(copy) + bytes_per_element * s.M * s.K, dout,
                              bytes_per_element * s.M * s.N, cudaMemcpyDeviceToDevice, stream));
      });
      CHECK(cudaFree(copy));
      return ms;
    };
    const double copy16_ms = copy_ms(problem.lhs16, problem.dout16, 2);
    auto* lhs32 = static_cast<float*>(device_alloc(s.M * s.K * sizeof(float)));
    auto* dout32 = static_cast<float*>(device_alloc(s.M * s.N * sizeof(float)));
    widen_bf16<<<1024, 256, 0, stream>>>(problem.lhs16, lhs32, s.M * s.K);
    widen_bf16<<<1024, 256, 0, stream>>>(problem.dout16, dout32, s.M * s.N);
    CHECK(cudaGetLastError());
    const double transposed32_ms = time([&] {
      CHECK(nodrop::cuda::quantize_fp8_transposed(lhs32, nodrop::DType::kFloat32, problem.sizes,
                                                  s.M, s.K, s.G, nullptr, problem.lhs8_t,
                                                  problem.lhs_t_scales, stream));
      CHECK(nodrop::cuda::quantize_fp8_transposed(dout32, nodrop::DType::kFloat32, problem.sizes,
                                                  s.M, s.N, s.G, nullptr, problem.dout8_t,
                                                  problem.dout_t_scales, stream));
    });
    const double copy32_ms = copy_ms(lhs32, dout32, 4);
    CHECK(cudaFree(lhs32));
    CHECK(cudaFree(dout32));
    bandwidths.push_back({&s, rows_bytes / (rows_ms * 1e6),
                          (in_bytes + written_t) / (transposed_ms * 1e6),
                          (in_bytes / 2 + (s.K + s.N) * P) / (relaid_ms * 1e6),
                          2 * in_bytes / (copy16_ms * 1e6),
                          (2 * in_bytes + written_t) / (transposed32_ms * 1e6),
                          4 * in_bytes / (copy32_ms * 1e6)});
    // The weights' quantisers, last: they overwrite the forward's and the input gradient's FP8
    // operands. Bytes: 2 read and 1 written per weight, 4 per scale written (and per given scale
    // read), against a copy of the same bf16 weights (2 read and 2 written per weight).
    const double weights = double(s.G) * s.K * s.N;
    const double weight_scales = double(s.G) * ((s.N + 127) / 128) * ((s.K + 127) / 128);
    auto* expert_scales = static_cast<float*>(device_alloc(s.G * sizeof(float)));
    fill_ones<<<1, 256, 0, stream>>>(expert_scales, s.G);
    CHECK(cudaGetLastError());
    WeightsBandwidth weights_bandwidth{&s, {}, {}, 0};
    for (const int layout : {0, 1}) {
      for (const int tensorwise : {0, 1}) {
        const double ms = time([&] {
          problem.quantize_weights(layout == 0, tensorwise ? expert_scales : nullptr, stream);
        });
        weights_bandwidth.ms[layout][tensorwise] = ms;
        weights_bandwidth.gbs[layout][tensorwise] =
            (3 * weights + 4 * weight_scales + 4.0 * s.G * tensorwise) / (ms * 1e6);
      }
    }
    void* weights_copy = device_alloc(static_cast<size_t>(2 * weights));
    const double weights_copy_ms = time([&] {
      CHECK(cudaMemcpyAsync(weights_copy, problem.rhs16, static_cast<size_t>(2 * weights),
                            cudaMemcpyDeviceToDevice, stream));
    });
    CHECK(cudaFree(weights_copy));
    CHECK(cudaFree(expert_scales));
    weights_bandwidth.copy_gbs = 4 * weights / (weights_copy_ms * 1e6);
    weights_bandwidths.push_back(weights_bandwidth);
  }
  std::printf("\nQuantisers of the activations and output gradients (GB/s read + written; copy: "
              "cudaMemcpyAsync of the same inputs, bf16 or float32):\n\n");
  std::printf("| shape | rows (1 x 128) | transposed (weight gradient) | re-laid codes "
              "(tensorwise weight gradient) | copy | rows / copy | transposed / copy | "
              "re-laid / copy | transposed, float32 input | float32 copy | "
              "transposed / copy, float32 |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Bandwidth& b : bandwidths) {
    std::printf("| %s | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.2f | %.0f | %.0f | %.2f |\n",
                b.shape->id, b.rows_gbs, b.transposed_gbs, b.relaid_gbs, b.copy_gbs,
                b.rows_gbs / b.copy_gbs, b.transposed_gbs / b.copy_gbs,
                b.relaid_gbs / b.copy_gbs, b.transposed32_gbs, b.copy32_gbs,
                b.transposed32_gbs / b.copy32_gbs);
  }
  std::printf("\nQuantisers of the weights (bf16 w [G, K, N] -> E4M3 and 128 x 128 scales, "
              "blockwise or at a given scale per expert; transposed: the forward's q_t [G, N, K], "
              "in place: the input gradient's q [G, K, N]; ms, and GB/s read + written over the "
              "copy's; copy: cudaMemcpyAsync of the same bf16 weights):\n\n");
  std::printf("| shape | G | K | N | copy GB/s | transposed: blockwise ms | tensorwise ms | "
              "blockwise / copy | tensorwise / copy | in place: blockwise ms | tensorwise ms | "
              "blockwise / copy | tensorwise / copy |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: |\n");
  for (const WeightsBandwidth& b : weights_bandwidths) {
    std::printf("| %s | %lld | %lld | %lld | %.0f", b.shape->id,
                static_cast<long long>(b.shape->G), static_cast<long long>(b.shape->K),
                static_cast<long long>(b.shape->N), b.copy_gbs);
    for (int layout : {0, 1}) {
      std::printf(" | %.3f | %.3f | %.2f | %.2f", b.ms[layout][0], b.ms[layout][1],
                  b.gbs[layout][0] / b.copy_gbs, b.gbs[layout][1] / b.copy_gbs);
    }
    std::printf(" |\n");
  }
  std::printf("\nThe tensorwise recipe's three GEMMs (ms; the rows quantised as above, and for "
              "the weight gradient their codes re-laid; forward with fast accumulation; "
              "automatic tiles):\n\n");
  std::printf("| shape | bf16 total | re-lay codes | fwd | dgrad promoted | wgrad promoted | "
              "total | vs bf16 | dgrad fast | wgrad fast | total, fast gradients | vs bf16 | "
              "total, bf16 wgrad | vs bf16 |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: | ---: |\n");
  for (const std::string& row : tensorwise_rows) std::printf("%s\n", row.c_str());
  if (!tensorwise_kernel_rows.empty()) {
    std::printf("\nEvery tensorwise kernel on the gradients (ms, TFLOP/s):\n\n");
    std::printf("| shape | kernel | dgrad | TFLOP/s | wgrad | TFLOP/s |\n");
    std::printf("| --- | --- | ---: | ---: | ---: | ---: |\n");
    for (const std::string& row : tensorwise_kernel_rows) std::printf("%s\n", row.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  using nodrop::cuda::Fp8GemmSchedule;
  using nodrop::cuda::Fp8TensorwiseSchedule;
  int iters = 50, warmup = 5;
  bool all_configs = false, training = false;
  std::string shape_ids;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--iters=", 8) == 0) {
      iters = std::max(1, std::atoi(argv[i] + 8));
    } else if (std::strncmp(argv[i], "--warmup=", 9) == 0) {
      warmup = std::max(0, std::atoi(argv[i] + 9));
    } else if (std::strcmp(argv[i], "--configs=all") == 0) {
      all_configs = true;
    } else if (std::strcmp(argv[i], "--configs=auto") == 0) {
      all_configs = false;
    } else if (std::strcmp(argv[i], "--mode=training") == 0) {
      training = true;
    } else if (std::strcmp(argv[i], "--mode=forward") == 0) {
      training = false;
    } else if (std::strncmp(argv[i], "--shapes=", 9) == 0) {
      shape_ids = argv[i] + 9;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--mode=forward|training] [--iters=N] [--warmup=N] "
                   "[--configs=auto|all] [--shapes=ID,...]\n"
                   "shape ids:",
                   argv[0]);
      for (const Shape& s : kShapes) std::fprintf(stderr, " %s", s.id);
      std::fprintf(stderr, "\n");
      return 2;
    }
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  if (training) {
    run_training(iters, warmup, all_configs, shape_ids, stream);
    CHECK(cudaStreamDestroy(stream));
    return 0;
  }
  std::vector<Best> bests;
  std::printf("| shape | M | K | N | G | kernel | ms | TFLOP/s | vs bf16 |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |\n");
  for (const Shape& s : kShapes) {
    if (!selected(s, shape_ids)) continue;
    const Problem problem(s, stream, /*training=*/false);
    const double tflop = 2.0 * s.M * s.N * s.K * 1e-12;
    double bf16_ms = 0;
    auto row = [&](const std::string& kernel, double ms) {
      std::printf("| %s | %lld | %lld | %lld | %lld | %s | %.3f | %.0f | %.2fx |\n", s.id,
                  static_cast<long long>(s.M), static_cast<long long>(s.K),
                  static_cast<long long>(s.N), static_cast<long long>(s.G), kernel.c_str(), ms,
                  tflop / (ms * 1e-3), bf16_ms / ms);
      std::fflush(stdout);
    };
    bf16_ms = median_ms(iters, warmup, stream, [&] { problem.run_bf16(stream); });
    row("bf16 auto", bf16_ms);
    auto time_fp8 = [&](const auto& schedule, const std::string& label) {
      const double ms = median_ms(iters, warmup, stream, [&] { problem.run_fp8(schedule, stream); });
      row(label, ms);
      return ms;
    };
    const Fp8GemmSchedule automatic = nodrop::cuda::grouped_matmul_fp8_schedule(s.M, s.K, s.N, s.G);
    const Fp8TensorwiseSchedule tensorwise_automatic =
        nodrop::cuda::grouped_matmul_fp8_tensorwise_schedule(s.M, s.K, s.N, s.G,
                                                             /*fast_accumulation=*/true);
    if (!all_configs) {
      time_fp8(Fp8GemmSchedule{}, "fp8 auto: " + schedule_name(automatic));
      time_fp8(Fp8TensorwiseSchedule{}, "fp8 auto: " + schedule_name(tensorwise_automatic));
      continue;
    }
    Best best{&s, tflop / (bf16_ms * 1e-3)};
    double default_ms = 0, tensorwise_default_ms = 0;
    const auto [best_schedule, best_ms] =
        sweep(nodrop::cuda::kFp8GemmTiles, automatic, time_fp8, &default_ms);
    // The forward's tensorwise kernels: those with fast accumulation (the recipe's).
    const auto [tensorwise_best, tensorwise_best_ms] = sweep(
        tensorwise_tiles(/*fast=*/true), tensorwise_automatic, time_fp8, &tensorwise_default_ms);
    best.default_tflops = tflop / (default_ms * 1e-3);
    best.best_tflops = tflop / (best_ms * 1e-3);
    best.best_name = schedule_name(best_schedule);
    best.tensorwise_default_tflops = tflop / (tensorwise_default_ms * 1e-3);
    best.tensorwise_best_tflops = tflop / (tensorwise_best_ms * 1e-3);
    best.tensorwise_best_name = schedule_name(tensorwise_best);
    bests.push_back(best);
  }
  if (!bests.empty()) {
    std::printf("\nBest FP8 schedule per shape (TFLOP/s; default: the automatic tile along M, "
                "swizzle 1):\n\n");
    std::printf("| shape | bf16 | blockwise default | blockwise best | best / default | "
                "best schedule | tensorwise default | tensorwise best | best schedule |\n");
    std::printf("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |\n");
    for (const Best& b : bests) {
      std::printf("| %s | %.0f | %.0f | %.0f | %.2fx | %s | %.0f | %.0f | %s |\n", b.shape->id,
                  b.bf16_tflops, b.default_tflops, b.best_tflops,
                  b.best_tflops / b.default_tflops, b.best_name.c_str(),
                  b.tensorwise_default_tflops, b.tensorwise_best_tflops,
                  b.tensorwise_best_name.c_str());
    }
  }
  CHECK(cudaStreamDestroy(stream));
  return 0;
}
