// Tests of validate_router_config, topk_router and topk_router_grad against a naive
// double-precision router (reference.py's semantics) and finite differences of its weights.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "nodrop/engine_cpu.h"
#include "test_util.h"

namespace {

using nodrop::RouterConfig;
using nodrop::ScoreFunction;
using nodrop::Status;
using nodrop_test::Guarded;
using nodrop_test::mentions;
using nodrop_test::random_floats;
using nodrop_test::rel_error;
using nodrop_test::ThreadRunner;
using Ints = std::vector<int32_t>;
using Doubles = std::vector<double>;

constexpr ScoreFunction kSoftmax = ScoreFunction::kSoftmax;
constexpr ScoreFunction kSigmoid = ScoreFunction::kSigmoid;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

RouterConfig make_config(int64_t T, int64_t E, int64_t k, ScoreFunction fn = kSoftmax,
                         int64_t num_groups = 1, int64_t topk_groups = 1, bool renormalize = false,
                         float scaling_factor = 1.0f) {
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

// ---- naive router in double precision --------------------------------------------------------

Doubles naive_scores(const double* z, int64_t E, ScoreFunction fn) {
  Doubles p(E);
  if (fn == kSigmoid) {
    for (int64_t e = 0; e < E; ++e) p[e] = 1.0 / (1.0 + std::exp(-z[e]));
    return p;
  }
  const double m = *std::max_element(z, z + E);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(z[e] - m);
  for (double& x : p) x /= sum;
  return p;
}

// The n largest entries' indices, by descending value; ties go to the lower index.
std::vector<int64_t> top_indices(const Doubles& v, int64_t n) {
  std::vector<int64_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
  idx.resize(n);
  return idx;
}

// One token's weights for given ids: the unbiased scores, renormalised, scaled.
Doubles naive_weights(const double* z, const int32_t* ids, const RouterConfig& c) {
  const Doubles p = naive_scores(z, c.num_experts, c.score_function);
  Doubles w(c.k);
  double sum = 0;
  for (int64_t s = 0; s < c.k; ++s) sum += w[s] = p[ids[s]];
  for (double& x : w) x = (c.renormalize ? x / (sum + 1e-20) : x) * c.scaling_factor;
  return w;
}

struct Routed {
  Doubles weights;  // [T, k]
  Ints ids;         // [T, k]
};

Routed naive_router(const std::vector<float>& logits, const float* bias, const RouterConfig& c) {
  const int64_t T = c.num_tokens, E = c.num_experts, k = c.k;
  Routed out{Doubles(T * k), Ints(T * k)};
  for (int64_t t = 0; t < T; ++t) {
    const Doubles z(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    Doubles sel = naive_scores(z.data(), E, c.score_function);
    if (bias)  // added to the sigmoid scores, to the softmax logits
      for (int64_t e = 0; e < E; ++e) {
        sel[e] = c.score_function == ScoreFunction::kSoftmax ? sel[e] * std::exp(double(bias[e]))
                                                             : sel[e] + bias[e];
      }
    if (c.num_groups > 1) {  // keep the topk_groups groups with the best sums of their best few
      const int64_t per_group = E / c.num_groups;
      const int64_t best = std::max<int64_t>(1, c.k / c.topk_groups);
      Doubles group_score(c.num_groups, 0.0);
      for (int64_t g = 0; g < c.num_groups; ++g) {
        const Doubles members(sel.begin() + g * per_group, sel.begin() + (g + 1) * per_group);
        for (int64_t i : top_indices(members, best)) group_score[g] += members[i];
      }
      std::vector<bool> keep(c.num_groups, false);
      for (int64_t g : top_indices(group_score, c.topk_groups)) keep[g] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per_group]) sel[e] = -std::numeric_limits<double>::infinity();
    }
    const auto ids = top_indices(sel, k);
    for (int64_t s = 0; s < k; ++s) out.ids[t * k + s] = static_cast<int32_t>(ids[s]);
    const Doubles w = naive_weights(z.data(), &out.ids[t * k], c);
    std::copy(w.begin(), w.end(), out.weights.begin() + t * k);
  }
  return out;
}

// d(sum_s g[t,s] * w[t,s]) / d logits[t, e] by central differences of naive_weights (ids fixed:
// the selection is piecewise constant). Step 1e-6 in double: error far below 1e-8.
Doubles finite_difference_grad(const std::vector<float>& logits, const Ints& ids,
                               const std::vector<float>& grad_w, const RouterConfig& c) {
  const int64_t T = c.num_tokens, E = c.num_experts, k = c.k;
  const double h = 1e-6;
  Doubles grad(T * E);
  for (int64_t t = 0; t < T; ++t) {
    Doubles z(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    for (int64_t e = 0; e < E; ++e) {
      const double z0 = z[e];
      z[e] = z0 + h;
      const Doubles up = naive_weights(z.data(), &ids[t * k], c);
      z[e] = z0 - h;
      const Doubles down = naive_weights(z.data(), &ids[t * k], c);
      z[e] = z0;
      double d = 0;
      for (int64_t s = 0; s < k; ++s) d += grad_w[t * k + s] * (up[s] - down[s]) / (2 * h);
      grad[t * E + e] = d;
    }
  }
  return grad;
}

// ---- engine calls ------------------------------------------------------------------------------

struct EngineRouted {
  Status status;
  std::vector<float> weights;
  Ints ids;
  bool canaries_intact;
};

EngineRouted run_router(const std::vector<float>& logits, const float* bias,
                        const RouterConfig& c, nodrop::ParallelRunner* runner = nullptr) {
  const int64_t n = c.num_tokens * c.k;
  Guarded<float> weights(n, kNaN);
  Guarded<int32_t> ids(n, -12345);
  Status s = nodrop::cpu::topk_router(logits.data(), bias, c, weights.data(), ids.data(), runner);
  return {s, weights.vec(), ids.vec(), weights.canaries_intact() && ids.canaries_intact()};
}

struct EngineGrad {
  Status status;
  std::vector<float> grad;
  bool canaries_intact;
};

EngineGrad run_router_grad(const std::vector<float>& logits, const Ints& ids,
                           const std::vector<float>& grad_w, const RouterConfig& c,
                           nodrop::ParallelRunner* runner = nullptr) {
  Guarded<float> grad(c.num_tokens * c.num_experts, kNaN);
  Status s = nodrop::cpu::topk_router_grad(logits.data(), ids.data(), grad_w.data(), c,
                                           grad.data(), runner);
  return {s, grad.vec(), grad.canaries_intact()};
}

// ---- the configurations every value test runs --------------------------------------------------

struct RouterCase {
  const char* name;
  RouterConfig config;
  bool with_bias;
};

std::vector<RouterCase> router_cases() {
  return {
      {"softmax_top2", make_config(33, 8, 2), false},
      {"softmax_renormalized", make_config(33, 8, 2, kSoftmax, 1, 1, true), false},
      {"softmax_odd_E_scaled", make_config(17, 13, 5, kSoftmax, 1, 1, false, 0.5f), false},
      {"softmax_expert_bias", make_config(33, 8, 3), true},
      {"sigmoid_top4", make_config(33, 16, 4, kSigmoid), false},
      // DeepSeek-V3's shape of routing: sigmoid, bias, 8 groups of which 4 may be chosen.
      {"sigmoid_bias_groups_renorm_scaled", make_config(33, 32, 8, kSigmoid, 8, 4, true, 2.5f),
       true},
      {"softmax_groups_k_not_a_multiple", make_config(25, 12, 3, kSoftmax, 4, 2), false},
      {"sigmoid_groups_k_below_topk_groups", make_config(25, 16, 2, kSigmoid, 4, 3), false},
      {"softmax_all_groups_allowed", make_config(25, 12, 4, kSoftmax, 3, 3), false},
      {"softmax_k_equals_allowed_experts", make_config(25, 16, 8, kSoftmax, 4, 2, true), false},
      {"one_token_softmax_k_equals_E", make_config(1, 8, 8, kSoftmax, 1, 1, true), false},
      {"one_token_sigmoid_bias_k_equals_E", make_config(1, 6, 6, kSigmoid), true},
  };
}

// ctest names show the case name, not the struct's bytes.
void PrintTo(const RouterCase& rc, std::ostream* os) { *os << rc.name; }

class TopkRouterCases : public testing::TestWithParam<RouterCase> {
 protected:
  void SetUp() override {
    const RouterConfig& c = GetParam().config;
    std::mt19937 rng(42);
    logits = random_floats(c.num_tokens * c.num_experts, rng, -3.0, 3.0);
    if (GetParam().with_bias) bias = random_floats(c.num_experts, rng, -0.3, 0.3);
    grad_w = random_floats(c.num_tokens * c.k, rng);
  }
  const float* bias_ptr() const { return bias.empty() ? nullptr : bias.data(); }
  std::vector<float> logits, bias, grad_w;
};

INSTANTIATE_TEST_SUITE_P(Configs, TopkRouterCases, testing::ValuesIn(router_cases()),
                         [](const testing::TestParamInfo<RouterCase>& i) { return i.param.name; });

// ---- validate_router_config --------------------------------------------------------------------

TEST(ValidateRouterConfig, AcceptsEveryTestedConfigAndZeroTokens) {
  for (const RouterCase& rc : router_cases()) {
    const Status s = nodrop::validate_router_config(rc.config);
    EXPECT_TRUE(s.ok()) << rc.name << ": " << s.message();
  }
  const Status s = nodrop::validate_router_config(make_config(0, 8, 2));
  EXPECT_TRUE(s.ok()) << s.message();
}

TEST(ValidateRouterConfig, RejectsKOutsideOneToE) {
  EXPECT_FALSE(nodrop::validate_router_config(make_config(4, 8, 9)).ok());
  EXPECT_FALSE(nodrop::validate_router_config(make_config(4, 8, 0)).ok());
  EXPECT_FALSE(nodrop::validate_router_config(make_config(4, 8, -1)).ok());
}

TEST(ValidateRouterConfig, RejectsGroupsThatDoNotDivideTheExpertsNamingNumGroups) {
  for (int64_t groups : {3, 0, -2}) {
    const Status s = nodrop::validate_router_config(make_config(4, 8, 1, kSoftmax, groups, 1));
    EXPECT_FALSE(s.ok()) << groups;
    EXPECT_TRUE(mentions(s, "num_groups")) << s.message();
  }
}

TEST(ValidateRouterConfig, RejectsTopkGroupsOutsideOneToNumGroupsNamingTopkGroups) {
  for (int64_t topk_groups : {5, 0}) {
    const Status s =
        nodrop::validate_router_config(make_config(4, 8, 1, kSoftmax, 4, topk_groups));
    EXPECT_FALSE(s.ok()) << topk_groups;
    EXPECT_TRUE(mentions(s, "topk_groups")) << s.message();
  }
}

TEST(ValidateRouterConfig, RejectsKAboveTheExpertsOfTheAllowedGroups) {
  // 4 groups of 4 experts, 1 group allowed: only 4 experts can be chosen.
  EXPECT_FALSE(nodrop::validate_router_config(make_config(4, 16, 5, kSoftmax, 4, 1)).ok());
  EXPECT_TRUE(nodrop::validate_router_config(make_config(4, 16, 4, kSoftmax, 4, 1)).ok());
}

// ---- topk_router -------------------------------------------------------------------------------

TEST_P(TopkRouterCases, RouterMatchesNaiveReference) {
  const RouterConfig& c = GetParam().config;
  const EngineRouted got = run_router(logits, bias_ptr(), c);
  ASSERT_TRUE(got.status.ok()) << got.status.message();
  EXPECT_TRUE(got.canaries_intact);
  const Routed want = naive_router(logits, bias_ptr(), c);
  EXPECT_EQ(got.ids, want.ids);
  EXPECT_LE(rel_error(nodrop_test::to_double(got.weights), want.weights), 1e-5);
}

TEST(TopkRouter, BiasSteersSelectionButWeightsUseUnbiasedScores) {
  const RouterConfig c = make_config(1, 4, 1);
  const std::vector<float> logits = {2, 1, 0, -1};
  const std::vector<float> bias = {0, 0, 0, 10};
  const EngineRouted got = run_router(logits, bias.data(), c);
  ASSERT_TRUE(got.status.ok()) << got.status.message();
  EXPECT_EQ(got.ids, (Ints{3}));
  const double z[] = {2, 1, 0, -1};
  const double p3 = naive_scores(z, 4, kSoftmax)[3];  // about 0.032, not 0.032 + 10
  EXPECT_NEAR(got.weights[0], p3, 1e-5 * p3);
}

TEST(TopkRouter, GroupsAreScoredByTheSumOfTheirBestMaxOneKOverTopkGroupsExperts) {
  // Sigmoid scores: group 0 = {0.95, 0.05}, group 1 = {0.8, 0.7}.
  const auto logit = [](double p) { return static_cast<float>(std::log(p / (1 - p))); };
  const std::vector<float> logits = {logit(0.95), logit(0.05), logit(0.8), logit(0.7)};
  // k=2, topk_groups=1: groups score their best 2 -> 1.0 vs 1.5, so group 1 wins even though
  // expert 0 has the best score overall.
  const EngineRouted two = run_router(logits, nullptr, make_config(1, 4, 2, kSigmoid, 2, 1));
  ASSERT_TRUE(two.status.ok()) << two.status.message();
  EXPECT_EQ(two.ids, (Ints{2, 3}));
  EXPECT_NEAR(two.weights[0], 0.8, 1e-5);
  EXPECT_NEAR(two.weights[1], 0.7, 1e-5);
  // k=1: groups score their single best -> 0.95 vs 0.8, group 0 wins.
  const EngineRouted one = run_router(logits, nullptr, make_config(1, 4, 1, kSigmoid, 2, 1));
  ASSERT_TRUE(one.status.ok()) << one.status.message();
  EXPECT_EQ(one.ids, (Ints{0}));
}

TEST(TopkRouter, TiesGoToTheLowerExpertIndex) {
  for (ScoreFunction fn : {kSoftmax, kSigmoid}) {
    // Equal logits give bitwise-equal scores.
    const std::vector<float> equal(6, 0.5f);
    EXPECT_EQ(run_router(equal, nullptr, make_config(1, 6, 3, fn)).ids, (Ints{0, 1, 2}));
    // Equal groups too: groups 0 and 1 are kept, then experts 0, 1, 2.
    EXPECT_EQ(run_router(equal, nullptr, make_config(1, 6, 3, fn, 3, 2)).ids, (Ints{0, 1, 2}));
    // A three-way tie at the top: experts 1, 2, 4 in index order.
    const std::vector<float> partial = {1, 3, 3, 0, 3};
    EXPECT_EQ(run_router(partial, nullptr, make_config(1, 5, 3, fn)).ids, (Ints{1, 2, 4}));
  }
}

TEST(TopkRouter, SlotsAreOrderedByDescendingScore) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.0f, 3.0f};
  const EngineRouted got = run_router(logits, nullptr, make_config(1, 5, 5, kSigmoid));
  ASSERT_TRUE(got.status.ok()) << got.status.message();
  EXPECT_EQ(got.ids, (Ints{4, 1, 3, 0, 2}));
  EXPECT_TRUE(std::is_sorted(got.weights.rbegin(), got.weights.rend()));
}

