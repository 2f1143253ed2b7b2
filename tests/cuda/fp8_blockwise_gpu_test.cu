// GPU tests of nodrop::cuda::grouped_matmul_fp8_blockwise (ragged rows, E4M3 with 1x128 / 128x128
// float32 scales, bfloat16 out), grouped_matmul_fp8_tensorwise (the same with one scale for lhs
// and one per expert, fast or promoted accumulation), grouped_matmul_fp8_blockwise_contract (the
// weight gradient: ragged contraction, 1x128 scales along it on both operands) and
// grouped_matmul_fp8_tensorwise_contract (the same with one scale per operand) against host
// references computed from the dequantised inputs in double. Needs a Hopper GPU, so it is run by hand, not
// by ctest (part of nodrop_cuda_tests):
//   ./nodrop_cuda_tests --gtest_filter='CudaFp8*:*/CudaFp8*'
// Every kernel of fp8_tiles.def and fp8_tensorwise_tiles.def runs every case; the cases of one
// shape, each kernel once, fit a sanitizer run:
//   compute-sanitizer ./nodrop_cuda_tests --gtest_filter='*/CudaFp8*Test.*/mixed_*'
//
// Every call writes into an output poisoned with 0xFF bytes (NaN in bfloat16) and fenced by
// poisoned guard bytes, so an unwritten element or a write out of bounds fails; every call runs
// twice and must give the same bytes.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
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

#include "nodrop/engine.h"
#include "nodrop/engine_cuda.h"

namespace {

using nodrop::Status;
using Sizes = std::vector<int32_t>;

void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
  }
}
#define CUDA_CHECK(expr) check_cuda((expr), #expr)

constexpr int64_t kBlock = 128;  // scale block along K (lhs, rhs) and N (rhs)

int64_t blocks_of(int64_t extent) { return (extent + kBlock - 1) / kBlock; }

// A device allocation with `kGuard` poisoned bytes on each side of the usable part.
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
    if (bytes_ > 0) CUDA_CHECK(cudaMemcpy(get(), host, bytes_, cudaMemcpyHostToDevice));
  }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes_);
    if (bytes_ > 0) CUDA_CHECK(cudaMemcpy(host.data(), get(), bytes_, cudaMemcpyDeviceToHost));
    return host;
  }
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

// The clamping rule of engine.h, written out independently of the engine.
std::vector<int64_t> naive_offsets(const Sizes& sizes, int64_t rows) {
  std::vector<int64_t> offsets(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) {
    offsets[g + 1] = std::min<int64_t>(rows, offsets[g] + std::max<int32_t>(0, sizes[g]));
  }
  return offsets;
}

// One problem's host inputs: E4M3 bytes and positive float32 scales in the layouts of
// engine_cuda.h: blockwise lhs_scales [M, KB] and rhs_scales [G, NB, KB] (both row-major), or
// tensorwise lhs_scale [1] and rhs_scales [G].
struct Inputs {
  int64_t M, K, N, G;
  bool tensorwise;
  std::vector<__nv_fp8_e4m3> lhs, rhs;
  std::vector<float> lhs_scales, rhs_scales;

  Inputs(int64_t M, int64_t K, int64_t N, int64_t G, uint32_t seed, bool tensorwise = false)
      : M(M), K(K), N(N), G(G), tensorwise(tensorwise), lhs(M * K), rhs(G * N * K),
        lhs_scales(tensorwise ? 1 : M * blocks_of(K)),
        rhs_scales(tensorwise ? G : G * blocks_of(N) * blocks_of(K)) {
    std::mt19937 rng(seed);
    // Values over most of E4M3's normal range (max 448); scales over four octaves.
    std::uniform_real_distribution<float> value(-8.f, 8.f);
    std::uniform_real_distribution<float> log2_scale(-2.f, 2.f);
    for (auto& x : lhs) x = __nv_fp8_e4m3(value(rng));
    for (auto& x : rhs) x = __nv_fp8_e4m3(value(rng));
    for (auto& s : lhs_scales) s = std::exp2(log2_scale(rng));
    for (auto& s : rhs_scales) s = std::exp2(log2_scale(rng));
  }
  float a(int64_t m, int64_t k) const {
    return float(lhs[m * K + k]) * lhs_scales[tensorwise ? 0 : m * blocks_of(K) + k / kBlock];
  }
  float b(int64_t g, int64_t n, int64_t k) const {
    return float(rhs[(g * N + n) * K + k]) *
           rhs_scales[tensorwise ? g : (g * blocks_of(N) + n / kBlock) * blocks_of(K) + k / kBlock];
  }
};

// out [M, N] from the dequantised inputs, in double; rows in no group are zero.
std::vector<float> reference(const Inputs& in, const Sizes& sizes) {
  const std::vector<int64_t> offsets = naive_offsets(sizes, in.M);
  std::vector<float> out(in.M * in.N, 0.f);
  std::vector<float> row(in.K);
  for (int64_t g = 0; g < in.G; ++g) {
    for (int64_t m = offsets[g]; m < offsets[g + 1]; ++m) {
      for (int64_t k = 0; k < in.K; ++k) row[k] = in.a(m, k);
      for (int64_t n = 0; n < in.N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < in.K; ++k) acc += double(row[k]) * in.b(g, n, k);
        out[m * in.N + n] = float(acc);
      }
    }
  }
  return out;
}

