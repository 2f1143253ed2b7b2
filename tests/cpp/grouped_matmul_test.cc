// Tests of the dtype helpers, clamp_group_offsets, grouped_matmul and grouped_matmul_contract
// (serial and on a parallel runner) against naive double-precision loops.

#include <gtest/gtest.h>

#include <climits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "nodrop/engine_cpu.h"
#include "test_util.h"

namespace {

using nodrop::DType;
using nodrop::Status;
using nodrop_test::Array;
using nodrop_test::Fenced;
using nodrop_test::first_nonzero;
using nodrop_test::Guarded;
using nodrop_test::kAllDtypes;
using nodrop_test::mentions;
using nodrop_test::random_array;
using nodrop_test::rel_error;
using nodrop_test::short_name;
using nodrop_test::ThreadRunner;
using nodrop_test::tolerance;
using Sizes = std::vector<int32_t>;

// ---- naive references ------------------------------------------------------------------------

// The header's offset rule, written out independently of the engine.
std::vector<int64_t> naive_offsets(const Sizes& sizes, int64_t rows) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g)
    off[g + 1] = std::min<int64_t>(rows, off[g] + std::max<int32_t>(0, sizes[g]));
  return off;
}

// out[M, N]: lhs[rows_g] @ rhs[g] (rhs [G, K, N]) or @ rhs[g]^T (rhs [G, N, K]); other rows zero.
std::vector<double> naive_grouped_matmul(const Array& lhs, const Array& rhs, const Sizes& sizes,
                                         int64_t M, int64_t K, int64_t N, bool transpose_rhs) {
  const auto off = naive_offsets(sizes, M);
  std::vector<double> out(M * N, 0.0);
  for (size_t g = 0; g < sizes.size(); ++g)
    for (int64_t m = off[g]; m < off[g + 1]; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += lhs.at(m * K + k) *
                 (transpose_rhs ? rhs.at((g * N + n) * K + k) : rhs.at((g * K + k) * N + n));
        out[m * N + n] = acc;
      }
  return out;
}

// out[G, K, N]: out[g] = lhs[rows_g]^T @ rhs[rows_g].
std::vector<double> naive_contract(const Array& lhs, const Array& rhs, const Sizes& sizes,
                                   int64_t M, int64_t K, int64_t N) {
  const auto off = naive_offsets(sizes, M);
  const int64_t G = sizes.size();
  std::vector<double> out(G * K * N, 0.0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t m = off[g]; m < off[g + 1]; ++m) acc += lhs.at(m * K + k) * rhs.at(m * N + n);
        out[(g * K + k) * N + n] = acc;
      }
  return out;
}

// ---- shapes ----------------------------------------------------------------------------------

struct Shape {
  const char* name;
  int64_t M, K, N;
  Sizes sizes;
};

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> kShapes = {
      {"empty groups, rows past the last group", 37, 13, 7, {5, 0, 12, 9, 0}},
      {"odd K=7 and N=13", 29, 7, 13, {10, 0, 0, 19}},
      {"all rows in one group", 40, 16, 24, {0, 40, 0}},
      {"a single group", 23, 9, 5, {23}},
      {"a single row", 1, 5, 3, {0, 1}},
      {"larger than a kernel tile", 300, 130, 70, {100, 37, 0, 150}},
  };
  return kShapes;
}

// Sizes that are invalid: negative, or summing past M (= 20 here), including int32 overflow.
struct InvalidSizes {
  const char* name;
  Sizes sizes;
};
constexpr int64_t kInvalidM = 20;
const std::vector<InvalidSizes>& invalid_sizes() {
  static const std::vector<InvalidSizes> kCases = {
      {"negative size", {4, -3, 6}},
      {"total past M", {10, 9, 8}},
      {"last group runs past M", {5, 5, 100}},
      {"int32 max twice (overflows int32)", {3, INT32_MAX, INT32_MAX}},
      {"int32 min then past M", {INT32_MIN, 7, 30}},
      {"negative then past M", {-5, 25, 4}},
  };
  return kCases;
}

Status run_grouped_matmul(const void* lhs, const void* rhs, DType in, const int32_t* sizes,
                          int64_t M, int64_t K, int64_t N, int64_t G, bool transpose_rhs,
                          Array& out, bool checked, nodrop::ParallelRunner* runner = nullptr) {
  return nodrop::cpu::grouped_matmul(lhs, rhs, in, sizes, M, K, N, G, transpose_rhs, out.data(),
                                     out.dtype(), checked, runner);
}

