// Tests of the CPU grouped_matmul_fp8_blockwise (the forward), grouped_matmul_fp8_tensorwise
// (the forward with one scale per tensor), grouped_matmul_fp8_blockwise_contract (the weight
// gradient) and grouped_matmul_fp8_tensorwise_contract (the weight gradient with one scale per
// tensor) against float64 dequantise-then-matmul references: uneven, empty and invalid groups,
// K and N that are not multiples of 128, threads, and the argument errors the GPU engine gives
// too.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "nodrop/engine_cpu.h"
#include "test_util.h"

namespace {

using nodrop_test::bf16_to_float;
using nodrop_test::Fenced;
using nodrop_test::Guarded;
using nodrop_test::mentions;
using nodrop_test::ThreadRunner;

constexpr int64_t kBlock = 128;

double e4m3_value(uint8_t code) {  // independent of the engine's decoder
  const int exponent = (code >> 3) & 15, mantissa = code & 7;
  const double sign = code & 0x80 ? -1.0 : 1.0;
  if (exponent == 0) return sign * std::ldexp(mantissa / 8.0, -6);
  return sign * std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
}

struct Problem {
  int64_t M, K, N;
  std::vector<int32_t> sizes;
  int64_t G() const { return static_cast<int64_t>(sizes.size()); }
  int64_t KB() const { return (K + kBlock - 1) / kBlock; }
  int64_t NB() const { return (N + kBlock - 1) / kBlock; }
};

struct Operands {
  std::vector<uint8_t> lhs, rhs;
  std::vector<float> lhs_scales, rhs_scales;
};

// Finite E4M3 codes (any but 0x7f and 0xff) and positive scales over a few binades.
struct RandomFp8 {
  explicit RandomFp8(uint32_t seed) : rng(seed) {}
  std::vector<uint8_t> codes(int64_t n) {
    std::uniform_int_distribution<int> code(0, 255);
    std::vector<uint8_t> out(n);
    for (auto& c : out) c = static_cast<uint8_t>(code(rng));
    for (auto& c : out) if ((c & 0x7f) == 0x7f) c ^= 1;  // no NaN codes
    return out;
  }
  std::vector<float> scales(int64_t n) {
    std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
    std::uniform_int_distribution<int> exponent(-12, -4);
    std::vector<float> out(n);
    for (auto& s : out) s = std::ldexp(mantissa(rng), exponent(rng));
    return out;
  }
  std::mt19937 rng;
};

Operands random_operands(const Problem& p, uint32_t seed) {
  RandomFp8 random(seed);
  return {random.codes(p.M * p.K), random.codes(p.G() * p.N * p.K),
          random.scales(p.M * p.KB()), random.scales(p.G() * p.NB() * p.KB())};
}

// The tensorwise operands: the same codes, lhs_scales [1] and rhs_scales [G].
Operands random_tensorwise_operands(const Problem& p, uint32_t seed) {
  RandomFp8 random(seed);
  return {random.codes(p.M * p.K), random.codes(p.G() * p.N * p.K), random.scales(1),
          random.scales(p.G())};
}

// Both forwards take the same arguments; only the scales' layouts differ.
using Forward = decltype(&nodrop::cpu::grouped_matmul_fp8_blockwise);

std::vector<uint16_t> run(Forward forward, const Problem& p, const Operands& o,
                          nodrop::ParallelRunner* runner, bool checked = false,
                          nodrop::Status* status = nullptr) {
  std::vector<uint16_t> out(p.M * p.N, 0xffff);  // NaN: every element must be written
  const auto s = forward(o.lhs.data(), o.lhs_scales.data(), o.rhs.data(), o.rhs_scales.data(),
                         p.sizes.data(), p.M, p.K, p.N, p.G(), out.data(), checked, runner);
  if (status) *status = s;
  else EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

std::vector<uint16_t> run(const Problem& p, const Operands& o, nodrop::ParallelRunner* runner,
                          bool checked = false, nodrop::Status* status = nullptr) {
  return run(nodrop::cpu::grouped_matmul_fp8_blockwise, p, o, runner, checked, status);
}

// The scale of lhs[m, k] times that of rhs[g, n, k], per recipe.
double blockwise_scale(const Problem& p, const Operands& o, int64_t m, int64_t g, int64_t n,
                       int64_t k) {
  return static_cast<double>(o.lhs_scales[m * p.KB() + k / kBlock]) *
         o.rhs_scales[(g * p.NB() + n / kBlock) * p.KB() + k / kBlock];
}

double tensorwise_scale(const Problem&, const Operands& o, int64_t, int64_t g, int64_t,
                        int64_t) {
  return static_cast<double>(o.lhs_scales[0]) * o.rhs_scales[g];
}

using Scale = decltype(&blockwise_scale);

// Each row's group (clamped), -1 past the groups.
std::vector<int64_t> groups_of_rows(const Problem& p) {
  int64_t begin = 0;
  std::vector<int64_t> group_of_row(p.M, -1);
  for (int64_t g = 0; g < p.G(); ++g) {
    const int64_t end = std::min<int64_t>(p.M, begin + std::max<int32_t>(p.sizes[g], 0));
    for (int64_t m = begin; m < end; ++m) group_of_row[m] = g;
    begin = end;
  }
  return group_of_row;
}

// out[m, n] of row m in group g against the dequantised operands in float64: the value and the
// sum of its terms' magnitudes (which bounds float32 summation error).
std::pair<double, double> reference(const Problem& p, const Operands& o, Scale scale, int64_t m,
                                    int64_t g, int64_t n) {
  double want = 0.0, magnitude = 0.0;
  for (int64_t k = 0; k < p.K; ++k) {
    const double term = e4m3_value(o.lhs[m * p.K + k]) *
                        e4m3_value(o.rhs[(g * p.N + n) * p.K + k]) * scale(p, o, m, g, n, k);
    want += term;
    magnitude += std::fabs(term);
  }
  return {want, magnitude};
}

// Each group's rows against the reference; rows past the (clamped) groups zero. The tolerance
// is bfloat16's rounding plus float32 summation error.
void expect_matches_reference(const Problem& p, const Operands& o,
                              const std::vector<uint16_t>& out, Scale scale = blockwise_scale) {
  const std::vector<int64_t> group_of_row = groups_of_rows(p);
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t n = 0; n < p.N; ++n) {
      const float got = bf16_to_float(out[m * p.N + n]);
      const int64_t g = group_of_row[m];
      if (g < 0) {
        ASSERT_EQ(got, 0.0f) << "row " << m << " past the groups";
        continue;
      }
      const auto [want, magnitude] = reference(p, o, scale, m, g, n);
      ASSERT_NEAR(got, want, std::fabs(want) / 256 + magnitude * 1e-6)
          << "row " << m << ", column " << n << ", group " << g;
    }
  }
}