// Empty string when `got` (bfloat16 bytes) matches: within 1e-2 of the largest |reference| (bf16
// rounding is 2^-9 relative; float32 accumulation of E4M3 products adds far less, and so does the
// tensor cores' own accumulation at these K), and exactly zero where the reference row is in no
// group.
std::string compare(const std::vector<uint8_t>& got, const std::vector<float>& want,
                    const std::vector<int64_t>& offsets, int64_t N) {
  float max_abs = 0.f;
  for (float v : want) max_abs = std::max(max_abs, std::fabs(v));
  const float tolerance = 1e-2f * max_abs;
  const auto* values = reinterpret_cast<const __nv_bfloat16*>(got.data());
  const int64_t owned_rows = offsets.back();
  int64_t bad = 0;
  std::ostringstream first;
  for (size_t i = 0; i < want.size(); ++i) {
    const float v = __bfloat162float(values[i]);
    const bool owned = int64_t(i) / N < owned_rows;
    const bool ok = owned ? !std::isnan(v) && std::fabs(v - want[i]) <= tolerance : v == 0.f;
    if (!ok && bad++ < 5) {
      first << "  [row " << int64_t(i) / N << ", col " << int64_t(i) % N << "] got " << v
            << ", want " << want[i] << (owned ? " +- " + std::to_string(tolerance) : " exactly")
            << "\n";
    }
  }
  if (bad == 0) return "";
  return std::to_string(bad) + " of " + std::to_string(want.size()) + " elements wrong:\n" +
         first.str();
}

// The accumulation a tensorwise call on `schedule` asks for: its pinned tile's, else `automatic`.
bool accumulation_of(const nodrop::cuda::Fp8TensorwiseSchedule& schedule, bool automatic) {
  return schedule.tile == nodrop::cuda::Fp8TensorwiseTile::kAuto
             ? automatic
             : nodrop::cuda::fp8_tensorwise_tile_fast_accumulation(schedule.tile);
}

// Inputs, group sizes, output and workspace of one problem on the device.
struct Buffers {
  DeviceBuffer lhs, lhs_scales, rhs, rhs_scales, sizes, out, workspace;
  explicit Buffers(const Inputs& in)
      : lhs(in.lhs.size()),
        lhs_scales(in.lhs_scales.size() * sizeof(float)),
        rhs(in.rhs.size()),
        rhs_scales(in.rhs_scales.size() * sizeof(float)),
        sizes(std::max<int64_t>(in.G, 1) * sizeof(int32_t)),
        out(in.M * in.N * sizeof(__nv_bfloat16)),
        workspace(nodrop::cuda::grouped_matmul_fp8_blockwise_workspace_bytes(in.G)) {
    lhs.upload(in.lhs.data());
    lhs_scales.upload(in.lhs_scales.data());
    rhs.upload(in.rhs.data());
    rhs_scales.upload(in.rhs_scales.data());
  }
  void set_sizes(const Sizes& values) const {
    if (!values.empty()) {
      CUDA_CHECK(cudaMemcpy(sizes.get(), values.data(), values.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice));
    }
  }
  Status run(const Inputs& in, cudaStream_t stream,
             const nodrop::cuda::Fp8GemmSchedule& schedule = {}) const {
    return nodrop::cuda::grouped_matmul_fp8_blockwise(
        lhs.get(), static_cast<const float*>(lhs_scales.get()), rhs.get(),
        static_cast<const float*>(rhs_scales.get()), static_cast<const int32_t*>(sizes.get()),
        in.M, in.K, in.N, in.G, out.get(), workspace.get(), workspace.bytes(), stream, schedule);
  }
  // A pinned tile runs with its own accumulation; kAuto with `fast_accumulation`.
  Status run(const Inputs& in, cudaStream_t stream,
             const nodrop::cuda::Fp8TensorwiseSchedule& schedule,
             bool fast_accumulation = true) const {
    return nodrop::cuda::grouped_matmul_fp8_tensorwise(
        lhs.get(), static_cast<const float*>(lhs_scales.get()), rhs.get(),
        static_cast<const float*>(rhs_scales.get()), static_cast<const int32_t*>(sizes.get()),
        in.M, in.K, in.N, in.G, accumulation_of(schedule, fast_accumulation), out.get(),
        workspace.get(), workspace.bytes(), stream, schedule);
  }
};

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