TEST(TopkRouter, ZeroTokensIsANoOp) {
  const EngineRouted got = run_router({}, nullptr, make_config(0, 8, 2));
  EXPECT_TRUE(got.status.ok()) << got.status.message();
  EXPECT_TRUE(got.canaries_intact);
}

TEST(TopkRouter, RejectsAnInvalidConfigWithoutWritingOutsideTheOutputs) {
  const std::vector<float> logits(4 * 8, 0.f);
  for (const RouterConfig& c : {make_config(4, 8, 9), make_config(4, 8, 2, kSoftmax, 3, 1),
                                make_config(4, 16, 5, kSoftmax, 4, 1)}) {
    const int64_t n = 4 * std::max<int64_t>(c.k, 1);  // sized as if valid, to hold k slots
    Guarded<float> w(n, kNaN);
    Guarded<int32_t> ids(n, -1);
    const Status s = nodrop::cpu::topk_router(logits.data(), nullptr, c, w.data(), ids.data());
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(w.canaries_intact() && ids.canaries_intact());
  }
}

TEST(TopkRouter, TwoCallsGiveBitwiseIdenticalOutputs) {
  const RouterConfig c = make_config(1024, 64, 6, kSigmoid, 8, 3, true, 2.5f);
  std::mt19937 rng(600);
  const std::vector<float> logits = random_floats(c.num_tokens * c.num_experts, rng, -4, 4);
  const std::vector<float> bias = random_floats(c.num_experts, rng, -0.3, 0.3);
  const EngineRouted a = run_router(logits, bias.data(), c), b = run_router(logits, bias.data(), c);
  ASSERT_TRUE(a.status.ok()) << a.status.message();
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(0, std::memcmp(a.weights.data(), b.weights.data(), a.weights.size() * sizeof(float)));
}