// Uneven, empty, clamped and missing groups; K and N off whole 128-blocks.
const auto kShapes = testing::Values(
    Problem{37, 272, 200, {5, 0, 20, 7}},       // uneven and empty groups, rows past them;
                                                // K and N past whole blocks
    Problem{64, 128, 136, {0, 64, 0}},          // every row in one group
    Problem{20, 16, 8, {-3, 10, 100}},          // negative and overlong sizes are clamped
    Problem{300, 256, 256, {129, 1, 127, 43}},  // groups across row blocks
    Problem{9, 0, 8, {4, 5}},                   // nothing to contract: zeros
    Problem{0, 32, 8, {0, 0}},                  // no rows
    Problem{6, 32, 8, {}});                     // no groups: every row past them

class Fp8Blockwise : public testing::TestWithParam<Problem> {};

TEST_P(Fp8Blockwise, MatchesTheDequantisedReference) {
  const Problem& p = GetParam();
  const Operands o = random_operands(p, 7);
  const auto serial = run(p, o, nullptr);
  expect_matches_reference(p, o, serial);
  ThreadRunner runner(3);
  EXPECT_EQ(run(p, o, &runner), serial);  // threads change nothing
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8Blockwise, kShapes);

TEST(Fp8BlockwiseArgs, CheckedModeRefusesInvalidGroupSizes) {
  const Problem p{20, 16, 8, {-3, 10, 100}};
  const Operands o = random_operands(p, 1);
  nodrop::Status status = nodrop::Status::Ok();
  run(p, o, nullptr, /*checked=*/true, &status);
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(mentions(status, "group_sizes[0] = -3")) << status.message();
  const Problem over{20, 16, 8, {10, 100}};
  run(over, random_operands(over, 1), nullptr, true, &status);
  EXPECT_TRUE(mentions(status, "group_sizes sum to 110")) << status.message();
}

TEST(Fp8BlockwiseArgs, RejectsWhatTheGpuRejects) {
  const Problem p{4, 256, 16, {4}};
  const Operands o = random_operands(p, 2);
  std::vector<uint16_t> out(p.M * p.N);
  auto call = [&](int64_t M, int64_t K, int64_t N, const void* lhs) {
    return nodrop::cpu::grouped_matmul_fp8_blockwise(lhs, o.lhs_scales.data(), o.rhs.data(),
                                                     o.rhs_scales.data(), p.sizes.data(), M, K, N,
                                                     1, out.data(), false);
  };
  auto status = call(4, 24, 16, o.lhs.data());
  EXPECT_TRUE(mentions(status, "K = 24 must be a multiple of 16")) << status.message();
  status = call(4, 256, 12, o.lhs.data());
  EXPECT_TRUE(mentions(status, "N = 12 must be a multiple of 8")) << status.message();
  status = call(-1, 256, 16, o.lhs.data());
  EXPECT_TRUE(mentions(status, "M = -1 is negative")) << status.message();
  status = call(4, 256, 16, nullptr);
  EXPECT_TRUE(mentions(status, "lhs is null")) << status.message();
  EXPECT_TRUE(mentions(status, "grouped_matmul_fp8_blockwise")) << status.message();
}