struct Case {
  std::string name;
  int64_t M, K, N;
  Sizes sizes;
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

// Captured once into a CUDA graph, the call replays with new group sizes written on the device.
// First in this file on purpose, as in grouped_matmul_gpu_test.cu: the process's first call of
// each kind happens inside the capture, so its one-time host work (function attributes, the
// occupancy query) must be capture-safe.
template <class Schedule, class... Accumulation>
void expect_graph_replays_with_new_group_sizes(bool tensorwise, Accumulation... fast) {
  const Inputs in(/*M=*/300, /*K=*/256, /*N=*/256, /*G=*/3, /*seed=*/11, tensorwise);
  const Buffers buffers(in);
  buffers.set_sizes({100, 100, 100});
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status status = buffers.run(in, stream, Schedule(), fast...);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(status.ok()) << status.message();
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (const Sizes& sizes : {Sizes{100, 100, 100}, Sizes{0, 1, 130}, Sizes{299, 0, 1}}) {
    buffers.set_sizes(sizes);
    buffers.out.poison();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(compare(buffers.out.download(), reference(in, sizes), naive_offsets(sizes, in.M),
                      in.N),
              "")
        << "sizes " << sizes[0] << ", " << sizes[1] << ", " << sizes[2];
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaFp8BlockwiseGraph, ReplaysWithNewGroupSizesOnTheDevice) {
  expect_graph_replays_with_new_group_sizes<nodrop::cuda::Fp8GemmSchedule>(false);
}

TEST(CudaFp8TensorwiseGraph, ReplaysWithNewGroupSizesOnTheDevice) {
  expect_graph_replays_with_new_group_sizes<nodrop::cuda::Fp8TensorwiseSchedule>(true, true);
  expect_graph_replays_with_new_group_sizes<nodrop::cuda::Fp8TensorwiseSchedule>(true, false);
}

using nodrop::cuda::Fp8GemmSchedule;
using nodrop::cuda::Fp8GemmTile;
using nodrop::cuda::GemmRaster;

// Every kernel in its automatic tile order, and two kernels in the other orders.
std::vector<Fp8GemmSchedule> schedules() {
  std::vector<Fp8GemmSchedule> all(std::begin(nodrop::cuda::kFp8GemmTiles),
                                   std::end(nodrop::cuda::kFp8GemmTiles));
  all.emplace_back(Fp8GemmTile::kCooperative128x128x128Cluster1x2, GemmRaster::kAlongN, 2);
  all.emplace_back(Fp8GemmTile::kPingpong64x128x128Cluster1x1, GemmRaster::kAlongN, 8);
  return all;
}

// "cooperative_128x128x128_1x2_along_n_swizzle_2" for test names.
std::string schedule_id(const Fp8GemmSchedule& schedule) {
  std::string id = nodrop::cuda::fp8_gemm_tile_id(schedule.tile);
  if (schedule.raster == GemmRaster::kAlongN) id += "_along_n";
  if (schedule.swizzle != 0) id += "_swizzle_" + std::to_string(schedule.swizzle);
  return id;
}

// Defined with the tensorwise tiles below.
std::string schedule_id(const nodrop::cuda::Fp8TensorwiseSchedule& schedule);

// "mixed_cooperative_128x128x128_1x2_along_n_swizzle_2": every parametrised suite's test names.
template <class Schedule>
std::string case_and_schedule_name(
    const testing::TestParamInfo<std::tuple<Case, Schedule>>& info) {
  return std::get<0>(info.param).name + "_" + schedule_id(std::get<1>(info.param));
}

// Runs the case twice on `schedule`: both runs match the reference, write nothing outside out
// and the workspace, and give the same bytes.
template <class Schedule>
void expect_matches_reference_deterministically(const Case& c, const Schedule& schedule,
                                                bool tensorwise) {
  const int64_t G = static_cast<int64_t>(c.sizes.size());
  const Inputs in(c.M, c.K, c.N, G, /*seed=*/7, tensorwise);
  const Buffers buffers(in);
  buffers.set_sizes(c.sizes);
  const std::vector<float> want = reference(in, c.sizes);
  std::vector<uint8_t> first;
  for (int run = 0; run < 2; ++run) {
    buffers.out.poison();
    const Status status = buffers.run(in, /*stream=*/nullptr, schedule);
    ASSERT_TRUE(status.ok()) << status.message();
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> got = buffers.out.download();
    EXPECT_EQ(compare(got, want, naive_offsets(c.sizes, c.M), c.N), "") << "run " << run;
    EXPECT_TRUE(buffers.out.guards_intact()) << "a write outside out";
    EXPECT_TRUE(buffers.workspace.guards_intact()) << "a write outside the workspace";
    if (run == 0) {
      first = got;
    } else {
      EXPECT_TRUE(got == first) << "two runs gave different bytes";
    }
  }
}

class CudaFp8BlockwiseTest : public testing::TestWithParam<std::tuple<Case, Fp8GemmSchedule>> {};

TEST_P(CudaFp8BlockwiseTest, MatchesDequantisedReferenceDeterministically) {
  const auto& [c, schedule] = GetParam();
  expect_matches_reference_deterministically(c, schedule, /*tensorwise=*/false);
}

// The ragged-rows cases every forward kernel runs.
const auto kRowsCases = testing::Values(
    // An empty group, a group of one row, 130 rows (one whole tile and two rows), 200, and 69
    // rows past every group that must come out zero.
    Case{"mixed", 400, 512, 256, {0, 1, 130, 200, 0}},
    // K and N not multiples of 128: partial scale blocks along both.
    Case{"partial_blocks", 333, 272, 200, {130, 0, 1, 202}},
    // All rows in one group, between empty ones; three row and three column tiles, so a 2-CTA
    // cluster has a tile past the group either way.
    Case{"one_group", 384, 384, 384, {0, 0, 384, 0}},
    // More k tiles (16) than pipeline stages, and several tiles for each CTA.
    Case{"long_k", 600, 2048, 384, {300, 0, 117, 183}},
    // Invalid sizes: a negative one counts as zero, the total past M is clamped.
    Case{"clamped", 300, 256, 128, {-5, 200, 250, 7}},
    // Every group empty: the whole output is zero.
    Case{"all_empty", 64, 256, 128, {0, 0, 0}},
    // Sizes at int32's bounds: the first group takes every row.
    Case{"int32_extremes", 256, 128, 128, {INT32_MAX, 5, -INT32_MAX, INT32_MIN}},
    // More groups than the setup kernel's 256 threads, many of them empty or tiny.
    Case{"many_groups", 2000, 128, 128, random_sizes(2000, 300, 12, 5)},
    // No rows, and K = 0 (nothing to contract: the owned rows are zero too).
    Case{"no_rows", 0, 256, 128, {0, 0, 0, 0}}, Case{"k_zero", 96, 0, 128, {32, 32, 32}});

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaFp8BlockwiseTest, testing::Combine(kRowsCases, testing::ValuesIn(schedules())),
    case_and_schedule_name<Fp8GemmSchedule>);

// ---- one scale per tensor (fast and promoted accumulation) -------------------------------------

using nodrop::cuda::Fp8TensorwiseSchedule;
using nodrop::cuda::Fp8TensorwiseTile;

// Every tensorwise kernel (each with its accumulation) in its automatic tile order, and the
// cooperative one along N.
std::vector<Fp8TensorwiseSchedule> tensorwise_schedules() {
  std::vector<Fp8TensorwiseSchedule> all(std::begin(nodrop::cuda::kFp8TensorwiseTiles),
                                         std::end(nodrop::cuda::kFp8TensorwiseTiles));
  all.emplace_back(Fp8TensorwiseTile::kCooperative128x256x128Cluster1x2, GemmRaster::kAlongN, 2);
  return all;
}

std::string schedule_id(const Fp8TensorwiseSchedule& schedule) {
  std::string id = nodrop::cuda::fp8_tensorwise_tile_id(schedule.tile);
  if (schedule.raster == GemmRaster::kAlongN) id += "_along_n";
  if (schedule.swizzle != 0) id += "_swizzle_" + std::to_string(schedule.swizzle);
  return id;
}

class CudaFp8TensorwiseTest
    : public testing::TestWithParam<std::tuple<Case, Fp8TensorwiseSchedule>> {};

TEST_P(CudaFp8TensorwiseTest, MatchesDequantisedReferenceDeterministically) {
  const auto& [c, schedule] = GetParam();
  expect_matches_reference_deterministically(c, schedule, /*tensorwise=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaFp8TensorwiseTest,
    testing::Combine(kRowsCases, testing::ValuesIn(tensorwise_schedules())),
    case_and_schedule_name<Fp8TensorwiseSchedule>);

// The tensorwise op is the blockwise one with every block's scale the tensor's: same values up
// to the order of the float32 sums (the blockwise kernel adds per 128-deep block).
TEST(CudaFp8Tensorwise, MatchesBlockwiseWithRepeatedScales) {
  const Sizes sizes = {0, 130, 1, 253};
  const Inputs tensorwise(/*M=*/400, /*K=*/1024, /*N=*/384, /*G=*/4, /*seed=*/5, true);
  Inputs blockwise(400, 1024, 384, 4, 5, false);
  blockwise.lhs = tensorwise.lhs;
  blockwise.rhs = tensorwise.rhs;
  std::fill(blockwise.lhs_scales.begin(), blockwise.lhs_scales.end(), tensorwise.lhs_scales[0]);
  const int64_t per_expert = blocks_of(384) * blocks_of(1024);
  for (int64_t g = 0; g < 4; ++g) {
    std::fill_n(blockwise.rhs_scales.begin() + g * per_expert, per_expert,
                tensorwise.rhs_scales[g]);
  }
  const Buffers tensorwise_buffers(tensorwise), blockwise_buffers(blockwise);
  tensorwise_buffers.set_sizes(sizes);
  blockwise_buffers.set_sizes(sizes);
  ASSERT_TRUE(blockwise_buffers.run(blockwise, nullptr).ok());
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = blockwise_buffers.out.download();
  for (bool fast : {true, false}) {
    tensorwise_buffers.out.poison();
    ASSERT_TRUE(tensorwise_buffers.run(tensorwise, nullptr, Fp8TensorwiseSchedule(), fast).ok());
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> want(400 * 384);
    const std::vector<uint8_t> tensorwise_out = tensorwise_buffers.out.download();
    const auto* values = reinterpret_cast<const __nv_bfloat16*>(tensorwise_out.data());
    for (size_t i = 0; i < want.size(); ++i) want[i] = __bfloat162float(values[i]);
    EXPECT_EQ(compare(got, want, naive_offsets(sizes, 400), 384), "") << "fast " << fast;
  }
}

// ---- the weight gradient (ragged contraction) ------------------------------------------------

// One contraction problem's host inputs in quantize_fp8_transposed's layouts (engine.h):
// lhs_t [K, P], rhs_t [N, P] E4M3, lhs_scales [PB, K], rhs_scales [PB, N], or one scale each
// (tensorwise). Every column and scale that no group's row owns holds NaN, so a kernel that read
// one would show it.
struct ContractInputs {
  int64_t M, K, N, G, PB, P;
  bool tensorwise;
  std::vector<int64_t> offsets, first_block;  // clamped rows and block numbering per group
  std::vector<__nv_fp8_e4m3> lhs_t, rhs_t;
  std::vector<float> lhs_scales, rhs_scales;