// ---- topk_router_grad --------------------------------------------------------------------------

TEST_P(TopkRouterCases, GradMatchesFiniteDifferencesOfTheWeights) {
  const RouterConfig& c = GetParam().config;
  const Ints ids = naive_router(logits, bias_ptr(), c).ids;
  const EngineGrad got = run_router_grad(logits, ids, grad_w, c);
  ASSERT_TRUE(got.status.ok()) << got.status.message();
  EXPECT_TRUE(got.canaries_intact);
  EXPECT_LE(rel_error(nodrop_test::to_double(got.grad),
                      finite_difference_grad(logits, ids, grad_w, c)),
            1e-5);
}

TEST(TopkRouterGrad, UsesTheGivenIdsRatherThanReselecting) {
  // The ids of the k *worst* experts, as a biased forward might choose: the gradient must flow
  // through those slots, not through a fresh top-k of the logits.
  for (ScoreFunction fn : {kSoftmax, kSigmoid}) {
    const RouterConfig c = make_config(5, 6, 2, fn, 1, 1, /*renormalize=*/true, 1.5f);
    std::mt19937 rng(700);
    const std::vector<float> logits = random_floats(c.num_tokens * c.num_experts, rng, -2, 2);
    const std::vector<float> grad_w = random_floats(c.num_tokens * c.k, rng);
    Ints ids(c.num_tokens * c.k);
    for (int64_t t = 0; t < c.num_tokens; ++t) {
      Doubles neg(c.num_experts);
      for (int64_t e = 0; e < c.num_experts; ++e) neg[e] = -logits[t * c.num_experts + e];
      const auto worst = top_indices(neg, c.k);
      for (int64_t s = 0; s < c.k; ++s) ids[t * c.k + s] = static_cast<int32_t>(worst[s]);
    }
    const EngineGrad got = run_router_grad(logits, ids, grad_w, c);
    ASSERT_TRUE(got.status.ok()) << got.status.message();
    EXPECT_LE(rel_error(nodrop_test::to_double(got.grad),
                        finite_difference_grad(logits, ids, grad_w, c)),
              1e-5);
  }
}