TEST(Fp8BlockwiseNumerics, ScalesMultiplyEachKBlocksPartialSum) {
  // K = 256: ones everywhere, with different scales per k block, so the result is
  // 128 * (l0 * r0) + 128 * (l1 * r1) exactly.
  const Problem p{1, 256, 8, {1}};
  Operands o{std::vector<uint8_t>(256, 0x38), std::vector<uint8_t>(8 * 256, 0x38),  // 0x38 = 1.0
             {0.5f, 2.0f}, {0.25f, 4.0f}};
  const auto out = run(p, o, nullptr);
  for (int64_t n = 0; n < 8; ++n) EXPECT_EQ(bf16_to_float(out[n]), 128 * 0.125f + 128 * 8.0f);
  o.lhs_scales[1] = std::nanf("");  // a non-finite block stays visible in its row
  EXPECT_TRUE(std::isnan(bf16_to_float(run(p, o, nullptr)[0])));
}

// ---- grouped_matmul_fp8_tensorwise ----------------------------------------------------------

class Fp8Tensorwise : public testing::TestWithParam<Problem> {};

TEST_P(Fp8Tensorwise, MatchesTheDequantisedReference) {
  const Problem& p = GetParam();
  const Operands o = random_tensorwise_operands(p, 7);
  const auto serial = run(nodrop::cpu::grouped_matmul_fp8_tensorwise, p, o, nullptr);
  expect_matches_reference(p, o, serial, tensorwise_scale);
  ThreadRunner runner(3);
  EXPECT_EQ(run(nodrop::cpu::grouped_matmul_fp8_tensorwise, p, o, &runner), serial);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8Tensorwise, kShapes);

// The tensorwise scales repeated over every block of the blockwise op's scale arrays: the same
// products. Within one 128-block (K <= 128) both compute the same float32 dot times the same
// scale product, bitwise; past it the blockwise op scales each block's sum before adding, so
// they differ by float32 summation order (and the bfloat16 rounding that may flip).
TEST(Fp8TensorwiseNumerics, IsTheBlockwiseOpOnRepeatedScales) {
  for (const Problem& p : {Problem{37, 128, 200, {5, 0, 20, 7}}, Problem{20, 16, 8, {-3, 10, 100}},
                           Problem{37, 272, 200, {5, 0, 20, 7}}}) {
    const Operands tensorwise = random_tensorwise_operands(p, 3);
    Operands blockwise = tensorwise;
    blockwise.lhs_scales.assign(p.M * p.KB(), tensorwise.lhs_scales[0]);
    blockwise.rhs_scales.resize(p.G() * p.NB() * p.KB());
    for (int64_t i = 0; i < static_cast<int64_t>(blockwise.rhs_scales.size()); ++i) {
      blockwise.rhs_scales[i] = tensorwise.rhs_scales[i / (p.NB() * p.KB())];
    }
    const auto got = run(nodrop::cpu::grouped_matmul_fp8_tensorwise, p, tensorwise, nullptr);
    const auto want = run(p, blockwise, nullptr);
    if (p.K <= kBlock) {
      EXPECT_EQ(got, want) << "K = " << p.K;
      continue;
    }
    const std::vector<int64_t> group_of_row = groups_of_rows(p);
    for (int64_t m = 0; m < p.M; ++m) {
      for (int64_t n = 0; n < p.N; ++n) {
        const float a = bf16_to_float(got[m * p.N + n]), b = bf16_to_float(want[m * p.N + n]);
        if (group_of_row[m] < 0) {
          ASSERT_TRUE(a == 0.0f && b == 0.0f) << "row " << m << " past the groups";
          continue;
        }
        const double magnitude =
            reference(p, tensorwise, tensorwise_scale, m, group_of_row[m], n).second;
        ASSERT_NEAR(a, b, std::fabs(b) / 128 + magnitude * 2e-6) << "row " << m << ", column "
                                                                  << n;
      }
    }
  }
}