  ContractInputs(int64_t M, int64_t K, int64_t N, const Sizes& sizes, uint32_t seed,
                 bool tensorwise = false)
      : M(M), K(K), N(N), G(int64_t(sizes.size())), PB(nodrop::fp8_contract_blocks(M, G)),
        P(PB * kBlock), tensorwise(tensorwise), offsets(naive_offsets(sizes, M)),
        first_block(G + 1, 0), lhs_t(K * P), rhs_t(N * P),
        lhs_scales(tensorwise ? 1 : PB * K, NAN), rhs_scales(tensorwise ? 1 : PB * N, NAN) {
    for (int64_t g = 0; g < G; ++g) {
      first_block[g + 1] = first_block[g] + blocks_of(offsets[g + 1] - offsets[g]);
    }
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> value(-8.f, 8.f);
    std::uniform_real_distribution<float> log2_scale(-2.f, 2.f);
    const __nv_fp8_e4m3 nan = __nv_fp8_e4m3(NAN);
    std::fill(lhs_t.begin(), lhs_t.end(), nan);
    std::fill(rhs_t.begin(), rhs_t.end(), nan);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t r = 0; r < offsets[g + 1] - offsets[g]; ++r) {
        const int64_t column = first_block[g] * kBlock + r;
        for (int64_t k = 0; k < K; ++k) lhs_t[k * P + column] = __nv_fp8_e4m3(value(rng));
        for (int64_t n = 0; n < N; ++n) rhs_t[n * P + column] = __nv_fp8_e4m3(value(rng));
      }
    }
    if (tensorwise) {
      lhs_scales[0] = std::exp2(log2_scale(rng));
      rhs_scales[0] = std::exp2(log2_scale(rng));
    }
    for (int64_t b = 0; b < (tensorwise ? 0 : first_block[G]); ++b) {
      for (int64_t k = 0; k < K; ++k) lhs_scales[b * K + k] = std::exp2(log2_scale(rng));
      for (int64_t n = 0; n < N; ++n) rhs_scales[b * N + n] = std::exp2(log2_scale(rng));
    }
  }
  float lhs_scale(int64_t b, int64_t k) const { return lhs_scales[tensorwise ? 0 : b * K + k]; }
  float rhs_scale(int64_t b, int64_t n) const { return rhs_scales[tensorwise ? 0 : b * N + n]; }

  // out [G, K, N] from the dequantised inputs, in double; an empty group's is zero.
  std::vector<float> reference() const {
    std::vector<float> out(G * K * N, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rows = offsets[g + 1] - offsets[g];
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t b = first_block[g] + r / kBlock, column = first_block[g] * kBlock + r;
            acc += double(float(lhs_t[k * P + column]) * lhs_scale(b, k)) *
                   double(float(rhs_t[n * P + column]) * rhs_scale(b, n));
          }
          out[(g * K + k) * N + n] = float(acc);
        }
      }
    }
    return out;
  }
};