// ---- dtype helpers ---------------------------------------------------------------------------

TEST(DTypeHelpers, SizesAndNamesFollowNumpy) {
  EXPECT_EQ(nodrop::dtype_size(DType::kFloat32), 4);
  EXPECT_EQ(nodrop::dtype_size(DType::kFloat16), 2);
  EXPECT_EQ(nodrop::dtype_size(DType::kBFloat16), 2);
  EXPECT_STREQ(nodrop::dtype_name(DType::kFloat32), "float32");
  EXPECT_STREQ(nodrop::dtype_name(DType::kFloat16), "float16");
  EXPECT_STREQ(nodrop::dtype_name(DType::kBFloat16), "bfloat16");
}

// ---- clamp_group_offsets -----------------------------------------------------------------------

std::vector<int64_t> clamp(const Sizes& sizes, int64_t rows, bool checked, Status* status) {
  Guarded<int64_t> off(sizes.size() + 1, -777);
  *status = nodrop::clamp_group_offsets(sizes.data(), sizes.size(), rows, checked, "my_sizes",
                                        off.data());
  EXPECT_TRUE(off.canaries_intact());
  return off.vec();
}

TEST(ClampGroupOffsets, ValidSizesGiveTheRunningSum) {
  for (bool checked : {false, true}) {
    Status s = Status::Ok();
    EXPECT_EQ(clamp({3, 0, 5, 2}, 10, checked, &s), (std::vector<int64_t>{0, 3, 3, 8, 10}));
    EXPECT_TRUE(s.ok()) << s.message();
    // A total below `rows` is valid: the remaining rows are simply in no group.
    EXPECT_EQ(clamp({1, 2}, 10, checked, &s), (std::vector<int64_t>{0, 1, 3}));
    EXPECT_TRUE(s.ok()) << s.message();
  }
}

TEST(ClampGroupOffsets, NoGroupsGiveTheSingleOffsetZero) {
  Status s = Status::Ok();
  EXPECT_EQ(clamp({}, 10, true, &s), (std::vector<int64_t>{0}));
  EXPECT_TRUE(s.ok()) << s.message();
}

TEST(ClampGroupOffsets, UncheckedCountsNegativeSizesAsZero) {
  Status s = Status::Ok();
  EXPECT_EQ(clamp({4, -3, 6, INT32_MIN, 1}, 20, false, &s),
            (std::vector<int64_t>{0, 4, 4, 10, 10, 11}));
  EXPECT_TRUE(s.ok()) << s.message();
}

TEST(ClampGroupOffsets, UncheckedClampsTheTotalAtRows) {
  Status s = Status::Ok();
  EXPECT_EQ(clamp({10, 9, 8, 1}, 20, false, &s), (std::vector<int64_t>{0, 10, 19, 20, 20}));
  EXPECT_TRUE(s.ok()) << s.message();
  // A running total past INT32_MAX must not wrap around to a small or negative offset.
  EXPECT_EQ(clamp({3, INT32_MAX, INT32_MAX, 2}, 20, false, &s),
            (std::vector<int64_t>{0, 3, 20, 20, 20}));
  EXPECT_EQ(clamp({5}, 0, false, &s), (std::vector<int64_t>{0, 0}));
}

TEST(ClampGroupOffsets, CheckedRejectsANegativeSizeNamingTheArgument) {
  Status s = Status::Ok();
  clamp({4, -3, 6}, 20, true, &s);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(mentions(s, "my_sizes")) << s.message();
}

TEST(ClampGroupOffsets, CheckedRejectsATotalPastRowsNamingTheArgument) {
  for (const Sizes& sizes : {Sizes{10, 9, 8}, Sizes{3, INT32_MAX, INT32_MAX}, Sizes{21}}) {
    Status s = Status::Ok();
    clamp(sizes, 20, true, &s);
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(mentions(s, "my_sizes")) << s.message();
  }
}

// ---- grouped_matmul: values, every dtype pair, both layouts ----------------------------------

using MatmulParam = std::tuple<DType, DType, bool>;  // in dtype, out dtype, transpose_rhs

class GroupedMatmulDtypes : public testing::TestWithParam<MatmulParam> {};

