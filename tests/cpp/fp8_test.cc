// Tests of quantize_fp8 (1 x block FP8 scaling) against a brute-force E4M3 encoder: the nearest
// of the 127 finite magnitudes, ties to the even code.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "nodrop/engine_cpu.h"
#include "test_util.h"

namespace {

using nodrop::DType;
using nodrop_test::Array;
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

// What quantize_fp8 must give: scales from each block's amax, codes from the brute-force encoder.
void expect_quantized(const Array& x, int64_t M, int64_t C, int64_t block,
                      const std::vector<uint8_t>& q, const std::vector<float>& scale) {
  const int64_t blocks = (C + block - 1) / block;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = b * block; i < std::min(C, (b + 1) * block); ++i) {
        const float v = static_cast<float>(x.at(r * C + i));
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::fabs(v));
      }
      const float want = !finite ? std::nanf("") : amax * (1.0f / kE4M3Max) > 0.0f
                                                       ? amax * (1.0f / kE4M3Max) : 1.0f;
      const float got = scale[r * blocks + b];
      ASSERT_TRUE(std::isnan(want) ? std::isnan(got) : got == want)
          << "scale of row " << r << " block " << b << ": got " << got << ", want " << want;
      const float inverse = 1.0f / want;
      for (int64_t i = b * block; i < std::min(C, (b + 1) * block); ++i) {
        float v = static_cast<float>(x.at(r * C + i)) * inverse;
        if (!std::isnan(v)) v = std::min(std::max(v, -kE4M3Max), kE4M3Max);
        const uint8_t code = q[r * C + i];
        if (std::isnan(v)) {
          ASSERT_EQ(code & 0x7f, 0x7f) << "element " << r << ", " << i << " is not NaN";
        } else {
          ASSERT_EQ(code, e4m3_reference(v)) << "element " << r << ", " << i << ": " << v;
        }
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

}  // namespace
