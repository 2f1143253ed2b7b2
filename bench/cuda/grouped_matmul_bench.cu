// Benchmark of the CUDA grouped matmul: forward, input gradient and weight gradient of an MoE
// expert layer at real model shapes, against cuBLAS's dense bf16 GEMM of the same FLOPs (the
// ceiling) and, where the groups are equal, cuBLAS's strided batched GEMM of the same groups (what
// a capacity-factor layer runs: one buffer per expert) and CUTLASS's batched GEMM on the same tile
// as nodrop's kernel and on cuBLAS's (cutlass_batched_gemm.cu; forward and input gradient), and,
// for any group sizes, a prototype of nodrop's rows form without per-group TMA descriptors on the
// same tile (rows_grouped_gemm.cu; where every group is whole row tiles, also with a TMA store),
// printed as a table.
//
//   nodrop_cuda_bench [--iters=50] [--warmup=5] [--tiles=auto|all|sweep] [--csv=FILE]
//                     [--shapes=NAME,NAME] [--sizes=NAME,NAME] [--raster=auto|M|N]
//                     [--groups=G,G] [--rows-form-edges]
//
// --tiles=all times every tile; --tiles=sweep times the automatic tile under every raster order
// and swizzle of the tile scheduler. --shapes runs only the named shapes (default: all).
// --sizes runs only the named group-size distributions (uniform, router-like, zipf(1)).
// --raster=M or N makes every timed kernel walk its tiles along M or N (default: the engine's).
// --groups runs each shape again with its rows split into G groups (same M, K and N: the same
// FLOPs), to separate what a group costs from what its rows cost.
// --rows-form-edges only checks the rows-form prototype on edge cases of group sizes (a small
// problem, for compute-sanitizer), which every run does first.
//
// Each timing is the median of `iters` single calls timed with CUDA events after `warmup` calls;
// consecutive calls read different copies of the inputs, so they do not start in L2.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "cutlass_batched_gemm.h"
#include "nodrop/engine_cuda.h"
#include "rows_grouped_gemm.h"

namespace {

using nodrop::DType;
using nodrop::cuda::GemmRaster;
using nodrop::cuda::GemmSchedule;
using nodrop::cuda::GemmTile;
using Sizes = std::vector<int32_t>;
using bf16 = __nv_bfloat16;

void check(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "%s: cuBLAS status %d\n", what, static_cast<int>(status));
  std::exit(1);
}
using nodrop_bench::check;

struct Shape {
  std::string name;
  int64_t M, K, N, G;  // rows (tokens x top-k), hidden, expert width, experts
};

const Shape kShapes[] = {
    {"Mixtral-8x7B", 16384, 4096, 14336, 8},
    {"Qwen3-30B-A3B", 131072, 2048, 768, 128},
    {"DeepSeek-V2-Lite", 98304, 2048, 1408, 64},
    {"DeepSeek-V3 EP8 rank", 8192, 7168, 2048, 32},
    // One device's micro-batch: few rows per group, where tile choice matters most.
    {"Mixtral-8x7B 2k tokens", 4096, 4096, 14336, 8},
    {"Qwen3-30B-A3B 2k tokens", 16384, 2048, 768, 128},
    {"DeepSeek-V2-Lite 1k tokens", 6144, 2048, 1408, 64},
    // The two GEMMs of bench/gpu_moe.py's MoE layers: gate and up fused, then down.
    {"Mixtral-8x7B layer gate+up", 16384, 4096, 28672, 8},
    {"Mixtral-8x7B layer down", 16384, 14336, 4096, 8},
    {"DeepSeek-V2-Lite layer gate+up", 98304, 2048, 2816, 64},
    {"DeepSeek-V2-Lite layer down", 98304, 1408, 2048, 64},
    // The `mixtral` training preset's expert GEMMs (16 x 2048 tokens, top-2 of 8 experts):
    // 8192 rows per group, where a group's ragged last tile costs the least.
    {"mixtral preset gate+up", 65536, 2048, 11264, 8},
    {"mixtral preset down", 65536, 5632, 2048, 8},
};

enum class Mode { kForward, kInputGrad, kWeightGrad };
const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kForward: return "forward";
    case Mode::kInputGrad: return "input grad";
    case Mode::kWeightGrad: return "weight grad";
  }
  return "?";
}

Sizes uniform_sizes(int64_t M, int64_t G) {
  Sizes sizes(G, static_cast<int32_t>(M / G));
  for (int64_t g = 0; g < M % G; ++g) ++sizes[g];
  return sizes;
}