TEST_P(GroupedMatmulDtypes, MatchesNaiveReferenceAndZeroesUncoveredRows) {
  const auto [in, out_dtype, transpose] = GetParam();
  std::mt19937 rng(1234);
  for (const Shape& sh : shapes()) {
    SCOPED_TRACE(sh.name);
    const int64_t G = sh.sizes.size();
    const Array lhs = random_array(in, sh.M * sh.K, rng);
    const Array rhs = random_array(in, G * sh.K * sh.N, rng);
    Array out(out_dtype, sh.M * sh.N);  // NaN-poisoned
    const Status s = run_grouped_matmul(lhs.data(), rhs.data(), in, sh.sizes.data(), sh.M, sh.K,
                                        sh.N, G, transpose, out, /*checked=*/false);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(out.canaries_intact());
    const auto want = naive_grouped_matmul(lhs, rhs, sh.sizes, sh.M, sh.K, sh.N, transpose);
    const auto got = out.values();
    EXPECT_LE(rel_error(got, want), tolerance(in, out_dtype));
    const int64_t covered = naive_offsets(sh.sizes, sh.M).back();
    EXPECT_EQ(first_nonzero(got, covered * sh.N, sh.M * sh.N), -1) << "rows past the groups";
  }
}

std::vector<MatmulParam> all_matmul_params() {
  std::vector<MatmulParam> params;
  for (DType in : kAllDtypes)
    for (DType out : kAllDtypes)
      for (bool transpose : {false, true}) params.emplace_back(in, out, transpose);
  return params;
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypes, GroupedMatmulDtypes, testing::ValuesIn(all_matmul_params()),
    [](const testing::TestParamInfo<MatmulParam>& info) {
      return std::string(short_name(std::get<0>(info.param))) + "_to_" +
             short_name(std::get<1>(info.param)) + (std::get<2>(info.param) ? "_rhsT" : "");
    });

// ---- grouped_matmul: edge cases ----------------------------------------------------------------

TEST(GroupedMatmul, NoGroupsGiveAllZeroRows) {
  // G = 0: rhs [0, K, N] and group_sizes [0] are empty, so every output row is uncovered.
  const int64_t M = 5, K = 3, N = 4;
  std::mt19937 rng(7);
  const Array lhs = random_array(DType::kFloat32, M * K, rng);
  const Array rhs(DType::kFloat32, 0);
  for (bool checked : {false, true}) {
    for (bool transpose : {false, true}) {
      Array out(DType::kFloat32, M * N);
      const Status s = run_grouped_matmul(lhs.data(), rhs.data(), DType::kFloat32, nullptr, M, K,
                                          N, 0, transpose, out, checked);
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_TRUE(out.canaries_intact());
      EXPECT_EQ(first_nonzero(out.values(), 0, M * N), -1);
    }
  }
}

TEST(GroupedMatmul, NoRowsIsANoOp) {
  // M = 0 with groups of size zero: nothing to compute, nothing written.
  const int64_t K = 3, N = 4, G = 3;
  const Sizes sizes = {0, 0, 0};
  std::mt19937 rng(8);
  const Array lhs(DType::kBFloat16, 0);
  const Array rhs = random_array(DType::kBFloat16, G * K * N, rng);
  for (bool checked : {false, true}) {
    Array out(DType::kBFloat16, 0);
    const Status s = run_grouped_matmul(lhs.data(), rhs.data(), DType::kBFloat16, sizes.data(), 0,
                                        K, N, G, false, out, checked);
    EXPECT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(out.canaries_intact());
  }
}

TEST(GroupedMatmul, UncheckedInvalidSizesAreClampedWithoutTouchingMemoryOutsideBuffers) {
  const int64_t M = kInvalidM, K = 13, N = 7;
  std::mt19937 rng(9);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const InvalidSizes& c : invalid_sizes()) {
      for (bool transpose : {false, true}) {
        SCOPED_TRACE(std::string(c.name) + (transpose ? " rhsT " : " ") + short_name(dtype));
        const int64_t G = c.sizes.size();
        const Array lhs = random_array(dtype, M * K, rng);
        const Array rhs = random_array(dtype, G * K * N, rng);
        // Inputs end right before an inaccessible page: a read past M rows or G groups crashes.
        const Fenced lhs_f(lhs), rhs_f(rhs), sizes_f(c.sizes);
        Array out(dtype, M * N);
        const Status s = run_grouped_matmul(lhs_f.data(), rhs_f.data(), dtype,
                                            sizes_f.as<int32_t>(), M, K, N, G, transpose, out,
                                            /*checked=*/false);
        ASSERT_TRUE(s.ok()) << s.message();
        EXPECT_TRUE(out.canaries_intact());
        const auto got = out.values();
        EXPECT_LE(rel_error(got, naive_grouped_matmul(lhs, rhs, c.sizes, M, K, N, transpose)),
                  tolerance(dtype, dtype));
        const int64_t covered = naive_offsets(c.sizes, M).back();
        EXPECT_EQ(first_nonzero(got, covered * N, M * N), -1) << "rows past the clamped total";
      }
    }
  }
}