TEST(Fp8TensorwiseNumerics, OneScaleProductMultipliesTheWholeDot) {
  // K = 256 of ones: out = 256 * (lhs_scale * rhs_scales[g]) exactly, for each group's rows.
  const Problem p{3, 256, 8, {1, 2}};
  Operands o{std::vector<uint8_t>(p.M * p.K, 0x38), std::vector<uint8_t>(2 * 8 * 256, 0x38),
             {0.5f}, {0.25f, 4.0f}};  // 0x38 = 1.0
  auto out = run(nodrop::cpu::grouped_matmul_fp8_tensorwise, p, o, nullptr);
  for (int64_t n = 0; n < p.N; ++n) {
    EXPECT_EQ(bf16_to_float(out[n]), 256 * 0.125f);
    EXPECT_EQ(bf16_to_float(out[p.N + n]), 256 * 2.0f);
    EXPECT_EQ(bf16_to_float(out[2 * p.N + n]), 256 * 2.0f);
  }
  o.rhs_scales[0] = std::nanf("");  // a non-finite expert scale stays visible in its rows only
  out = run(nodrop::cpu::grouped_matmul_fp8_tensorwise, p, o, nullptr);
  EXPECT_TRUE(std::isnan(bf16_to_float(out[0])));
  EXPECT_EQ(bf16_to_float(out[p.N]), 256 * 2.0f);
  const Problem nothing{3, 0, 8, {1, 2}};  // K = 0 contracts nothing: zeros, NaN scale or not
  for (uint16_t v : run(nodrop::cpu::grouped_matmul_fp8_tensorwise, nothing, o, nullptr)) {
    EXPECT_EQ(v, 0);
  }
}

TEST(Fp8TensorwiseArgs, CheckedModeRefusesInvalidGroupSizes) {
  nodrop::Status status = nodrop::Status::Ok();
  const Problem negative{20, 16, 8, {-3, 10, 100}};
  run(nodrop::cpu::grouped_matmul_fp8_tensorwise, negative,
      random_tensorwise_operands(negative, 1), nullptr, /*checked=*/true, &status);
  EXPECT_TRUE(mentions(status, "group_sizes[0] = -3 is negative")) << status.message();
  const Problem over{20, 16, 8, {10, 100}};
  run(nodrop::cpu::grouped_matmul_fp8_tensorwise, over, random_tensorwise_operands(over, 1),
      nullptr, true, &status);
  EXPECT_TRUE(mentions(status, "group_sizes sum to 110 but there are only 20 rows"))
      << status.message();
}

TEST(Fp8TensorwiseArgs, RejectsWhatTheGpuRejects) {
  const Problem p{4, 256, 16, {4}};
  const Operands o = random_tensorwise_operands(p, 2);
  std::vector<uint16_t> out(p.M * p.N);
  struct Pointers {
    const void* lhs;
    const float* lhs_scale;
    const void* rhs;
    const float* rhs_scales;
    const int32_t* group_sizes;
    void* out;
  };
  const Pointers valid{o.lhs.data(), o.lhs_scales.data(), o.rhs.data(), o.rhs_scales.data(),
                       p.sizes.data(), out.data()};
  auto call = [&](int64_t M, int64_t K, int64_t N, const Pointers& at) {
    return nodrop::cpu::grouped_matmul_fp8_tensorwise(at.lhs, at.lhs_scale, at.rhs,
                                                      at.rhs_scales, at.group_sizes, M, K, N, 1,
                                                      at.out, false);
  };
  EXPECT_TRUE(call(4, 256, 16, valid).ok());
  auto status = call(4, 24, 16, valid);
  EXPECT_TRUE(mentions(status, "grouped_matmul_fp8_tensorwise: K = 24 must be a multiple of 16"))
      << status.message();
  status = call(4, 256, 12, valid);
  EXPECT_TRUE(mentions(status, "N = 12 must be a multiple of 8")) << status.message();
  status = call(-1, 256, 16, valid);
  EXPECT_TRUE(mentions(status, "M = -1 is negative")) << status.message();
  // Each pointer null in turn.
  const std::pair<const char*, void (*)(Pointers&)> nulls[] = {
      {"lhs", [](Pointers& at) { at.lhs = nullptr; }},
      {"lhs_scale", [](Pointers& at) { at.lhs_scale = nullptr; }},
      {"rhs", [](Pointers& at) { at.rhs = nullptr; }},
      {"rhs_scales", [](Pointers& at) { at.rhs_scales = nullptr; }},
      {"group_sizes", [](Pointers& at) { at.group_sizes = nullptr; }},
      {"out", [](Pointers& at) { at.out = nullptr; }}};
  for (const auto& [name, make_null] : nulls) {
    Pointers at = valid;
    make_null(at);
    status = call(4, 256, 16, at);
    EXPECT_TRUE(mentions(status, std::string("grouped_matmul_fp8_tensorwise: ") + name +
                                     " is null"))
        << status.message();
  }
}

// ---- grouped_matmul_fp8_blockwise_contract -------------------------------------------------