// Equal shares moved about at random, as a router's counts are (few are multiples of a tile).
Sizes router_like_sizes(int64_t M, int64_t G) {
  Sizes sizes = uniform_sizes(M, G);
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

// Weights 1 / (g + 1), largest group first, summing to M.
Sizes zipf_sizes(int64_t M, int64_t G) {
  double total = 0;
  for (int64_t g = 0; g < G; ++g) total += 1.0 / (g + 1);
  Sizes sizes(G);
  int64_t assigned = 0;
  for (int64_t g = 0; g < G; ++g) assigned += sizes[g] = static_cast<int32_t>(M / (g + 1) / total);
  sizes[0] += static_cast<int32_t>(M - assigned);
  return sizes;
}

// The group-size distributions timed, under the names --sizes takes.
struct Distribution {
  const char* name;
  Sizes (*sizes)(int64_t M, int64_t G);
};
const Distribution kDistributions[] = {
    {"uniform", uniform_sizes}, {"router-like", router_like_sizes}, {"zipf(1)", zipf_sizes}};

// Hash-based values in [-1, 1): never time zeros.
__global__ void fill_random(bf16* data, int64_t count, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    data[i] = __float2bfloat16(static_cast<float>(h & 0xFFFFFF) / float(1 << 23) - 1.f);
  }
}

struct DeviceArray {
  void* data = nullptr;
  explicit DeviceArray(size_t bytes) { CHECK(cudaMalloc(&data, std::max<size_t>(bytes, 1))); }
  ~DeviceArray() { cudaFree(data); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

// One copy of the layer's inputs: x [M, K], w [G, K, N], dy [M, N].
struct InputSet {
  DeviceArray x, w, dy;
  InputSet(const Shape& s, uint32_t seed)
      : x(s.M * s.K * sizeof(bf16)),
        w(s.G * s.K * s.N * sizeof(bf16)),
        dy(s.M * s.N * sizeof(bf16)) {
    fill_random<<<1024, 256>>>(static_cast<bf16*>(x.data), s.M * s.K, seed);
    fill_random<<<1024, 256>>>(static_cast<bf16*>(w.data), s.G * s.K * s.N, seed + 1);
    fill_random<<<1024, 256>>>(static_cast<bf16*>(dy.data), s.M * s.N, seed + 2);
    CHECK(cudaGetLastError());
  }
};

struct Options {
  int iters = 50;
  int warmup = 5;
  std::string tiles = "auto";
  std::string raster = "auto";
  std::string csv;
  std::vector<std::string> shapes;  // empty: every shape
  std::vector<std::string> sizes;   // empty: every distribution
  std::vector<int64_t> groups;      // empty: each shape's own group count
  bool rows_form_edges_only = false;
};

std::vector<std::string> split_commas(std::string rest) {
  std::vector<std::string> names;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    names.push_back(rest.substr(0, comma));
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
  }
  return names;
}

bool selected(const std::vector<std::string>& names, const std::string& name) {
  return names.empty() || std::find(names.begin(), names.end(), name) != names.end();
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* key) -> const char* {
      const size_t n = std::strlen(key);
      return arg.compare(0, n, key) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = value("--iters=")) {
      options.iters = std::max(1, std::atoi(v));
    } else if (const char* v = value("--warmup=")) {
      options.warmup = std::max(0, std::atoi(v));
    } else if (const char* v = value("--tiles=")) {
      options.tiles = v;
    } else if (const char* v = value("--raster=")) {
      options.raster = v;
    } else if (const char* v = value("--csv=")) {
      options.csv = v;
    } else if (const char* v = value("--shapes=")) {
      options.shapes = split_commas(v);
    } else if (const char* v = value("--sizes=")) {
      options.sizes = split_commas(v);
    } else if (const char* v = value("--groups=")) {
      for (const std::string& g : split_commas(v)) {
        const int64_t groups = std::atoll(g.c_str());
        if (groups < 1) {
          std::fprintf(stderr, "--groups: expected counts of at least 1, got \"%s\"\n", g.c_str());
          std::exit(2);
        }
        options.groups.push_back(groups);
      }
    } else if (arg == "--rows-form-edges") {
      options.rows_form_edges_only = true;
    } else {
      options.tiles = "";  // unknown argument: print the usage below
    }
  }
  const bool raster_known =
      options.raster == "auto" || options.raster == "M" || options.raster == "N";
  if ((options.tiles != "auto" && options.tiles != "all" && options.tiles != "sweep") ||
      !raster_known || (options.tiles == "sweep" && options.raster != "auto")) {
    std::fprintf(stderr,
                 "usage: %s [--iters=N] [--warmup=N] [--tiles=auto|all|sweep] [--csv=FILE] "
                 "[--shapes=NAME,NAME] [--sizes=NAME,NAME] [--raster=auto|M|N] (not with "
                 "--tiles=sweep, which sweeps it) [--groups=G,G] [--rows-form-edges]\n",
                 argv[0]);
    std::exit(2);
  }
  for (const std::string& name : options.shapes) {
    if (std::none_of(std::begin(kShapes), std::end(kShapes),
                     [&](const Shape& s) { return name == s.name; })) {
      std::fprintf(stderr, "--shapes: unknown shape \"%s\"; known:", name.c_str());
      for (const Shape& s : kShapes) std::fprintf(stderr, " \"%s\"", s.name.c_str());
      std::fprintf(stderr, "\n");
      std::exit(2);
    }
  }
  for (const std::string& name : options.sizes) {
    if (std::none_of(std::begin(kDistributions), std::end(kDistributions),
                     [&](const Distribution& d) { return name == d.name; })) {
      std::fprintf(stderr, "--sizes: unknown distribution \"%s\"; known:", name.c_str());
      for (const Distribution& d : kDistributions) std::fprintf(stderr, " \"%s\"", d.name);
      std::fprintf(stderr, "\n");
      std::exit(2);
    }
  }
  return options;
}