struct ContractBuffers {
  DeviceBuffer lhs_t, lhs_scales, rhs_t, rhs_scales, sizes, out, workspace;
  explicit ContractBuffers(const ContractInputs& in)
      : lhs_t(in.lhs_t.size()),
        lhs_scales(in.lhs_scales.size() * sizeof(float)),
        rhs_t(in.rhs_t.size()),
        rhs_scales(in.rhs_scales.size() * sizeof(float)),
        sizes(std::max<int64_t>(in.G, 1) * sizeof(int32_t)),
        out(in.G * in.K * in.N * sizeof(__nv_bfloat16)),
        workspace(nodrop::cuda::grouped_matmul_fp8_blockwise_workspace_bytes(in.G)) {
    lhs_t.upload(in.lhs_t.data());
    lhs_scales.upload(in.lhs_scales.data());
    rhs_t.upload(in.rhs_t.data());
    rhs_scales.upload(in.rhs_scales.data());
  }
  void set_sizes(const Sizes& values) const {
    if (!values.empty()) {
      CUDA_CHECK(cudaMemcpy(sizes.get(), values.data(), values.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice));
    }
  }
  Status run(const ContractInputs& in, cudaStream_t stream,
             const nodrop::cuda::Fp8GemmSchedule& schedule = {}) const {
    return nodrop::cuda::grouped_matmul_fp8_blockwise_contract(
        lhs_t.get(), static_cast<const float*>(lhs_scales.get()), rhs_t.get(),
        static_cast<const float*>(rhs_scales.get()), static_cast<const int32_t*>(sizes.get()),
        in.M, in.K, in.N, in.G, out.get(), workspace.get(), workspace.bytes(), stream, schedule);
  }
  Status run(const ContractInputs& in, cudaStream_t stream,
             const nodrop::cuda::Fp8TensorwiseSchedule& schedule,
             bool fast_accumulation = false) const {
    return nodrop::cuda::grouped_matmul_fp8_tensorwise_contract(
        lhs_t.get(), static_cast<const float*>(lhs_scales.get()), rhs_t.get(),
        static_cast<const float*>(rhs_scales.get()), static_cast<const int32_t*>(sizes.get()),
        in.M, in.K, in.N, in.G, accumulation_of(schedule, fast_accumulation), out.get(),
        workspace.get(), workspace.bytes(), stream, schedule);
  }
};

// Every weight-gradient kernel (fp8_tiles.def's NODROP_FP8_CONTRACT_TILE lines) in its own tile
// order, the automatic choice, and the 1x2 cluster along M.
std::vector<Fp8GemmSchedule> contract_schedules() {
  return {Fp8GemmSchedule(),
#define NODROP_FP8_GEMM_TILE(...)
#define NODROP_FP8_CONTRACT_TILE(name) Fp8GemmSchedule(Fp8GemmTile::name),
#include "engine/cuda/grouped_matmul/fp8_tiles.def"
#undef NODROP_FP8_CONTRACT_TILE
#undef NODROP_FP8_GEMM_TILE
          Fp8GemmSchedule(Fp8GemmTile::kCooperative128x128x128Cluster1x2, GemmRaster::kAlongM,
                          1)};
}