struct ContractProblem {
  int64_t M, K, N;
  std::vector<int32_t> sizes;
  int64_t G() const { return static_cast<int64_t>(sizes.size()); }
  int64_t PB() const { return (M + kBlock - 1) / kBlock + G(); }
  int64_t P() const { return kBlock * PB(); }
};

struct ContractOperands {
  std::vector<uint8_t> lhs_t, rhs_t;  // [K, P], [N, P]
  std::vector<float> lhs_scales, rhs_scales;  // [PB, K], [PB, N]
};

// Random codes and scales everywhere, the columns no group row owns included: the contraction
// must read none of them.
ContractOperands random_contract_operands(const ContractProblem& p, uint32_t seed) {
  RandomFp8 random(seed);
  return {random.codes(p.K * p.P()), random.codes(p.N * p.P()), random.scales(p.PB() * p.K),
          random.scales(p.PB() * p.N)};
}

// The tensorwise operands: the same codes, lhs_scales [1] and rhs_scales [1].
ContractOperands random_tensorwise_contract_operands(const ContractProblem& p, uint32_t seed) {
  RandomFp8 random(seed);
  return {random.codes(p.K * p.P()), random.codes(p.N * p.P()), random.scales(1),
          random.scales(1)};
}

// Both contractions take the same arguments; only the scales' layouts differ.
using Contract = decltype(&nodrop::cpu::grouped_matmul_fp8_blockwise_contract);

std::vector<uint16_t> run_contract(Contract contract, const ContractProblem& p,
                                   const ContractOperands& o, nodrop::ParallelRunner* runner,
                                   bool checked = false, nodrop::Status* status = nullptr) {
  Guarded<uint16_t> out(p.G() * p.K * p.N, 0xffff);  // NaN: every element must be written
  const Fenced lhs_t(o.lhs_t), lhs_scales(o.lhs_scales), rhs_t(o.rhs_t),
      rhs_scales(o.rhs_scales), sizes(p.sizes);
  const auto s = contract(lhs_t.data(), lhs_scales.as<float>(), rhs_t.data(),
                          rhs_scales.as<float>(), sizes.as<int32_t>(), p.M, p.K, p.N, p.G(),
                          out.data(), checked, runner);
  if (status) *status = s;
  else EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(out.canaries_intact());
  return out.vec();
}

std::vector<uint16_t> run_contract(const ContractProblem& p, const ContractOperands& o,
                                   nodrop::ParallelRunner* runner, bool checked = false,
                                   nodrop::Status* status = nullptr) {
  return run_contract(nodrop::cpu::grouped_matmul_fp8_blockwise_contract, p, o, runner, checked,
                      status);
}

// The scale of lhs_t[k] times that of rhs_t[n] in block b, per recipe.
double blockwise_contract_scale(const ContractProblem& p, const ContractOperands& o, int64_t b,
                                int64_t k, int64_t n) {
  return static_cast<double>(o.lhs_scales[b * p.K + k]) * o.rhs_scales[b * p.N + n];
}

double tensorwise_contract_scale(const ContractProblem&, const ContractOperands& o, int64_t,
                                 int64_t, int64_t) {
  return static_cast<double>(o.lhs_scales[0]) * o.rhs_scales[0];
}

using ContractScale = decltype(&blockwise_contract_scale);

// Each group's rows (clamped) and its first block: group g's rows are columns 128 * b + j of
// its blocks b, numbered on from the blocks of the groups before it.
std::vector<std::pair<int64_t, int64_t>> contract_groups(const ContractProblem& p) {
  std::vector<std::pair<int64_t, int64_t>> groups;
  int64_t begin = 0, first_block = 0;
  for (int64_t g = 0; g < p.G(); ++g) {
    const int64_t end = std::min<int64_t>(p.M, begin + std::max<int32_t>(p.sizes[g], 0));
    groups.emplace_back(end - begin, first_block);
    first_block += (end - begin + kBlock - 1) / kBlock;
    begin = end;
  }
  return groups;
}

// out[g, k, n] of a group of `rows` rows from block first_block, against the dequantised
// operands in float64: the value and the sum of its terms' magnitudes (which bounds float32
// summation error).
std::pair<double, double> contract_reference(const ContractProblem& p, const ContractOperands& o,
                                             ContractScale scale, int64_t rows,
                                             int64_t first_block, int64_t k, int64_t n) {
  double want = 0.0, magnitude = 0.0;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t b = first_block + row / kBlock, column = kBlock * b + row % kBlock;
    const double term = e4m3_value(o.lhs_t[k * p.P() + column]) *
                        e4m3_value(o.rhs_t[n * p.P() + column]) * scale(p, o, b, k, n);
    want += term;
    magnitude += std::fabs(term);
  }
  return {want, magnitude};
}

