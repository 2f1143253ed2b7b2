// Tests of quantize_fp8 (1 x block FP8 scaling), quantize_fp8_transposed (the weight gradient's
// blocks of 128 rows within each group, transposed) and transpose_fp8_codes (its layout of codes
// already made), quantize_fp8_weights and
// quantize_fp8_weights_transposed (the experts' weights in 128 x 128 blocks, in place for the
// input gradient and transposed for the forward) and permute_rows_fp8 (permute with the rows'
// quantisation) against a brute-force E4M3 encoder: the nearest of the 127 finite magnitudes,
// ties to the even code.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "nodrop/engine_cpu.h"
#include "test_util.h"

namespace {

using nodrop::DType;
using nodrop_test::Array;
using nodrop_test::Fenced;
using nodrop_test::Guarded;
using nodrop_test::mentions;
using nodrop_test::ThreadRunner;

constexpr float kE4M3Max = 448.0f;

float e4m3_value(uint8_t code) {
  const int exponent = (code >> 3) & 15, mantissa = code & 7;
  const float sign = code & 0x80 ? -1.0f : 1.0f;
  if ((code & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(mantissa / 8.0f, -6);
  return sign * std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
}

uint8_t e4m3_reference(float v) {
  if (std::isnan(v)) return 0x7f;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(v));
  uint8_t best = 0;
  for (int code = 1; code < 0x7f; ++code) {
    const double d = std::fabs(e4m3_value(code) - a), best_d = std::fabs(e4m3_value(best) - a);
    if (d < best_d || (d == best_d && (code & 1) == 0)) best = static_cast<uint8_t>(code);
  }
  return sign | best;
}

// The scale of a block: amax * float32(1 / 448), 1 where that is below float32's smallest normal
// number, NaN for a NaN or an inf.
float want_scale(const std::vector<float>& block) {
  float amax = 0.0f;
  bool finite = true;
  for (float v : block) {
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  if (!finite) return std::nanf("");
  const float scale = amax * (1.0f / kE4M3Max);
  return scale >= std::numeric_limits<float>::min() ? scale : 1.0f;
}

// The code of v in a block of scale s, saturated; NaN for a non-finite block's values.
void expect_code(uint8_t code, float v, float s, const std::string& where) {
  v *= 1.0f / s;
  if (std::isnan(v)) {
    ASSERT_EQ(code & 0x7f, 0x7f) << where << " is not NaN";
  } else {
    ASSERT_EQ(code, e4m3_reference(std::min(std::max(v, -kE4M3Max), kE4M3Max)))
        << where << ": " << v;
  }
}

void expect_scale(float got, float want, const std::string& where) {
  ASSERT_TRUE(std::isnan(want) ? std::isnan(got) : got == want)
      << "scale of " << where << ": got " << got << ", want " << want;
}

// What quantize_fp8 must give: scales from each block's amax, codes from the brute-force encoder.
void expect_quantized(const Array& x, int64_t M, int64_t C, int64_t block,
                      const std::vector<uint8_t>& q, const std::vector<float>& scale) {
  const int64_t blocks = (C + block - 1) / block;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      std::vector<float> values;
      for (int64_t i = b * block; i < std::min(C, (b + 1) * block); ++i) {
        values.push_back(static_cast<float>(x.at(r * C + i)));
      }
      const float s = want_scale(values);
      const std::string where = "row " + std::to_string(r) + " block " + std::to_string(b);
      ASSERT_NO_FATAL_FAILURE(expect_scale(scale[r * blocks + b], s, where));
      for (int64_t i = b * block; i < std::min(C, (b + 1) * block); ++i) {
        ASSERT_NO_FATAL_FAILURE(expect_code(q[r * C + i], values[i - b * block], s,
                                            "element " + std::to_string(r) + ", " +
                                                std::to_string(i)));
      }
    }
  }
}

class QuantizeFp8 : public testing::TestWithParam<DType> {};

TEST_P(QuantizeFp8, MatchesTheBruteForceEncoder) {
  const DType dtype = GetParam();
  const int64_t M = 37, C = 300, block = 128;  // a short last block of 44 columns
  std::mt19937 rng(7);
  Array x = nodrop_test::random_array(dtype, M * C, rng, -3.0, 3.0);
  // Magnitudes from 2^-20 to 2^12 across the rows, so subnormal codes and saturation both occur.
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < C; ++i) x.set(r * C + i, x.at(r * C + i) * std::ldexp(1.0, r - 20));
  for (int64_t i = 0; i < 128; ++i) x.set(3 * C + i, 0.0);   // an all-zero block: scale 1
  // A block whose amax / 448 is subnormal in float32 (zero in float16): scale 1 too, not a
  // scale whose reciprocal is inf.
  for (int64_t i = 0; i < 128; ++i) x.set(4 * C + i, 1e-37 * double(i % 5 - 2));
  x.set(5 * C + 200, std::numeric_limits<double>::quiet_NaN());  // a NaN block
  x.set(6 * C + 10, std::numeric_limits<double>::infinity());    // an inf block
  std::vector<uint8_t> q(M * C);
  std::vector<float> scale(M * 3);
  ThreadRunner runner(3);
  ASSERT_TRUE(nodrop::cpu::quantize_fp8(x.data(), dtype, M, C, block, q.data(), scale.data(),
                                        &runner).ok());
  EXPECT_GT(runner.calls(), 0);
  expect_quantized(x, M, C, block, q, scale);
  EXPECT_EQ(scale[3 * 3], 1.0f);
  EXPECT_EQ(scale[4 * 3], 1.0f);
  EXPECT_TRUE(std::isnan(scale[5 * 3 + 1]) && std::isnan(scale[6 * 3]));
  std::vector<uint8_t> alone(M * C);
  std::vector<float> alone_scale(M * 3);
  ASSERT_TRUE(nodrop::cpu::quantize_fp8(x.data(), dtype, M, C, block, alone.data(),
                                        alone_scale.data()).ok());
  EXPECT_EQ(alone, q);  // threads change nothing
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizeFp8, testing::ValuesIn(nodrop_test::kAllDtypes));

TEST(QuantizeFp8Codes, EveryFiniteCodeRoundTripsAndTiesGoToEven) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    EXPECT_EQ(e4m3_reference(e4m3_value(code)), code == 0x80 ? 0x80 : code);
  }
  // One block per value, scale 1 exactly: amax 448 * fl(1/448) rounds to 1 in float32.
  ASSERT_EQ(448.0f * (1.0f / kE4M3Max), 1.0f);
  const std::vector<float> values = {448.0f, 1.0625f, 1.1875f, 3.0f * std::ldexp(1.0f, -10),
                                     -2.5f * std::ldexp(1.0f, -9), 0.0f, -0.0f, 416.0f};
  for (float v : values) {
    const std::vector<float> x = {kE4M3Max, v};  // block 2: the first sets the scale to 1
    std::vector<uint8_t> q(2);
    float scale;
    ASSERT_TRUE(nodrop::cpu::quantize_fp8(x.data(), DType::kFloat32, 1, 2, 2, q.data(), &scale)
                    .ok());
    EXPECT_EQ(scale, 1.0f);
    EXPECT_EQ(q[1], e4m3_reference(v)) << v;
  }
}