// Runs the case twice on `schedule`, as expect_matches_reference_deterministically.
template <class Schedule>
void expect_contraction_matches_reference_deterministically(const Case& c,
                                                            const Schedule& schedule,
                                                            bool tensorwise) {
  const ContractInputs in(c.M, c.K, c.N, c.sizes, /*seed=*/9, tensorwise);
  const ContractBuffers buffers(in);
  buffers.set_sizes(c.sizes);
  const std::vector<float> want = in.reference();
  // compare() checks [rows, N] matrices: here G * K rows, all owned (an empty group's are 0).
  const std::vector<int64_t> all_rows = {0, in.G * in.K};
  std::vector<uint8_t> first;
  for (int run = 0; run < 2; ++run) {
    buffers.out.poison();
    const Status status = buffers.run(in, /*stream=*/nullptr, schedule);
    ASSERT_TRUE(status.ok()) << status.message();
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> got = buffers.out.download();
    EXPECT_EQ(compare(got, want, all_rows, c.N), "") << "run " << run;
    EXPECT_TRUE(buffers.out.guards_intact()) << "a write outside out";
    EXPECT_TRUE(buffers.workspace.guards_intact()) << "a write outside the workspace";
    if (run == 0) {
      first = got;
    } else {
      EXPECT_TRUE(got == first) << "two runs gave different bytes";
    }
  }
}

class CudaFp8ContractTest : public testing::TestWithParam<std::tuple<Case, Fp8GemmSchedule>> {};

TEST_P(CudaFp8ContractTest, MatchesDequantisedReferenceDeterministically) {
  const auto& [c, schedule] = GetParam();
  expect_contraction_matches_reference_deterministically(c, schedule, /*tensorwise=*/false);
}

// The ragged-contraction cases every weight-gradient kernel runs.
const auto kContractCases = testing::Values(
    // Empty groups (zero gradients), one row, 130 rows (a block and two rows), 200 rows,
    // and 69 rows past every group that nothing may read.
    Case{"mixed", 400, 256, 256, {0, 1, 130, 200, 0}},
    // K and N not multiples of the 128-wide tile.
    Case{"partial_tiles", 333, 200, 136, {130, 0, 1, 202}},
    // All rows in one group: 16 k tiles, more than the pipeline's stages.
    Case{"one_group", 2048, 128, 256, {0, 2048, 0}},
    // Invalid sizes: a negative one counts as zero, the total past M is clamped.
    Case{"clamped", 300, 128, 128, {-5, 200, 250, 7}},
    // More groups than the setup kernel's 256 threads, many of them empty or tiny.
    Case{"many_groups", 2000, 128, 128, random_sizes(2000, 300, 12, 5)},
    // Every group empty, and no rows at all: all zeros.
    Case{"all_empty", 64, 128, 128, {0, 0, 0}}, Case{"no_rows", 0, 128, 128, {0, 0, 0, 0}});

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaFp8ContractTest,
    testing::Combine(kContractCases, testing::ValuesIn(contract_schedules())),
    case_and_schedule_name<Fp8GemmSchedule>);

// The tensorwise weight gradient on every tensorwise kernel (one kernel serves both forms).
class CudaFp8TensorwiseContractTest
    : public testing::TestWithParam<std::tuple<Case, Fp8TensorwiseSchedule>> {};

TEST_P(CudaFp8TensorwiseContractTest, MatchesDequantisedReferenceDeterministically) {
  const auto& [c, schedule] = GetParam();
  expect_contraction_matches_reference_deterministically(c, schedule, /*tensorwise=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaFp8TensorwiseContractTest,
    testing::Combine(kContractCases, testing::ValuesIn(tensorwise_schedules())),
    case_and_schedule_name<Fp8TensorwiseSchedule>);

// The tensorwise weight gradient is the blockwise one with every scale the tensor's: the same
// values up to the order of the float32 sums, with either accumulation.
TEST(CudaFp8TensorwiseContract, MatchesBlockwiseWithRepeatedScales) {
  const Sizes sizes = {0, 700, 1, 253};
  const ContractInputs tensorwise(/*M=*/1000, /*K=*/256, /*N=*/384, sizes, /*seed=*/5, true);
  ContractInputs blockwise(1000, 256, 384, sizes, 5, false);
  blockwise.lhs_t = tensorwise.lhs_t;
  blockwise.rhs_t = tensorwise.rhs_t;
  std::fill(blockwise.lhs_scales.begin(), blockwise.lhs_scales.end(), tensorwise.lhs_scales[0]);
  std::fill(blockwise.rhs_scales.begin(), blockwise.rhs_scales.end(), tensorwise.rhs_scales[0]);
  const ContractBuffers tensorwise_buffers(tensorwise), blockwise_buffers(blockwise);
  tensorwise_buffers.set_sizes(sizes);
  blockwise_buffers.set_sizes(sizes);
  ASSERT_TRUE(blockwise_buffers.run(blockwise, nullptr).ok());
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = blockwise_buffers.out.download();
  for (bool fast : {true, false}) {
    tensorwise_buffers.out.poison();
    ASSERT_TRUE(tensorwise_buffers.run(tensorwise, nullptr, Fp8TensorwiseSchedule(), fast).ok());
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> want(4 * 256 * 384);
    const std::vector<uint8_t> tensorwise_out = tensorwise_buffers.out.download();
    const auto* values = reinterpret_cast<const __nv_bfloat16*>(tensorwise_out.data());
    for (size_t i = 0; i < want.size(); ++i) want[i] = __bfloat162float(values[i]);
    EXPECT_EQ(compare(got, want, {0, 4 * 256}, 384), "") << "fast " << fast;
  }
}