void expect_contract_matches_reference(const ContractProblem& p, const ContractOperands& o,
                                       const std::vector<uint16_t>& out,
                                       ContractScale scale = blockwise_contract_scale) {
  const auto groups = contract_groups(p);
  for (int64_t g = 0; g < p.G(); ++g) {
    for (int64_t k = 0; k < p.K; ++k) {
      for (int64_t n = 0; n < p.N; ++n) {
        const auto [rows, first_block] = groups[g];
        const auto [want, magnitude] = contract_reference(p, o, scale, rows, first_block, k, n);
        const float got = bf16_to_float(out[(g * p.K + k) * p.N + n]);
        ASSERT_NEAR(got, want, std::fabs(want) / 256 + magnitude * 1e-6)
            << "group " << g << ", k " << k << ", n " << n;
      }
    }
  }
}

class Fp8BlockwiseContract : public testing::TestWithParam<ContractProblem> {};

TEST_P(Fp8BlockwiseContract, MatchesTheDequantisedReference) {
  const ContractProblem& p = GetParam();
  const ContractOperands o = random_contract_operands(p, 5);
  const auto serial = run_contract(p, o, nullptr);
  ASSERT_NO_FATAL_FAILURE(expect_contract_matches_reference(p, o, serial));
  ThreadRunner runner(3);
  EXPECT_EQ(run_contract(p, o, &runner), serial);  // threads change nothing
}

const auto kContractShapes = testing::Values(
    ContractProblem{300, 24, 16, {129, 1, 127, 43}},  // sizes off 128: short last blocks
    ContractProblem{37, 20, 8, {5, 0, 20, 7}},        // an empty group, rows past them
    ContractProblem{300, 10, 8, {0, 300, 0}},         // every row in one group
    ContractProblem{20, 3, 8, {-3, 10, 100}},         // negative and overlong: clamped
    ContractProblem{256, 8, 136, {128, 128}},         // whole blocks; N past 128
    ContractProblem{9, 0, 8, {4, 5}},                 // K = 0: nothing to write
    ContractProblem{40, 4, 0, {40}},                  // N = 0
    ContractProblem{0, 5, 8, {0, 0}},                 // no rows: zeros
    ContractProblem{6, 4, 8, {}});                    // no groups

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8BlockwiseContract, kContractShapes);

TEST(Fp8BlockwiseContractNumerics, ScalesMultiplyEachBlocksPartialSumOverTheGroupsRows) {
  // One group of 200 rows: block 0 (128 rows) and block 1 (72 rows, then 56 columns that are
  // not the group's). Ones everywhere, so out = 128 * (l0 * r0) + 72 * (l1 * r1) exactly.
  const ContractProblem p{200, 2, 8, {200}};
  ContractOperands o{std::vector<uint8_t>(p.K * p.P(), 0x38),  // 0x38 = 1.0
                     std::vector<uint8_t>(p.N * p.P(), 0x38), std::vector<float>(p.PB() * p.K),
                     std::vector<float>(p.PB() * p.N, 1.0f)};
  for (int64_t k = 0; k < p.K; ++k) {
    o.lhs_scales[0 * p.K + k] = 0.5f;
    o.lhs_scales[1 * p.K + k] = 2.0f;
  }
  for (int64_t n = 0; n < p.N; ++n) {
    o.rhs_scales[0 * p.N + n] = 0.25f;
    o.rhs_scales[1 * p.N + n] = 4.0f;
  }
  auto out = run_contract(p, o, nullptr);
  for (uint16_t v : out) EXPECT_EQ(bf16_to_float(v), 128 * 0.125f + 72 * 8.0f);
  o.lhs_scales[1 * p.K + 1] = std::nanf("");  // a non-finite block stays visible in its row
  out = run_contract(p, o, nullptr);
  for (int64_t n = 0; n < p.N; ++n) {
    EXPECT_EQ(bf16_to_float(out[n]), 128 * 0.125f + 72 * 8.0f);
    EXPECT_TRUE(std::isnan(bf16_to_float(out[p.N + n])));
  }
}

TEST(Fp8BlockwiseContractArgs, CheckedModeRefusesInvalidGroupSizes) {
  nodrop::Status status = nodrop::Status::Ok();
  const ContractProblem negative{20, 3, 8, {-3, 10, 100}};
  run_contract(negative, random_contract_operands(negative, 1), nullptr, /*checked=*/true,
               &status);
  EXPECT_TRUE(mentions(status, "group_sizes[0] = -3 is negative")) << status.message();
  const ContractProblem over{20, 3, 8, {10, 100}};
  run_contract(over, random_contract_operands(over, 1), nullptr, true, &status);
  EXPECT_TRUE(mentions(status, "group_sizes sum to 110 but there are only 20 rows"))
      << status.message();
}

