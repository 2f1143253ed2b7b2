// GPU tests of nodrop::cuda::grouped_matmul and grouped_matmul_contract against a naive CUDA
// reference (one thread per output element, float32 accumulation). Needs a Hopper GPU, so it is
// run by hand, not by ctest:  ./nodrop_cuda_tests  [--gtest_filter=...]
//
// Every call writes into an output poisoned with 0xFF bytes (NaN in every dtype) and fenced by
// poisoned guard bytes, so an unwritten element or a write out of bounds fails; every call runs
// twice and must give the same bytes.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "nodrop/engine_cuda.h"

namespace {

using nodrop::DType;
using nodrop::Status;
using nodrop::cuda::GemmRaster;
using nodrop::cuda::GemmSchedule;
using nodrop::cuda::GemmTile;
using Sizes = std::vector<int32_t>;

void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
  }
}
#define CUDA_CHECK(expr) check_cuda((expr), #expr)

enum class Mode { kRows, kRowsTransposed, kContract };

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kRows: return "rows";
    case Mode::kRowsTransposed: return "rows_t";
    case Mode::kContract: return "contract";
  }
  return "?";
}

const char* dtype_short(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
  }
  return "?";
}

int64_t bytes_of(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// ---- device memory ---------------------------------------------------------------------------

// A device allocation with `guard` poisoned bytes on each side of the usable part.
class DeviceBuffer {
 public:
  static constexpr size_t kGuard = 256;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    CUDA_CHECK(cudaMalloc(&base_, bytes + 2 * kGuard));
    CUDA_CHECK(cudaMemset(base_, 0xFF, bytes + 2 * kGuard));
  }
  ~DeviceBuffer() { cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return static_cast<char*>(base_) + kGuard; }
  size_t bytes() const { return bytes_; }
  void poison() const { CUDA_CHECK(cudaMemset(get(), 0xFF, bytes_)); }
  void upload(const void* host) const {
    CUDA_CHECK(cudaMemcpy(get(), host, bytes_, cudaMemcpyHostToDevice));
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes_);
    CUDA_CHECK(cudaMemcpy(host.data(), get(), bytes_, cudaMemcpyDeviceToHost));
    return host;
  }
  // True while both guards still hold only 0xFF bytes.
  bool guards_intact() const {
    std::vector<uint8_t> host(bytes_ + 2 * kGuard);
    CUDA_CHECK(cudaMemcpy(host.data(), base_, host.size(), cudaMemcpyDeviceToHost));
    auto poisoned = [](auto begin, auto end) {
      return std::all_of(begin, end, [](uint8_t b) { return b == 0xFF; });
    };
    return poisoned(host.begin(), host.begin() + kGuard) &&
           poisoned(host.end() - kGuard, host.end());
  }

 private:
  void* base_ = nullptr;
  size_t bytes_;
};

// ---- the problem -----------------------------------------------------------------------------

struct Shape {
  std::string name;
  int64_t M, K, N;
  Sizes sizes;
};

struct Problem {
  Mode mode;
  int64_t M, K, N, G;
  DType in, out;
  int64_t lhs_elements() const { return M * K; }
  int64_t rhs_elements() const { return mode == Mode::kContract ? M * N : G * K * N; }
  int64_t out_elements() const { return mode == Mode::kContract ? G * K * N : M * N; }
};

// The clamping rule of engine.h, written out independently of the engine.
std::vector<int64_t> naive_offsets(const Sizes& sizes, int64_t rows) {
  std::vector<int64_t> offsets(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) {
    offsets[g + 1] = std::min<int64_t>(rows, offsets[g] + std::max<int32_t>(0, sizes[g]));
  }
  return offsets;
}

// Random values in [-1, 1], stored in `dtype`.
std::vector<uint8_t> random_input(int64_t elements, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<uint8_t> bytes(elements * bytes_of(dtype));
  for (int64_t i = 0; i < elements; ++i) {
    const float v = uniform(rng);
    if (dtype == DType::kBFloat16) {
      reinterpret_cast<__nv_bfloat16*>(bytes.data())[i] = __float2bfloat16(v);
    } else {
      reinterpret_cast<__half*>(bytes.data())[i] = __float2half(v);
    }
  }
  return bytes;
}