// Captured once into a CUDA graph, the weight gradient replays with new group sizes (the
// quantiser's layout moves with them: each replay's inputs are laid out for its sizes).
template <class Schedule, class... Accumulation>
void expect_contraction_graph_replays_with_new_group_sizes(bool tensorwise,
                                                           Accumulation... fast) {
  const int64_t M = 300, K = 128, N = 256;
  const Sizes first = {100, 100, 100};
  const ContractBuffers buffers(ContractInputs(M, K, N, first, /*seed=*/11, tensorwise));
  buffers.set_sizes(first);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const Status status =
      buffers.run(ContractInputs(M, K, N, first, 11, tensorwise), stream, Schedule(), fast...);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(status.ok()) << status.message();
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (const Sizes& sizes : {Sizes{100, 100, 100}, Sizes{0, 1, 130}, Sizes{299, 0, 1}}) {
    const ContractInputs in(M, K, N, sizes, /*seed=*/13, tensorwise);
    buffers.lhs_t.upload(in.lhs_t.data());
    buffers.lhs_scales.upload(in.lhs_scales.data());
    buffers.rhs_t.upload(in.rhs_t.data());
    buffers.rhs_scales.upload(in.rhs_scales.data());
    buffers.set_sizes(sizes);
    buffers.out.poison();
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(compare(buffers.out.download(), in.reference(), {0, in.G * K}, N), "")
        << "sizes " << sizes[0] << ", " << sizes[1] << ", " << sizes[2];
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaFp8ContractGraph, ReplaysWithNewGroupSizesOnTheDevice) {
  expect_contraction_graph_replays_with_new_group_sizes<Fp8GemmSchedule>(false);
}

TEST(CudaFp8TensorwiseContractGraph, ReplaysWithNewGroupSizesOnTheDevice) {
  expect_contraction_graph_replays_with_new_group_sizes<Fp8TensorwiseSchedule>(true, true);
  expect_contraction_graph_replays_with_new_group_sizes<Fp8TensorwiseSchedule>(true, false);
}

TEST(CudaFp8ContractArguments, ErrorsNameTheArgument) {
  const ContractInputs in(/*M=*/16, /*K=*/128, /*N=*/128, {16}, /*seed=*/3);
  const ContractBuffers buffers(in);
  auto call = [&](int64_t M, int64_t N, size_t workspace_bytes,
                  const Fp8GemmSchedule& schedule = {}) {
    return nodrop::cuda::grouped_matmul_fp8_blockwise_contract(
        buffers.lhs_t.get(), static_cast<const float*>(buffers.lhs_scales.get()),
        buffers.rhs_t.get(), static_cast<const float*>(buffers.rhs_scales.get()),
        static_cast<const int32_t*>(buffers.sizes.get()), M, in.K, N, in.G, buffers.out.get(),
        buffers.workspace.get(), workspace_bytes, nullptr, schedule);
  };
  const size_t bytes = buffers.workspace.bytes();
  EXPECT_NE(call(/*M=*/-1, 128, bytes).message().find("M = -1"), std::string::npos);
  EXPECT_NE(call(16, /*N=*/100, bytes).message().find("N = 100"), std::string::npos);
  EXPECT_NE(call(16, 128, bytes - 1).message().find("workspace"), std::string::npos);
  // The pingpong tile has no weight-gradient kernel.
  EXPECT_NE(call(16, 128, bytes, Fp8GemmTile::kPingpong64x128x128Cluster1x1)
                .message()
                .find("no kernel for tile"),
            std::string::npos);
}

TEST(CudaFp8BlockwiseArguments, ErrorsNameTheArgument) {
  const Inputs in(/*M=*/16, /*K=*/128, /*N=*/128, /*G=*/1, /*seed=*/3);
  const Buffers buffers(in);
  auto call = [&](int64_t K, int64_t N, size_t workspace_bytes,
                  const Fp8GemmSchedule& schedule = {}) {
    return nodrop::cuda::grouped_matmul_fp8_blockwise(
        buffers.lhs.get(), static_cast<const float*>(buffers.lhs_scales.get()), buffers.rhs.get(),
        static_cast<const float*>(buffers.rhs_scales.get()),
        static_cast<const int32_t*>(buffers.sizes.get()), in.M, K, N, in.G, buffers.out.get(),
        buffers.workspace.get(), workspace_bytes, nullptr, schedule);
  };
  const size_t bytes = buffers.workspace.bytes();
  EXPECT_NE(call(/*K=*/120, 128, bytes).message().find("K = 120"), std::string::npos);
  EXPECT_NE(call(128, /*N=*/100, bytes).message().find("N = 100"), std::string::npos);
  EXPECT_NE(call(128, 128, bytes - 1).message().find("workspace"), std::string::npos);
  EXPECT_NE(call(128, 128, bytes, static_cast<Fp8GemmTile>(99)).message().find("schedule.tile"),
            std::string::npos);
  EXPECT_NE(call(128, 128, bytes, Fp8GemmSchedule(Fp8GemmTile::kAuto, GemmRaster::kAuto, 3))
                .message()
                .find("schedule.swizzle = 3"),
            std::string::npos);
  EXPECT_NE(call(128, 128, bytes,
                 Fp8GemmSchedule(Fp8GemmTile::kAuto, static_cast<GemmRaster>(7), 1))
                .message()
                .find("schedule.raster = 7"),
            std::string::npos);
}

TEST(CudaFp8TensorwiseArguments, ErrorsNameTheArgument) {
  const Inputs in(/*M=*/16, /*K=*/128, /*N=*/128, /*G=*/2, /*seed=*/3, /*tensorwise=*/true);
  const Buffers buffers(in);
  auto call = [&](int64_t K, int64_t N, size_t workspace_bytes,
                  const Fp8TensorwiseSchedule& schedule = {}, const float* lhs_scale = nullptr) {
    return nodrop::cuda::grouped_matmul_fp8_tensorwise(
        buffers.lhs.get(),
        lhs_scale != nullptr ? lhs_scale : static_cast<const float*>(buffers.lhs_scales.get()),
        buffers.rhs.get(), static_cast<const float*>(buffers.rhs_scales.get()),
        static_cast<const int32_t*>(buffers.sizes.get()), in.M, K, N, in.G,
        accumulation_of(schedule, true), buffers.out.get(), buffers.workspace.get(),
        workspace_bytes, nullptr, schedule);
  };
  const size_t bytes = buffers.workspace.bytes();
  EXPECT_NE(call(/*K=*/120, 128, bytes).message().find("K = 120"), std::string::npos);
  EXPECT_NE(call(128, /*N=*/100, bytes).message().find("N = 100"), std::string::npos);
  EXPECT_NE(call(128, 128, bytes - 1).message().find("workspace"), std::string::npos);
  EXPECT_NE(call(128, 128, bytes, static_cast<Fp8TensorwiseTile>(99))
                .message()
                .find("schedule.tile = 99 is not an Fp8TensorwiseTile"),
            std::string::npos);
  EXPECT_NE(call(128, 128, bytes,
                 Fp8TensorwiseSchedule(Fp8TensorwiseTile::kAuto, GemmRaster::kAuto, 3))
                .message()
                .find("schedule.swizzle = 3"),
            std::string::npos);
  const float* misaligned = reinterpret_cast<const float*>(
      static_cast<const char*>(buffers.lhs_scales.get()) + 2);
  EXPECT_NE(call(128, 128, bytes, {}, misaligned).message().find("lhs_scale must be 4-byte"),
            std::string::npos);
}

// A pinned tile must accumulate as the call asks, in both forms; the contraction's checks name
// its arguments.
TEST(CudaFp8TensorwiseContractArguments, ErrorsNameTheArgument) {
  const ContractInputs in(/*M=*/16, /*K=*/128, /*N=*/128, {16}, /*seed=*/3, /*tensorwise=*/true);
  const ContractBuffers buffers(in);
  auto call = [&](int64_t M, int64_t N, size_t workspace_bytes, bool fast,
                  const Fp8TensorwiseSchedule& schedule = {}) {
    return nodrop::cuda::grouped_matmul_fp8_tensorwise_contract(
        buffers.lhs_t.get(), static_cast<const float*>(buffers.lhs_scales.get()),
        buffers.rhs_t.get(), static_cast<const float*>(buffers.rhs_scales.get()),
        static_cast<const int32_t*>(buffers.sizes.get()), M, in.K, N, in.G, fast,
        buffers.out.get(), buffers.workspace.get(), workspace_bytes, nullptr, schedule);
  };
  const size_t bytes = buffers.workspace.bytes();
  EXPECT_NE(call(/*M=*/-1, 128, bytes, false).message().find("M = -1"), std::string::npos);
  EXPECT_NE(call(16, /*N=*/100, bytes, false).message().find("N = 100"), std::string::npos);
  EXPECT_NE(call(16, 128, bytes - 1, false).message().find("workspace"), std::string::npos);
  const std::string mismatch =
      call(16, 128, bytes, /*fast=*/false, Fp8TensorwiseTile::kCooperative128x256x128Cluster1x2)
          .message();
  EXPECT_NE(mismatch.find("schedule.tile = cooperative 128x256x128, cluster 1x2, fast "
                          "accumulation does not match fast_accumulation = false"),
            std::string::npos)
      << mismatch;

  const Inputs rows(/*M=*/16, /*K=*/128, /*N=*/128, /*G=*/2, /*seed=*/3, /*tensorwise=*/true);
  const Buffers rows_buffers(rows);
  const Status status = nodrop::cuda::grouped_matmul_fp8_tensorwise(
      rows_buffers.lhs.get(), static_cast<const float*>(rows_buffers.lhs_scales.get()),
      rows_buffers.rhs.get(), static_cast<const float*>(rows_buffers.rhs_scales.get()),
      static_cast<const int32_t*>(rows_buffers.sizes.get()), rows.M, rows.K, rows.N, rows.G,
      /*fast_accumulation=*/true, rows_buffers.out.get(), rows_buffers.workspace.get(),
      rows_buffers.workspace.bytes(), nullptr,
      Fp8TensorwiseTile::kCooperative128x128x128Cluster1x2Promoted);
  EXPECT_NE(status.message().find("does not match fast_accumulation = true"), std::string::npos)
      << status.message();
}

}  // namespace