TEST(Fp8BlockwiseContractArgs, RejectsWhatTheGpuRejects) {
  const ContractProblem p{4, 2, 16, {4}};
  const ContractOperands o = random_contract_operands(p, 2);
  std::vector<uint16_t> out(p.K * p.N);
  auto call = [&](int64_t M, int64_t K, int64_t N, const void* lhs_t) {
    return nodrop::cpu::grouped_matmul_fp8_blockwise_contract(
        lhs_t, o.lhs_scales.data(), o.rhs_t.data(), o.rhs_scales.data(), p.sizes.data(), M, K, N,
        1, out.data(), false);
  };
  EXPECT_TRUE(call(4, 2, 16, o.lhs_t.data()).ok());
  auto status = call(4, 2, 12, o.lhs_t.data());
  EXPECT_TRUE(mentions(status, "N = 12 must be a multiple of 8")) << status.message();
  status = call(-1, 2, 16, o.lhs_t.data());
  EXPECT_TRUE(mentions(status, "M = -1 is negative")) << status.message();
  status = call(4, -2, 16, o.lhs_t.data());
  EXPECT_TRUE(mentions(status, "K = -2 is negative")) << status.message();
  status = call(4, 2, 16, nullptr);
  EXPECT_TRUE(mentions(status, "grouped_matmul_fp8_blockwise_contract: lhs_t is null"))
      << status.message();
}

// ---- grouped_matmul_fp8_tensorwise_contract ------------------------------------------------

class Fp8TensorwiseContract : public testing::TestWithParam<ContractProblem> {};

TEST_P(Fp8TensorwiseContract, MatchesTheDequantisedReference) {
  const ContractProblem& p = GetParam();
  const ContractOperands o = random_tensorwise_contract_operands(p, 5);
  const Contract contract = nodrop::cpu::grouped_matmul_fp8_tensorwise_contract;
  const auto serial = run_contract(contract, p, o, nullptr);
  ASSERT_NO_FATAL_FAILURE(expect_contract_matches_reference(p, o, serial,
                                                            tensorwise_contract_scale));
  ThreadRunner runner(3);
  EXPECT_EQ(run_contract(contract, p, o, &runner), serial);  // threads change nothing
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8TensorwiseContract, kContractShapes);

// The tensorwise scales repeated over every block of the blockwise contraction's scale arrays
// (what quantize_fp8_transposed writes when given the scale): the same products. A group of at
// most 128 rows is one block, where both compute the same float32 dot times the same scale
// product, bitwise; past it the blockwise contraction scales each block's sum before adding, so
// they differ by float32 summation order (and the bfloat16 rounding that may flip).
TEST(Fp8TensorwiseContractNumerics, IsTheBlockwiseContractOnRepeatedScales) {
  for (const ContractProblem& p : {ContractProblem{37, 20, 8, {5, 0, 20, 7}},
                                   ContractProblem{256, 8, 136, {128, 128}},
                                   ContractProblem{300, 24, 16, {129, 1, 127, 43}},
                                   ContractProblem{300, 10, 8, {0, 300, 0}}}) {
    const ContractOperands tensorwise = random_tensorwise_contract_operands(p, 3);
    ContractOperands blockwise = tensorwise;
    blockwise.lhs_scales.assign(p.PB() * p.K, tensorwise.lhs_scales[0]);
    blockwise.rhs_scales.assign(p.PB() * p.N, tensorwise.rhs_scales[0]);
    const auto got =
        run_contract(nodrop::cpu::grouped_matmul_fp8_tensorwise_contract, p, tensorwise, nullptr);
    const auto want = run_contract(p, blockwise, nullptr);
    if (*std::max_element(p.sizes.begin(), p.sizes.end()) <= kBlock) {
      EXPECT_EQ(got, want) << "M = " << p.M;
      continue;
    }
    const auto groups = contract_groups(p);
    for (int64_t g = 0; g < p.G(); ++g) {
      for (int64_t k = 0; k < p.K; ++k) {
        for (int64_t n = 0; n < p.N; ++n) {
          const int64_t i = (g * p.K + k) * p.N + n;
          const float a = bf16_to_float(got[i]), b = bf16_to_float(want[i]);
          const double magnitude = contract_reference(p, tensorwise, tensorwise_contract_scale,
                                                      groups[g].first, groups[g].second, k, n)
                                       .second;
          ASSERT_NEAR(a, b, std::fabs(b) / 128 + magnitude * 2e-6)
              << "group " << g << ", k " << k << ", n " << n << ", M = " << p.M;
        }
      }
    }
  }
}