TEST(GroupedMatmul, CheckedRejectsInvalidSizesNamingGroupSizes) {
  const int64_t M = kInvalidM, K = 5, N = 3;
  std::mt19937 rng(10);
  for (const InvalidSizes& c : invalid_sizes()) {
    SCOPED_TRACE(c.name);
    const int64_t G = c.sizes.size();
    const Array lhs = random_array(DType::kFloat32, M * K, rng);
    const Array rhs = random_array(DType::kFloat32, G * K * N, rng);
    Array out(DType::kFloat32, M * N);
    const Status s = run_grouped_matmul(lhs.data(), rhs.data(), DType::kFloat32, c.sizes.data(),
                                        M, K, N, G, false, out, /*checked=*/true);
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(mentions(s, "group_sizes")) << s.message();
    EXPECT_TRUE(out.canaries_intact());
  }
}

TEST(GroupedMatmul, CheckedAcceptsValidSizesAndGivesTheSameResult) {
  // Sizes that sum to M, and to less than M, are valid in checked mode.
  const int64_t M = 30, K = 11, N = 6;
  std::mt19937 rng(11);
  for (const Sizes& sizes : {Sizes{10, 0, 20}, Sizes{3, 4, 0}}) {
    const int64_t G = sizes.size();
    const Array lhs = random_array(DType::kFloat32, M * K, rng);
    const Array rhs = random_array(DType::kFloat32, G * K * N, rng);
    Array out(DType::kFloat32, M * N);
    const Status s = run_grouped_matmul(lhs.data(), rhs.data(), DType::kFloat32, sizes.data(), M,
                                        K, N, G, false, out, /*checked=*/true);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_LE(rel_error(out.values(), naive_grouped_matmul(lhs, rhs, sizes, M, K, N, false)),
              1e-5);
  }
}

TEST(GroupedMatmul, TwoCallsGiveBitwiseIdenticalOutputs) {
  const int64_t M = 300, K = 130, N = 70;
  const Sizes sizes = {100, 37, 0, 150};
  const int64_t G = sizes.size();
  std::mt19937 rng(12);
  for (DType dtype : kAllDtypes) {
    for (bool transpose : {false, true}) {
      const Array lhs = random_array(dtype, M * K, rng);
      const Array rhs = random_array(dtype, G * K * N, rng);
      Array a(dtype, M * N), b(dtype, M * N);
      ASSERT_TRUE(run_grouped_matmul(lhs.data(), rhs.data(), dtype, sizes.data(), M, K, N, G,
                                     transpose, a, false).ok());
      ASSERT_TRUE(run_grouped_matmul(lhs.data(), rhs.data(), dtype, sizes.data(), M, K, N, G,
                                     transpose, b, false).ok());
      EXPECT_EQ(a.raw(), b.raw()) << short_name(dtype) << (transpose ? " rhsT" : "");
    }
  }
}

TEST(GroupedMatmul, ParallelRunnerMatchesReferenceAndRepeatsBitwise) {
  // Big enough that the engine cuts the groups into blocks for the runner's workers.
  const int64_t M = 300, K = 130, N = 70;
  const Sizes sizes = {100, 37, 0, 150};
  const int64_t G = sizes.size();
  std::mt19937 rng(18);
  for (DType dtype : kAllDtypes) {
    for (bool transpose : {false, true}) {
      SCOPED_TRACE(std::string(short_name(dtype)) + (transpose ? " rhsT" : ""));
      const Array lhs = random_array(dtype, M * K, rng);
      const Array rhs = random_array(dtype, G * K * N, rng);
      ThreadRunner runner(4);
      Array a(dtype, M * N), b(dtype, M * N);
      ASSERT_TRUE(run_grouped_matmul(lhs.data(), rhs.data(), dtype, sizes.data(), M, K, N, G,
                                     transpose, a, false, &runner).ok());
      ASSERT_TRUE(run_grouped_matmul(lhs.data(), rhs.data(), dtype, sizes.data(), M, K, N, G,
                                     transpose, b, false, &runner).ok());
      EXPECT_GT(runner.calls(), 0) << "shape too small to exercise the runner";
      EXPECT_TRUE(a.canaries_intact());
      const auto got = a.values();
      EXPECT_LE(rel_error(got, naive_grouped_matmul(lhs, rhs, sizes, M, K, N, transpose)),
                tolerance(dtype, dtype));
      EXPECT_EQ(first_nonzero(got, 287 * N, M * N), -1) << "rows past the groups";
      EXPECT_EQ(a.raw(), b.raw());
    }
  }
}

