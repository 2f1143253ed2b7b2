// CUDA top-k router, forward and backward: one warp per token, the token's scores in registers
// (expert e = 32 * j + lane is register j of lane `lane`). Sums are warp butterflies of fixed
// shape and the argmax orders integer keys totally, so every result is reproducible.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "engine/cuda/launch_status.cuh"
#include "nodrop/engine_cuda.h"

namespace nodrop::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;
constexpr float kRenormEps = 1e-20f;  // guards a zero sum of selected scores, as the CPU engine

// ---- warp helpers ------------------------------------------------------------------------------

__device__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Selection values as keys whose unsigned order is the order of selection: larger values first,
// NaN (key 1) below every number, -0 equal to +0; key 0 is "no candidate". Equal keys go to the
// lower index.
__device__ uint32_t order_key(float x) {
  if (isnan(x)) return 1u;
  const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // a number's key is at least 0x007FFFFF
}
__device__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// An argmax result; index -1 is none.
struct Best {
  uint32_t key;
  int index;
};

// The lowest index of the largest key among the entries whose bit is set in this lane's `mask`,
// the same on every lane: each lane's best (the lower register on ties), then a warp max of the
// keys and a warp min of the indices that hold it, both single instructions (redux.sync).
template <int kPerLane>
__device__ Best warp_argmax(const uint32_t (&keys)[kPerLane], uint32_t mask, int lane) {
  uint32_t key = 0;
  int index = INT_MAX;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const uint32_t candidate = (mask >> j & 1u) ? keys[j] : 0u;
    if (candidate > key) {
      key = candidate;
      index = 32 * j + lane;
    }
  }
  const uint32_t best_key = __reduce_max_sync(kFullMask, key);
  const int best_index = __reduce_min_sync(kFullMask, key == best_key ? index : INT_MAX);
  return {best_key, best_index == INT_MAX ? -1 : best_index};
}

// Clears entry `index` from a mask of entries.
__device__ void take(uint32_t& mask, int index, int lane) {
  if (index >= 0 && index % 32 == lane) mask &= ~(1u << (index / 32));
}

// Registers cannot be indexed at run time, so the helpers below pick register j of a lane with
// a one-hot bit mask: one bit of `hit` per register. (Compares with the index itself get folded
// into an indexed array in local memory.)
__device__ uint32_t register_bit(int index) { return 1u << (index / 32); }

// Entry `index` of a register array, on every lane: each lane picks register index / 32, and
// lane index % 32 hands its pick out.
template <int kPerLane>
__device__ float entry(const float (&v)[kPerLane], int index) {
  const uint32_t hit = register_bit(index);
  float mine = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) mine = (hit >> j & 1u) ? v[j] : mine;
  return __shfl_sync(kFullMask, mine, index % 32);
}

// Sets entry `index`, or adds to it, on the lane that holds it.
template <int kPerLane, typename U>
__device__ void set_entry(U (&v)[kPerLane], int index, U value, int lane) {
  const uint32_t hit = lane == index % 32 ? register_bit(index) : 0u;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) v[j] = (hit >> j & 1u) ? value : v[j];
}
template <int kPerLane>
__device__ void add_entry(float (&v)[kPerLane], int index, float value, int lane) {
  const uint32_t hit = lane == index % 32 ? register_bit(index) : 0u;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) v[j] += (hit >> j & 1u) ? value : 0.0f;
}

// ---- routing -----------------------------------------------------------------------------------

// Bits of this lane's entries below n.
template <int kPerLane>
__device__ uint32_t entries_below(int n, int lane) {
  uint32_t mask = 0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (32 * j + lane < n) mask |= 1u << j;
  }
  return mask;
}

// One token's scores: softmax over its E logits, or elementwise sigmoid; 0 past E.
template <int kPerLane>
__device__ void token_scores(const float* __restrict__ logits, const RouterConfig& c, int lane,
                             float (&p)[kPerLane]) {
  const int E = static_cast<int>(c.num_experts);
  float x[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) x[j] = 32 * j + lane < E ? logits[32 * j + lane] : -INFINITY;
  if (c.score_function == ScoreFunction::kSigmoid) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      p[j] = 32 * j + lane < E ? 1.0f / (1.0f + expf(-x[j])) : 0.0f;
    }
    return;
  }
  float max_logit = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) max_logit = fmaxf(max_logit, x[j]);
  max_logit = warp_max(max_logit);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    p[j] = 32 * j + lane < E ? expf(x[j] - max_logit) : 0.0f;
    sum += p[j];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) p[j] /= sum;
}