float element(const std::vector<uint8_t>& bytes, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return reinterpret_cast<const float*>(bytes.data())[i];
    case DType::kFloat16: return __half2float(reinterpret_cast<const __half*>(bytes.data())[i]);
    case DType::kBFloat16:
      return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(bytes.data())[i]);
  }
  return NAN;
}

// ---- the reference ---------------------------------------------------------------------------

__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ float to_float(__half x) { return __half2float(x); }

// out[m, n] (and the sum of |products|, for the tolerance); rows in no group are zero.
template <typename In>
__global__ void reference_rows(const In* lhs, const In* rhs, const int64_t* offsets, int64_t G,
                               int64_t M, int64_t K, int64_t N, bool transpose_rhs, float* out,
                               float* abs_sum) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * N) return;
  const int64_t m = i / N, n = i % N;
  int64_t g = 0;
  while (g < G && offsets[g + 1] <= m) ++g;
  float acc = 0.f, abs_acc = 0.f;
  if (g < G) {
    for (int64_t k = 0; k < K; ++k) {
      const float b = to_float(transpose_rhs ? rhs[(g * N + n) * K + k] : rhs[(g * K + k) * N + n]);
      const float product = to_float(lhs[m * K + k]) * b;
      acc += product;
      abs_acc += fabsf(product);
    }
  }
  out[i] = acc;
  abs_sum[i] = abs_acc;
}

// out[g, k, n] = sum over the rows r of group g of lhs[r, k] * rhs[r, n].
template <typename In>
__global__ void reference_contract(const In* lhs, const In* rhs, const int64_t* offsets, int64_t G,
                                   int64_t K, int64_t N, float* out, float* abs_sum) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= G * K * N) return;
  const int64_t g = i / (K * N), k = i / N % K, n = i % N;
  float acc = 0.f, abs_acc = 0.f;
  for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
    const float product = to_float(lhs[r * K + k]) * to_float(rhs[r * N + n]);
    acc += product;
    abs_acc += fabsf(product);
  }
  out[i] = acc;
  abs_sum[i] = abs_acc;
}

struct Reference {
  std::vector<float> value, abs_sum;
};

