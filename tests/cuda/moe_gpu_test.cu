// GPU tests of the CUDA routing, permutation and AdamW kernels (engine_cuda.h) against the CPU
// engine (nodrop::cpu) on the same inputs. Needs a Hopper GPU, so it is run by hand, not by
// ctest:  ./nodrop_cuda_moe_tests  [--gtest_filter=...]
//
// Every output is poisoned with 0xFF bytes before each call and fenced by poisoned guard bytes,
// so an unwritten element or a write out of bounds fails; every call runs twice and must give the
// same bytes. The sort, the row copies and the float32 row sums must equal the CPU's bit for bit;
// the row dot products and the router (float64 on the CPU) must agree to float32 rounding.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "nodrop/engine_cpu.h"
#include "nodrop/engine_cuda.h"

namespace {

using nodrop::DType;
using nodrop::RouterConfig;
using nodrop::ScoreFunction;
using nodrop::Status;
using Bytes = std::vector<uint8_t>;
using Floats = std::vector<float>;
using Ints = std::vector<int32_t>;

void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
  }
}
#define CUDA_CHECK(expr) check_cuda((expr), #expr)

const char* dtype_short(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
  }
  return "?";
}

size_t bytes_of(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// The stream of every call and every copy: a non-blocking one, which the default stream does not
// order, so a kernel launched on another stream than the one passed races with the copies.
cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t created;
    CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return s;
}

// ---- device memory ---------------------------------------------------------------------------