// ---- grouped_matmul_contract -------------------------------------------------------------------

Status run_contract(const void* lhs, const void* rhs, DType in, const int32_t* sizes, int64_t M,
                    int64_t K, int64_t N, int64_t G, Array& out, bool checked,
                    nodrop::ParallelRunner* runner = nullptr) {
  return nodrop::cpu::grouped_matmul_contract(lhs, rhs, in, sizes, M, K, N, G, out.data(),
                                              out.dtype(), checked, runner);
}

using ContractParam = std::tuple<DType, DType>;  // in dtype, out dtype

class GroupedMatmulContractDtypes : public testing::TestWithParam<ContractParam> {};

TEST_P(GroupedMatmulContractDtypes, MatchesNaiveReferenceAndZeroesEmptyGroups) {
  const auto [in, out_dtype] = GetParam();
  std::mt19937 rng(2345);
  for (const Shape& sh : shapes()) {
    SCOPED_TRACE(sh.name);
    const int64_t G = sh.sizes.size();
    const Array lhs = random_array(in, sh.M * sh.K, rng);
    const Array rhs = random_array(in, sh.M * sh.N, rng);
    Array out(out_dtype, G * sh.K * sh.N);
    const Status s = run_contract(lhs.data(), rhs.data(), in, sh.sizes.data(), sh.M, sh.K, sh.N,
                                  G, out, /*checked=*/false);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(out.canaries_intact());
    const auto got = out.values();
    EXPECT_LE(rel_error(got, naive_contract(lhs, rhs, sh.sizes, sh.M, sh.K, sh.N)),
              tolerance(in, out_dtype));
    const int64_t KN = sh.K * sh.N;
    for (int64_t g = 0; g < G; ++g)
      if (sh.sizes[g] == 0)
        EXPECT_EQ(first_nonzero(got, g * KN, (g + 1) * KN), -1) << "empty group " << g;
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypes, GroupedMatmulContractDtypes,
    testing::Combine(testing::ValuesIn(kAllDtypes), testing::ValuesIn(kAllDtypes)),
    [](const testing::TestParamInfo<ContractParam>& info) {
      return std::string(short_name(std::get<0>(info.param))) + "_to_" +
             short_name(std::get<1>(info.param));
    });

TEST(GroupedMatmulContract, NoRowsGiveZeroForEveryGroup) {
  // M = 0: every group is empty (a K = 0 GEMM for the library underneath); out must still be 0.
  const int64_t K = 6, N = 5, G = 3;
  const Sizes sizes = {0, 0, 0};
  for (DType dtype : kAllDtypes) {
    const Array lhs(dtype, 0), rhs(dtype, 0);
    Array out(dtype, G * K * N);
    const Status s = run_contract(lhs.data(), rhs.data(), dtype, sizes.data(), 0, K, N, G, out,
                                  /*checked=*/true);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(out.canaries_intact());
    EXPECT_EQ(first_nonzero(out.values(), 0, G * K * N), -1) << short_name(dtype);
  }
}

TEST(GroupedMatmulContract, AllGroupsEmptyGiveZerosEvenWithRows) {
  const int64_t M = 9, K = 4, N = 3, G = 2;
  const Sizes sizes = {0, 0};
  std::mt19937 rng(13);
  const Array lhs = random_array(DType::kFloat32, M * K, rng);
  const Array rhs = random_array(DType::kFloat32, M * N, rng);
  Array out(DType::kFloat32, G * K * N);
  ASSERT_TRUE(run_contract(lhs.data(), rhs.data(), DType::kFloat32, sizes.data(), M, K, N, G, out,
                           false).ok());
  EXPECT_EQ(first_nonzero(out.values(), 0, G * K * N), -1);
}

TEST(GroupedMatmulContract, NoGroupsIsANoOp) {
  const int64_t M = 4, K = 3, N = 2;
  std::mt19937 rng(14);
  const Array lhs = random_array(DType::kFloat32, M * K, rng);
  const Array rhs = random_array(DType::kFloat32, M * N, rng);
  for (bool checked : {false, true}) {
    Array out(DType::kFloat32, 0);
    const Status s =
        run_contract(lhs.data(), rhs.data(), DType::kFloat32, nullptr, M, K, N, 0, out, checked);
    EXPECT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(out.canaries_intact());
  }
}

TEST(GroupedMatmulContract, UncheckedInvalidSizesAreClampedWithoutTouchingMemoryOutsideBuffers) {
  const int64_t M = kInvalidM, K = 7, N = 13;
  std::mt19937 rng(15);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const InvalidSizes& c : invalid_sizes()) {
      SCOPED_TRACE(std::string(c.name) + " " + short_name(dtype));
      const int64_t G = c.sizes.size();
      const Array lhs = random_array(dtype, M * K, rng);
      const Array rhs = random_array(dtype, M * N, rng);
      const Fenced lhs_f(lhs), rhs_f(rhs), sizes_f(c.sizes);
      Array out(dtype, G * K * N);
      const Status s = run_contract(lhs_f.data(), rhs_f.data(), dtype, sizes_f.as<int32_t>(), M,
                                    K, N, G, out, /*checked=*/false);
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_TRUE(out.canaries_intact());
      EXPECT_LE(rel_error(out.values(), naive_contract(lhs, rhs, c.sizes, M, K, N)),
                tolerance(dtype, dtype));
    }
  }
}