template <typename In>
Reference run_reference(const Problem& p, const void* lhs, const void* rhs, const Sizes& sizes) {
  const std::vector<int64_t> offsets = naive_offsets(sizes, p.M);
  const int64_t count = p.out_elements();
  DeviceBuffer d_offsets(offsets.size() * sizeof(int64_t));
  d_offsets.upload(offsets.data());
  DeviceBuffer d_value(std::max<int64_t>(count, 1) * sizeof(float));
  DeviceBuffer d_abs(std::max<int64_t>(count, 1) * sizeof(float));
  const auto* a = static_cast<const In*>(lhs);
  const auto* b = static_cast<const In*>(rhs);
  const auto* off = static_cast<const int64_t*>(d_offsets.get());
  auto* value = static_cast<float*>(d_value.get());
  auto* abs_sum = static_cast<float*>(d_abs.get());
  const int threads = 256;
  const int64_t blocks = (count + threads - 1) / threads;
  if (blocks > 0) {
    if (p.mode == Mode::kContract) {
      reference_contract<In><<<blocks, threads>>>(a, b, off, p.G, p.K, p.N, value, abs_sum);
    } else {
      reference_rows<In><<<blocks, threads>>>(a, b, off, p.G, p.M, p.K, p.N,
                                              p.mode == Mode::kRowsTransposed, value, abs_sum);
    }
    CUDA_CHECK(cudaGetLastError());
  }
  Reference ref{std::vector<float>(count), std::vector<float>(count)};
  CUDA_CHECK(cudaMemcpy(ref.value.data(), value, count * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_CHECK(
      cudaMemcpy(ref.abs_sum.data(), abs_sum, count * sizeof(float), cudaMemcpyDeviceToHost));
  return ref;
}

Reference reference(const Problem& p, const void* lhs, const void* rhs, const Sizes& sizes) {
  return p.in == DType::kBFloat16 ? run_reference<__nv_bfloat16>(p, lhs, rhs, sizes)
                                  : run_reference<__half>(p, lhs, rhs, sizes);
}

// Empty string when `got` matches the reference: within the output dtype's rounding plus a
// float32 re-association allowance (plus float16's subnormal spacing); exactly zero where the
// reference has no products.
std::string compare(const Problem& p, const std::vector<uint8_t>& got, const Reference& ref) {
  const float rounding = p.out == DType::kBFloat16  ? 0x1p-8f
                         : p.out == DType::kFloat16 ? 0x1p-11f
                                                    : 0.f;
  const float reassociation = 0x1p-12f;
  // Below float16's smallest normal (2^-14) its spacing is a fixed 2^-24: half of it absolute.
  const float subnormal = p.out == DType::kFloat16 ? 0x1p-25f : 0.f;
  int64_t bad = 0;
  std::ostringstream first;
  for (int64_t i = 0; i < p.out_elements(); ++i) {
    const float v = element(got, i, p.out);
    const float tolerance =
        rounding * std::fabs(ref.value[i]) + reassociation * ref.abs_sum[i] + subnormal;
    if (std::isnan(v) || std::fabs(v - ref.value[i]) > tolerance) {
      if (bad++ < 5) {
        first << "  [" << i << "] got " << v << ", want " << ref.value[i] << " +- " << tolerance
              << "\n";
      }
    }
  }
  if (bad == 0) return "";
  return std::to_string(bad) + " of " + std::to_string(p.out_elements()) + " elements wrong:\n" +
         first.str();
}

// ---- running the engine ----------------------------------------------------------------------

Status run_engine(const Problem& p, const void* lhs, const void* rhs, const int32_t* sizes,
                  void* out, const DeviceBuffer& workspace, cudaStream_t stream,
                  const GemmSchedule& schedule) {
  if (p.mode == Mode::kContract) {
    return nodrop::cuda::grouped_matmul_contract(lhs, rhs, p.in, sizes, p.M, p.K, p.N, p.G, out,
                                                 p.out, workspace.get(), workspace.bytes(), stream,
                                                 schedule);
  }
  return nodrop::cuda::grouped_matmul(lhs, rhs, p.in, sizes, p.M, p.K, p.N, p.G,
                                      p.mode == Mode::kRowsTransposed, out, p.out, workspace.get(),
                                      workspace.bytes(), stream, schedule);
}

// Inputs and output of one problem on the device.
struct Buffers {
  DeviceBuffer lhs, rhs, sizes, out, workspace;
  explicit Buffers(const Problem& p)
      : lhs(p.lhs_elements() * bytes_of(p.in)),
        rhs(p.rhs_elements() * bytes_of(p.in)),
        sizes(std::max<int64_t>(p.G, 1) * sizeof(int32_t)),
        out(p.out_elements() * bytes_of(p.out)),
        workspace(nodrop::cuda::grouped_matmul_workspace_bytes(p.G)) {
    lhs.upload(random_input(p.lhs_elements(), p.in, 1).data());
    rhs.upload(random_input(p.rhs_elements(), p.in, 2).data());
  }
  void set_sizes(const Sizes& values) const {
    if (!values.empty()) {
      CUDA_CHECK(cudaMemcpy(sizes.get(), values.data(), values.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice));
    }
  }
};

// Sizes that sum to M with weights 1 / (g + 1): Zipf(1) over the groups, largest first.
Sizes zipf_sizes(int64_t M, int64_t G) {
  double total_weight = 0;
  for (int64_t g = 0; g < G; ++g) total_weight += 1.0 / (g + 1);
  Sizes sizes(G);
  int64_t assigned = 0;
  for (int64_t g = 0; g < G; ++g) {
    sizes[g] = static_cast<int32_t>(M * (1.0 / (g + 1)) / total_weight);
    assigned += sizes[g];
  }
  sizes[0] += static_cast<int32_t>(M - assigned);
  return sizes;
}

// Random sizes in [0, max_size], the last one filling up to M when it can.
Sizes random_sizes(int64_t M, int64_t G, int32_t max_size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> size(0, max_size);
  Sizes sizes(G);
  int64_t total = 0;
  for (int64_t g = 0; g + 1 < G; ++g) total += sizes[g] = size(rng);
  sizes[G - 1] = static_cast<int32_t>(std::max<int64_t>(0, M - total));
  return sizes;
}

std::vector<Shape> shapes() {
  return {
      {"uniform", 1024, 136, 264, Sizes(8, 128)},
      {"uneven", 999, 72, 200, {167, 166, 166, 167, 166, 167}},
      {"zipf", 2000, 264, 136, zipf_sizes(2000, 16)},
      {"empty_groups", 700, 64, 128, {0, 300, 0, 0, 250, 150, 0}},
      {"all_in_one", 513, 96, 72, {0, 0, 0, 513, 0, 0, 0, 0}},
      {"one_group", 300, 520, 392, {300}},
      {"tail_rows", 800, 128, 128, {100, 200, 150, 113}},
      {"negative_and_past_M", 600, 80, 96, {-5, 250, -1, 400, 300}},
      {"int32_extremes", 256, 64, 64, {INT32_MAX, 5, -INT32_MAX, INT32_MIN}},
      {"many_groups", 3000, 64, 136, random_sizes(3000, 200, 30, 7)},
      {"more_groups_than_threads", 4000, 16, 24, random_sizes(4000, 1500, 5, 8)},
      {"single_rows", 64, 8, 8, Sizes(64, 1)},
      {"no_rows", 0, 64, 64, {0, 0, 0, 0}},
      {"no_groups", 128, 64, 64, {}},
      {"k_zero", 96, 0, 64, {32, 32, 32}},
  };
}

// ---- CUDA graphs -----------------------------------------------------------------------------

// First in this file on purpose: each form's first call in the process happens inside the
// capture, so one-time host work (function attributes, occupancy queries) must be capture-safe.
// The strictest capture mode rejects any call that could synchronise or allocate.
TEST(CudaGroupedMatmulGraph, ReplaysWithNewGroupSizesOnTheDevice) {
  const int64_t M = 640, K = 128, N = 256, G = 5;
  const std::vector<Sizes> size_sets = {
      {128, 128, 128, 128, 128}, {0, 600, 0, 40, 0}, {-3, 700, 5, 9, 1}, {10, 20, 30, 40, 50}};
  const std::tuple<Mode, GemmTile> forms[] = {
      {Mode::kRows, GemmTile::kCooperative128x256x64Cluster1x1},
      {Mode::kRowsTransposed, GemmTile::kPingpong128x128x64Cluster1x2},
      {Mode::kContract, GemmTile::kAuto}};
  for (const auto& [mode, tile] : forms) {
    SCOPED_TRACE(mode_name(mode));
    const Problem p{mode, M, K, N, G, DType::kBFloat16, DType::kBFloat16};
    Buffers buffers(p);
    buffers.set_sizes(size_sets[0]);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // The uploads ran on the legacy stream, which a non-blocking stream does not wait for.
    CUDA_CHECK(cudaDeviceSynchronize());
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const Status status = run_engine(p, buffers.lhs.get(), buffers.rhs.get(),
                                     static_cast<const int32_t*>(buffers.sizes.get()),
                                     buffers.out.get(), buffers.workspace, stream, tile);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(status.ok()) << status.message();
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (const Sizes& sizes : size_sets) {
      buffers.set_sizes(sizes);
      buffers.out.poison();
      CUDA_CHECK(cudaDeviceSynchronize());
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const Reference ref = reference(p, buffers.lhs.get(), buffers.rhs.get(), sizes);
      EXPECT_EQ(compare(p, buffers.out.download(), ref), "") << "sizes[1] = " << sizes[1];
      EXPECT_TRUE(buffers.out.guards_intact());
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// ---- every mode, dtype and tile on every shape -----------------------------------------------

using Param = std::tuple<Shape, Mode, std::pair<DType, DType>, GemmSchedule>;

class CudaGroupedMatmulTest : public ::testing::TestWithParam<Param> {};

TEST_P(CudaGroupedMatmulTest, MatchesReferenceDeterministically) {
  const auto& [shape, mode, dtypes, schedule] = GetParam();
  const int64_t G = static_cast<int64_t>(shape.sizes.size());
  const Problem p{mode, shape.M, shape.K, shape.N, G, dtypes.first, dtypes.second};
  Buffers buffers(p);
  buffers.set_sizes(shape.sizes);
  std::vector<uint8_t> runs[2];
  for (auto& run : runs) {
    buffers.out.poison();
    const Status status = run_engine(p, buffers.lhs.get(), buffers.rhs.get(),
                                     static_cast<const int32_t*>(buffers.sizes.get()),
                                     buffers.out.get(), buffers.workspace, nullptr, schedule);
    ASSERT_TRUE(status.ok()) << status.message();
    CUDA_CHECK(cudaDeviceSynchronize());
    run = buffers.out.download();
  }
  EXPECT_TRUE(buffers.out.guards_intact()) << "a write landed outside the output";
  EXPECT_TRUE(runs[0] == runs[1]) << "two runs gave different bytes";
  const Reference ref = reference(p, buffers.lhs.get(), buffers.rhs.get(), shape.sizes);
  EXPECT_EQ(compare(p, runs[0], ref), "");
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto& [shape, mode, dtypes, schedule] = info.param;
  return shape.name + "_" + mode_name(mode) + "_" + dtype_short(dtypes.first) + "_" +
         dtype_short(dtypes.second) + "_" + nodrop::cuda::gemm_tile_id(schedule.tile) +
         (schedule.raster == GemmRaster::kAlongN ? "_alongN" : "") +
         (schedule.swizzle > 1 ? "_swizzle" + std::to_string(schedule.swizzle) : "");
}

// Every kernel of tiles.def, and raster orders and swizzles (which walk the same tiles, rounded up
// to more of them): each must be exact.
std::vector<GemmSchedule> schedules() {
  std::vector<GemmSchedule> all(std::begin(nodrop::cuda::kGemmTiles),
                                std::end(nodrop::cuda::kGemmTiles));
  all.emplace_back(GemmTile::kCooperative128x256x64Cluster1x1, GemmRaster::kAlongN, 4);
  all.emplace_back(GemmTile::kPingpong128x128x64Cluster1x2, GemmRaster::kAlongM, 8);
  return all;
}

INSTANTIATE_TEST_SUITE_P(
    AllForms, CudaGroupedMatmulTest,
    ::testing::Combine(::testing::ValuesIn(shapes()),
                       ::testing::Values(Mode::kRows, Mode::kRowsTransposed, Mode::kContract),
                       ::testing::Values(std::pair{DType::kBFloat16, DType::kBFloat16},
                                         std::pair{DType::kBFloat16, DType::kFloat32},
                                         std::pair{DType::kFloat16, DType::kFloat16},
                                         std::pair{DType::kFloat16, DType::kFloat32}),
                       ::testing::ValuesIn(schedules())),
    param_name);

// ---- bad arguments ---------------------------------------------------------------------------

// Each call must fail before touching the GPU, with a message that names the argument.
// The bandwidth the tile rule reads: the device's memory clock times its bus width, found on
// the first call and the same on every later one; a device that does not exist reports 0.
TEST(CudaMemoryBandwidth, IsTheDevicesAndKeptAcrossCalls) {
  int device = 0, clock_khz = 0, bus_bits = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device),
            cudaSuccess);
  const int64_t want = int64_t{2} * clock_khz * 1000 * (bus_bits / 8);
  EXPECT_GT(want, 0);
  for (int call = 0; call < 3; ++call) EXPECT_EQ(nodrop::cuda::memory_bandwidth(device), want);
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  EXPECT_EQ(nodrop::cuda::memory_bandwidth(devices + 7), 0);
  EXPECT_EQ(nodrop::cuda::memory_bandwidth(devices + 7), 0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the failed query's error was cleared
}

TEST(CudaGroupedMatmulArguments, ErrorsNameTheArgument) {
  const Problem p{Mode::kRows, 64, 64, 64, 2, DType::kBFloat16, DType::kBFloat16};
  Buffers buffers(p);
  const auto* sizes = static_cast<const int32_t*>(buffers.sizes.get());
  const void* lhs = buffers.lhs.get();
  const void* rhs = buffers.rhs.get();
  void* out = buffers.out.get();
  void* ws = buffers.workspace.get();
  const size_t ws_bytes = buffers.workspace.bytes();
  using nodrop::cuda::grouped_matmul;
  using nodrop::cuda::grouped_matmul_contract;
  auto expect_error = [](const Status& status, const std::string& word) {
    ASSERT_FALSE(status.ok()) << "expected an error naming " << word;
    EXPECT_NE(status.message().find(word), std::string::npos) << status.message();
  };
  const DType bf16 = DType::kBFloat16;
  expect_error(
      grouped_matmul(lhs, rhs, bf16, sizes, 64, 60, 64, 2, false, out, bf16, ws, ws_bytes, nullptr),
      "K = 60");
  expect_error(
      grouped_matmul(lhs, rhs, bf16, sizes, 64, 64, 20, 2, false, out, bf16, ws, ws_bytes, nullptr),
      "N = 20");
  expect_error(grouped_matmul_contract(lhs, rhs, bf16, sizes, 64, 12, 64, 2, out, bf16, ws,
                                       ws_bytes, nullptr),
               "K = 12");
  expect_error(grouped_matmul(lhs, rhs, DType::kFloat32, sizes, 64, 64, 64, 2, false, out,
                              DType::kFloat32, ws, ws_bytes, nullptr),
               "in_dtype");
  expect_error(grouped_matmul(lhs, rhs, bf16, sizes, 64, 64, 64, 2, false, out, DType::kFloat16, ws,
                              ws_bytes, nullptr),
               "out_dtype");
  expect_error(grouped_matmul(lhs, rhs, bf16, sizes, 64, 64, 64, 2, false, out, bf16, ws,
                              ws_bytes - 1, nullptr),
               "workspace");
  expect_error(grouped_matmul(static_cast<const char*>(lhs) + 2, rhs, bf16, sizes, 64, 64, 64, 2,
                              false, out, bf16, ws, ws_bytes, nullptr),
               "lhs");
  expect_error(grouped_matmul(lhs, rhs, bf16, nullptr, 64, 64, 64, 2, false, out, bf16, ws,
                              ws_bytes, nullptr),
               "group_sizes");
  expect_error(
      grouped_matmul(lhs, rhs, bf16, sizes, -1, 64, 64, 2, false, out, bf16, ws, ws_bytes, nullptr),
      "M = -1");
  expect_error(grouped_matmul_contract(lhs, rhs, bf16, sizes, 64, 64, 64, 2, out, bf16, ws,
                                       ws_bytes, nullptr,
                                       {GemmTile::kAuto, GemmRaster::kAlongN, 3}),
               "schedule.swizzle = 3");
  expect_error(grouped_matmul(lhs, rhs, bf16, sizes, 64, 64, 64, 2, false, out, bf16, ws, ws_bytes,
                              nullptr, {static_cast<GemmTile>(9)}),
               "schedule.tile = 9");
  expect_error(grouped_matmul(lhs, rhs, bf16, sizes, 64, 64, 64, 2, false, out, bf16, ws, ws_bytes,
                              nullptr, {GemmTile::kAuto, static_cast<GemmRaster>(-1)}),
               "schedule.raster = -1");
}

}  // namespace