// A device allocation whose usable part starts `shift` bytes past a 256-byte boundary, with
// poisoned guard bytes on both sides; it holds a copy of `host` when given, else poison.
class DeviceBuffer {
 public:
  static constexpr size_t kGuard = 256;
  explicit DeviceBuffer(size_t bytes, size_t shift = 0, const void* host = nullptr)
      : bytes_(bytes), shift_(shift) {
    CUDA_CHECK(cudaMalloc(&base_, total()));
    fill(base_, total());
    if (host != nullptr && bytes > 0) upload(host);
  }
  ~DeviceBuffer() { cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return static_cast<char*>(base_) + kGuard + shift_; }
  template <typename T>
  T* as() const { return static_cast<T*>(get()); }
  void poison() const { fill(get(), bytes_); }
  void upload(const void* host) const {
    CUDA_CHECK(cudaMemcpyAsync(get(), host, bytes_, cudaMemcpyHostToDevice, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
  }
  Bytes download() const {
    Bytes host(bytes_);
    CUDA_CHECK(cudaMemcpyAsync(host.data(), get(), bytes_, cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    return host;
  }
  bool guards_intact() const {
    Bytes host(total());
    CUDA_CHECK(cudaMemcpyAsync(host.data(), base_, host.size(), cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    auto poisoned = [](auto begin, auto end) {
      return std::all_of(begin, end, [](uint8_t b) { return b == 0xFF; });
    };
    return poisoned(host.begin(), host.begin() + kGuard + shift_) &&
           poisoned(host.end() - kGuard, host.end());
  }

 private:
  size_t total() const { return bytes_ + shift_ + 2 * kGuard; }
  static void fill(void* p, size_t bytes) {
    CUDA_CHECK(cudaMemsetAsync(p, 0xFF, bytes, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
  }
  void* base_ = nullptr;
  size_t bytes_, shift_;
};

template <typename T>
std::vector<T> as_vector(const Bytes& bytes) {
  std::vector<T> v(bytes.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

template <typename T>
std::vector<T> download(const DeviceBuffer& buffer) {
  return as_vector<T>(buffer.download());
}

// Runs `call` twice, each time on freshly poisoned outputs; both runs must write the same bytes
// and leave every guard intact. The outputs then hold the second run's result.
void run_twice(const std::function<Status()>& call,
               std::initializer_list<const DeviceBuffer*> outputs) {
  std::vector<Bytes> first;
  for (int run = 0; run < 2; ++run) {
    for (const DeviceBuffer* out : outputs) out->poison();
    const Status status = call();
    ASSERT_TRUE(status.ok()) << status.message();
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    CUDA_CHECK(cudaGetLastError());
    int i = 0;
    for (const DeviceBuffer* out : outputs) {
      EXPECT_TRUE(out->guards_intact()) << "output " << i << " was written out of bounds";
      if (run == 0) {
        first.push_back(out->download());
      } else {
        EXPECT_TRUE(out->download() == first[i]) << "output " << i << " differs between runs";
      }
      ++i;
    }
  }
}

// "" when equal, else the first difference and the number of differences.
template <typename T>
std::string mismatch(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) {
    return "size " + std::to_string(got.size()) + ", want " + std::to_string(want.size());
  }
  int64_t count = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++count;
    }
  }
  if (count == 0) return "";
  return std::to_string(count) + " elements differ, first at " + std::to_string(first) + ": got " +
         std::to_string(+got[first]) + ", want " + std::to_string(+want[first]);
}

// Bytes of `dtype` elements compared element by element, as their bit patterns.
std::string mismatch_bits(const Bytes& got, const Bytes& want, DType dtype) {
  if (dtype == DType::kFloat32) {
    return mismatch(as_vector<uint32_t>(got), as_vector<uint32_t>(want));
  }
  return mismatch(as_vector<uint16_t>(got), as_vector<uint16_t>(want));
}

// max |got - want| / max |want|; infinite when got has a NaN (an unwritten, poisoned value).
double rel_error(const Floats& got, const Floats& want) {
  if (got.size() != want.size()) return INFINITY;
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::max(err, std::abs(double(got[i]) - want[i]));
    ref = std::max(ref, std::abs(double(want[i])));
  }
  return ref > 0 ? err / ref : err;
}

// ---- inputs ------------------------------------------------------------------------------------

enum class IdKind {
  kUniform,      // uniform over the experts
  kZipf,         // expert of popularity rank r drawn with weight 1 / (r + 1)^1.2
  kFewExperts,   // only the first quarter of the experts: the rest are empty
  kOneExpert,    // every slot to one expert
  kPermutation,  // k distinct experts per token, as a router gives (k = E: all of them)
  kOutOfRange,   // uniform, with every seventh id outside [0, E)
};

Ints make_ids(IdKind kind, int64_t T, int64_t k, int64_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  Ints ids(T * k);
  std::uniform_int_distribution<int32_t> uniform(0, static_cast<int32_t>(E) - 1);
  switch (kind) {
    case IdKind::kUniform:
      for (auto& id : ids) id = uniform(rng);
      break;
    case IdKind::kZipf: {
      Ints expert_of_rank(E);
      std::iota(expert_of_rank.begin(), expert_of_rank.end(), 0);
      std::shuffle(expert_of_rank.begin(), expert_of_rank.end(), rng);
      std::vector<double> weights(E);
      for (int64_t r = 0; r < E; ++r) weights[r] = std::pow(r + 1.0, -1.2);
      std::discrete_distribution<int32_t> zipf(weights.begin(), weights.end());
      for (auto& id : ids) id = expert_of_rank[zipf(rng)];
      break;
    }
    case IdKind::kFewExperts: {
      std::uniform_int_distribution<int32_t> few(
          0, static_cast<int32_t>(std::max<int64_t>(1, E / 4) - 1));
      for (auto& id : ids) id = few(rng);
      break;
    }
    case IdKind::kOneExpert:
      std::fill(ids.begin(), ids.end(), static_cast<int32_t>(E / 2));
      break;
    case IdKind::kPermutation: {
      Ints experts(E);
      std::iota(experts.begin(), experts.end(), 0);
      for (int64_t t = 0; t < T; ++t) {
        std::shuffle(experts.begin(), experts.end(), rng);
        std::copy(experts.begin(), experts.begin() + k, ids.begin() + t * k);
      }
      break;
    }
    case IdKind::kOutOfRange: {
      const int32_t e = static_cast<int32_t>(E);
      const Ints bad = {-1, e, INT32_MIN, INT32_MAX, e + 1000};
      for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = i % 7 == 3 ? bad[i % bad.size()] : uniform(rng);
      }
      break;
    }
  }
  return ids;
}

// Row map and group sizes from the CPU sort (unchecked: out-of-range ids are dropped).
struct Sorted {
  Ints row_map, group_sizes;
};
Sorted cpu_sort(const Ints& ids, int64_t T, int64_t k, int64_t E) {
  Sorted s{Ints(T * k), Ints(E)};
  const Status status = nodrop::cpu::sort_by_expert(ids.data(), T, k, E, /*checked=*/false,
                                                    s.row_map.data(), s.group_sizes.data());
  if (!status.ok()) throw std::runtime_error(status.message());
  return s;
}

// n random values in [-1, 1], stored as `dtype`.
Bytes random_values(DType dtype, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  Bytes bytes(n * bytes_of(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float v = uniform(rng);
    switch (dtype) {
      case DType::kFloat32: reinterpret_cast<float*>(bytes.data())[i] = v; break;
      case DType::kFloat16: reinterpret_cast<__half*>(bytes.data())[i] = __float2half_rn(v); break;
      case DType::kBFloat16:
        reinterpret_cast<__nv_bfloat16*>(bytes.data())[i] = __float2bfloat16_rn(v);
        break;
    }
  }
  return bytes;
}

Floats random_floats(int64_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(lo, hi);
  Floats v(n);
  for (auto& x : v) x = uniform(rng);
  return v;
}

DeviceBuffer to_device(const Bytes& host, size_t shift = 0) {
  return DeviceBuffer(host.size(), shift, host.data());
}
template <typename T>
DeviceBuffer to_device(const std::vector<T>& host) {
  return DeviceBuffer(host.size() * sizeof(T), 0, host.data());
}

// ---- sort_by_expert ----------------------------------------------------------------------------

struct SortCase {
  const char* name;
  int64_t T, k, E;
  IdKind ids;
};

const SortCase kSortCases[] = {
    {"uniform", 1000, 8, 64, IdKind::kUniform},
    {"zipf", 4096, 8, 256, IdKind::kZipf},
    {"empty_experts", 3000, 2, 128, IdKind::kFewExperts},
    {"all_to_one_expert", 4096, 4, 32, IdKind::kOneExpert},
    {"one_expert", 3000, 1, 1, IdKind::kUniform},
    {"one_token_k_equals_E", 1, 64, 64, IdKind::kPermutation},
    {"out_of_range_ids", 2000, 4, 16, IdKind::kOutOfRange},
    {"one_slot_past_a_tile", 2049, 1, 3, IdKind::kUniform},
    {"E_not_a_power_of_two", 777, 3, 1000, IdKind::kPermutation},
    {"max_experts_zipf", 20000, 8, 1024, IdKind::kZipf},
    {"millions_of_slots", 400000, 8, 256, IdKind::kUniform},
    {"millions_of_slots_zipf", 300000, 8, 128, IdKind::kZipf},
    {"millions_of_slots_out_of_range", 250000, 8, 64, IdKind::kOutOfRange},
    {"no_tokens", 0, 4, 8, IdKind::kUniform},
};

class SortByExpert : public testing::TestWithParam<SortCase> {};

TEST_P(SortByExpert, EqualsCpuSort) {
  const SortCase& c = GetParam();
  const Ints ids = make_ids(c.ids, c.T, c.k, c.E, 1);
  const Sorted want = cpu_sort(ids, c.T, c.k, c.E);
  const DeviceBuffer d_ids = to_device(ids);
  const DeviceBuffer row_map(c.T * c.k * sizeof(int32_t)), sizes(c.E * sizeof(int32_t));
  const size_t workspace_bytes = nodrop::cuda::sort_by_expert_workspace_bytes(c.T, c.k, c.E);
  const DeviceBuffer workspace(workspace_bytes, /*shift=*/1);  // any alignment must do
  run_twice(
      [&] {
        return nodrop::cuda::sort_by_expert(d_ids.as<int32_t>(), c.T, c.k, c.E,
                                            row_map.as<int32_t>(), sizes.as<int32_t>(),
                                            workspace.get(), workspace_bytes, stream());
      },
      {&row_map, &sizes});
  EXPECT_EQ(mismatch(download<int32_t>(row_map), want.row_map), "");
  EXPECT_EQ(mismatch(download<int32_t>(sizes), want.group_sizes), "");
  EXPECT_TRUE(workspace.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cases, SortByExpert, testing::ValuesIn(kSortCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(SortByExpertArgs, NoExpertsDropsEverySlot) {
  const Ints ids = {0, 1, -1, 3};
  const DeviceBuffer d_ids = to_device(ids), row_map(ids.size() * sizeof(int32_t));
  run_twice(
      [&] {
        return nodrop::cuda::sort_by_expert(d_ids.as<int32_t>(), 2, 2, 0, row_map.as<int32_t>(),
                                            nullptr, nullptr, 0, stream());
      },
      {&row_map});
  EXPECT_EQ(download<int32_t>(row_map), Ints(4, -1));
}

TEST(SortByExpertArgs, RejectsBadArguments) {
  const DeviceBuffer ids(64 * sizeof(int32_t)), row_map(64 * sizeof(int32_t)), sizes(4096);
  const size_t needed = nodrop::cuda::sort_by_expert_workspace_bytes(32, 2, 8);
  const DeviceBuffer workspace(needed);
  auto sort = [&](int64_t T, int64_t E, size_t workspace_bytes) {
    return nodrop::cuda::sort_by_expert(ids.as<int32_t>(), T, 2, E, row_map.as<int32_t>(),
                                        sizes.as<int32_t>(), workspace.get(), workspace_bytes,
                                        stream());
  };
  EXPECT_FALSE(sort(32, 8, needed - 1).ok());
  EXPECT_FALSE(sort(32, nodrop::cuda::kMaxExperts + 1, needed).ok());
  EXPECT_FALSE(sort(-1, 8, needed).ok());
  EXPECT_FALSE(sort(int64_t(1) << 31, 8, needed).ok());
  EXPECT_TRUE(sort(32, 8, needed).ok());
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

// ---- row movers --------------------------------------------------------------------------------

struct RowCase {
  const char* name;
  int64_t T, k, E, H;
  IdKind ids;
};

const RowCase kRowCases[] = {
    {"odd_H", 37, 3, 8, 13, IdKind::kUniform},
    {"H_1", 20, 2, 4, 1, IdKind::kUniform},
    {"one_chunk_rows", 50, 2, 4, 8, IdKind::kZipf},
    {"vector_rows", 300, 4, 16, 256, IdKind::kPermutation},
    {"wide_rows", 128, 8, 32, 4096, IdKind::kZipf},
    {"odd_wide_rows", 64, 2, 8, 4095, IdKind::kUniform},
    {"one_token_k_equals_E", 1, 8, 8, 64, IdKind::kPermutation},
    {"one_expert", 64, 1, 1, 40, IdKind::kUniform},
    {"all_to_one_expert", 100, 4, 16, 24, IdKind::kOneExpert},
    {"empty_experts", 200, 2, 64, 32, IdKind::kFewExperts},
    {"out_of_range_ids", 100, 4, 8, 24, IdKind::kOutOfRange},
    {"many_tokens", 4096, 6, 64, 128, IdKind::kZipf},
    {"no_tokens", 0, 2, 4, 16, IdKind::kUniform},
};

class RowMovers : public testing::TestWithParam<std::tuple<DType, RowCase>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  const RowCase& shape() const { return std::get<1>(GetParam()); }
  int64_t slots() const { return shape().T * shape().k; }
  // Element shifts of the data pointers to run: 0 (16-byte accesses where the rows allow) and
  // one element (misaligned, so element accesses), which must give the same bytes.
  static constexpr size_t kShifts[] = {0, 1};
};

TEST_P(RowMovers, ScatterEqualsCpu) {
  const RowCase& c = shape();
  const Sorted sorted = cpu_sort(make_ids(c.ids, c.T, c.k, c.E, 2), c.T, c.k, c.E);
  const Bytes src = random_values(dtype(), c.T * c.H, 3);
  const Floats weights = random_floats(slots(), 4, -2.0f, 2.0f);
  const DeviceBuffer d_row_map = to_device(sorted.row_map), d_weights = to_device(weights);
  for (bool weighted : {false, true}) {
    Bytes want(slots() * c.H * bytes_of(dtype()));
    nodrop::cpu::permute_rows(src.data(), dtype(), sorted.row_map.data(),
                              weighted ? weights.data() : nullptr, c.T, c.k, c.H, want.data());
    for (size_t shift : kShifts) {
      SCOPED_TRACE(std::string(weighted ? "weighted" : "unweighted") + ", shift " +
                   std::to_string(shift));
      const DeviceBuffer d_src = to_device(src, shift * bytes_of(dtype()));
      const DeviceBuffer dst(want.size(), shift * bytes_of(dtype()));
      run_twice(
          [&] {
            return nodrop::cuda::permute_rows(d_src.get(), dtype(), d_row_map.as<int32_t>(),
                                              weighted ? d_weights.as<float>() : nullptr, c.T,
                                              c.k, c.H, dst.get(), stream());
          },
          {&dst});
      EXPECT_EQ(mismatch_bits(dst.download(), want, dtype()), "");
    }
  }
}

TEST_P(RowMovers, GatherEqualsCpu) {
  const RowCase& c = shape();
  const Sorted sorted = cpu_sort(make_ids(c.ids, c.T, c.k, c.E, 5), c.T, c.k, c.E);
  const Bytes src = random_values(dtype(), slots() * c.H, 6);
  const Floats weights = random_floats(slots(), 7, -2.0f, 2.0f);
  const DeviceBuffer d_row_map = to_device(sorted.row_map), d_weights = to_device(weights);
  for (bool weighted : {false, true}) {
    Bytes want(c.T * c.H * bytes_of(dtype()));
    nodrop::cpu::unpermute(src.data(), dtype(), sorted.row_map.data(),
                           weighted ? weights.data() : nullptr, c.T, c.k, c.H, want.data());
    for (size_t shift : kShifts) {
      SCOPED_TRACE(std::string(weighted ? "weighted" : "unweighted") + ", shift " +
                   std::to_string(shift));
      const DeviceBuffer d_src = to_device(src, shift * bytes_of(dtype()));
      const DeviceBuffer dst(want.size(), shift * bytes_of(dtype()));
      run_twice(
          [&] {
            return nodrop::cuda::unpermute(d_src.get(), dtype(), d_row_map.as<int32_t>(),
                                           weighted ? d_weights.as<float>() : nullptr, c.T, c.k,
                                           c.H, dst.get(), stream());
          },
          {&dst});
      EXPECT_EQ(mismatch_bits(dst.download(), want, dtype()), "");
    }
  }
}

TEST_P(RowMovers, RowDotsMatchCpu) {
  const RowCase& c = shape();
  const Sorted sorted = cpu_sort(make_ids(c.ids, c.T, c.k, c.E, 8), c.T, c.k, c.E);
  const Bytes a = random_values(dtype(), c.T * c.H, 9);
  const Bytes rows = random_values(dtype(), slots() * c.H, 10);
  Floats want(slots());
  nodrop::cpu::gather_row_dots(a.data(), rows.data(), dtype(), sorted.row_map.data(), c.T, c.k,
                               c.H, want.data());
  const DeviceBuffer d_row_map = to_device(sorted.row_map), out(slots() * sizeof(float));
  for (size_t shift : kShifts) {
    SCOPED_TRACE("shift " + std::to_string(shift));
    const DeviceBuffer d_a = to_device(a, shift * bytes_of(dtype()));
    const DeviceBuffer d_rows = to_device(rows, shift * bytes_of(dtype()));
    run_twice(
        [&] {
          return nodrop::cuda::gather_row_dots(d_a.get(), d_rows.get(), dtype(),
                                               d_row_map.as<int32_t>(), c.T, c.k, c.H,
                                               out.as<float>(), stream());
        },
        {&out});
    // Both sum in float64, in different orders: the float32 results differ by a rounding at most.
    const Floats got = download<float>(out);
    for (int64_t i = 0; i < slots(); ++i) {
      ASSERT_NEAR(got[i], want[i], 2e-7 * std::abs(want[i]) + 1e-12) << "slot " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RowMovers,
    testing::Combine(testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                     testing::ValuesIn(kRowCases)),
    [](const auto& info) {
      return std::string(dtype_short(std::get<0>(info.param))) + "_" + std::get<1>(info.param).name;
    });

// A row map that sort_by_expert cannot make (duplicates, gaps, entries out of range): every
// access stays in bounds, gather and row dots still equal the CPU's, and scatter writes each row
// that one slot maps to as the CPU does and zeroes the unmapped rows at or past n, the number of
// in-range entries.
TEST(RowMoversArbitraryRowMap, StayInBoundsAndKeepTheirContracts) {
  const int64_t T = 50, k = 3, H = 24, slots = T * k;
  const DType dtype = DType::kBFloat16;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> any_row(-4, static_cast<int32_t>(slots) + 4);
  Ints row_map(slots);
  for (auto& r : row_map) r = any_row(rng);
  const Bytes x = random_values(dtype, T * H, 12), rows = random_values(dtype, slots * H, 13);
  const Floats weights = random_floats(slots, 14, -2.0f, 2.0f);
  const DeviceBuffer d_row_map = to_device(row_map), d_weights = to_device(weights);
  const DeviceBuffer d_x = to_device(x), d_rows = to_device(rows);

  Bytes want_gather(T * H * 2);
  nodrop::cpu::unpermute(rows.data(), dtype, row_map.data(), weights.data(), T, k, H,
                         want_gather.data());
  const DeviceBuffer gathered(want_gather.size());
  run_twice(
      [&] {
        return nodrop::cuda::unpermute(d_rows.get(), dtype, d_row_map.as<int32_t>(),
                                       d_weights.as<float>(), T, k, H, gathered.get(), stream());
      },
      {&gathered});
  EXPECT_EQ(mismatch_bits(gathered.download(), want_gather, dtype), "");

  Floats want_dots(slots);
  nodrop::cpu::gather_row_dots(x.data(), rows.data(), dtype, row_map.data(), T, k, H,
                               want_dots.data());
  const DeviceBuffer dots(slots * sizeof(float));
  run_twice(
      [&] {
        return nodrop::cuda::gather_row_dots(d_x.get(), d_rows.get(), dtype,
                                             d_row_map.as<int32_t>(), T, k, H, dots.as<float>(),
                                             stream());
      },
      {&dots});
  EXPECT_LT(rel_error(download<float>(dots), want_dots), 1e-6);

  // Duplicates make scatter's result order-dependent, so it runs once here.
  Bytes want_scatter(slots * H * 2);
  nodrop::cpu::permute_rows(x.data(), dtype, row_map.data(), weights.data(), T, k, H,
                            want_scatter.data());
  const DeviceBuffer scattered(want_scatter.size());
  scattered.poison();
  const Status status = nodrop::cuda::permute_rows(d_x.get(), dtype, d_row_map.as<int32_t>(),
                                                   d_weights.as<float>(), T, k, H,
                                                   scattered.get(), stream());
  ASSERT_TRUE(status.ok()) << status.message();
  CUDA_CHECK(cudaStreamSynchronize(stream()));
  EXPECT_TRUE(scattered.guards_intact());
  Ints writers(slots, 0);
  int64_t mapped = 0;
  for (int32_t r : row_map) {
    if (r >= 0 && r < slots) ++writers[r], ++mapped;
  }
  const Bytes got = scattered.download();
  for (int64_t r = 0; r < slots; ++r) {
    const size_t begin = r * H * 2, end = begin + H * 2;
    const bool checked = writers[r] == 1 || (writers[r] == 0 && r >= mapped);
    if (checked) {
      EXPECT_TRUE(std::equal(got.begin() + begin, got.begin() + end, want_scatter.begin() + begin))
          << "row " << r << " (" << writers[r] << " writers, " << mapped << " in-range entries)";
    }
  }
}

TEST(RowMoversArgs, RejectBadShapes) {
  const DeviceBuffer buffer(4096);
  const int32_t* row_map = buffer.as<int32_t>();
  EXPECT_FALSE(nodrop::cuda::permute_rows(buffer.get(), DType::kFloat32, row_map, nullptr, 2, 2,
                                          -1, buffer.get(), stream()).ok());
  EXPECT_FALSE(nodrop::cuda::unpermute(buffer.get(), DType::kFloat32, row_map, nullptr,
                                       int64_t(1) << 31, 1, 4, buffer.get(), stream()).ok());
  EXPECT_FALSE(nodrop::cuda::gather_row_dots(buffer.get(), buffer.get(), static_cast<DType>(7),
                                             row_map, 2, 2, 4, buffer.as<float>(), stream()).ok());
}

// ---- router ------------------------------------------------------------------------------------

// Logits that make every selection either an exact tie or a clear win, so that float32 (GPU)
// and float64 (CPU) arithmetic must choose the same experts.
enum class Logits {
  kQuantized,     // multiples of 1/16 in [-2, 2]: many exact ties, the rest 6% apart
  kRankedGroups,  // 0.5 * (a random rank of the expert's group) + a multiple of 1/32 below 0.25:
                  // groups, and so their sums of best scores, are clearly apart
  kEqual,         // all zero: every choice is a tie, decided by the lower index
};

struct RouterCase {
  const char* name;
  int64_t T, E, k;
  ScoreFunction fn;
  int64_t num_groups, topk_groups;
  bool renormalize;
  float scaling_factor;
  // A bias of 0.3 times {-1, 0, 1}: softmax selects by p * exp(bias), a logit shift, and the
  // quantized logits are multiples of 1/16, so a bias difference of 0.3 or 0.6 never ties two
  // scores exactly (an integer one did: CPU and GPU roundings broke such ties differently);
  // sigmoid adds it to scores in (0, 1).
  bool bias;
  Logits logits;

  RouterConfig config() const {
    RouterConfig c;
    c.num_tokens = T;
    c.num_experts = E;
    c.k = k;
    c.score_function = fn;
    c.num_groups = num_groups;
    c.topk_groups = topk_groups;
    c.renormalize = renormalize;
    c.scaling_factor = scaling_factor;
    return c;
  }
};

constexpr ScoreFunction kSoftmax = ScoreFunction::kSoftmax;
constexpr ScoreFunction kSigmoid = ScoreFunction::kSigmoid;

const RouterCase kRouterCases[] = {
    {"softmax_E8_k2", 1000, 8, 2, kSoftmax, 1, 1, false, 1.0f, false, Logits::kQuantized},
    {"softmax_E64_k6_renormalized", 777, 64, 6, kSoftmax, 1, 1, true, 1.0f, false,
     Logits::kQuantized},
    {"softmax_E128_k8_bias", 4096, 128, 8, kSoftmax, 1, 1, false, 1.0f, true, Logits::kQuantized},
    {"sigmoid_E96_k3_bias", 1000, 96, 3, kSigmoid, 1, 1, true, 1.0f, true, Logits::kQuantized},
    {"deepseek_v3_E256_k8_groups8_top4", 2048, 256, 8, kSigmoid, 8, 4, true, 2.5f, false,
     Logits::kRankedGroups},
    {"deepseek_v2_E160_k6_groups8_top3", 1500, 160, 6, kSoftmax, 8, 3, false, 16.0f, false,
     Logits::kRankedGroups},
    {"groups_best_one_bias", 1000, 64, 4, kSigmoid, 8, 4, true, 1.0f, true, Logits::kQuantized},
    {"E1000_k40_groups10_top3", 300, 1000, 40, kSigmoid, 10, 3, true, 1.0f, false,
     Logits::kRankedGroups},
    {"E1024_k8_bias", 200, 1024, 8, kSoftmax, 1, 1, true, 1.0f, true, Logits::kQuantized},
    {"one_expert", 100, 1, 1, kSoftmax, 1, 1, false, 1.0f, false, Logits::kQuantized},
    {"k_equals_E", 500, 32, 32, kSoftmax, 1, 1, true, 1.0f, false, Logits::kQuantized},
    {"all_logits_equal", 64, 16, 4, kSoftmax, 1, 1, false, 1.0f, false, Logits::kEqual},
    {"no_tokens", 0, 8, 2, kSoftmax, 1, 1, false, 1.0f, false, Logits::kQuantized},
};

Floats make_logits(const RouterCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Floats logits(c.T * c.E, 0.0f);
  if (c.logits == Logits::kQuantized) {
    std::uniform_int_distribution<int> level(-32, 32);
    for (auto& x : logits) x = level(rng) / 16.0f;
  } else if (c.logits == Logits::kRankedGroups) {
    const int64_t per_group = c.E / c.num_groups;
    std::uniform_int_distribution<int> noise(0, 7);
    Ints rank(c.num_groups);
    std::iota(rank.begin(), rank.end(), 0);
    for (int64_t t = 0; t < c.T; ++t) {
      std::shuffle(rank.begin(), rank.end(), rng);
      for (int64_t e = 0; e < c.E; ++e) {
        logits[t * c.E + e] = 0.5f * rank[e / per_group] + noise(rng) / 32.0f;
      }
    }
  }
  return logits;
}

class Router : public testing::TestWithParam<RouterCase> {};

TEST_P(Router, ForwardMatchesCpu) {
  const RouterCase& c = GetParam();
  const RouterConfig config = c.config();
  const Floats logits = make_logits(c, 20);
  Floats bias(c.E);
  std::mt19937 rng(21);
  for (auto& b : bias) b = 0.3f * std::uniform_int_distribution<int>(-1, 1)(rng);
  const float* host_bias = c.bias ? bias.data() : nullptr;

  Floats want_weights(c.T * c.k);
  Ints want_ids(c.T * c.k);
  const Status cpu = nodrop::cpu::topk_router(logits.data(), host_bias, config,
                                              want_weights.data(), want_ids.data());
  ASSERT_TRUE(cpu.ok()) << cpu.message();

  const DeviceBuffer d_logits = to_device(logits), d_bias = to_device(bias);
  const DeviceBuffer weights(c.T * c.k * sizeof(float)), ids(c.T * c.k * sizeof(int32_t));
  run_twice(
      [&] {
        return nodrop::cuda::topk_router(d_logits.as<float>(),
                                         c.bias ? d_bias.as<float>() : nullptr, config,
                                         weights.as<float>(), ids.as<int32_t>(), stream());
      },
      {&weights, &ids});
  EXPECT_EQ(mismatch(download<int32_t>(ids), want_ids), "");
  EXPECT_LT(rel_error(download<float>(weights), want_weights), 1e-5);
}

TEST_P(Router, GradMatchesCpu) {
  const RouterCase& c = GetParam();
  const RouterConfig config = c.config();
  const Floats logits = make_logits(c, 22);
  Floats unused_weights(c.T * c.k);
  Ints ids(c.T * c.k);
  ASSERT_TRUE(nodrop::cpu::topk_router(logits.data(), nullptr, config, unused_weights.data(),
                                       ids.data()).ok());
  const Floats grad_weights = random_floats(c.T * c.k, 23, -1.0f, 1.0f);
  Floats want(c.T * c.E);
  ASSERT_TRUE(nodrop::cpu::topk_router_grad(logits.data(), ids.data(), grad_weights.data(), config,
                                            want.data()).ok());

  const DeviceBuffer d_logits = to_device(logits), d_ids = to_device(ids);
  const DeviceBuffer d_grad_weights = to_device(grad_weights), grad(c.T * c.E * sizeof(float));
  run_twice(
      [&] {
        return nodrop::cuda::topk_router_grad(d_logits.as<float>(), d_ids.as<int32_t>(),
                                              d_grad_weights.as<float>(), config,
                                              grad.as<float>(), stream());
      },
      {&grad});
  EXPECT_LT(rel_error(download<float>(grad), want), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Cases, Router, testing::ValuesIn(kRouterCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(RouterGrad, SkipsOutOfRangeIdsAndRepeatsAsCpu) {
  RouterCase c{"", 64, 16, 4, kSoftmax, 1, 1, true, 1.5f, false, Logits::kQuantized};
  const RouterConfig config = c.config();
  const Floats logits = make_logits(c, 30);
  Ints ids = make_ids(IdKind::kOutOfRange, c.T, c.k, c.E, 31);
  ids[5] = ids[4];  // one expert twice in a token: its gradients add up
  const Floats grad_weights = random_floats(c.T * c.k, 32, -1.0f, 1.0f);
  Floats want(c.T * c.E);
  ASSERT_TRUE(nodrop::cpu::topk_router_grad(logits.data(), ids.data(), grad_weights.data(), config,
                                            want.data()).ok());
  const DeviceBuffer d_logits = to_device(logits), d_ids = to_device(ids);
  const DeviceBuffer d_grad_weights = to_device(grad_weights), grad(c.T * c.E * sizeof(float));
  run_twice(
      [&] {
        return nodrop::cuda::topk_router_grad(d_logits.as<float>(), d_ids.as<int32_t>(),
                                              d_grad_weights.as<float>(), config,
                                              grad.as<float>(), stream());
      },
      {&grad});
  EXPECT_LT(rel_error(download<float>(grad), want), 1e-5);
}

TEST(RouterArgs, RejectsBadConfigs) {
  const DeviceBuffer buffer(1 << 16);
  auto route = [&](int64_t E, int64_t k, int64_t groups, int64_t topk_groups) {
    RouterConfig c;
    c.num_tokens = 4;
    c.num_experts = E;
    c.k = k;
    c.num_groups = groups;
    c.topk_groups = topk_groups;
    return nodrop::cuda::topk_router(buffer.as<float>(), nullptr, c, buffer.as<float>(),
                                     buffer.as<int32_t>(), stream());
  };
  EXPECT_FALSE(route(nodrop::cuda::kMaxExperts + 1, 2, 1, 1).ok());
  EXPECT_FALSE(route(8, 9, 1, 1).ok());
  EXPECT_FALSE(route(8, 2, 3, 1).ok());
  EXPECT_FALSE(route(8, 5, 4, 2).ok());  // only 4 experts in the 2 chosen groups
  EXPECT_TRUE(route(8, 4, 4, 2).ok());
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

// ---- FP8 quantisation ------------------------------------------------------------------------

// Stores `value` as element i of a `dtype` buffer.
void set_value(Bytes& bytes, DType dtype, int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32: reinterpret_cast<float*>(bytes.data())[i] = value; break;
    case DType::kFloat16: reinterpret_cast<__half*>(bytes.data())[i] = __float2half_rn(value); break;
    case DType::kBFloat16:
      reinterpret_cast<__nv_bfloat16*>(bytes.data())[i] = __float2bfloat16_rn(value);
      break;
  }
}

// A float buffer's bits, to compare NaN scales bitwise.
std::vector<uint32_t> as_bits(const Floats& values) {
  return as_vector<uint32_t>(Bytes(reinterpret_cast<const uint8_t*>(values.data()),
                                   reinterpret_cast<const uint8_t*>(values.data() + values.size())));
}

class QuantizeFp8Gpu : public testing::TestWithParam<DType> {};

// Bitwise the CPU engine's bytes: codes and scales, with whole blocks (C = 256) and a short last
// block (C = 300), an all-zero block, a NaN block and an inf block, rows of large, small and
// subnormal magnitudes (a scale whose reciprocal is inf), and an odd block size (rows of 7
// blocks of 45); x aligned and not (the vector path and the element-wise one).
TEST_P(QuantizeFp8Gpu, MatchesTheCpuBitwise) {
  const DType dtype = GetParam();
  for (const auto& [case_columns, case_block] :
       {std::pair<int64_t, int64_t>{256, 128}, {300, 128}, {300, 45}}) {
    const int64_t C = case_columns, block = case_block;  // named copies: a lambda captures them
    const int64_t M = 37, blocks = (C + block - 1) / block;
    Bytes x = random_values(dtype, M * C, 41);
    for (int64_t i = 0; i < block; ++i) set_value(x, dtype, 3 * C + i, 0.0f);
    set_value(x, dtype, 5 * C + 200, std::nanf(""));
    set_value(x, dtype, 6 * C + 10, INFINITY);
    const Floats large = random_floats(C, 43, -3e4f, 3e4f);
    const Floats small = random_floats(C, 44, -1e-4f, 1e-4f);
    for (int64_t i = 0; i < C; ++i) {  // rows of large, small and subnormal magnitudes
      set_value(x, dtype, 9 * C + i, large[i]);
      set_value(x, dtype, 10 * C + i, small[i]);
      set_value(x, dtype, 11 * C + i, small[i] * 1e-35f);
    }
    Bytes want_q(M * C);
    Floats want_scale(M * blocks);
    ASSERT_TRUE(nodrop::cpu::quantize_fp8(x.data(), dtype, M, C, block, want_q.data(),
                                          want_scale.data()).ok());
    // Aligned (block 128: the vector path) and not (element by element).
    for (const size_t shift : {size_t{0}, 2 * bytes_of(dtype)}) {
      const DeviceBuffer d_x = to_device(x, shift);
      const DeviceBuffer q(M * C), scale(M * blocks * sizeof(float));
      run_twice(
          [&] {
            return nodrop::cuda::quantize_fp8(d_x.get(), dtype, M, C, block, q.as<uint8_t>(),
                                              scale.as<float>(), stream());
          },
          {&q, &scale});
      EXPECT_EQ(mismatch(download<uint8_t>(q), want_q), "")
          << "C " << C << ", block " << block << ", shift " << shift;
      EXPECT_EQ(mismatch(download<uint32_t>(scale), as_bits(want_scale)), "")
          << "C " << C << ", block " << block << ", shift " << shift;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizeFp8Gpu,
                         testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         [](const auto& info) { return std::string(dtype_short(info.param)); });

class QuantizeFp8TransposedGpu : public testing::TestWithParam<DType> {};

// The weight gradient's operand layout (engine.h), bitwise the CPU engine's: group sizes with an
// empty group, one row, 130 and 200 rows and 69 rows past the groups; invalid sizes (clamped);
// 300 groups, most of them tiny; C = 300 (a partial column tile) and C = 1100 (9 tiles, the last
// partial), with a zero block, a NaN block (whose padding must stay 0), an inf block, a block of
// subnormals (a scale whose reciprocal is inf) and columns of large and small magnitudes. Each
// case with each block's own scale, and with a given one (a tensorwise scale: 0.01, which
// saturates the large columns, and NaN).
TEST_P(QuantizeFp8TransposedGpu, MatchesTheCpuBitwise) {
  const DType dtype = GetParam();
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tiny(0, 12);
  std::vector<int32_t> many(300);
  for (auto& size : many) size = tiny(rng);
  const std::tuple<int64_t, int64_t, std::vector<int32_t>> cases[] = {
      {400, 300, {0, 1, 130, 200, 0}}, {300, 300, {-5, 200, 250, 7}}, {2000, 300, many},
      {0, 300, {0, 0}}, {400, 1100, {0, 1, 130, 200, 0}}};
  for (const auto& [case_rows, case_columns, case_sizes] : cases) {
    const int64_t M = case_rows, C = case_columns;  // named copies: a lambda below captures them
    const std::vector<int32_t>& sizes = case_sizes;
    const int64_t G = static_cast<int64_t>(sizes.size());
    const int64_t blocks = nodrop::fp8_contract_blocks(M, G), P = blocks * nodrop::kFp8Block;
    Bytes x = random_values(dtype, std::max<int64_t>(M * C, 1), 47);
    if (M >= 300) {
      for (int64_t r = 1; r < 131; ++r) {  // group 2's blocks: zeros, and subnormals
        set_value(x, dtype, r * C + 7, 0.0f);
        set_value(x, dtype, r * C + 8, 1e-39f * float(r % 7 - 3));
      }
      set_value(x, dtype, 140 * C + 20, std::nanf(""));
      set_value(x, dtype, 150 * C + 21, INFINITY);
      const Floats large = random_floats(C, 43, -3e4f, 3e4f);
      const Floats small = random_floats(C, 44, -1e-4f, 1e-4f);
      for (int64_t r = 160; r < 170; ++r) {
        set_value(x, dtype, r * C + 30, large[r]);
        set_value(x, dtype, r * C + 31, small[r]);
      }
    }
    const DeviceBuffer d_sizes(std::max<int64_t>(G, 1) * sizeof(int32_t), 0, sizes.data());
    const float given_scales[] = {0.01f, std::nanf("")};
    const DeviceBuffer d_given(sizeof(given_scales), 0, given_scales);
    for (const int given : {-1, 0, 1}) {  // -1: each block's own scale
      const float* host_given = given < 0 ? nullptr : &given_scales[given];
      const float* device_given = given < 0 ? nullptr : d_given.as<float>() + given;
      Bytes want_q(C * P);
      Floats want_scale(blocks * C);
      ASSERT_TRUE(nodrop::cpu::quantize_fp8_transposed(x.data(), dtype, sizes.data(), M, C, G,
                                                       host_given, want_q.data(),
                                                       want_scale.data(), /*checked=*/false)
                      .ok());
      // Aligned (the vector path) and not (element by element).
      for (const size_t shift : {size_t{0}, 2 * bytes_of(dtype)}) {
        const DeviceBuffer d_x = to_device(x, shift);
        const DeviceBuffer q(C * P), scale(blocks * C * sizeof(float));
        run_twice(
            [&] {
              return nodrop::cuda::quantize_fp8_transposed(
                  d_x.get(), dtype, d_sizes.as<int32_t>(), M, C, G, device_given,
                  q.as<uint8_t>(), scale.as<float>(), stream());
            },
            {&q, &scale});
        EXPECT_EQ(mismatch(download<uint8_t>(q), want_q), "")
            << "M " << M << ", C " << C << ", G " << G << ", shift " << shift << ", given "
            << given;
        EXPECT_EQ(mismatch(download<uint32_t>(scale), as_bits(want_scale)), "")
            << "M " << M << ", C " << C << ", G " << G << ", shift " << shift << ", given "
            << given;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizeFp8TransposedGpu,
                         testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         [](const auto& info) { return std::string(dtype_short(info.param)); });

// Bitwise the CPU engine's transpose_fp8_codes on random bytes (NaN codes among them): the
// quantiser's group cases, C = 300 and 1100 (partial column tiles) and 7 (under one lane's 8),
// q aligned (the vector path) and not (element by element).
TEST(TransposeFp8CodesGpu, MatchesTheCpuBitwise) {
  std::mt19937 rng(6);
  std::uniform_int_distribution<int32_t> tiny(0, 12), byte(0, 255);
  std::vector<int32_t> many(300);
  for (auto& size : many) size = tiny(rng);
  const std::tuple<int64_t, int64_t, std::vector<int32_t>> cases[] = {
      {400, 300, {0, 1, 130, 200, 0}}, {300, 300, {-5, 200, 250, 7}}, {2000, 300, many},
      {0, 300, {0, 0}}, {400, 1100, {0, 1, 130, 200, 0}}, {259, 7, {3, 256}}};
  for (const auto& [case_rows, case_columns, case_sizes] : cases) {
    const int64_t M = case_rows, C = case_columns;  // named copies: a lambda below captures them
    const std::vector<int32_t>& sizes = case_sizes;
    const int64_t G = static_cast<int64_t>(sizes.size());
    const int64_t P = nodrop::fp8_contract_blocks(M, G) * nodrop::kFp8Block;
    Bytes q(std::max<int64_t>(M * C, 1));
    for (auto& code : q) code = static_cast<uint8_t>(byte(rng));
    const DeviceBuffer d_sizes(std::max<int64_t>(G, 1) * sizeof(int32_t), 0, sizes.data());
    Bytes want(C * P);
    ASSERT_TRUE(nodrop::cpu::transpose_fp8_codes(q.data(), sizes.data(), M, C, G, want.data(),
                                                 /*checked=*/false)
                    .ok());
    for (const size_t shift : {size_t{0}, size_t{3}}) {
      const DeviceBuffer d_q = to_device(q, shift);
      const DeviceBuffer q_t(C * P);
      run_twice(
          [&] {
            return nodrop::cuda::transpose_fp8_codes(d_q.as<uint8_t>(), d_sizes.as<int32_t>(), M,
                                                     C, G, q_t.as<uint8_t>(), stream());
          },
          {&q_t});
      EXPECT_EQ(mismatch(download<uint8_t>(q_t), want), "")
          << "M " << M << ", C " << C << ", G " << G << ", shift " << shift;
    }
  }
}

TEST(TransposeFp8CodesGpuArgs, RejectsBadShapesAndDoesNothingWhenEmpty) {
  const DeviceBuffer buffer(1 << 12);
  EXPECT_NE(nodrop::cuda::transpose_fp8_codes(buffer.as<uint8_t>(), buffer.as<int32_t>(), -1, 4,
                                              1, buffer.as<uint8_t>(), stream())
                .message()
                .find("transpose_fp8_codes: M, C and G must not be negative"),
            std::string::npos);
  EXPECT_NE(nodrop::cuda::transpose_fp8_codes(nullptr, buffer.as<int32_t>(), 4, 4, 1,
                                              buffer.as<uint8_t>(), stream())
                .message()
                .find("q is null"),
            std::string::npos);
  EXPECT_TRUE(nodrop::cuda::transpose_fp8_codes(nullptr, nullptr, 0, 4, 0, nullptr, stream()).ok());
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

class PermuteRowsFp8Gpu : public testing::TestWithParam<DType> {};

// Bitwise the CPU engine's permute_rows_fp8 (itself checked against permute_rows and
// quantize_fp8): k = 1, 2 and 3; H = 4096 and 256 (whole blocks, the vector path), 300 (a short
// last block, element by element) and 7 (under one lane's 8); ids out of range (dropped slots:
// their rows are the unmapped ones, zero with scale 1), a NaN, an inf and an all-zero block;
// tokens aligned and not; each block's own scale, and a given one (0.01: the largest values
// saturate; NaN).
TEST_P(PermuteRowsFp8Gpu, MatchesTheCpuBitwise) {
  const DType dtype = GetParam();
  const int64_t E = 5;
  for (const auto& [case_k, case_hidden] :
       {std::pair<int64_t, int64_t>{1, 256}, {2, 4096}, {2, 300}, {3, 7}}) {
    const int64_t T = 45, k = case_k, H = case_hidden;  // named copies: a lambda captures them
    const int64_t slots = T * k, blocks = (H + nodrop::kFp8Block - 1) / nodrop::kFp8Block;
    Bytes x = random_values(dtype, T * H, 53);
    set_value(x, dtype, 3 * H + H / 2, std::nanf(""));
    set_value(x, dtype, 7 * H + H - 1, INFINITY);
    for (int64_t i = 0; i < std::min<int64_t>(H, nodrop::kFp8Block); ++i) {
      set_value(x, dtype, 9 * H + i, 0.0f);
    }
    std::mt19937 rng(55);
    std::uniform_int_distribution<int32_t> expert(-1, int32_t(E));  // -1 and E: dropped
    std::vector<int32_t> ids(slots), row_map(slots), sizes(E);
    for (auto& id : ids) id = expert(rng);
    ASSERT_TRUE(nodrop::cpu::sort_by_expert(ids.data(), T, k, E, /*checked=*/false,
                                            row_map.data(), sizes.data())
                    .ok());
    const DeviceBuffer d_map = to_device(row_map);
    const float given_scales[] = {0.01f, std::nanf("")};
    const DeviceBuffer d_given(sizeof(given_scales), 0, given_scales);
    for (const int given : {-1, 0, 1}) {  // -1: each block's own scale
      const float* host_given = given < 0 ? nullptr : &given_scales[given];
      const float* device_given = given < 0 ? nullptr : d_given.as<float>() + given;
      Bytes want_rows(slots * H * bytes_of(dtype)), want_q(slots * H);
      Floats want_scale(slots * blocks);
      ASSERT_TRUE(nodrop::cpu::permute_rows_fp8(x.data(), dtype, row_map.data(), T, k, H,
                                                host_given, want_rows.data(), want_q.data(),
                                                want_scale.data())
                      .ok());
      for (const size_t shift : {size_t{0}, 2 * bytes_of(dtype)}) {
        const DeviceBuffer d_x = to_device(x, shift);
        const DeviceBuffer rows(want_rows.size()), q(slots * H),
            scale(slots * blocks * sizeof(float));
        run_twice(
            [&] {
              return nodrop::cuda::permute_rows_fp8(d_x.get(), dtype, d_map.as<int32_t>(), T, k,
                                                    H, device_given, rows.get(), q.as<uint8_t>(),
                                                    scale.as<float>(), stream());
            },
            {&rows, &q, &scale});
        const std::string where = "k " + std::to_string(k) + ", H " + std::to_string(H) +
                                  ", shift " + std::to_string(shift) + ", given " +
                                  std::to_string(given);
        EXPECT_EQ(mismatch(download<uint8_t>(rows), want_rows), "") << where;
        EXPECT_EQ(mismatch(download<uint8_t>(q), want_q), "") << where;
        EXPECT_EQ(mismatch(download<uint32_t>(scale), as_bits(want_scale)), "") << where;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PermuteRowsFp8Gpu,
                         testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         [](const auto& info) { return std::string(dtype_short(info.param)); });

TEST(PermuteRowsFp8GpuArgs, RejectsBadShapesAndDoesNothingWhenEmpty) {
  const DeviceBuffer buffer(1 << 12);
  EXPECT_NE(nodrop::cuda::permute_rows_fp8(buffer.get(), DType::kBFloat16, buffer.as<int32_t>(),
                                           4, -1, 8, nullptr, buffer.get(), buffer.as<uint8_t>(),
                                           buffer.as<float>(), stream())
                .message()
                .find("k = -1"),
            std::string::npos);
  EXPECT_NE(nodrop::cuda::permute_rows_fp8(buffer.get(), DType::kBFloat16, nullptr, 4, 2, 8,
                                           nullptr, buffer.get(), buffer.as<uint8_t>(),
                                           buffer.as<float>(), stream())
                .message()
                .find("a buffer is null"),
            std::string::npos);
  EXPECT_TRUE(nodrop::cuda::permute_rows_fp8(nullptr, DType::kBFloat16, nullptr, 0, 2, 8, nullptr,
                                             nullptr, nullptr, nullptr, stream())
                  .ok());
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

TEST(QuantizeFp8TransposedGpuArgs, RejectsBadShapesAndDoesNothingWhenEmpty) {
  const DeviceBuffer buffer(1 << 12);
  EXPECT_NE(nodrop::cuda::quantize_fp8_transposed(buffer.get(), DType::kFloat32,
                                                  buffer.as<int32_t>(), -1, 4, 1, nullptr,
                                                  buffer.as<uint8_t>(), buffer.as<float>(),
                                                  stream())
                .message()
                .find("M = -1"),
            std::string::npos);
  EXPECT_NE(nodrop::cuda::quantize_fp8_transposed(buffer.get(), static_cast<DType>(7),
                                                  buffer.as<int32_t>(), 4, 4, 1, nullptr,
                                                  buffer.as<uint8_t>(), buffer.as<float>(),
                                                  stream())
                .message()
                .find("unknown dtype 7"),
            std::string::npos);
  EXPECT_TRUE(nodrop::cuda::quantize_fp8_transposed(nullptr, DType::kFloat32, nullptr, 0, 4, 0,
                                                    nullptr, nullptr, nullptr, stream())
                  .ok());
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

TEST(QuantizeFp8GpuArgs, RejectsBadBlocksAndDoesNothingWhenEmpty) {
  const DeviceBuffer buffer(1 << 12);
  EXPECT_FALSE(nodrop::cuda::quantize_fp8(buffer.get(), DType::kFloat32, 4, 4, 0,
                                          buffer.as<uint8_t>(), buffer.as<float>(), stream())
                   .ok());
  EXPECT_TRUE(nodrop::cuda::quantize_fp8(nullptr, DType::kFloat32, 0, 4, 128, nullptr, nullptr,
                                         stream()).ok());
  CUDA_CHECK(cudaStreamSynchronize(stream()));
}

// The experts' weights quantised for the forward (transposed: quantize_fp8_weights_transposed,
// q_t [G, N, K], scale [G, NB, KB]) or the input gradient (in place: quantize_fp8_weights,
// q [G, K, N], scale [G, KB, NB]), `transposed` picking the function.
Status quantize_weights_gpu(bool transposed, const void* w, DType dtype, int64_t G, int64_t K,
                            int64_t N, const float* given_scale, uint8_t* q, float* scale) {
  return transposed ? nodrop::cuda::quantize_fp8_weights_transposed(w, dtype, G, K, N,
                                                                     given_scale, q, scale,
                                                                     stream())
                    : nodrop::cuda::quantize_fp8_weights(w, dtype, G, K, N, given_scale, q, scale,
                                                         stream());
}
Status quantize_weights_cpu(bool transposed, const void* w, DType dtype, int64_t G, int64_t K,
                            int64_t N, const float* given_scale, uint8_t* q, float* scale) {
  return transposed
             ? nodrop::cpu::quantize_fp8_weights_transposed(w, dtype, G, K, N, given_scale, q,
                                                            scale)
             : nodrop::cpu::quantize_fp8_weights(w, dtype, G, K, N, given_scale, q, scale);
}
const char* layout_short(bool transposed) { return transposed ? "transposed" : "in_place"; }

// (transposed, dtype).
class QuantizeFp8WeightsGpu : public testing::TestWithParam<std::tuple<bool, DType>> {};

// The weights' operands, bitwise the CPU engine's in either layout: a training-like expert pair
// (K = 512, N = 768: whole blocks, vector loads and stores), short edge blocks both ways
// (K = 300, N = 260: element loads and stores), edges of 8 (K = 136, N = 264: 16-byte loads;
// element stores transposed, 8-byte ones in place) and less than a block (K = 7, N = 5); with a
// zero block, a block of subnormals (a scale whose reciprocal is inf), a NaN in a short block, an
// inf in a narrow one, and columns of large and small magnitudes. w aligned and not (element
// loads), q aligned and not (element stores: q_t shifted by 8 bytes, in place q by 1); each
// block's own scale, and given per-expert ones (0.01, which saturates the large values; NaN for
// one expert; 0.125).
TEST_P(QuantizeFp8WeightsGpu, MatchesTheCpuBitwise) {
  const bool transposed = std::get<0>(GetParam());  // named: lambdas capture them
  const DType dtype = std::get<1>(GetParam());
  const std::tuple<int64_t, int64_t, int64_t> cases[] = {
      {2, 512, 768}, {3, 300, 260}, {2, 136, 264}, {1, 7, 5}};
  for (const auto& [case_experts, case_rows, case_columns] : cases) {
    const int64_t G = case_experts, K = case_rows, N = case_columns;  // named copies: lambdas
    const int64_t KB = (K + nodrop::kFp8Block - 1) / nodrop::kFp8Block;
    const int64_t NB = (N + nodrop::kFp8Block - 1) / nodrop::kFp8Block;
    Bytes w = random_values(dtype, G * K * N, 61);
    auto at = [&](int64_t g, int64_t k, int64_t n) { return (g * K + k) * N + n; };
    if (K >= 136 && N >= 136) {
      const int64_t last = G - 1;
      for (int64_t k = 0; k < 128; ++k) {
        for (int64_t n = 0; n < 128; ++n) set_value(w, dtype, at(last, k, n), 0.0f);
      }
      for (int64_t k = 128; k < std::min<int64_t>(K, 256); ++k) {
        for (int64_t n = 0; n < 128; ++n) {
          set_value(w, dtype, at(last, k, n), 1e-39f * float((k + n) % 7 - 3));
        }
      }
      set_value(w, dtype, at(0, K - 1, N - 1), std::nanf(""));  // the last, short block
      set_value(w, dtype, at(0, 3, N - 2), -INFINITY);
      const Floats large = random_floats(K, 63, -3e4f, 3e4f);
      const Floats small = random_floats(K, 64, -1e-4f, 1e-4f);
      for (int64_t k = 0; k < K; ++k) {
        set_value(w, dtype, at(0, k, 130), large[k]);
        set_value(w, dtype, at(last, k, 131), small[k]);
      }
    }
    const float per_expert[] = {0.01f, std::nanf(""), 0.125f};
    Floats given_scales(G);
    for (int64_t g = 0; g < G; ++g) given_scales[g] = per_expert[g % 3];
    const DeviceBuffer d_given = to_device(given_scales);
    for (const bool given : {false, true}) {
      Bytes want_q(G * K * N);
      Floats want_scale(G * KB * NB);
      ASSERT_TRUE(quantize_weights_cpu(transposed, w.data(), dtype, G, K, N,
                                       given ? given_scales.data() : nullptr, want_q.data(),
                                       want_scale.data())
                      .ok());
      // Aligned (the vector paths where the shape allows) and not: w shifted by two elements,
      // q below its vector stores' alignment.
      const size_t unaligned_q = transposed ? 8 : 1;
      for (const auto& [w_shift, q_shift] : {std::pair<size_t, size_t>{0, 0},
                                             {2 * bytes_of(dtype), 0}, {0, unaligned_q}}) {
        const DeviceBuffer d_w = to_device(w, w_shift);
        const DeviceBuffer q(G * K * N, q_shift), scale(G * KB * NB * sizeof(float));
        run_twice(
            [&] {
              return quantize_weights_gpu(transposed, d_w.get(), dtype, G, K, N,
                                          given ? d_given.as<float>() : nullptr, q.as<uint8_t>(),
                                          scale.as<float>());
            },
            {&q, &scale});
        const std::string where = std::string(layout_short(transposed)) + ", G " +
                                  std::to_string(G) + ", K " + std::to_string(K) + ", N " +
                                  std::to_string(N) + ", w shift " + std::to_string(w_shift) +
                                  ", q shift " + std::to_string(q_shift) +
                                  (given ? ", given" : "");
        EXPECT_EQ(mismatch(download<uint8_t>(q), want_q), "") << where;
        EXPECT_EQ(mismatch(download<uint32_t>(scale), as_bits(want_scale)), "") << where;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, QuantizeFp8WeightsGpu,
                         testing::Combine(testing::Bool(),
                                          testing::Values(DType::kFloat32, DType::kFloat16,
                                                          DType::kBFloat16)),
                         [](const auto& info) {
                           return std::string(layout_short(std::get<0>(info.param))) + "_" +
                                  dtype_short(std::get<1>(info.param));
                         });

class QuantizeFp8WeightsGpuArgs : public testing::TestWithParam<bool> {};  // transposed

TEST_P(QuantizeFp8WeightsGpuArgs, RejectsBadShapesAndDoesNothingWhenEmpty) {
  const bool transposed = GetParam();
  const std::string function =
      transposed ? "quantize_fp8_weights_transposed: " : "quantize_fp8_weights: ";
  const DeviceBuffer buffer(1 << 12), q(64), scale(64);
  const std::string negative =
      quantize_weights_gpu(transposed, buffer.get(), DType::kBFloat16, 2, -1, 8, nullptr,
                           q.as<uint8_t>(), scale.as<float>())
          .message();
  EXPECT_NE(negative.find(function + "G, K and N must not be negative"), std::string::npos)
      << negative;
  EXPECT_NE(negative.find("K = -1"), std::string::npos) << negative;
  const std::string null_buffer =
      quantize_weights_gpu(transposed, nullptr, DType::kBFloat16, 2, 8, 8, nullptr,
                           q.as<uint8_t>(), scale.as<float>())
          .message();
  EXPECT_NE(null_buffer.find(function + "a buffer is null"), std::string::npos) << null_buffer;
  // Nothing to do: no buffer needed, and none written.
  EXPECT_TRUE(
      quantize_weights_gpu(transposed, nullptr, DType::kBFloat16, 0, 8, 8, nullptr, nullptr,
                           nullptr)
          .ok());
  for (const auto& [G, K, N] : {std::tuple<int64_t, int64_t, int64_t>{0, 8, 8}, {2, 0, 8},
                                {2, 8, 0}}) {
    EXPECT_TRUE(quantize_weights_gpu(transposed, buffer.get(), DType::kBFloat16, G, K, N,
                                     buffer.as<float>(), q.as<uint8_t>(), scale.as<float>())
                    .ok())
        << G << " " << K << " " << N;
  }
  CUDA_CHECK(cudaStreamSynchronize(stream()));
  CUDA_CHECK(cudaGetLastError());
  EXPECT_EQ(q.download(), Bytes(64, 0xFF));
  EXPECT_EQ(scale.download(), Bytes(64, 0xFF));
}

INSTANTIATE_TEST_SUITE_P(Layouts, QuantizeFp8WeightsGpuArgs, testing::Bool(),
                         [](const auto& info) { return std::string(layout_short(info.param)); });

// ---- the AdamW step ----------------------------------------------------------------------------
// Parameters and moments bit for bit the CPU's (the same float32 operations, no FMA on either),
// NaN for NaN (the GPU's NaN has other bits than x86's); each chunk's sums to float32 rounding
// (another order), its non-finite counts exactly.

Floats any_nan_as_one(Floats v) {
  for (float& x : v) {
    if (std::isnan(x)) x = NAN;
  }
  return v;
}

std::string adamw_mismatch(const Floats& got, const Floats& want) {
  return mismatch(any_nan_as_one(got), any_nan_as_one(want));
}

struct AdamWCase {
  int64_t n;
  int64_t partials;
  size_t shift;         // bytes past a 256-byte boundary: 4 takes the element-access path
  float max_grad_norm;  // 0.25 clips (the norm is 0.5), 0 does not
  bool poison_inputs;   // a NaN gradient and an infinite parameter
  DType grad_dtype = DType::kFloat32;
};

std::string adamw_name(const testing::TestParamInfo<AdamWCase>& info) {
  const AdamWCase& c = info.param;
  return "n" + std::to_string(c.n) + "_p" + std::to_string(c.partials) + "_shift" +
         std::to_string(c.shift) + (c.max_grad_norm > 0 ? "_clip" : "") +
         (c.poison_inputs ? "_nonfinite" : "") +
         (c.grad_dtype != DType::kFloat32 ? std::string("_grad_") + dtype_short(c.grad_dtype) : "");
}

class AdamWGpu : public testing::TestWithParam<AdamWCase> {};

TEST_P(AdamWGpu, MatchesCpu) {
  const AdamWCase& c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(c.n * 31 + c.partials));
  auto random = [&](double lo, double hi) {
    Floats v(c.n);
    std::uniform_real_distribution<double> dist(lo, hi);
    for (float& x : v) x = static_cast<float>(dist(rng));
    return v;
  };
  Floats param = random(-1, 1), grad = random(-1e-3, 1e-3), mu = random(-1e-3, 1e-3),
         nu = random(0, 1e-6);
  if (c.poison_inputs && c.n > 3) {
    grad[1] = NAN;
    param[c.n - 2] = INFINITY;
  }
  // The gradient as the engine reads it (16-bit values for a 16-bit gradient), for both engines.
  Bytes grad_bytes(c.n * bytes_of(c.grad_dtype));
  for (int64_t i = 0; i < c.n; ++i) set_value(grad_bytes, c.grad_dtype, i, grad[i]);
  const Floats scalars = {-3e-4f, 0.5f, 0.271f, 0.142625f};
  nodrop::AdamWConfig config;
  config.num_elements = c.n;
  config.num_partials = c.partials;
  config.b1 = 0.9f;
  config.b2 = 0.95f;
  config.eps = 1e-8f;
  config.weight_decay = 0.1f;
  config.update_scale = 0.5f;
  config.max_grad_norm = c.max_grad_norm;

  Floats want_param(c.n), want_mu(c.n), want_nu(c.n), want_partials(c.partials * 5);
  ASSERT_TRUE(nodrop::cpu::adamw_update(param.data(), grad_bytes.data(), c.grad_dtype, mu.data(),
                                        nu.data(), scalars.data(), config, want_param.data(),
                                        want_mu.data(), want_nu.data(), want_partials.data())
                  .ok());

  const size_t bytes = c.n * sizeof(float);
  const DeviceBuffer d_param(bytes, c.shift, param.data()),
      d_grad(grad_bytes.size(), c.shift, grad_bytes.data()),
      d_mu(bytes, c.shift, mu.data()), d_nu(bytes, c.shift, nu.data()),
      d_scalars(4 * sizeof(float), 0, scalars.data()), out_param(bytes, c.shift),
      out_mu(bytes, c.shift), out_nu(bytes, c.shift),
      out_partials(c.partials * nodrop::kAdamWSums * sizeof(float));
  run_twice(
      [&] {
        return nodrop::cuda::adamw_update(d_param.as<float>(), d_grad.get(), c.grad_dtype,
                                          d_mu.as<float>(), d_nu.as<float>(),
                                          d_scalars.as<float>(), config, out_param.as<float>(),
                                          out_mu.as<float>(), out_nu.as<float>(),
                                          out_partials.as<float>(), stream());
      },
      {&out_param, &out_mu, &out_nu, &out_partials});
  EXPECT_EQ(adamw_mismatch(download<float>(out_param), want_param), "") << "param";
  EXPECT_EQ(adamw_mismatch(download<float>(out_mu), want_mu), "") << "mu";
  EXPECT_EQ(adamw_mismatch(download<float>(out_nu), want_nu), "") << "nu";
  const Floats partials = download<float>(out_partials);
  for (int64_t i = 0; i < c.partials * nodrop::kAdamWSums; ++i) {
    const float got = partials[i], want = want_partials[i];
    if (i % nodrop::kAdamWSums >= 3 || !std::isfinite(want)) {
      EXPECT_TRUE(got == want || (std::isnan(got) && std::isnan(want)))
          << "partials[" << i << "] = " << got << ", want " << want;
    } else {
      EXPECT_NEAR(got, want, 1e-5f * std::abs(want)) << "partials[" << i << "]";
    }
  }

  // In place (the trainer's donated state): the same bits.
  run_twice(
      [&] {
        d_param.upload(param.data());
        d_mu.upload(mu.data());
        d_nu.upload(nu.data());
        return nodrop::cuda::adamw_update(d_param.as<float>(), d_grad.get(), c.grad_dtype,
                                          d_mu.as<float>(), d_nu.as<float>(),
                                          d_scalars.as<float>(), config, d_param.as<float>(),
                                          d_mu.as<float>(), d_nu.as<float>(),
                                          out_partials.as<float>(), stream());
      },
      {&out_partials});
  EXPECT_EQ(adamw_mismatch(download<float>(d_param), want_param), "") << "param in place";
  EXPECT_EQ(adamw_mismatch(download<float>(d_mu), want_mu), "") << "mu in place";
  EXPECT_EQ(adamw_mismatch(download<float>(d_nu), want_nu), "") << "nu in place";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AdamWGpu,
    testing::Values(AdamWCase{0, 1, 0, 0.0f, false}, AdamWCase{1, 3, 0, 0.0f, false},
                    AdamWCase{5, 8, 0, 0.25f, false}, AdamWCase{1003, 7, 0, 0.0f, true},
                    AdamWCase{1003, 7, 4, 0.25f, true}, AdamWCase{196615, 13, 0, 0.25f, false},
                    AdamWCase{196615, 64, 4, 0.0f, true},
                    AdamWCase{(1 << 22) + 4, 512, 0, 0.0f, false},
                    // 16-bit gradients: 8-byte loads (shift 0), element loads (shift 4).
                    AdamWCase{1003, 7, 0, 0.25f, true, DType::kBFloat16},
                    AdamWCase{196615, 13, 4, 0.0f, true, DType::kBFloat16},
                    AdamWCase{196615, 64, 0, 0.0f, false, DType::kFloat16},
                    AdamWCase{(1 << 22) + 4, 512, 0, 0.25f, false, DType::kBFloat16}),
    adamw_name);

TEST(AdamWGpuArgs, RejectsABadConfigNamingTheField) {
  nodrop::AdamWConfig config;
  config.num_elements = 4;
  config.b2 = 1.0f;
  const Status status = nodrop::cuda::adamw_update(nullptr, nullptr, DType::kFloat32, nullptr,
                                                   nullptr, nullptr, config, nullptr, nullptr,
                                                   nullptr, nullptr, stream());
  EXPECT_NE(status.message().find("b2"), std::string::npos) << status.message();
  config.b2 = 0.95f;
  const Status bad_dtype = nodrop::cuda::adamw_update(
      nullptr, nullptr, static_cast<DType>(7), nullptr, nullptr, nullptr, config, nullptr,
      nullptr, nullptr, nullptr, stream());
  EXPECT_NE(bad_dtype.message().find("grad_dtype"), std::string::npos) << bad_dtype.message();
}

}  // namespace