TEST(GroupedMatmulContract, CheckedRejectsInvalidSizesNamingGroupSizes) {
  const int64_t M = kInvalidM, K = 5, N = 3;
  std::mt19937 rng(16);
  for (const InvalidSizes& c : invalid_sizes()) {
    SCOPED_TRACE(c.name);
    const int64_t G = c.sizes.size();
    const Array lhs = random_array(DType::kFloat32, M * K, rng);
    const Array rhs = random_array(DType::kFloat32, M * N, rng);
    Array out(DType::kFloat32, G * K * N);
    const Status s = run_contract(lhs.data(), rhs.data(), DType::kFloat32, c.sizes.data(), M, K,
                                  N, G, out, /*checked=*/true);
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(mentions(s, "group_sizes")) << s.message();
    EXPECT_TRUE(out.canaries_intact());
  }
}

TEST(GroupedMatmulContract, TwoCallsGiveBitwiseIdenticalOutputs) {
  const int64_t M = 300, K = 70, N = 50;
  const Sizes sizes = {100, 37, 0, 150};
  const int64_t G = sizes.size();
  std::mt19937 rng(17);
  for (DType dtype : kAllDtypes) {
    const Array lhs = random_array(dtype, M * K, rng);
    const Array rhs = random_array(dtype, M * N, rng);
    Array a(dtype, G * K * N), b(dtype, G * K * N);
    ASSERT_TRUE(run_contract(lhs.data(), rhs.data(), dtype, sizes.data(), M, K, N, G, a, false).ok());
    ASSERT_TRUE(run_contract(lhs.data(), rhs.data(), dtype, sizes.data(), M, K, N, G, b, false).ok());
    EXPECT_EQ(a.raw(), b.raw()) << short_name(dtype);
  }
}

TEST(GroupedMatmulContract, ParallelRunnerMatchesReferenceAndRepeatsBitwise) {
  // K = 130 rows of output per group: enough for the engine to split each group into blocks.
  const int64_t M = 300, K = 130, N = 50;
  const Sizes sizes = {100, 37, 0, 150};
  const int64_t G = sizes.size();
  std::mt19937 rng(19);
  for (DType dtype : kAllDtypes) {
    SCOPED_TRACE(short_name(dtype));
    const Array lhs = random_array(dtype, M * K, rng);
    const Array rhs = random_array(dtype, M * N, rng);
    ThreadRunner runner(4);
    Array a(dtype, G * K * N), b(dtype, G * K * N);
    ASSERT_TRUE(run_contract(lhs.data(), rhs.data(), dtype, sizes.data(), M, K, N, G, a, false,
                             &runner).ok());
    ASSERT_TRUE(run_contract(lhs.data(), rhs.data(), dtype, sizes.data(), M, K, N, G, b, false,
                             &runner).ok());
    EXPECT_GT(runner.calls(), 0) << "shape too small to exercise the runner";
    EXPECT_TRUE(a.canaries_intact());
    const auto got = a.values();
    EXPECT_LE(rel_error(got, naive_contract(lhs, rhs, sizes, M, K, N)), tolerance(dtype, dtype));
    EXPECT_EQ(first_nonzero(got, 2 * K * N, 3 * K * N), -1) << "empty group 2";
    EXPECT_EQ(a.raw(), b.raw());
  }
}

}  // namespace