// This lane's experts that may be chosen: all, or with num_groups > 1 those of the topk_groups
// best groups, a group scoring the sum of its best max(1, k / topk_groups) selection scores.
template <int kPerLane>
__device__ uint32_t allowed_experts(const uint32_t (&keys)[kPerLane], const RouterConfig& c,
                                    int lane) {
  const int E = static_cast<int>(c.num_experts), groups = static_cast<int>(c.num_groups);
  const uint32_t experts = entries_below<kPerLane>(E, lane);
  if (groups <= 1) return experts;
  const int per_group = E / groups;
  const int best_in_group = max(1, static_cast<int>(c.k / c.topk_groups));
  int group_of[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) group_of[j] = (32 * j + lane) / per_group;
  auto members = [&](int g) {
    uint32_t mask = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (group_of[j] == g) mask |= 1u << j;
    }
    return mask & experts;
  };

  uint32_t group_keys[kPerLane] = {};  // group g is entry g, like expert g
  for (int g = 0; g < groups; ++g) {
    uint32_t candidates = members(g);
    float score = 0.0f;
    for (int r = 0; r < best_in_group; ++r) {  // best first, the CPU's order of the sum
      const Best best = warp_argmax(keys, candidates, lane);
      take(candidates, best.index, lane);
      score += key_value(best.key);
    }
    set_entry(group_keys, g, order_key(score), lane);
  }
  uint32_t open = entries_below<kPerLane>(groups, lane);
  uint32_t allowed = 0;
  for (int r = 0; r < c.topk_groups; ++r) {
    const Best best = warp_argmax(group_keys, open, lane);
    take(open, best.index, lane);
    allowed |= members(best.index);
  }
  return allowed;
}

template <int kPerLane>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    router_forward(const float* __restrict__ logits, const float* __restrict__ expert_bias,
                   RouterConfig c, float* __restrict__ weights, int32_t* __restrict__ ids) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= c.num_tokens) return;  // t is the same on every lane of the warp
  const int lane = threadIdx.x % 32;
  const int E = static_cast<int>(c.num_experts), k = static_cast<int>(c.k);
  float p[kPerLane];
  token_scores(logits + t * E, c, lane, p);
  uint32_t keys[kPerLane];  // of the selection scores (engine.h: RouterConfig)
  const bool softmax = c.score_function == ScoreFunction::kSoftmax;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = 32 * j + lane;
    const float bias = expert_bias != nullptr && e < E ? expert_bias[e] : 0.0f;
    keys[j] = order_key(softmax ? p[j] * expf(bias) : p[j] + bias);
  }
  uint32_t allowed = allowed_experts(keys, c, lane);

  float chosen_score[kPerLane] = {};  // slot s is entry s
  int32_t chosen_id[kPerLane] = {};
  float sum = 0.0f;
  for (int s = 0; s < k; ++s) {
    const Best best = warp_argmax(keys, allowed, lane);
    take(allowed, best.index, lane);
    const float score = entry(p, best.index);
    sum += score;
    set_entry(chosen_score, s, score, lane);
    set_entry(chosen_id, s, int32_t(best.index), lane);
  }
  const float norm = c.renormalize ? sum + kRenormEps : 1.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int s = 32 * j + lane;
    if (s < k) {
      weights[t * k + s] = chosen_score[j] / norm * c.scaling_factor;
      ids[t * k + s] = chosen_id[j];
    }
  }
}

// Calls fn(id, grad) for each slot of a token in order, the same on every lane: lane s loads
// slot s0 + s of each run of 32, and shuffles hand the slots out.
template <typename Fn>
__device__ void for_each_slot(const int32_t* __restrict__ ids, const float* __restrict__ grads,
                              int k, int lane, Fn&& fn) {
  for (int s0 = 0; s0 < k; s0 += 32) {
    const int n = min(32, k - s0);
    const int32_t my_id = lane < n ? ids[s0 + lane] : -1;
    const float my_grad = lane < n ? grads[s0 + lane] : 0.0f;
    for (int s = 0; s < n; ++s) {
      fn(__shfl_sync(kFullMask, my_id, s), __shfl_sync(kFullMask, my_grad, s));
    }
  }
}