TEST(Fp8TensorwiseContractNumerics, OneScaleProductMultipliesEachGroupsWholeDot) {
  // Groups of 200 rows (blocks of 128 and 72, then 56 columns that are not the group's) and 0.
  // Ones everywhere, so out[0] = 200 * (0.5 * 4) exactly, and out[1] = 0.
  const ContractProblem p{200, 2, 8, {200, 0}};
  ContractOperands o{std::vector<uint8_t>(p.K * p.P(), 0x38),  // 0x38 = 1.0
                     std::vector<uint8_t>(p.N * p.P(), 0x38), {0.5f}, {4.0f}};
  const Contract contract = nodrop::cpu::grouped_matmul_fp8_tensorwise_contract;
  auto out = run_contract(contract, p, o, nullptr);
  for (int64_t i = 0; i < p.K * p.N; ++i) EXPECT_EQ(bf16_to_float(out[i]), 200 * 2.0f);
  for (int64_t i = p.K * p.N; i < p.G() * p.K * p.N; ++i) EXPECT_EQ(out[i], 0) << i;
  // A non-finite scale shows in every group that contracts anything; an empty group stays zero.
  o.rhs_scales[0] = std::nanf("");
  out = run_contract(contract, p, o, nullptr);
  for (int64_t i = 0; i < p.K * p.N; ++i) EXPECT_TRUE(std::isnan(bf16_to_float(out[i]))) << i;
  for (int64_t i = p.K * p.N; i < p.G() * p.K * p.N; ++i) EXPECT_EQ(out[i], 0) << i;
}

TEST(Fp8TensorwiseContractArgs, CheckedModeRefusesInvalidGroupSizes) {
  const Contract contract = nodrop::cpu::grouped_matmul_fp8_tensorwise_contract;
  nodrop::Status status = nodrop::Status::Ok();
  const ContractProblem negative{20, 3, 8, {-3, 10, 100}};
  run_contract(contract, negative, random_tensorwise_contract_operands(negative, 1), nullptr,
               /*checked=*/true, &status);
  EXPECT_TRUE(mentions(status, "group_sizes[0] = -3 is negative")) << status.message();
  const ContractProblem over{20, 3, 8, {10, 100}};
  run_contract(contract, over, random_tensorwise_contract_operands(over, 1), nullptr, true,
               &status);
  EXPECT_TRUE(mentions(status, "group_sizes sum to 110 but there are only 20 rows"))
      << status.message();
}

TEST(Fp8TensorwiseContractArgs, RejectsWhatTheGpuRejects) {
  const ContractProblem p{4, 2, 16, {4}};
  const ContractOperands o = random_tensorwise_contract_operands(p, 2);
  std::vector<uint16_t> out(p.K * p.N);
  struct Pointers {
    const void* lhs_t;
    const float* lhs_scale;
    const void* rhs_t;
    const float* rhs_scale;
    const int32_t* group_sizes;
    void* out;
  };
  const Pointers valid{o.lhs_t.data(), o.lhs_scales.data(), o.rhs_t.data(), o.rhs_scales.data(),
                       p.sizes.data(), out.data()};
  auto call = [&](int64_t M, int64_t K, int64_t N, const Pointers& at) {
    return nodrop::cpu::grouped_matmul_fp8_tensorwise_contract(
        at.lhs_t, at.lhs_scale, at.rhs_t, at.rhs_scale, at.group_sizes, M, K, N, 1, at.out,
        false);
  };
  EXPECT_TRUE(call(4, 2, 16, valid).ok());
  auto status = call(4, 2, 12, valid);
  EXPECT_TRUE(mentions(status,
                       "grouped_matmul_fp8_tensorwise_contract: N = 12 must be a multiple of 8"))
      << status.message();
  status = call(-1, 2, 16, valid);
  EXPECT_TRUE(mentions(status, "M = -1 is negative")) << status.message();
  status = call(4, -2, 16, valid);
  EXPECT_TRUE(mentions(status, "K = -2 is negative")) << status.message();
  // Each pointer null in turn.
  const std::pair<const char*, void (*)(Pointers&)> nulls[] = {
      {"lhs_t", [](Pointers& at) { at.lhs_t = nullptr; }},
      {"lhs_scale", [](Pointers& at) { at.lhs_scale = nullptr; }},
      {"rhs_t", [](Pointers& at) { at.rhs_t = nullptr; }},
      {"rhs_scale", [](Pointers& at) { at.rhs_scale = nullptr; }},
      {"group_sizes", [](Pointers& at) { at.group_sizes = nullptr; }},
      {"out", [](Pointers& at) { at.out = nullptr; }}};
  for (const auto& [name, make_null] : nulls) {
    Pointers at = valid;
    make_null(at);
    status = call(4, 2, 16, at);
    EXPECT_TRUE(mentions(status, std::string("grouped_matmul_fp8_tensorwise_contract: ") + name +
                                     " is null"))
        << status.message();
  }
}

}  // namespace