TEST(QuantizeFp8Args, RejectsBadShapesAndBlocks) {
  float x = 0.0f, scale = 0.0f;
  uint8_t q = 0;
  const auto status = nodrop::cpu::quantize_fp8(&x, DType::kFloat32, 1, 1, 0, &q, &scale);
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(mentions(status, "block")) << status.message();
  EXPECT_FALSE(nodrop::cpu::quantize_fp8(&x, DType::kFloat32, -1, 1, 1, &q, &scale).ok());
  EXPECT_TRUE(nodrop::cpu::quantize_fp8(nullptr, DType::kFloat32, 0, 5, 128, nullptr, nullptr)
                  .ok());  // nothing to do
}

// ---- quantize_fp8_transposed ---------------------------------------------------------------

constexpr int64_t kBlock = 128;

struct TransposedProblem {
  int64_t M, C;
  std::vector<int32_t> sizes;
  int64_t G() const { return static_cast<int64_t>(sizes.size()); }
  int64_t PB() const { return (M + kBlock - 1) / kBlock + G(); }
  int64_t P() const { return kBlock * PB(); }
};

struct Transposed {
  std::vector<uint8_t> q_t;
  std::vector<float> scale;
};

// Poisoned outputs between canaries (every byte must be written, none past the ends), inputs
// fenced (no read past them).
Transposed quantize_transposed(const TransposedProblem& p, const Array& x,
                               nodrop::ParallelRunner* runner, bool checked = false,
                               nodrop::Status* status = nullptr,
                               const float* given_scale = nullptr) {
  Guarded<uint8_t> q_t(p.C * p.P(), 0xab);
  Guarded<float> scale(p.PB() * p.C, std::nanf(""));
  const Fenced x_in(x), sizes_in(p.sizes);
  const auto s = nodrop::cpu::quantize_fp8_transposed(
      x_in.data(), x.dtype(), sizes_in.as<int32_t>(), p.M, p.C, p.G(), given_scale, q_t.data(),
      scale.data(), checked, runner);
  if (status) *status = s;
  else EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(q_t.canaries_intact() && scale.canaries_intact());
  return {q_t.vec(), scale.vec()};
}

// The layout re-derived: group g's rows (clamped) in blocks of 128 from its first row, numbered
// on from the blocks of the groups before it; everything else zero codes and unit scales. With
// given_scale, every scale is that one.
void expect_transposed(const TransposedProblem& p, const Array& x, const Transposed& got,
                       const float* given_scale = nullptr) {
  std::vector<bool> written(p.C * p.P(), false), scaled(p.PB() * p.C, false);
  int64_t begin = 0, b = 0;
  for (int64_t g = 0; g < p.G(); ++g) {
    const int64_t end = std::min<int64_t>(p.M, begin + std::max<int32_t>(p.sizes[g], 0));
    for (int64_t first = begin; first < end; first += kBlock, ++b) {
      const int64_t rows = std::min(kBlock, end - first);
      for (int64_t c = 0; c < p.C; ++c) {
        std::vector<float> values(rows);
        for (int64_t j = 0; j < rows; ++j) values[j] = static_cast<float>(x.at((first + j) * p.C + c));
        const float s = given_scale ? *given_scale : want_scale(values);
        const std::string where = "block " + std::to_string(b) + " column " + std::to_string(c);
        ASSERT_NO_FATAL_FAILURE(expect_scale(got.scale[b * p.C + c], s, where));
        scaled[b * p.C + c] = true;
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t at = c * p.P() + kBlock * b + j;
          ASSERT_NO_FATAL_FAILURE(expect_code(got.q_t[at], values[j], s,
                                              where + " row " + std::to_string(j)));
          written[at] = true;
        }
      }
    }
    begin = end;
  }
  ASSERT_LE(b, p.PB());
  for (int64_t i = 0; i < p.C * p.P(); ++i) {
    if (!written[i]) ASSERT_EQ(got.q_t[i], 0) << "q_t[" << i / p.P() << ", " << i % p.P() << "]";
  }
  for (int64_t i = 0; i < p.PB() * p.C; ++i) {
    if (!scaled[i]) {
      ASSERT_NO_FATAL_FAILURE(expect_scale(got.scale[i], given_scale ? *given_scale : 1.0f,
                                           "unused block " + std::to_string(i / p.C)));
    }
  }
}

class QuantizeFp8Transposed
    : public testing::TestWithParam<std::tuple<DType, TransposedProblem>> {};

TEST_P(QuantizeFp8Transposed, MatchesTheLayoutAndTheBruteForceEncoder) {
  const auto& [dtype, p] = GetParam();
  std::mt19937 rng(11);
  Array x = nodrop_test::random_array(dtype, p.M * p.C, rng, -3.0, 3.0);
  // Magnitudes from 2^-20 to 2^12 across the columns (float16 stays finite), and over a few
  // binades down each column: subnormal codes within a block.
  for (int64_t r = 0; r < p.M; ++r) {
    for (int64_t c = 0; c < p.C; ++c) {
      x.set(r * p.C + c, x.at(r * p.C + c) * std::ldexp(1.0, int(c % 29) - 20 + int(r % 5)));
    }
  }
  const Transposed serial = quantize_transposed(p, x, nullptr);
  ASSERT_NO_FATAL_FAILURE(expect_transposed(p, x, serial));
  ThreadRunner runner(3);
  const Transposed threaded = quantize_transposed(p, x, &runner);
  EXPECT_EQ(threaded.q_t, serial.q_t);  // threads change nothing (bitwise: NaN scales too)
  EXPECT_EQ(0, std::memcmp(threaded.scale.data(), serial.scale.data(),
                           serial.scale.size() * sizeof(float)));
}

