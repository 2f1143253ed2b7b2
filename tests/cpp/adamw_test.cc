// Tests of the CPU AdamW step against a double-precision reference of the same arithmetic, its
// statistics, clipping, in-place updates, 16-bit gradients, chunking edge cases and invalid
// configurations.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "nodrop/engine_cpu.h"
#include "test_util.h"

namespace {

using nodrop::AdamWConfig;
using nodrop::DType;
using nodrop::kAdamWSums;
using nodrop::Status;
using nodrop_test::mentions;
using nodrop_test::random_floats;
using nodrop_test::ThreadRunner;
using Floats = std::vector<float>;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct State {
  Floats param, grad, mu, nu;
};

State random_state(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  State s{random_floats(n, rng), random_floats(n, rng, -1e-3, 1e-3),
          random_floats(n, rng, -1e-3, 1e-3), random_floats(n, rng, 0.0, 1e-6)};
  return s;
}

AdamWConfig make_config(int64_t n, int64_t partials, float weight_decay = 0.1f,
                        float update_scale = 1.0f, float max_grad_norm = 0.0f) {
  AdamWConfig c;
  c.num_elements = n;
  c.num_partials = partials;
  c.b1 = 0.9f;
  c.b2 = 0.95f;
  c.eps = 1e-8f;
  c.weight_decay = weight_decay;
  c.update_scale = update_scale;
  c.max_grad_norm = max_grad_norm;
  return c;
}

// step_size, grad_norm, 1 - b1^t, 1 - b2^t at step t = 3.
const Floats kScalars = {-3e-4f, 0.5f, 1.0f - 0.9f * 0.9f * 0.9f, 1.0f - 0.95f * 0.95f * 0.95f};

struct Result {
  State state;
  Floats partials;
  Status status;
};

Result run(State s, const AdamWConfig& c, const Floats& scalars = kScalars,
           ThreadRunner* runner = nullptr) {
  Result r{s, Floats(c.num_partials * kAdamWSums, kNaN), Status::Ok()};
  r.status = nodrop::cpu::adamw_update(s.param.data(), s.grad.data(), DType::kFloat32,
                                       s.mu.data(), s.nu.data(), scalars.data(), c,
                                       r.state.param.data(), r.state.mu.data(),
                                       r.state.nu.data(), r.partials.data(), runner);
  return r;
}

// The step on the gradient given as 16-bit values of `dtype` (s.grad rounded to it).
Result run_16bit(const State& s, DType dtype, const AdamWConfig& c) {
  std::vector<uint16_t> grad;
  for (float g : s.grad) {
    grad.push_back(dtype == DType::kBFloat16 ? nodrop_test::float_to_bf16(g)
                                             : nodrop_test::float_to_fp16(g));
  }
  Result r{s, Floats(c.num_partials * kAdamWSums, kNaN), Status::Ok()};
  r.status = nodrop::cpu::adamw_update(s.param.data(), grad.data(), dtype, s.mu.data(),
                                       s.nu.data(), kScalars.data(), c, r.state.param.data(),
                                       r.state.mu.data(), r.state.nu.data(), r.partials.data());
  return r;
}

// The same step in double precision: new param, mu, nu and the update, per element.
struct Reference {
  std::vector<double> param, mu, nu, update;
};

Reference reference(const State& s, const AdamWConfig& c, const Floats& scalars) {
  Reference r;
  const bool clip = c.max_grad_norm > 0 && !(scalars[1] < c.max_grad_norm);
  for (size_t j = 0; j < s.param.size(); ++j) {
    const double g = clip ? double(s.grad[j]) / scalars[1] * c.max_grad_norm : s.grad[j];
    const double m = (1.0 - c.b1) * g + double(c.b1) * s.mu[j];
    const double v = (1.0 - c.b2) * g * g + double(c.b2) * s.nu[j];
    double u = (m / scalars[2]) / (std::sqrt(v / scalars[3]) + c.eps);
    u += double(c.weight_decay) * s.param[j];
    u *= double(scalars[0]) * c.update_scale;
    r.param.push_back(s.param[j] + u);
    r.mu.push_back(m);
    r.nu.push_back(v);
    r.update.push_back(u);
  }
  return r;
}

// max |got - want| / max |want| within `tolerance`.
void expect_close(const Floats& got, const std::vector<double>& want, double tolerance,
                  const char* what) {
  EXPECT_LT(nodrop_test::rel_error(nodrop_test::to_double(got), want), tolerance) << what;
}

TEST(AdamW, MatchesDoubleReferenceAndSumsPerChunk) {
  const int64_t n = 1003, partials = 7;  // n not a multiple of 4 or of the chunk
  const State s = random_state(n, 1);
  for (float max_grad_norm : {0.0f, 1.0f, 0.25f}) {  // off, not reached (norm 0.5), clipping
    const AdamWConfig c = make_config(n, partials, 0.1f, 1.0f, max_grad_norm);
    const Result r = run(s, c);
    ASSERT_TRUE(r.status.ok()) << r.status.message();
    const Reference want = reference(s, c, kScalars);
    expect_close(r.state.mu, want.mu, 1e-6, "mu");
    expect_close(r.state.nu, want.nu, 1e-6, "nu");
    expect_close(r.state.param, want.param, 2e-7, "param");  // one rounding of param + u
    const int64_t chunk = nodrop::adamw_chunk(n, partials);
    EXPECT_EQ(chunk, 144);
    for (int64_t i = 0; i < partials; ++i) {
      double square = 0;
      for (int64_t j = i * chunk; j < std::min(n, (i + 1) * chunk); ++j) {
        square += want.update[j] * want.update[j];
      }
      const float* p = &r.partials[i * kAdamWSums];
      EXPECT_NEAR(p[0], square, 1e-5 * square) << "chunk " << i;
      EXPECT_EQ(p[1], 0.0f);  // (u * 2^-70)^2 underflows for u ~ 1e-4: the plain sum is used
      EXPECT_NEAR(p[2], square * std::ldexp(1.0, 140), 1e-5 * square * std::ldexp(1.0, 140));
      EXPECT_EQ(p[3], 0.0f);
      EXPECT_EQ(p[4], 0.0f);
    }
  }
}

TEST(AdamW, InPlaceAndThreadedGiveTheSameBits) {
  const int64_t n = 4099, num_partials = 9;
  const State s = random_state(n, 2);
  const AdamWConfig c = make_config(n, num_partials);
  const Result once = run(s, c);
  ThreadRunner runner(4);
  const Result threaded = run(s, c, kScalars, &runner);
  EXPECT_GT(runner.calls(), 0);
  EXPECT_EQ(threaded.state.param, once.state.param);
  EXPECT_EQ(threaded.partials, once.partials);
  State in_place = s;
  Floats partials(num_partials * kAdamWSums);
  ASSERT_TRUE(nodrop::cpu::adamw_update(in_place.param.data(), in_place.grad.data(),
                                        DType::kFloat32, in_place.mu.data(), in_place.nu.data(),
                                        kScalars.data(), c, in_place.param.data(),
                                        in_place.mu.data(), in_place.nu.data(), partials.data())
                  .ok());
  EXPECT_EQ(in_place.param, once.state.param);
  EXPECT_EQ(in_place.mu, once.state.mu);
  EXPECT_EQ(in_place.nu, once.state.nu);
  EXPECT_EQ(partials, once.partials);
}

// A bfloat16 or float16 gradient is the float32 step on its widened values, bit for bit (the
// trainer passes the 16-bit gradients of weights the model computes in 16 bits).
TEST(AdamW, SixteenBitGradientIsTheStepOnItsWidenedValues) {
  const int64_t n = 1003, num_partials = 7;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    State s = random_state(n, 8);
    if (dtype == DType::kFloat16) {
      for (float& g : s.grad) g *= 1000.0f;  // into float16's normal range
    }
    s.grad[3] = kNaN;
    s.grad[4] = -kInf;
    State widened = s;
    for (float& g : widened.grad) g = float(nodrop_test::round_to(dtype, g));
    for (float max_grad_norm : {0.0f, 0.25f}) {
      const AdamWConfig c = make_config(n, num_partials, 0.1f, 1.0f, max_grad_norm);
      const Result got = run_16bit(s, dtype, c), want = run(widened, c);
      ASSERT_TRUE(got.status.ok()) << got.status.message();
      EXPECT_EQ(0, std::memcmp(got.state.param.data(), want.state.param.data(), n * 4))
          << nodrop_test::short_name(dtype);
      EXPECT_EQ(0, std::memcmp(got.state.mu.data(), want.state.mu.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(got.state.nu.data(), want.state.nu.data(), n * 4));
      EXPECT_EQ(0, std::memcmp(got.partials.data(), want.partials.data(),
                               got.partials.size() * 4));
    }
  }
}

TEST(AdamW, ClippingIsTheGradientRescaledFirst) {
  const int64_t n = 64;
  State s = random_state(n, 3);
  const AdamWConfig clipped = make_config(n, 1, 0.1f, 1.0f, 0.25f);
  const Result r = run(s, clipped);  // grad_norm 0.5 >= 0.25
  for (float& g : s.grad) g = (g / kScalars[1]) * 0.25f;
  const Result rescaled = run(s, make_config(n, 1));
  EXPECT_EQ(r.state.param, rescaled.state.param);
  EXPECT_EQ(r.state.mu, rescaled.state.mu);
  // A NaN norm clips too, as optax's select does: every value turns NaN and is counted.
  Floats nan_norm = kScalars;
  nan_norm[1] = kNaN;
  const Result bad = run(random_state(n, 3), clipped, nan_norm);
  EXPECT_TRUE(std::isnan(bad.state.param[0]));
  EXPECT_EQ(bad.partials[3], float(n));
}

TEST(AdamW, WeightDecayAndUpdateScaleApplyWhereSet) {
  const int64_t n = 32;
  State s = random_state(n, 4);
  s.param[5] = kInf;  // decay 0 never reads the parameter into the update
  const Result plain = run(s, make_config(n, 1, 0.0f));
  EXPECT_EQ(plain.state.param[5], kInf);
  EXPECT_EQ(plain.partials[3], 1.0f);  // the new parameter is not finite
  EXPECT_EQ(plain.partials[4], 0.0f);
  const Result scaled = run(s, make_config(n, 1, 0.0f, 0.5f));
  for (int64_t j = 0; j < n; ++j) {
    if (j == 5) continue;
    const float u = plain.state.param[j] - s.param[j], half = scaled.state.param[j] - s.param[j];
    EXPECT_NEAR(half, 0.5f * u, 1e-6f * std::abs(s.param[j]) + 1e-12f) << j;
  }
  const Result decayed = run(s, make_config(n, 1, 0.1f));
  EXPECT_TRUE(std::isnan(decayed.state.param[5]));  // inf + -3e-5 * inf
}

TEST(AdamW, CountsNonFiniteUpdatesAndSquares) {
  const int64_t n = 12;
  State s = random_state(n, 5);
  s.grad[0] = kNaN;
  s.grad[7] = kInf;
  // An update past 1.8e19 (here a step size of 1e30): its square overflows, the scaled one not.
  Floats huge = kScalars;
  huge[0] = -1e30f;
  const Result r = run(s, make_config(n, 3, 0.0f), huge);
  ASSERT_TRUE(r.status.ok());
  float nonfinite = 0, square_overflows = 0;
  for (int64_t i = 0; i < 3; ++i) {
    nonfinite += r.partials[i * kAdamWSums + 3];
    square_overflows += r.partials[i * kAdamWSums + 4];
  }
  EXPECT_EQ(nonfinite, 2.0f);  // NaN, and inf / inf
  EXPECT_EQ(square_overflows, float(n));
  EXPECT_TRUE(std::isnan(r.partials[1]));  // chunk 0 holds the NaN update
  // Chunk 2 (elements 8-11) is finite: its plain sum overflowed, the scaled one holds it.
  const float* last = &r.partials[2 * kAdamWSums];
  EXPECT_EQ(last[0], kInf);
  double down = 0;
  for (int64_t j = 8; j < 12; ++j) {
    const double u = double(r.state.param[j]) - s.param[j];
    down += u * u * std::ldexp(1.0, -140);
  }
  EXPECT_NEAR(last[1], down, 1e-5 * down);
}

TEST(AdamW, ChunksPastTheElementsSumToZero) {
  for (int64_t n : {0, 1, 5}) {
    const State s = random_state(n, 6);
    const Result r = run(s, make_config(n, 8));
    ASSERT_TRUE(r.status.ok()) << r.status.message();
    const int64_t chunk = nodrop::adamw_chunk(n, 8);
    EXPECT_EQ(chunk, 4);
    for (int64_t i = 0; i < 8; ++i) {
      const bool holds = i * chunk < n;
      EXPECT_EQ(r.partials[i * kAdamWSums] > 0, holds) << "n " << n << " chunk " << i;
    }
  }
}

TEST(AdamW, RefusesInvalidConfigsNamingTheField) {
  const State s = random_state(8, 7);
  struct Case {
    const char* field;
    AdamWConfig config;
  };
  std::vector<Case> cases;
  auto with = [](auto change) {
    AdamWConfig c = make_config(8, 1);
    change(c);
    return c;
  };
  cases.push_back({"b1", with([](AdamWConfig& c) { c.b1 = 1.0f; })});
  cases.push_back({"b2", with([](AdamWConfig& c) { c.b2 = -0.1f; })});
  cases.push_back({"eps", with([](AdamWConfig& c) { c.eps = kNaN; })});
  cases.push_back({"weight_decay", with([](AdamWConfig& c) { c.weight_decay = -1.0f; })});
  cases.push_back({"update_scale", with([](AdamWConfig& c) { c.update_scale = kInf; })});
  cases.push_back({"max_grad_norm", with([](AdamWConfig& c) { c.max_grad_norm = kNaN; })});
  cases.push_back({"num_partials", with([](AdamWConfig& c) { c.num_partials = 0; })});
  cases.push_back({"num_elements", with([](AdamWConfig& c) { c.num_elements = -1; })});
  for (const Case& test : cases) {
    Floats param(8), mu(8), nu(8), partials(kAdamWSums);
    const Status status = nodrop::cpu::adamw_update(
        s.param.data(), s.grad.data(), DType::kFloat32, s.mu.data(), s.nu.data(),
        kScalars.data(), test.config, param.data(), mu.data(), nu.data(), partials.data());
    EXPECT_FALSE(status.ok()) << test.field;
    EXPECT_TRUE(mentions(status, test.field)) << status.message();
  }
  Floats param(8), mu(8), nu(8), partials(kAdamWSums);
  const Status status = nodrop::cpu::adamw_update(
      s.param.data(), s.grad.data(), static_cast<DType>(7), s.mu.data(), s.nu.data(),
      kScalars.data(), make_config(8, 1), param.data(), mu.data(), nu.data(), partials.data());
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(mentions(status, "grad_dtype")) << status.message();
  EXPECT_TRUE(mentions(status, "7")) << status.message();
}

}  // namespace