// weights_s = scale * p[id_s] / S, with S the sum of the k chosen scores (1 without
// renormalisation): the gradient reaches the scores of the chosen experts, then the logits
// through the softmax or sigmoid.
template <int kPerLane>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    router_backward(const float* __restrict__ logits, const int32_t* __restrict__ ids,
                    const float* __restrict__ grad_weights, RouterConfig c,
                    float* __restrict__ grad_logits) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= c.num_tokens) return;
  const int lane = threadIdx.x % 32;
  const int E = static_cast<int>(c.num_experts), k = static_cast<int>(c.k);
  float p[kPerLane];
  token_scores(logits + t * E, c, lane, p);
  const int32_t* token_ids = ids + t * k;
  const float* token_grads = grad_weights + t * k;
  // An id out of range is never produced by topk_router: it is skipped, as on the CPU.
  auto valid = [E](int32_t e) { return e >= 0 && e < E; };

  float sum = 0.0f, weighted = 0.0f;
  for_each_slot(token_ids, token_grads, k, lane, [&](int32_t e, float g) {
    if (!valid(e)) return;  // e is the same on every lane, so entry's shuffle sees them all
    const float score = entry(p, e);
    sum += score;
    weighted += g * score;
  });
  const float norm = c.renormalize ? sum + kRenormEps : 1.0f;
  float grad_p[kPerLane] = {};
  for_each_slot(token_ids, token_grads, k, lane, [&](int32_t e, float g) {
    if (!valid(e)) return;
    float d = g / norm;
    if (c.renormalize) d -= weighted / (norm * norm);
    add_entry(grad_p, e, c.scaling_factor * d, lane);
  });

  float* out = grad_logits + t * E;
  if (c.score_function == ScoreFunction::kSigmoid) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (32 * j + lane < E) out[32 * j + lane] = grad_p[j] * p[j] * (1.0f - p[j]);
    }
    return;
  }
  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) dot += grad_p[j] * p[j];
  dot = warp_sum(dot);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (32 * j + lane < E) out[32 * j + lane] = p[j] * (grad_p[j] - dot);
  }
}

// ---- launch ------------------------------------------------------------------------------------

// validate_router_config's checks plus this kernel's limits (experts in registers, one warp a token).
Status check_config(const char* fn, const RouterConfig& c) {
  Status status = validate_router_config(c);
  if (!status.ok()) return Status::Error(std::string(fn) + ": " + status.message());
  if (c.num_experts > kMaxExperts) {
    return Status::Error(std::string(fn) + ": router config: num_experts must be at most " +
                         std::to_string(kMaxExperts) + " on the GPU, got " +
                         std::to_string(c.num_experts));
  }
  const int64_t max_tokens = int64_t(INT32_MAX) * kWarpsPerBlock;  // one warp each
  if (c.num_tokens > max_tokens) {
    return Status::Error(std::string(fn) + ": router config: num_tokens must be at most " +
                         std::to_string(max_tokens) + ", got " + std::to_string(c.num_tokens));
  }
  return Status::Ok();
}

// Calls launch(std::integral_constant<int, kPerLane>{}) with the fewest registers per lane, a
// power of two, that hold E entries.
template <typename Fn>
void dispatch_experts(int64_t E, Fn&& launch) {
  if (E <= 32) return launch(std::integral_constant<int, 1>{});
  if (E <= 64) return launch(std::integral_constant<int, 2>{});
  if (E <= 128) return launch(std::integral_constant<int, 4>{});
  if (E <= 256) return launch(std::integral_constant<int, 8>{});
  if (E <= 512) return launch(std::integral_constant<int, 16>{});
  return launch(std::integral_constant<int, 32>{});
}
static_assert(kMaxExperts <= 32 * 32, "a lane's entries are the bits of a 32-bit mask");

unsigned token_blocks(int64_t T) { return unsigned((T + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

Status topk_router(const float* logits, const float* expert_bias, const RouterConfig& config,
                   float* weights, int32_t* ids, cudaStream_t stream) {
  constexpr const char* fn = "topk_router";
  Status status = check_config(fn, config);
  if (!status.ok()) return status;
  if (config.num_tokens == 0) return Status::Ok();
  if (logits == nullptr || weights == nullptr || ids == nullptr) {
    return Status::Error(std::string(fn) + ": a buffer is null");
  }
  dispatch_experts(config.num_experts, [&](auto per_lane) {
    router_forward<decltype(per_lane)::value>
        <<<token_blocks(config.num_tokens), 32 * kWarpsPerBlock, 0, stream>>>(
            logits, expert_bias, config, weights, ids);
  });
  return launch_status(fn);
}

Status topk_router_grad(const float* logits, const int32_t* ids, const float* grad_weights,
                        const RouterConfig& config, float* grad_logits, cudaStream_t stream) {
  constexpr const char* fn = "topk_router_grad";
  Status status = check_config(fn, config);
  if (!status.ok()) return status;
  if (config.num_tokens == 0) return Status::Ok();
  if (logits == nullptr || ids == nullptr || grad_weights == nullptr || grad_logits == nullptr) {
    return Status::Error(std::string(fn) + ": a buffer is null");
  }
  dispatch_experts(config.num_experts, [&](auto per_lane) {
    router_backward<decltype(per_lane)::value>
        <<<token_blocks(config.num_tokens), 32 * kWarpsPerBlock, 0, stream>>>(
            logits, ids, grad_weights, config, grad_logits);
  });
  return launch_status(fn);
}

}  // namespace nodrop::cuda