// A tensorwise recipe's scale given: the amax of every row in the groups, then half of it (the
// largest values saturate), a tiny one (everything saturates) and NaN (every code NaN).
TEST_P(QuantizeFp8Transposed, AGivenScaleReplacesEveryBlocksOwn) {
  const auto& [dtype, p] = GetParam();
  std::mt19937 rng(12);
  const Array x = nodrop_test::random_array(dtype, p.M * p.C, rng, -3.0, 3.0);
  std::vector<float> in_groups;
  int64_t end = 0;
  for (int32_t size : p.sizes) end = std::min<int64_t>(p.M, end + std::max<int32_t>(size, 0));
  for (int64_t i = 0; i < end * p.C; ++i) in_groups.push_back(static_cast<float>(x.at(i)));
  const float tensorwise = want_scale(in_groups);
  for (const float given : {tensorwise, tensorwise * 0.5f, 1e-30f, std::nanf("")}) {
    SCOPED_TRACE(given);
    const Transposed serial = quantize_transposed(p, x, nullptr, false, nullptr, &given);
    ASSERT_NO_FATAL_FAILURE(expect_transposed(p, x, serial, &given));
    ThreadRunner runner(3);
    const Transposed threaded = quantize_transposed(p, x, &runner, false, nullptr, &given);
    EXPECT_EQ(threaded.q_t, serial.q_t);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantizeFp8Transposed,
    testing::Combine(
        testing::ValuesIn(nodrop_test::kAllDtypes),
        testing::Values(
            TransposedProblem{300, 37, {129, 1, 127, 43}},  // sizes off 128: short last blocks
            TransposedProblem{37, 20, {5, 0, 20, 7}},       // an empty group, rows past them
            TransposedProblem{300, 9, {0, 300, 0}},         // every row in one group
            TransposedProblem{20, 9, {-3, 10, 100}},        // negative and overlong: clamped
            TransposedProblem{256, 5, {128, 128}},          // whole blocks
            TransposedProblem{9, 0, {4, 5}},                // no columns
            TransposedProblem{0, 5, {0, 0}},                // no rows: unused blocks only
            TransposedProblem{6, 4, {}})));                 // no groups: every row past them

TEST(QuantizeFp8TransposedValues, ZeroNonFiniteAndSaturatingBlocks) {
  // Groups of 130 and 70 rows: blocks 0 (rows 0-127), 1 (128-129), 2 (130-199).
  const TransposedProblem p{200, 4, {130, 70}};
  Array x(DType::kFloat32, p.M * p.C);
  for (int64_t r = 0; r < p.M; ++r) {
    x.set(r * p.C + 0, 0.0);                    // column 0: zeros, scale 1 in every block
    x.set(r * p.C + 1, r == 129 ? 7.0 : 1e-3);  // column 1: block 1's amax is 7
    x.set(r * p.C + 2, 1.0);                    // column 2: a NaN in block 0, an inf in block 2
    x.set(r * p.C + 3, -2.0 * (r + 1));         // column 3: the largest magnitude -> -448
  }
  x.set(5 * p.C + 2, std::numeric_limits<double>::quiet_NaN());
  x.set(150 * p.C + 2, -std::numeric_limits<double>::infinity());
  const Transposed got = quantize_transposed(p, x, nullptr);
  ASSERT_NO_FATAL_FAILURE(expect_transposed(p, x, got));
  const int64_t P = p.P();
  for (int64_t b = 0; b < 3; ++b) EXPECT_EQ(got.scale[b * p.C + 0], 1.0f) << b;
  EXPECT_EQ(got.scale[1 * p.C + 1], 7.0f * (1.0f / kE4M3Max));
  EXPECT_EQ(got.q_t[1 * P + 128 + 1], 0x7e);  // 448: the block's amax, row 129
  EXPECT_TRUE(std::isnan(got.scale[0 * p.C + 2]) && std::isnan(got.scale[2 * p.C + 2]));
  EXPECT_EQ(got.scale[1 * p.C + 2], 1.0f / kE4M3Max);  // the NaN and the inf stay in their blocks
  for (int64_t j = 0; j < 128; ++j) EXPECT_EQ(got.q_t[2 * P + j] & 0x7f, 0x7f) << j;
  EXPECT_EQ(got.q_t[3 * P + 127], 0xfe);  // -448 in block 0, row 127 (-256)
  EXPECT_EQ(got.q_t[3 * P + 2 * 128 + 69], 0xfe);  // and in block 2, row 199 (-400)
  EXPECT_EQ(got.q_t[3 * P + 128 + 2], 0);  // past block 1's two rows
}

TEST(QuantizeFp8TransposedArgs, CheckedModeRefusesInvalidGroupSizes) {
  std::mt19937 rng(3);
  nodrop::Status status = nodrop::Status::Ok();
  const TransposedProblem negative{20, 3, {-3, 10, 100}};
  quantize_transposed(negative, nodrop_test::random_array(DType::kFloat32, 60, rng), nullptr,
                      /*checked=*/true, &status);
  EXPECT_TRUE(mentions(status, "group_sizes[0] = -3 is negative")) << status.message();
  const TransposedProblem over{20, 3, {10, 100}};
  quantize_transposed(over, nodrop_test::random_array(DType::kFloat32, 60, rng), nullptr, true,
                      &status);
  EXPECT_TRUE(mentions(status, "group_sizes sum to 110 but there are only 20 rows"))
      << status.message();
  const TransposedProblem valid{20, 3, {10, 10}};
  quantize_transposed(valid, nodrop_test::random_array(DType::kFloat32, 60, rng), nullptr, true,
                      &status);
  EXPECT_TRUE(status.ok()) << status.message();
}

TEST(QuantizeFp8TransposedArgs, RejectsNegativeShapesAndNullBuffers) {
  std::vector<float> x(8, 1.0f), scale(4 * 2);
  std::vector<uint8_t> q_t(2 * 128 * 4);
  const std::vector<int32_t> sizes = {2, 2, 0};
  auto call = [&](int64_t M, int64_t C, int64_t G, const float* x_data, uint8_t* q_data) {
    return nodrop::cpu::quantize_fp8_transposed(x_data, DType::kFloat32, sizes.data(), M, C, G,
                                                nullptr, q_data, scale.data(), false);
  };
  EXPECT_TRUE(call(4, 2, 3, x.data(), q_t.data()).ok());  // PB = 1 + 3
  auto status = call(-4, 2, 3, x.data(), q_t.data());
  EXPECT_TRUE(mentions(status, "quantize_fp8_transposed: M = -4 is negative")) << status.message();
  status = call(4, 2, -1, x.data(), q_t.data());
  EXPECT_TRUE(mentions(status, "G = -1 is negative")) << status.message();
  status = call(4, 2, 3, nullptr, q_t.data());
  EXPECT_TRUE(mentions(status, "quantize_fp8_transposed: x is null")) << status.message();
  status = call(4, 2, 3, x.data(), nullptr);
  EXPECT_TRUE(mentions(status, "q_t is null")) << status.message();
  EXPECT_TRUE(call(0, 0, 0, nullptr, nullptr).ok());  // nothing to write: PB = 0
}

// ---- transpose_fp8_codes --------------------------------------------------------------------

// Poisoned q_t between canaries, q fenced.
std::vector<uint8_t> transpose_codes(const TransposedProblem& p, const std::vector<uint8_t>& q,
                                     nodrop::ParallelRunner* runner, bool checked = false,
                                     nodrop::Status* status = nullptr) {
  Guarded<uint8_t> q_t(p.C * p.P(), 0xab);
  const Fenced q_in(q), sizes_in(p.sizes);
  const auto s = nodrop::cpu::transpose_fp8_codes(q_in.as<uint8_t>(), sizes_in.as<int32_t>(),
                                                  p.M, p.C, p.G(), q_t.data(), checked, runner);
  if (status) *status = s;
  else EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(q_t.canaries_intact());
  return q_t.vec();
}

class TransposeFp8Codes : public testing::TestWithParam<TransposedProblem> {};

// Every byte value (NaN codes too) moved to where quantize_fp8_transposed puts its code:
// row j of group g's block b at q_t[c, 128 b + j]; every other byte zero.
TEST_P(TransposeFp8Codes, MovesEachCodeToItsBlockAndZeroesTheRest) {
  const TransposedProblem& p = GetParam();
  std::mt19937 rng(13);
  std::vector<uint8_t> q(p.M * p.C);
  for (auto& code : q) code = static_cast<uint8_t>(rng());
  const std::vector<uint8_t> got = transpose_codes(p, q, nullptr);
  std::vector<uint8_t> want(p.C * p.P(), 0);
  int64_t begin = 0, b = 0;
  for (int64_t g = 0; g < p.G(); ++g) {
    const int64_t end = std::min<int64_t>(p.M, begin + std::max<int32_t>(p.sizes[g], 0));
    for (int64_t first = begin; first < end; first += kBlock, ++b) {
      for (int64_t j = 0; j < std::min(kBlock, end - first); ++j) {
        for (int64_t c = 0; c < p.C; ++c) {
          want[c * p.P() + kBlock * b + j] = q[(first + j) * p.C + c];
        }
      }
    }
    begin = end;
  }
  EXPECT_EQ(got, want);
  ThreadRunner runner(3);
  EXPECT_EQ(transpose_codes(p, q, &runner), got);
}

// The tensorwise recipe's use: the rows quantised at one scale (permute_rows_fp8 with the scale
// given, an identity row map), then re-laid, are bitwise quantize_fp8_transposed of the rows
// at that scale, for the tensor's own scale, half of it (saturating) and NaN.
TEST_P(TransposeFp8Codes, OfTensorwiseRowsIsTheTransposedQuantisation) {
  const TransposedProblem& p = GetParam();
  std::mt19937 rng(14);
  const Array x = nodrop_test::random_array(DType::kBFloat16, p.M * p.C, rng, -3.0, 3.0);
  std::vector<float> values(p.M * p.C);
  for (int64_t i = 0; i < p.M * p.C; ++i) values[i] = static_cast<float>(x.at(i));
  std::vector<int32_t> identity(p.M);
  std::iota(identity.begin(), identity.end(), 0);
  for (const float given : {want_scale(values), want_scale(values) * 0.5f, std::nanf("")}) {
    SCOPED_TRACE(given);
    Array rows(DType::kBFloat16, p.M * p.C);
    std::vector<uint8_t> q(p.M * p.C);
    std::vector<float> scale(p.M * ((p.C + kBlock - 1) / kBlock));
    ASSERT_TRUE(nodrop::cpu::permute_rows_fp8(x.data(), DType::kBFloat16, identity.data(), p.M, 1,
                                              p.C, &given, rows.data(), q.data(), scale.data())
                    .ok());
    const Transposed want = quantize_transposed(p, x, nullptr, false, nullptr, &given);
    EXPECT_EQ(transpose_codes(p, q, nullptr), want.q_t);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, TransposeFp8Codes,
    testing::Values(TransposedProblem{300, 37, {129, 1, 127, 43}},  // short last blocks
                    TransposedProblem{37, 20, {5, 0, 20, 7}},       // an empty group, rows past
                    TransposedProblem{300, 9, {0, 300, 0}},         // every row in one group
                    TransposedProblem{20, 9, {-3, 10, 100}},        // clamped sizes
                    TransposedProblem{256, 5, {128, 128}},          // whole blocks
                    TransposedProblem{9, 0, {4, 5}},                // no columns
                    TransposedProblem{0, 5, {0, 0}},                // no rows
                    TransposedProblem{6, 4, {}}));                  // no groups

TEST(TransposeFp8CodesArgs, RefusesInvalidGroupSizesNegativeShapesAndNullBuffers) {
  nodrop::Status status = nodrop::Status::Ok();
  transpose_codes(TransposedProblem{20, 3, {-3, 10, 100}}, std::vector<uint8_t>(60), nullptr,
                  /*checked=*/true, &status);
  EXPECT_TRUE(mentions(status, "group_sizes[0] = -3 is negative")) << status.message();
  transpose_codes(TransposedProblem{20, 3, {10, 100}}, std::vector<uint8_t>(60), nullptr, true,
                  &status);
  EXPECT_TRUE(mentions(status, "group_sizes sum to 110 but there are only 20 rows"))
      << status.message();
  std::vector<uint8_t> q(8), q_t(2 * 128 * 4);
  const std::vector<int32_t> sizes = {2, 2, 0};
  auto call = [&](int64_t M, int64_t G, const uint8_t* q_data, uint8_t* q_t_data) {
    return nodrop::cpu::transpose_fp8_codes(q_data, sizes.data(), M, 2, G, q_t_data, false);
  };
  EXPECT_TRUE(call(4, 3, q.data(), q_t.data()).ok());
  status = call(-4, 3, q.data(), q_t.data());
  EXPECT_TRUE(mentions(status, "transpose_fp8_codes: M = -4 is negative")) << status.message();
  status = call(4, 3, nullptr, q_t.data());
  EXPECT_TRUE(mentions(status, "transpose_fp8_codes: q is null")) << status.message();
  status = call(4, 3, q.data(), nullptr);
  EXPECT_TRUE(mentions(status, "q_t is null")) << status.message();
  EXPECT_TRUE(call(0, 0, nullptr, nullptr).ok());  // nothing to write: PB = 0
}

// ---- quantize_fp8_weights and quantize_fp8_weights_transposed ----------------------------------

// The experts' weights w [G, K, N] -> q [G, K, N] and scale [G, KB, NB] (quantize_fp8_weights,
// the input gradient's operand) or q_t [G, N, K] and scale [G, NB, KB]
// (quantize_fp8_weights_transposed, the forward's): the same blocks and codes in either layout.
// The tests run on both, `transposed` picking the function.
struct WeightsProblem {
  int64_t G, K, N;
  int64_t KB() const { return (K + kBlock - 1) / kBlock; }
  int64_t NB() const { return (N + kBlock - 1) / kBlock; }
};

void PrintTo(const WeightsProblem& p, std::ostream* os) {
  *os << "G " << p.G << ", K " << p.K << ", N " << p.N;
}

const char* weights_function(bool transposed) {
  return transposed ? "quantize_fp8_weights_transposed" : "quantize_fp8_weights";
}

// A layout parameter's test name.
std::string layout_name(const testing::TestParamInfo<bool>& info) {
  return info.param ? "Transposed" : "InPlace";
}

// quantize_fp8_weights, or with `transposed` quantize_fp8_weights_transposed.
nodrop::Status quantize_weights_call(bool transposed, const void* w, DType dtype, int64_t G,
                                     int64_t K, int64_t N, const float* given_scale, uint8_t* q,
                                     float* scale, nodrop::ParallelRunner* runner = nullptr) {
  return transposed ? nodrop::cpu::quantize_fp8_weights_transposed(w, dtype, G, K, N, given_scale,
                                                                    q, scale, runner)
                    : nodrop::cpu::quantize_fp8_weights(w, dtype, G, K, N, given_scale, q, scale,
                                                        runner);
}

// One call's codes and scales, read by w's indices whichever the layout.
struct Weights {
  WeightsProblem p;
  bool transposed;
  std::vector<uint8_t> q;    // [G, K, N], or transposed [G, N, K]
  std::vector<float> scale;  // [G, KB, NB], or transposed [G, NB, KB]

  int64_t q_at(int64_t g, int64_t k, int64_t n) const {
    return transposed ? (g * p.N + n) * p.K + k : (g * p.K + k) * p.N + n;
  }
  int64_t scale_at(int64_t g, int64_t kb, int64_t nb) const {
    return transposed ? (g * p.NB() + nb) * p.KB() + kb : (g * p.KB() + kb) * p.NB() + nb;
  }
  uint8_t code(int64_t g, int64_t k, int64_t n) const { return q[q_at(g, k, n)]; }
  float block_scale(int64_t g, int64_t kb, int64_t nb) const {
    return scale[scale_at(g, kb, nb)];
  }
};

// Poisoned outputs between canaries (every byte must be written, none past the ends), inputs
// fenced (no read past them); given: null, or G scales.
Weights quantize_weights(bool transposed, const WeightsProblem& p, const Array& w,
                         nodrop::ParallelRunner* runner,
                         const std::vector<float>* given = nullptr) {
  Guarded<uint8_t> q(p.G * p.K * p.N, 0xab);
  Guarded<float> scale(p.G * p.KB() * p.NB(), std::nanf(""));
  const Fenced w_in(w);
  const Fenced given_in(given ? *given : std::vector<float>());
  const auto s = quantize_weights_call(transposed, w_in.data(), w.dtype(), p.G, p.K, p.N,
                                       given ? given_in.as<float>() : nullptr, q.data(),
                                       scale.data(), runner);
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(q.canaries_intact() && scale.canaries_intact());
  return {p, transposed, q.vec(), scale.vec()};
}

// The layout re-derived: block (kb, nb) of expert g is w[g, 128 kb.., 128 nb..] (shorter at the
// edges), its scale at scale[g, kb, nb] (transposed: scale[g, nb, kb]; given[g] where given), the
// code of w[g, k, n] at q[g, k, n] (transposed: q_t[g, n, k]).
void expect_weights(const Array& w, const Weights& got,
                    const std::vector<float>* given = nullptr) {
  const WeightsProblem& p = got.p;
  ASSERT_EQ(static_cast<int64_t>(got.q.size()), p.G * p.K * p.N);
  ASSERT_EQ(static_cast<int64_t>(got.scale.size()), p.G * p.KB() * p.NB());
  for (int64_t g = 0; g < p.G; ++g) {
    for (int64_t kb = 0; kb < p.KB(); ++kb) {
      for (int64_t nb = 0; nb < p.NB(); ++nb) {
        const int64_t k0 = kb * kBlock, k1 = std::min(p.K, k0 + kBlock);
        const int64_t n0 = nb * kBlock, n1 = std::min(p.N, n0 + kBlock);
        std::vector<float> values;
        for (int64_t k = k0; k < k1; ++k) {
          for (int64_t n = n0; n < n1; ++n) {
            values.push_back(static_cast<float>(w.at((g * p.K + k) * p.N + n)));
          }
        }
        const float s = given ? (*given)[g] : want_scale(values);
        const std::string where = "expert " + std::to_string(g) + " block (k " +
                                  std::to_string(kb) + ", n " + std::to_string(nb) + ")";
        ASSERT_NO_FATAL_FAILURE(expect_scale(got.block_scale(g, kb, nb), s, where));
        for (int64_t k = k0; k < k1; ++k) {
          for (int64_t n = n0; n < n1; ++n) {
            ASSERT_NO_FATAL_FAILURE(expect_code(
                got.code(g, k, n), values[(k - k0) * (n1 - n0) + (n - n0)], s,
                where + " w[" + std::to_string(k) + ", " + std::to_string(n) + "]"));
          }
        }
      }
    }
  }
}

// Bitwise equal, NaN scales included.
void expect_same(const Weights& a, const Weights& b) {
  EXPECT_EQ(a.q, b.q);
  ASSERT_EQ(a.scale.size(), b.scale.size());
  EXPECT_EQ(0, std::memcmp(a.scale.data(), b.scale.data(), a.scale.size() * sizeof(float)));
}

// Random weights whose magnitudes differ by block (2^-20 to 2^6, a different binade for each
// block and expert) and by up to 2^6 within a block: subnormal codes inside blocks; float16
// stays finite (at most 3 * 2^12).
Array random_weights(DType dtype, const WeightsProblem& p, uint32_t seed) {
  std::mt19937 rng(seed);
  Array w = nodrop_test::random_array(dtype, p.G * p.K * p.N, rng, -3.0, 3.0);
  for (int64_t g = 0; g < p.G; ++g) {
    for (int64_t k = 0; k < p.K; ++k) {
      for (int64_t n = 0; n < p.N; ++n) {
        const int64_t i = (g * p.K + k) * p.N + n;
        const int block = int((7 * g + 3 * (k / kBlock) + n / kBlock) % 27) - 20;
        w.set(i, w.at(i) * std::ldexp(1.0, block + int((k + 2 * n) % 7)));
      }
    }
  }
  return w;
}

// (transposed, dtype, shape).
class QuantizeFp8Weights
    : public testing::TestWithParam<std::tuple<bool, DType, WeightsProblem>> {};

TEST_P(QuantizeFp8Weights, MatchesTheLayoutAndTheBruteForceEncoder) {
  const auto& [transposed, dtype, p] = GetParam();
  const Array w = random_weights(dtype, p, 21);
  const Weights serial = quantize_weights(transposed, p, w, nullptr);
  ASSERT_NO_FATAL_FAILURE(expect_weights(w, serial));
  ThreadRunner runner(3);
  const Weights threaded = quantize_weights(transposed, p, w, &runner);
  expect_same(threaded, serial);  // threads change nothing
  if (p.N > 0 && p.G * p.KB() > 1) {
    EXPECT_GT(runner.calls(), 0);  // the threaded path did run
  }
}

// A tensorwise recipe's scales given, one per expert and differing by expert: each expert's own
// amax (no saturation), then a mix of half of it (its largest values saturate), 0.01 (most
// values saturate), NaN (every code of that expert NaN, the others' unaffected) and a tiny one.
TEST_P(QuantizeFp8Weights, GivenScalesReplaceEveryBlocksOwnPerExpert) {
  const auto& [transposed, dtype, p] = GetParam();
  const Array w = random_weights(dtype, p, 22);
  std::vector<float> per_expert(p.G);
  for (int64_t g = 0; g < p.G; ++g) {
    std::vector<float> expert(p.K * p.N);
    for (int64_t i = 0; i < p.K * p.N; ++i) {
      expert[i] = static_cast<float>(w.at(g * p.K * p.N + i));
    }
    per_expert[g] = want_scale(expert);
  }
  const float mix_of[] = {0.5f, 0.01f, std::nanf(""), 1e-30f};
  std::vector<float> mixed(p.G);
  for (int64_t g = 0; g < p.G; ++g) {
    mixed[g] = g % 4 == 0 ? per_expert[g] * mix_of[0] : mix_of[g % 4];
  }
  for (const std::vector<float>* given : {&per_expert, &mixed}) {
    SCOPED_TRACE(given == &per_expert ? "each expert's amax" : "a mix");
    const Weights serial = quantize_weights(transposed, p, w, nullptr, given);
    ASSERT_NO_FATAL_FAILURE(expect_weights(w, serial, given));
    ThreadRunner runner(3);
    expect_same(quantize_weights(transposed, p, w, &runner, given), serial);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantizeFp8Weights,
    testing::Combine(testing::Bool(), testing::ValuesIn(nodrop_test::kAllDtypes),
                     testing::Values(WeightsProblem{3, 300, 260},  // short edge blocks both ways
                                     WeightsProblem{2, 128, 128},  // whole blocks
                                     WeightsProblem{2, 136, 264},  // edges of 8 both ways
                                     WeightsProblem{1, 7, 5},      // less than a block
                                     WeightsProblem{5, 3, 129},    // five experts, mixed given
                                     WeightsProblem{0, 5, 4},      // no experts
                                     WeightsProblem{2, 0, 4},      // no rows
                                     WeightsProblem{2, 4, 0})));   // no columns

// (transposed, dtype).
class QuantizeFp8WeightsValues : public testing::TestWithParam<std::tuple<bool, DType>> {};

// G = 2, K = 300, N = 260 (blocks of 128, 128 and 44 rows by 128, 128 and 4 columns): an all-zero
// block and a block of tiny values (amax / 448 below float32's smallest normal: scale 1 either
// way), a NaN in a short block and an inf in a narrow one (scale NaN, that block's codes NaN
// and no other's), and a block whose amax is 7 (7 -> 448).
TEST_P(QuantizeFp8WeightsValues, ZeroTinyNonFiniteAndAmaxBlocks) {
  const auto& [transposed, dtype] = GetParam();
  const WeightsProblem p{2, 300, 260};
  const int64_t K = p.K, N = p.N, KB = p.KB(), NB = p.NB();
  std::mt19937 rng(23);
  Array w = nodrop_test::random_array(dtype, p.G * K * N, rng, -3.0, 3.0);
  auto at = [&](int64_t g, int64_t k, int64_t n) { return (g * K + k) * N + n; };
  for (int64_t k = 0; k < 128; ++k) {
    for (int64_t n = 0; n < 128; ++n) {
      w.set(at(0, k, n), 0.0);                                   // expert 0, block (0, 0)
      w.set(at(0, 128 + k, n), 1e-37 * double((k + n) % 5 - 2));  // expert 0, block (1, 0)
      w.set(at(1, 128 + k, 128 + n), k == 3 && n == 9 ? -7.0 : 1.0);  // expert 1, block (1, 1)
    }
  }
  w.set(at(0, 260, 130), std::numeric_limits<double>::quiet_NaN());  // expert 0, block (2, 1)
  w.set(at(1, 5, 258), std::numeric_limits<double>::infinity());    // expert 1, block (0, 2)
  const Weights got = quantize_weights(transposed, p, w, nullptr);
  ASSERT_NO_FATAL_FAILURE(expect_weights(w, got));
  EXPECT_EQ(got.block_scale(0, 0, 0), 1.0f);
  EXPECT_EQ(got.block_scale(0, 1, 0), 1.0f);
  EXPECT_EQ(got.code(0, 0, 0), 0);
  EXPECT_TRUE(std::isnan(got.block_scale(0, 2, 1)));
  EXPECT_TRUE(std::isnan(got.block_scale(1, 0, 2)));
  EXPECT_EQ(got.block_scale(1, 1, 1), 7.0f * (1.0f / kE4M3Max));
  EXPECT_EQ(got.code(1, 128 + 3, 128 + 9), 0xfe);  // -7: the block's amax -> -448
  // The NaN and the inf stay in their blocks: every code of those blocks is NaN, no other is.
  int64_t nan_codes = 0;
  for (int64_t g = 0; g < p.G; ++g) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t n = 0; n < N; ++n) {
        const bool in_nan_block = (g == 0 && k >= 256 && n >= 128 && n < 256) ||
                                  (g == 1 && k < 128 && n >= 256);
        ASSERT_EQ((got.code(g, k, n) & 0x7f) == 0x7f, in_nan_block)
            << "expert " << g << " w[" << k << ", " << n << "]";
        nan_codes += in_nan_block;
      }
    }
  }
  EXPECT_EQ(nan_codes, 44 * 128 + 128 * 4);
  for (int64_t g = 0; g < p.G; ++g) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      for (int64_t nb = 0; nb < NB; ++nb) {
        const bool nan_block = (g == 0 && kb == 2 && nb == 1) || (g == 1 && kb == 0 && nb == 2);
        EXPECT_EQ(std::isnan(got.block_scale(g, kb, nb)), nan_block)
            << g << " " << kb << " " << nb;
      }
    }
  }
  ThreadRunner runner(3);
  expect_same(quantize_weights(transposed, p, w, &runner), got);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizeFp8WeightsValues,
                         testing::Combine(testing::Bool(),
                                          testing::ValuesIn(nodrop_test::kAllDtypes)));