TEST(TopkRouterGrad, ZeroTokensIsANoOp) {
  const EngineGrad got = run_router_grad({}, {}, {}, make_config(0, 8, 2));
  EXPECT_TRUE(got.status.ok()) << got.status.message();
  EXPECT_TRUE(got.canaries_intact);
}

TEST(TopkRouterGrad, RejectsAnInvalidConfig) {
  const std::vector<float> logits(4 * 8, 0.f), grad_w(4 * 9, 1.f);
  const Ints ids(4 * 9, 0);
  EXPECT_FALSE(run_router_grad(logits, ids, grad_w, make_config(4, 8, 9)).status.ok());
  EXPECT_FALSE(
      run_router_grad(logits, ids, grad_w, make_config(4, 8, 2, kSoftmax, 3, 1)).status.ok());
}

TEST(TopkRouterGrad, TwoCallsGiveBitwiseIdenticalOutputs) {
  const RouterConfig c = make_config(1024, 64, 6, kSoftmax, 8, 3, true, 2.5f);
  std::mt19937 rng(701);
  const std::vector<float> logits = random_floats(c.num_tokens * c.num_experts, rng, -4, 4);
  const std::vector<float> grad_w = random_floats(c.num_tokens * c.k, rng);
  const Ints ids = naive_router(logits, nullptr, c).ids;
  const EngineGrad a = run_router_grad(logits, ids, grad_w, c);
  const EngineGrad b = run_router_grad(logits, ids, grad_w, c);
  ASSERT_TRUE(a.status.ok()) << a.status.message();
  EXPECT_EQ(0, std::memcmp(a.grad.data(), b.grad.data(), a.grad.size() * sizeof(float)));
}

