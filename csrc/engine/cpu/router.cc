// CPU top-k router, forward and backward, one token per loop iteration (tokens are independent).
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/cpu/parallel.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {
namespace {

constexpr double kRenormEps = 1e-20;  // guards a zero sum of selected scores, as the reference
constexpr int64_t kMinBlockTokens = 256;  // tokens per parallel block

// scores[e] from one token's logits: softmax over the experts, or elementwise sigmoid.
void token_scores(const float* logits, const RouterConfig& c, double* scores) {
  const int64_t E = c.num_experts;
  if (c.score_function == ScoreFunction::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[e] = 1.0 / (1.0 + std::exp(-double(logits[e])));
    return;
  }
  double max_logit = logits[0];
  for (int64_t e = 1; e < E; ++e) max_logit = std::max(max_logit, double(logits[e]));
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += scores[e] = std::exp(double(logits[e]) - max_logit);
  for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
}

// Index of the largest value among candidates [begin, end) with allowed[i]; ties (and NaN) go to
// the lowest index. Marks the winner as no longer allowed.
int64_t take_best(const double* values, std::vector<char>& allowed, int64_t begin, int64_t end) {
  int64_t best = -1;
  for (int64_t i = begin; i < end; ++i) {
    if (allowed[i] && (best < 0 || values[i] > values[best])) best = i;
  }
  if (best >= 0) allowed[best] = 0;
  return best;
}

// Fills allowed[e] with 1 for the experts of the topk_groups best groups (all when ungrouped).
void allowed_experts(const double* selection, const RouterConfig& c, std::vector<char>& allowed) {
  const int64_t E = c.num_experts;
  if (c.num_groups <= 1) {
    std::fill(allowed.begin(), allowed.end(), 1);
    return;
  }
  const int64_t per_group = E / c.num_groups;
  const int64_t best_in_group = std::max<int64_t>(1, c.k / c.topk_groups);
  std::vector<double> group_score(c.num_groups, 0.0);
  std::fill(allowed.begin(), allowed.end(), 1);
  for (int64_t g = 0; g < c.num_groups; ++g) {
    for (int64_t j = 0; j < best_in_group; ++j) {
      group_score[g] += selection[take_best(selection, allowed, g * per_group, (g + 1) * per_group)];
    }
  }
  std::vector<char> group_open(c.num_groups, 1);
  std::fill(allowed.begin(), allowed.end(), 0);
  for (int64_t j = 0; j < c.topk_groups; ++j) {
    const int64_t g = take_best(group_score.data(), group_open, 0, c.num_groups);
    std::fill(allowed.begin() + g * per_group, allowed.begin() + (g + 1) * per_group, 1);
  }
}

}  // namespace

Status topk_router(const float* logits, const float* expert_bias, const RouterConfig& c,
                   float* weights, int32_t* ids, ParallelRunner* runner) {
  Status status = validate_router_config(c);
  if (!status.ok()) return status;
  const int64_t E = c.num_experts, k = c.k;
  parallel_blocks(runner, c.num_tokens, kMinBlockTokens, [&](int64_t begin, int64_t end) {
    std::vector<double> scores(E), selection(E);
    std::vector<char> allowed(E);
    for (int64_t t = begin; t < end; ++t) {
      token_scores(logits + t * E, c, scores.data());
      for (int64_t e = 0; e < E; ++e) {
        const double bias = expert_bias ? double(expert_bias[e]) : 0.0;
        selection[e] = c.score_function == ScoreFunction::kSoftmax ? scores[e] * std::exp(bias)
                                                                   : scores[e] + bias;
      }
      allowed_experts(selection.data(), c, allowed);
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = take_best(selection.data(), allowed, 0, E);
        ids[t * k + j] = static_cast<int32_t>(e);
        sum += scores[e];
      }
      const double norm = c.renormalize ? sum + kRenormEps : 1.0;
      for (int64_t j = 0; j < k; ++j) {
        weights[t * k + j] = static_cast<float>(scores[ids[t * k + j]] / norm * c.scaling_factor);
      }
    }
  });
  return Status::Ok();
}

Status topk_router_grad(const float* logits, const int32_t* ids, const float* grad_weights,
                        const RouterConfig& c, float* grad_logits, ParallelRunner* runner) {
  Status status = validate_router_config(c);
  if (!status.ok()) return status;
  const int64_t E = c.num_experts, k = c.k;
  parallel_blocks(runner, c.num_tokens, kMinBlockTokens, [&](int64_t begin, int64_t end) {
    std::vector<double> scores(E), grad_scores(E);
    for (int64_t t = begin; t < end; ++t) {
      token_scores(logits + t * E, c, scores.data());
      const int32_t* token_ids = ids + t * k;
      const float* g = grad_weights + t * k;
      // weights_j = scale * v_j / S (S = sum of the k selected scores v, or 1 without renorm).
      double sum = 0.0, weighted = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = token_ids[j];
        if (e < 0 || e >= E) continue;  // never produced by topk_router; ignore, stay in bounds
        sum += scores[e];
        weighted += g[j] * scores[e];
      }
      const double norm = c.renormalize ? sum + kRenormEps : 1.0;
      std::fill(grad_scores.begin(), grad_scores.end(), 0.0);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = token_ids[j];
        if (e < 0 || e >= E) continue;
        double d = g[j] / norm;
        if (c.renormalize) d -= weighted / (norm * norm);
        grad_scores[e] += c.scaling_factor * d;
      }
      float* out = grad_logits + t * E;
      if (c.score_function == ScoreFunction::kSigmoid) {
        for (int64_t e = 0; e < E; ++e) {
          out[e] = static_cast<float>(grad_scores[e] * scores[e] * (1.0 - scores[e]));
        }
      } else {
        double dot = 0.0;
        for (int64_t e = 0; e < E; ++e) dot += grad_scores[e] * scores[e];
        for (int64_t e = 0; e < E; ++e) {
          out[e] = static_cast<float>(scores[e] * (grad_scores[e] - dot));
        }
      }
    }
  });
  return Status::Ok();
}

}  // namespace nodrop::cpu