class QuantizeFp8WeightsGiven : public testing::TestWithParam<bool> {};  // transposed

// Given scales 0.01 and 2 for two experts of 7 x 5: expert 0's +-100 saturate to +-448 and
// expert 1's 3 is 1.5 (code 0x3c); every scale of an expert is its given one, and a NaN given
// makes that expert's codes NaN only.
TEST_P(QuantizeFp8WeightsGiven, GivenScalesSaturateAndDifferByExpert) {
  const bool transposed = GetParam();
  const WeightsProblem p{2, 7, 5};
  Array w(DType::kFloat32, p.G * p.K * p.N);
  for (int64_t i = 0; i < p.K * p.N; ++i) {
    w.set(i, i % 2 ? -100.0 : 100.0);
    w.set(p.K * p.N + i, 3.0);
  }
  const std::vector<float> given = {0.01f, 2.0f};
  const Weights got = quantize_weights(transposed, p, w, nullptr, &given);
  ASSERT_NO_FATAL_FAILURE(expect_weights(w, got, &given));
  EXPECT_EQ(got.scale, given);  // KB = NB = 1
  for (int64_t k = 0; k < p.K; ++k) {
    for (int64_t n = 0; n < p.N; ++n) {
      EXPECT_EQ(got.code(0, k, n), (k * p.N + n) % 2 ? 0xfe : 0x7e) << k << ", " << n;
      EXPECT_EQ(got.code(1, k, n), 0x3c) << k << ", " << n;
    }
  }
  const std::vector<float> nan_first = {std::nanf(""), 2.0f};
  const Weights nan = quantize_weights(transposed, p, w, nullptr, &nan_first);
  ASSERT_NO_FATAL_FAILURE(expect_weights(w, nan, &nan_first));
  for (int64_t i = 0; i < p.K * p.N; ++i) {  // expert g's codes are q[g] in either layout
    EXPECT_EQ(nan.q[i] & 0x7f, 0x7f) << i;
    EXPECT_EQ(nan.q[p.K * p.N + i], 0x3c) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, QuantizeFp8WeightsGiven, testing::Bool(), layout_name);

class QuantizeFp8WeightsLayouts : public testing::TestWithParam<DType> {};

// quantize_fp8_weights is quantize_fp8_weights_transposed with axes 1 and 2 of q and of scale
// swapped, bit for bit: on short edge blocks both ways, with a zero block, a NaN of either sign
// (the CPU keeps -NaN's sign, 0xff) and an inf, each block's own scales and given ones (one NaN).
TEST_P(QuantizeFp8WeightsLayouts, InPlaceIsTheTransposedWithAxesSwapped) {
  const DType dtype = GetParam();
  const WeightsProblem p{3, 300, 260};
  Array w = random_weights(dtype, p, 24);
  auto at = [&](int64_t g, int64_t k, int64_t n) { return (g * p.K + k) * p.N + n; };
  for (int64_t k = 0; k < 128; ++k) {
    for (int64_t n = 0; n < 128; ++n) w.set(at(2, 128 + k, n), 0.0);
  }
  w.set(at(0, 299, 259), std::numeric_limits<double>::quiet_NaN());
  w.set(at(1, 17, 200), -std::numeric_limits<double>::quiet_NaN());
  w.set(at(2, 250, 3), -std::numeric_limits<double>::infinity());
  const std::vector<float> given = {0.01f, std::nanf(""), 0.125f};
  for (const std::vector<float>* scales : {static_cast<const std::vector<float>*>(nullptr),
                                           &given}) {
    SCOPED_TRACE(scales ? "given scales" : "each block's own scale");
    const Weights in_place = quantize_weights(false, p, w, nullptr, scales);
    const Weights transposed = quantize_weights(true, p, w, nullptr, scales);
    int64_t nans = 0;
    for (int64_t g = 0; g < p.G; ++g) {
      for (int64_t k = 0; k < p.K; ++k) {
        for (int64_t n = 0; n < p.N; ++n) {
          ASSERT_EQ(in_place.q[(g * p.K + k) * p.N + n], transposed.q[(g * p.N + n) * p.K + k])
              << "expert " << g << " w[" << k << ", " << n << "]";
          nans += (in_place.q[(g * p.K + k) * p.N + n] & 0x7f) == 0x7f;
        }
      }
      for (int64_t kb = 0; kb < p.KB(); ++kb) {
        for (int64_t nb = 0; nb < p.NB(); ++nb) {
          const float a = in_place.scale[(g * p.KB() + kb) * p.NB() + nb];
          const float b = transposed.scale[(g * p.NB() + nb) * p.KB() + kb];
          ASSERT_EQ(0, std::memcmp(&a, &b, sizeof(float)))
              << "expert " << g << " block (k " << kb << ", n " << nb << "): " << a << ", " << b;
        }
      }
    }
    EXPECT_GT(nans, 0);  // the non-finite values did reach the codes
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizeFp8WeightsLayouts,
                         testing::ValuesIn(nodrop_test::kAllDtypes));

class QuantizeFp8WeightsArgs : public testing::TestWithParam<bool> {};  // transposed

TEST_P(QuantizeFp8WeightsArgs, RejectsNegativeShapesAndNullBuffers) {
  const bool transposed = GetParam();
  const std::string function = weights_function(transposed);
  std::vector<float> w(2 * 3 * 4, 1.0f), scale(2);
  std::vector<uint8_t> q(2 * 3 * 4);
  auto call = [&](int64_t G, int64_t K, int64_t N, const float* w_data, uint8_t* q_data,
                  float* scale_data) {
    return quantize_weights_call(transposed, w_data, DType::kFloat32, G, K, N, nullptr, q_data,
                                 scale_data);
  };
  EXPECT_TRUE(call(2, 3, 4, w.data(), q.data(), scale.data()).ok());
  auto status = call(2, -1, 4, w.data(), q.data(), scale.data());
  EXPECT_TRUE(mentions(status, function + ": K = -1 is negative")) << status.message();
  status = call(-2, 3, 4, w.data(), q.data(), scale.data());
  EXPECT_TRUE(mentions(status, function + ": G = -2 is negative")) << status.message();
  status = call(2, 3, -4, w.data(), q.data(), scale.data());
  EXPECT_TRUE(mentions(status, function + ": N = -4 is negative")) << status.message();
  status = call(2, 3, 4, nullptr, q.data(), scale.data());
  EXPECT_TRUE(mentions(status, function + ": w is null")) << status.message();
  status = call(2, 3, 4, w.data(), nullptr, scale.data());
  EXPECT_TRUE(mentions(status, function + (transposed ? ": q_t is null" : ": q is null")))
      << status.message();
  status = call(2, 3, 4, w.data(), q.data(), nullptr);
  EXPECT_TRUE(mentions(status, function + ": scale is null")) << status.message();
  // Nothing to read or write: every buffer may be null, and nothing is written.
  EXPECT_TRUE(call(0, 3, 4, nullptr, nullptr, nullptr).ok());
  EXPECT_TRUE(call(2, 0, 4, nullptr, nullptr, nullptr).ok());
  EXPECT_TRUE(call(2, 3, 0, nullptr, nullptr, nullptr).ok());
  Guarded<uint8_t> untouched_q(4, 0xcd);
  Guarded<float> untouched_scale(4, -7.0f);
  const float given[2] = {1.0f, 1.0f};
  EXPECT_TRUE(quantize_weights_call(transposed, w.data(), DType::kBFloat16, 2, 0, 4, given,
                                    untouched_q.data(), untouched_scale.data())
                  .ok());
  EXPECT_EQ(untouched_q.vec(), std::vector<uint8_t>(4, 0xcd));
  EXPECT_EQ(untouched_scale.vec(), std::vector<float>(4, -7.0f));
  EXPECT_TRUE(untouched_q.canaries_intact() && untouched_scale.canaries_intact());
}

INSTANTIATE_TEST_SUITE_P(Layouts, QuantizeFp8WeightsArgs, testing::Bool(), layout_name);

// ---- permute_rows_fp8 -----------------------------------------------------------------------

class PermuteRowsFp8 : public testing::TestWithParam<DType> {};

// A row_map of `slots` slots: a permutation of the first `mapped` rows, every fifth slot dropped
// (-1), so rows [mapped, slots) are the ones no slot maps to, as sort_by_expert leaves them.
std::vector<int32_t> dropping_row_map(int64_t slots, std::mt19937& rng, int64_t* mapped) {
  std::vector<int32_t> row_map(slots);
  std::vector<int32_t> rows_left(slots);
  std::iota(rows_left.begin(), rows_left.end(), 0);
  std::shuffle(rows_left.begin(), rows_left.end(), rng);
  int64_t next = 0;
  for (int64_t i = 0; i < slots; ++i) row_map[i] = i % 5 == 4 ? -1 : rows_left[next++];
  // Rows past the mapped ones stay unmapped only if the mapped rows are the first n: remap.
  std::vector<int32_t> order(rows_left.begin(), rows_left.begin() + next);
  std::sort(order.begin(), order.end());
  for (int32_t& row : row_map) {
    if (row >= 0) row = int32_t(std::lower_bound(order.begin(), order.end(), row) - order.begin());
  }
  *mapped = next;
  return row_map;
}

// Bitwise permute_rows and quantize_fp8 of its rows, for k = 1 and 3, H = 300 (a short last
// block) and 5 (less than a block), with dropped slots (row_map -1): their rows are zero rows,
// codes 0 and scale 1; and the codes of a NaN and of a saturating block.
TEST_P(PermuteRowsFp8, IsPermuteRowsThenQuantizeFp8) {
  const DType dtype = GetParam();
  for (const auto& [k, H] : {std::pair<int64_t, int64_t>{1, 300}, {3, 300}, {3, 5}}) {
    const int64_t T = 29, slots = T * k, blocks = (H + 127) / 128;
    std::mt19937 rng(11);
    Array x = nodrop_test::random_array(dtype, T * H, rng, -3e3, 3e3);
    x.set(2 * H + H / 2, std::numeric_limits<double>::quiet_NaN());
    int64_t next = 0;
    const std::vector<int32_t> row_map = dropping_row_map(slots, rng, &next);
    Array want_rows(dtype, slots * H);
    nodrop::cpu::permute_rows(x.data(), dtype, row_map.data(), nullptr, T, k, H,
                              want_rows.data());
    std::vector<uint8_t> want_q(slots * H);
    std::vector<float> want_scale(slots * blocks);
    ASSERT_TRUE(nodrop::cpu::quantize_fp8(want_rows.data(), dtype, slots, H, 128, want_q.data(),
                                          want_scale.data()).ok());
    Array rows(dtype, slots * H);
    Guarded<uint8_t> q(slots * H, 0xEE);
    Guarded<float> scale(slots * blocks, -7.0f);
    ThreadRunner runner(3);
    ASSERT_TRUE(nodrop::cpu::permute_rows_fp8(x.data(), dtype, row_map.data(), T, k, H, nullptr,
                                              rows.data(), q.data(), scale.data(), &runner)
                    .ok());
    EXPECT_EQ(rows.raw(), want_rows.raw()) << "k " << k << ", H " << H;
    EXPECT_EQ(q.vec(), want_q) << "k " << k << ", H " << H;
    for (int64_t i = 0; i < slots * blocks; ++i) {
      expect_scale(scale[i], want_scale[i], "block " + std::to_string(i));
    }
    EXPECT_TRUE(rows.canaries_intact() && q.canaries_intact() && scale.canaries_intact());
    for (int64_t r = next; r < slots; ++r) {  // the unmapped rows: a zero row's quantisation
      EXPECT_EQ(scale[r * blocks], 1.0f);
      EXPECT_EQ(q[r * H], 0);
    }
  }
}

// A tensorwise recipe's scale given: the tokens' amax (every row is a copy of a token), then half
// of it (the largest values saturate), a tiny one (every nonzero value saturates) and NaN (every
// code NaN). The codes are bitwise the tensorwise quantisation of the permuted rows
// (quantize_fp8_transposed of them as one group, the same scale given) and the brute-force
// encoder's; every scale, the unmapped rows' included, is the given one, and the unmapped rows'
// codes are 0.
TEST_P(PermuteRowsFp8, AGivenScaleIsTheTensorwiseQuantisationOfTheRows) {
  const DType dtype = GetParam();
  for (const auto& [k, H] : {std::pair<int64_t, int64_t>{1, 300}, {3, 300}, {3, 5}}) {
    const int64_t T = 29, slots = T * k, blocks = (H + 127) / 128;
    std::mt19937 rng(13);
    const Array x = nodrop_test::random_array(dtype, T * H, rng, -3e3, 3e3);
    int64_t next = 0;
    const std::vector<int32_t> row_map = dropping_row_map(slots, rng, &next);
    Array want_rows(dtype, slots * H);
    nodrop::cpu::permute_rows(x.data(), dtype, row_map.data(), nullptr, T, k, H,
                              want_rows.data());
    std::vector<float> tokens(T * H);
    for (int64_t i = 0; i < T * H; ++i) tokens[i] = static_cast<float>(x.at(i));
    const float tensorwise = want_scale(tokens);
    for (const float given : {tensorwise, tensorwise * 0.5f, 1e-30f, std::nanf("")}) {
      SCOPED_TRACE("k " + std::to_string(k) + ", H " + std::to_string(H) + ", given " +
                   std::to_string(given));
      const TransposedProblem p{slots, H, {static_cast<int32_t>(next)}};
      const Transposed want = quantize_transposed(p, want_rows, nullptr, false, nullptr, &given);
      Array rows(dtype, slots * H);
      Guarded<uint8_t> q(slots * H, 0xEE);
      Guarded<float> scale(slots * blocks, -7.0f);
      ThreadRunner runner(3);
      ASSERT_TRUE(nodrop::cpu::permute_rows_fp8(x.data(), dtype, row_map.data(), T, k, H,
                                                &given, rows.data(), q.data(), scale.data(),
                                                &runner)
                      .ok());
      EXPECT_EQ(rows.raw(), want_rows.raw());
      EXPECT_TRUE(rows.canaries_intact() && q.canaries_intact() && scale.canaries_intact());
      for (int64_t r = 0; r < slots; ++r) {
        for (int64_t c = 0; c < H; ++c) {
          const std::string where = "row " + std::to_string(r) + " column " + std::to_string(c);
          if (r < next) {
            ASSERT_EQ(q[r * H + c], want.q_t[c * p.P() + r]) << where;
            ASSERT_NO_FATAL_FAILURE(
                expect_code(q[r * H + c], static_cast<float>(want_rows.at(r * H + c)), given,
                            where));
          } else {
            ASSERT_EQ(q[r * H + c], 0) << where;
          }
        }
      }
      for (int64_t i = 0; i < slots * blocks; ++i) {
        ASSERT_NO_FATAL_FAILURE(expect_scale(scale[i], given, "block " + std::to_string(i)));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PermuteRowsFp8, testing::ValuesIn(nodrop_test::kAllDtypes));

TEST(PermuteRowsFp8Args, NamesTheNullBufferAndDoesNothingWhenEmpty) {
  float x = 1.0f, scale = 0.0f;
  int32_t row_map = 0;
  uint8_t q = 0;
  const auto status = nodrop::cpu::permute_rows_fp8(&x, DType::kFloat32, &row_map, 1, 1, 1,
                                                    nullptr, nullptr, &q, &scale);
  EXPECT_TRUE(mentions(status, "permute_rows_fp8: dst is null")) << status.message();
  EXPECT_TRUE(mentions(nodrop::cpu::permute_rows_fp8(&x, DType::kFloat32, &row_map, 1, -2, 1,
                                                     nullptr, &x, &q, &scale),
                       "k = -2 is negative"));
  EXPECT_TRUE(nodrop::cpu::permute_rows_fp8(nullptr, DType::kFloat32, nullptr, 0, 2, 4, nullptr,
                                            nullptr, nullptr, nullptr)
                  .ok());
}

}  // namespace