// ---- both, on a parallel runner ---------------------------------------------------------------

TEST(TopkRouter, ParallelRunnerMatchesReferenceForwardAndBackward) {
  // 1024 tokens: enough for the engine to hand blocks of tokens to the runner's workers.
  const RouterConfig c = make_config(1024, 64, 6, kSigmoid, 8, 3, true, 2.5f);
  std::mt19937 rng(800);
  const std::vector<float> logits = random_floats(c.num_tokens * c.num_experts, rng, -4, 4);
  const std::vector<float> bias = random_floats(c.num_experts, rng, -0.3, 0.3);
  const std::vector<float> grad_w = random_floats(c.num_tokens * c.k, rng);
  ThreadRunner runner(4);
  const EngineRouted got = run_router(logits, bias.data(), c, &runner);
  ASSERT_TRUE(got.status.ok()) << got.status.message();
  EXPECT_TRUE(got.canaries_intact);
  const Routed want = naive_router(logits, bias.data(), c);
  EXPECT_EQ(got.ids, want.ids);
  EXPECT_LE(rel_error(nodrop_test::to_double(got.weights), want.weights), 1e-5);
  const EngineGrad grad = run_router_grad(logits, want.ids, grad_w, c, &runner);
  ASSERT_TRUE(grad.status.ok()) << grad.status.message();
  EXPECT_TRUE(grad.canaries_intact);
  EXPECT_LE(rel_error(nodrop_test::to_double(grad.grad),
                      finite_difference_grad(logits, want.ids, grad_w, c)),
            1e-5);
  EXPECT_GE(runner.calls(), 2) << "shape too small to exercise the runner";
}

}  // namespace