// Median milliseconds of `iters` calls of run(i) (i counts calls, warm-up included).
template <typename Run>
double median_ms(const Options& options, cudaStream_t stream, Run run) {
  for (int i = 0; i < options.warmup; ++i) run(i);
  std::vector<cudaEvent_t> events(2 * options.iters);
  for (auto& event : events) CHECK(cudaEventCreate(&event));
  for (int i = 0; i < options.iters; ++i) {
    CHECK(cudaEventRecord(events[2 * i], stream));
    run(options.warmup + i);
    CHECK(cudaEventRecord(events[2 * i + 1], stream));
  }
  CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ms(options.iters);
  for (int i = 0; i < options.iters; ++i) {
    CHECK(cudaEventElapsedTime(&ms[i], events[2 * i], events[2 * i + 1]));
  }
  for (auto& event : events) CHECK(cudaEventDestroy(event));
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

// cuBLAS (column-major) on our row-major tensors: a row-major [r, c] matrix is a column-major
// [c, r] one, so each product is computed transposed.
void dense_gemm(cublasHandle_t handle, Mode mode, const Shape& s, const InputSet& in, void* out) {
  const float one = 1.f, zero = 0.f;
  const int M = static_cast<int>(s.M), K = static_cast<int>(s.K), N = static_cast<int>(s.N);
  const auto bf = CUDA_R_16BF;
  switch (mode) {
    case Mode::kForward:  // y^T [N, M] = w^T [N, K] x^T [K, M]
      CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &one, in.w.data, bf, N,
                         in.x.data, bf, K, &zero, out, bf, N, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
      break;
    case Mode::kInputGrad:  // dx^T [K, M] = w [K, N] dy^T [N, M]
      CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, K, M, N, &one, in.w.data, bf, N,
                         in.dy.data, bf, N, &zero, out, bf, K, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
      break;
    case Mode::kWeightGrad:  // dw^T [N, K] = dy^T [N, M] x [M, K]
      CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, N, K, M, &one, in.dy.data, bf, N,
                         in.x.data, bf, K, &zero, out, bf, N, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
      break;
  }
}

// cuBLAS's strided batched GEMM over G equal groups of M / G rows (M % G == 0), each group's
// product transposed as in dense_gemm.
void batched_gemm(cublasHandle_t handle, Mode mode, const Shape& s, const InputSet& in,
                  void* out) {
  const float one = 1.f, zero = 0.f;
  const int64_t rows = s.M / s.G;
  const int Mg = static_cast<int>(rows), K = static_cast<int>(s.K), N = static_cast<int>(s.N);
  const int G = static_cast<int>(s.G);
  const long long x_stride = rows * s.K, w_stride = s.K * s.N, dy_stride = rows * s.N;
  const auto bf = CUDA_R_16BF;
  switch (mode) {
    case Mode::kForward:  // y_g^T [N, Mg] = w_g^T [N, K] x_g^T [K, Mg]
      CHECK(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, N, Mg, K, &one,
                                       in.w.data, bf, N, w_stride, in.x.data, bf, K, x_stride,
                                       &zero, out, bf, N, dy_stride, G, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
      break;
    case Mode::kInputGrad:  // dx_g^T [K, Mg] = w_g [K, N] dy_g^T [N, Mg]
      CHECK(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, K, Mg, N, &one,
                                       in.w.data, bf, N, w_stride, in.dy.data, bf, N, dy_stride,
                                       &zero, out, bf, K, x_stride, G, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
      break;
    case Mode::kWeightGrad:  // dw_g^T [N, K] = dy_g^T [N, Mg] x_g [Mg, K]
      CHECK(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, N, K, Mg, &one,
                                       in.dy.data, bf, N, dy_stride, in.x.data, bf, K, x_stride,
                                       &zero, out, bf, N, w_stride, G, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
      break;
  }
}

nodrop::Status grouped(Mode mode, const Shape& s, const InputSet& in, const int32_t* sizes,
                       void* out, const DeviceArray& workspace, size_t workspace_bytes,
                       cudaStream_t stream, const GemmSchedule& schedule) {
  const DType bf = DType::kBFloat16;
  switch (mode) {
    case Mode::kForward:  // y [M, N] = x [M, K] @ w[g] [K, N]
      return nodrop::cuda::grouped_matmul(in.x.data, in.w.data, bf, sizes, s.M, s.K, s.N, s.G,
                                          false, out, bf, workspace.data, workspace_bytes, stream,
                                          schedule);
    case Mode::kInputGrad:  // dx [M, K] = dy [M, N] @ w[g]^T: w[g] read as [N', K'] = [K, N]
      return nodrop::cuda::grouped_matmul(in.dy.data, in.w.data, bf, sizes, s.M, s.N, s.K, s.G,
                                          true, out, bf, workspace.data, workspace_bytes, stream,
                                          schedule);
    case Mode::kWeightGrad:  // dw [G, K, N] = x_g^T @ dy_g
      return nodrop::cuda::grouped_matmul_contract(in.x.data, in.dy.data, bf, sizes, s.M, s.K, s.N,
                                                   s.G, out, bf, workspace.data, workspace_bytes,
                                                   stream, schedule);
  }
  return nodrop::Status::Error("unknown mode");
}

// The first `count` bf16 values of a device buffer, on the host as float.
std::vector<float> download_bf16(const void* data, size_t count) {
  std::vector<bf16> raw(count);
  CHECK(cudaMemcpy(raw.data(), data, count * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = __bfloat162float(raw[i]);
  return values;
}

// Where `got` (bf16 values on the device) differs from `want` (`reference`'s output) by more
// than 0.01 of max |want|, or holds a NaN (an unwritten, poisoned value), says so and stops: a
// peer computing something else would time something else.
void expect_close(const std::vector<float>& want, const void* got_device, const char* what,
                  const char* reference, const std::string& where) {
  const std::vector<float> got = download_bf16(got_device, want.size());
  float scale = 0.f;
  for (float w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < want.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 0.01f * scale)) {
      std::fprintf(stderr, "%s: %s differs from %s at element %zu: %g against %g\n",
                   where.c_str(), what, reference, i, got[i], want[i]);
      std::exit(1);
    }
  }
}

// CUTLASS's batched GEMM on `batched`'s tile: y_g = x_g w_g (forward) or dy_g w_g^T (input
// gradient) over G equal groups; NaN for the weight gradient. Its output on the first input set
// must match cuBLAS's batched GEMM's (expect_close, as gpu_moe.py checks nodrop).
double cutlass_batched_ms(const Options& options, cudaStream_t stream, cublasHandle_t handle,
                          Mode mode, BatchedTile batched, const Shape& s,
                          const std::vector<std::unique_ptr<InputSet>>& sets, void* out,
                          const DeviceArray& workspace, size_t workspace_bytes) {
  if (mode == Mode::kWeightGrad) return NAN;
  const bool forward = mode == Mode::kForward;
  const int rows = static_cast<int>(s.M / s.G), G = static_cast<int>(s.G);
  const int n = static_cast<int>(forward ? s.N : s.K), k = static_cast<int>(forward ? s.K : s.N);
  auto run = [&](int i) {
    const InputSet& in = *sets[i % sets.size()];
    return cutlass_batched_gemm(batched, !forward, forward ? in.x.data : in.dy.data, in.w.data,
                                out, rows, n, k, G, workspace.data, workspace_bytes, stream);
  };
  const size_t count = static_cast<size_t>(s.M) * n;
  batched_gemm(handle, mode, s, *sets[0], out);
  CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> want = download_bf16(out, count);
  if (!run(0)) {
    std::fprintf(stderr, "CUTLASS's batched GEMM (tile %d) refused %s\n", static_cast<int>(batched),
                 s.name.c_str());
    return NAN;
  }
  CHECK(cudaStreamSynchronize(stream));
  expect_close(want, out, "CUTLASS's batched GEMM", "cuBLAS's batched GEMM",
               s.name + " " + mode_name(mode));
  return median_ms(options, stream, run);
}

// CUTLASS's batched tile matching nodrop's, where it has one.
bool batched_tile_for(GemmTile tile, BatchedTile* batched) {
  if (tile == GemmTile::kPingpong128x128x64Cluster1x2) {
    *batched = BatchedTile::kPingpong128x128x64Cluster1x2;
  } else if (tile == GemmTile::kCooperative128x256x64Cluster1x1) {
    *batched = BatchedTile::kCooperative128x256x64Cluster1x1;
  } else {
    return false;
  }
  return true;
}

// The rows-form prototype's tile matching nodrop's, where it has one.
bool rows_tile_for(GemmTile tile, RowsTile* rows_tile) {
  if (tile == GemmTile::kPingpong128x128x64Cluster1x2) {
    *rows_tile = RowsTile::kPingpong128x128x64Cluster1x2;
  } else if (tile == GemmTile::kCooperative128x256x64Cluster1x1) {
    *rows_tile = RowsTile::kCooperative128x256x64Cluster1x1;
  } else {
    return false;
  }
  return true;
}

// y = x w_g (forward) or dy w_g^T (input gradient) on the rows-form prototype, with nodrop's
// input layout.
bool rows_form(RowsTile tile, RowsStore store, Mode mode, const Shape& s, const InputSet& in,
               const int32_t* sizes, void* out, const DeviceArray& workspace,
               size_t workspace_bytes, cudaStream_t stream) {
  const bool forward = mode == Mode::kForward;
  return rows_grouped_gemm(tile, store, !forward, forward ? in.x.data : in.dy.data, in.w.data, out,
                           sizes, static_cast<int>(s.M), static_cast<int>(forward ? s.N : s.K),
                           static_cast<int>(forward ? s.K : s.N), static_cast<int>(s.G),
                           workspace.data, workspace_bytes, stream);
}

// The prototype with `store` against nodrop's engine on group sizes `sizes`, every tile and both
// modes, its output poisoned first so that unwritten rows show. Stops on a mismatch.
void check_rows_form(RowsStore store, const Sizes& sizes, cudaStream_t stream) {
  int64_t M = 0;
  for (int32_t n : sizes) M += n;
  const Shape s{"rows-form edge cases", M, 256, 384, static_cast<int64_t>(sizes.size())};
  const InputSet in(s, 99);
  DeviceArray sizes_buffer(sizes.size() * sizeof(int32_t));
  CHECK(cudaMemcpy(sizes_buffer.data, sizes.data(), sizes.size() * sizeof(int32_t),
                   cudaMemcpyHostToDevice));
  const auto* d_sizes = static_cast<const int32_t*>(sizes_buffer.data);
  const size_t count = static_cast<size_t>(M) * std::max(s.K, s.N);
  DeviceArray out(count * sizeof(bf16));
  const size_t workspace_bytes = nodrop::cuda::grouped_matmul_workspace_bytes(s.G);
  DeviceArray workspace(workspace_bytes);
  const size_t rows_workspace_bytes = rows_grouped_gemm_workspace_bytes(static_cast<int>(s.G));
  DeviceArray rows_workspace(rows_workspace_bytes);
  CHECK(cudaDeviceSynchronize());
  for (Mode mode : {Mode::kForward, Mode::kInputGrad}) {
    for (RowsTile tile : {RowsTile::kPingpong128x128x64Cluster1x2,
                          RowsTile::kCooperative128x256x64Cluster1x1}) {
      const size_t values = static_cast<size_t>(M) * (mode == Mode::kForward ? s.N : s.K);
      CHECK(grouped(mode, s, in, d_sizes, out.data, workspace, workspace_bytes, stream,
                    GemmSchedule{}));
      CHECK(cudaStreamSynchronize(stream));
      const std::vector<float> want = download_bf16(out.data, values);
      CHECK(cudaMemsetAsync(out.data, 0xFF, values * sizeof(bf16), stream));  // NaN
      if (!rows_form(tile, store, mode, s, in, d_sizes, out.data, rows_workspace,
                     rows_workspace_bytes, stream)) {
        std::fprintf(stderr, "the rows-form prototype refused its edge cases\n");
        std::exit(1);
      }
      CHECK(cudaStreamSynchronize(stream));
      expect_close(want, out.data, "the rows-form prototype", "nodrop's",
                   std::string(s.name) + " " + mode_name(mode) +
                       (tile == RowsTile::kPingpong128x128x64Cluster1x2 ? " pingpong"
                                                                        : " cooperative") +
                       (store == RowsStore::kTmaWholeRowTiles ? ", TMA store" : ""));
    }
  }
}

// The edge cases of group sizes: empty groups, one row, a row short of and past a tile, and
// column tiles that do not pair up into clusters; for the TMA store, groups of whole row tiles
// between empty ones.
void check_rows_form_edges(cudaStream_t stream) {
  check_rows_form(RowsStore::kMaskedRegisters, {0, 1, 127, 128, 129, 0, 300, 400, 0}, stream);
  check_rows_form(RowsStore::kTmaWholeRowTiles, {0, 128, 256, 0, 384, 128, 0}, stream);
  std::fprintf(stderr, "rows-form prototype: edge cases match nodrop's engine\n");
}

// The rows-form prototype with `store` on nodrop's tile (NaN where it has no such tile or for the
// weight gradient), after its output on the first input set matched nodrop's (`want`).
double rows_form_ms(const Options& options, cudaStream_t stream, RowsStore store, Mode mode,
                    GemmTile tile, const Shape& s,
                    const std::vector<std::unique_ptr<InputSet>>& sets, const int32_t* sizes,
                    const std::vector<float>& want, void* out, const DeviceArray& workspace,
                    size_t workspace_bytes) {
  RowsTile rows_tile;
  if (mode == Mode::kWeightGrad || !rows_tile_for(tile, &rows_tile)) return NAN;
  auto run = [&](int i) {
    return rows_form(rows_tile, store, mode, s, *sets[i % sets.size()], sizes, out, workspace,
                     workspace_bytes, stream);
  };
  CHECK(cudaMemsetAsync(out, 0xFF, want.size() * sizeof(bf16), stream));
  if (!run(0)) {
    std::fprintf(stderr, "the rows-form prototype refused %s\n", s.name.c_str());
    return NAN;
  }
  CHECK(cudaStreamSynchronize(stream));
  expect_close(want, out, "the rows-form prototype", "nodrop's",
               s.name + " " + mode_name(mode));
  return median_ms(options, stream, run);
}

struct Row {
  std::string shape, sizes, mode, tile;
  double ms, tflops, dense_tflops;
  double batched_tflops;          // NaN where the groups are not equal
  double cutlass_batched_tflops;  // NaN where there is no such kernel
  // CUTLASS's batched GEMM on cuBLAS's tile (cooperative 128x256), clusters 2x1 and 1x2; NaN
  // where the groups are not equal
  double cutlass_cublas_tile_tflops[2];
  double rows_form_tflops;        // NaN where the prototype has no such kernel
  double rows_tma_tflops;         // NaN there or where a group is not whole row tiles
};

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  cudaDeviceProp props;
  CHECK(cudaGetDeviceProperties(&props, 0));
  const int64_t bandwidth = nodrop::cuda::memory_bandwidth(0);
  std::printf("device: %s, %d SMs, L2 %d MB, memory %.2f TB/s\n", props.name,
              props.multiProcessorCount, props.l2CacheSize >> 20, bandwidth * 1e-12);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t handle;
  CHECK(cublasCreate(&handle));
  CHECK(cublasSetStream(handle, stream));

  check_rows_form_edges(stream);
  if (options.rows_form_edges_only) return 0;
  const Mode modes[] = {Mode::kForward, Mode::kInputGrad, Mode::kWeightGrad};
  std::vector<Shape> shapes;
  for (const Shape& s : kShapes) {
    if (!selected(options.shapes, s.name)) continue;
    if (options.groups.empty()) shapes.push_back(s);
    for (int64_t G : options.groups) {
      shapes.push_back({s.name + ", " + std::to_string(G) + " groups", s.M, s.K, s.N, G});
    }
  }
  std::vector<Row> rows;
  for (const Shape& s : shapes) {
    // Enough input copies that the ones a call reads were evicted from L2 by the others.
    const size_t set_bytes = (s.M * s.K + s.G * s.K * s.N + s.M * s.N) * sizeof(bf16);
    const size_t copies = std::clamp<size_t>(4 * props.l2CacheSize / set_bytes + 1, 2, 8);
    std::vector<std::unique_ptr<InputSet>> sets;
    for (size_t i = 0; i < copies; ++i) {
      sets.push_back(std::make_unique<InputSet>(s, static_cast<uint32_t>(17 * i)));
    }
    DeviceArray out(std::max(s.M * std::max(s.K, s.N), s.G * s.K * s.N) * sizeof(bf16));
    const size_t workspace_bytes = nodrop::cuda::grouped_matmul_workspace_bytes(s.G);
    DeviceArray workspace(workspace_bytes);
    constexpr size_t kBatchedWorkspaceBytes = 16 << 20;
    DeviceArray batched_workspace(kBatchedWorkspaceBytes);
    const size_t rows_workspace_bytes = rows_grouped_gemm_workspace_bytes(static_cast<int>(s.G));
    DeviceArray rows_workspace(rows_workspace_bytes);
    DeviceArray sizes_buffer(s.G * sizeof(int32_t));
    CHECK(cudaDeviceSynchronize());  // the fills ran on the legacy stream; `stream` does not wait
    const double flop = 2.0 * s.M * s.K * s.N;

    for (Mode mode : modes) {
      const double dense_ms = median_ms(options, stream, [&](int i) {
        dense_gemm(handle, mode, s, *sets[i % copies], out.data);
      });
      for (const Distribution& distribution : kDistributions) {
        const char* dist = distribution.name;
        if (!selected(options.sizes, dist)) continue;
        const Sizes sizes = distribution.sizes(s.M, s.G);
        const bool equal_groups = s.M % s.G == 0 &&
            std::all_of(sizes.begin(), sizes.end(), [&](int32_t n) { return n == s.M / s.G; });
        const double batched_ms =
            equal_groups ? median_ms(options, stream, [&](int i) {
                             batched_gemm(handle, mode, s, *sets[i % copies], out.data);
                           })
                         : NAN;
        CHECK(cudaMemcpyAsync(sizes_buffer.data, sizes.data(), sizes.size() * sizeof(int32_t),
                              cudaMemcpyHostToDevice, stream));
        const auto* d_sizes = static_cast<const int32_t*>(sizes_buffer.data);
        const GemmTile auto_tile = nodrop::cuda::grouped_matmul_tile(
            s.M, mode == Mode::kInputGrad ? s.N : s.K, mode == Mode::kInputGrad ? s.K : s.N, s.G,
            mode == Mode::kWeightGrad, bandwidth);
        const GemmRaster forced_raster = options.raster == "M"   ? GemmRaster::kAlongM
                                         : options.raster == "N" ? GemmRaster::kAlongN
                                                                 : GemmRaster::kAuto;
        std::vector<GemmSchedule> schedules = {{auto_tile, forced_raster}};
        if (options.tiles == "all") {
          schedules.clear();
          for (GemmTile tile : nodrop::cuda::kGemmTiles) schedules.push_back({tile, forced_raster});
        } else if (options.tiles == "sweep") {
          schedules.clear();
          for (GemmRaster raster : {GemmRaster::kAlongM, GemmRaster::kAlongN}) {
            for (int swizzle : {1, 2, 4, 8}) schedules.push_back({auto_tile, raster, swizzle});
          }
        }
        for (const GemmSchedule& schedule : schedules) {
          CHECK(grouped(mode, s, *sets[0], d_sizes, out.data, workspace, workspace_bytes, stream,
                        schedule));
          const bool compare_peers =
              forced_raster == GemmRaster::kAuto && options.tiles != "sweep";
          std::vector<float> nodrop_out;
          if (compare_peers && mode != Mode::kWeightGrad) {
            CHECK(cudaStreamSynchronize(stream));
            nodrop_out = download_bf16(out.data, static_cast<size_t>(s.M) *
                                                     (mode == Mode::kForward ? s.N : s.K));
          }
          const double ms = median_ms(options, stream, [&](int i) {
            grouped(mode, s, *sets[i % copies], d_sizes, out.data, workspace, workspace_bytes,
                    stream, schedule);
          });
          auto cutlass_on = [&](BatchedTile batched) {
            return cutlass_batched_ms(options, stream, handle, mode, batched, s, sets, out.data,
                                      batched_workspace, kBatchedWorkspaceBytes);
          };
          BatchedTile same_tile;
          const double cutlass_ms = equal_groups && compare_peers &&
                                            batched_tile_for(schedule.tile, &same_tile)
                                        ? cutlass_on(same_tile)
                                        : NAN;
          const bool cublas_tile = equal_groups && compare_peers;
          const double cutlass_cublas_tile_ms[2] = {
              cublas_tile ? cutlass_on(BatchedTile::kCooperative128x256x64Cluster2x1) : NAN,
              cublas_tile ? cutlass_on(BatchedTile::kCooperative128x256x64Cluster1x2) : NAN};
          const double rows_ms =
              compare_peers ? rows_form_ms(options, stream, RowsStore::kMaskedRegisters, mode,
                                           schedule.tile, s, sets, d_sizes, nodrop_out, out.data,
                                           rows_workspace, rows_workspace_bytes)
                            : NAN;
          const bool whole_row_tiles =
              std::all_of(sizes.begin(), sizes.end(), [](int32_t n) { return n % 128 == 0; });
          const double rows_tma_ms =
              compare_peers && whole_row_tiles
                  ? rows_form_ms(options, stream, RowsStore::kTmaWholeRowTiles, mode,
                                 schedule.tile, s, sets, d_sizes, nodrop_out, out.data,
                                 rows_workspace, rows_workspace_bytes)
                  : NAN;
          std::string kernel = nodrop::cuda::gemm_tile_name(schedule.tile);
          if (schedule.tile == auto_tile) kernel += " (auto)";
          if (options.tiles == "sweep" || forced_raster != GemmRaster::kAuto) {
            kernel += std::string(", ") + nodrop::cuda::gemm_raster_name(schedule.raster) +
                      ", swizzle " + std::to_string(schedule.swizzle);
          }
          rows.push_back({s.name, dist, mode_name(mode), kernel, ms, flop / ms * 1e-9,
                          flop / dense_ms * 1e-9, flop / batched_ms * 1e-9,
                          flop / cutlass_ms * 1e-9,
                          {flop / cutlass_cublas_tile_ms[0] * 1e-9,
                           flop / cutlass_cublas_tile_ms[1] * 1e-9},
                          flop / rows_ms * 1e-9, flop / rows_tma_ms * 1e-9});
          std::fprintf(stderr, "  %s %s %s: %.3f ms\n", s.name.c_str(), dist, mode_name(mode),
                       ms);
        }
      }
    }
  }
  CHECK(cudaGetLastError());

  std::printf(
      "\n| shape | group sizes | mode | kernel | ms | TFLOP/s | cuBLAS dense TFLOP/s | ratio | "
      "cuBLAS batched TFLOP/s | nodrop / batched | CUTLASS batched, same tile, TFLOP/s | "
      "nodrop / CUTLASS batched | CUTLASS batched, cooperative 128x256 2x1 (cuBLAS's tile), "
      "TFLOP/s | nodrop / it | CUTLASS batched, cooperative 128x256 1x2, TFLOP/s | nodrop / it | "
      "rows form, same tile, TFLOP/s | nodrop / rows form | "
      "rows form, TMA store, TFLOP/s | nodrop / rows form, TMA store |\n");
  std::printf("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
              "---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const Row& r : rows) {
    std::printf("| %s | %s | %s | %s | %.3f | %.0f | %.0f | %.2f |", r.shape.c_str(),
                r.sizes.c_str(), r.mode.c_str(), r.tile.c_str(), r.ms, r.tflops, r.dense_tflops,
                r.tflops / r.dense_tflops);
    for (double peer : {r.batched_tflops, r.cutlass_batched_tflops, r.cutlass_cublas_tile_tflops[0],
                        r.cutlass_cublas_tile_tflops[1], r.rows_form_tflops, r.rows_tma_tflops}) {
      if (std::isnan(peer)) {
        std::printf(" | |");
      } else {
        std::printf(" %.0f | %.2f |", peer, r.tflops / peer);
      }
    }
    std::printf("\n");
  }
  if (!options.csv.empty()) {
    FILE* file = std::fopen(options.csv.c_str(), "w");
    if (file == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", options.csv.c_str());
      return 1;
    }
    std::fprintf(file,
                 "shape,group_sizes,mode,kernel,ms,tflops,dense_tflops,batched_tflops,"
                 "cutlass_batched_tflops,cutlass_cublas_tile_2x1_tflops,"
                 "cutlass_cublas_tile_1x2_tflops,rows_form_tflops,rows_tma_tflops\n");
    for (const Row& r : rows) {
      // The kernel column holds commas: quoted, as CSV readers expect.
      std::fprintf(file, "\"%s\",%s,%s,\"%s\",%.4f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f\n",
                   r.shape.c_str(), r.sizes.c_str(), r.mode.c_str(), r.tile.c_str(), r.ms,
                   r.tflops, r.dense_tflops, r.batched_tflops, r.cutlass_batched_tflops,
                   r.cutlass_cublas_tile_tflops[0], r.cutlass_cublas_tile_tflops[1],
                   r.rows_form_tflops, r.rows_tma_tflops);
    }
    std::fclose(file);
  }
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  return 0;
}
