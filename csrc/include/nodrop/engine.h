// nodrop engine: framework-free MoE kernels on raw pointers and shapes. This header holds what
// every backend shares (dtypes, Status, the group-size rule, the router's configuration);
// engine_cpu.h declares the functions (namespace nodrop::cpu, csrc/engine/cpu/) and engine_cuda.h
// the same functions on the GPU (namespace nodrop::cuda, csrc/engine/cuda/).
//
// Nothing here knows about JAX or XLA. Every function has the same contract on every backend.
//
// Conventions (docs/design.md):
//   tokens x [T, H]; routing ids [T, k] int32, weights [T, k] float32;
//   permuted rows [T*k, H] ordered by (expert, token, slot); group_sizes [E] int32;
//   row_map [T*k] int32: row_map[t*k + s] is the permuted row of (token t, slot s), or -1 when
//   that slot's expert id is out of range (the slot is dropped: it is in no group).
//   Grouped matmul: lhs [M, K], rhs [G, K, N], group_sizes [G]; group g owns the rows
//   [offset_g, offset_g + size_g) of lhs and of the output.
//
// Invalid group sizes never cause an out-of-bounds access: negative sizes count as zero and the
// running total is clamped at M (see clamp_group_offsets). With `checked` set, the functions
// return an error Status instead.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace nodrop {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

int64_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

// The result of an engine call: ok, or a message that says what was wrong with which argument.
class Status {
 public:
  static Status Ok() { return Status(); }
  static Status Error(std::string message) { return Status(std::move(message)); }
  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  Status() = default;
  explicit Status(std::string message) : message_(std::move(message)) {}
  std::string message_;
};

// Turns group sizes into G+1 row offsets inside [0, rows]: offsets[0] = 0 and
// offsets[g+1] = min(rows, offsets[g] + max(0, sizes[g])). With `checked`, a negative size or
// a total past `rows` is an error naming the argument `name`.
Status clamp_group_offsets(const int32_t* sizes, int64_t num_groups, int64_t rows, bool checked,
                           const char* name, int64_t* offsets);

// FP8 weight gradients (the blockwise recipe's ragged contraction) read their operands quantised
// along the rows in blocks of kFp8Block rows that restart at each group's first row, transposed
// (Hopper's FP8 wgmma reads both operands contraction-major) and laid out block by block: group
// g's blocks are numbered from the sum of ceil(rows_h / kFp8Block) over the groups h before it.
// fp8_contract_blocks(M, G) bounds that count for any group sizes: ceil(M / kFp8Block) + G.
inline constexpr int64_t kFp8Block = 128;
inline constexpr int64_t fp8_contract_blocks(int64_t M, int64_t G) {
  return (M + kFp8Block - 1) / kFp8Block + G;
}

enum class ScoreFunction : int32_t { kSoftmax = 0, kSigmoid = 1 };

// Top-k routing. Selection uses the score moved by expert_bias (optional; DeepSeek-V3's
// aux-loss-free balancing): sigmoid score + bias, as DeepSeek-V3; softmax probability *
// exp(bias), i.e. the bias added to the logit, so that one bias step moves an expert by the same
// factor whatever the number of experts. The returned weights use the unbiased score. With num_groups > 1 the experts are
// split into num_groups equal groups, each group is scored by the sum of its best
// max(1, k / topk_groups) selection scores, and only the topk_groups best groups may be chosen.
// Weights are optionally renormalised to sum to one over the k slots, then multiplied by
// scaling_factor. Slots are ordered by descending selection score; ties go to the lower expert
// index.
struct RouterConfig {
  int64_t num_tokens = 0;   // T
  int64_t num_experts = 0;  // E
  int64_t k = 1;
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  int64_t num_groups = 1;
  int64_t topk_groups = 1;
  bool renormalize = false;
  float scaling_factor = 1.0f;
};

// Checks a RouterConfig (k <= E, E divisible by num_groups, enough experts in the allowed groups).
Status validate_router_config(const RouterConfig& config);

// AdamW's step on one float32 parameter tensor and the statistics of that step, in one pass over
// it (the training step's optimizer; nodrop.ops.adamw). optax.adamw's arithmetic after
// optax.clip_by_global_norm, operation for operation (the divisions are divisions), on the
// gradient widened to float32 (it may come as bfloat16 or float16):
//   g     = grad, or (grad / grad_norm) * max_grad_norm where max_grad_norm > 0 and
//           grad_norm >= max_grad_norm
//   mu    = (1 - b1) * g + b1 * mu;   nu = (1 - b2) * (g * g) + b2 * nu
//   u     = (mu / bias_correction1) / (sqrt(nu / bias_correction2) + eps)
//   u     = u + weight_decay * param             (only where weight_decay != 0)
//   u     = update_scale * (step_size * u)       (step_size = -learning rate)
//   param = param + u
// The run-time scalars are device values (the schedule and the norm are computed on the
// device): scalars [4] float32 = step_size, grad_norm, bias_correction1 = 1 - b1^t,
// bias_correction2 = 1 - b2^t. param, mu and nu may be updated in place (the outputs may be the
// inputs). The elements split into num_partials chunks (adamw_chunk); for chunk i,
// partials[i, 0..4] (float32) are the sums over it of u^2, (u * 2^-70)^2, (u * 2^70)^2, the
// count of u or new param values that are not finite, and the count of u^2 that are not
// (nodrop.train.trainer.tree_stats' five sums). A chunk past the elements sums to zero.
struct AdamWConfig {
  int64_t num_elements = 0;
  int64_t num_partials = 1;
  float b1 = 0.9f;
  float b2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float update_scale = 1.0f;
  float max_grad_norm = 0.0f;  // <= 0: no clipping
};
inline constexpr int64_t kAdamWSums = 5;

// Checks an AdamWConfig (sizes, betas in [0, 1), finite non-negative eps and weight decay).
Status validate_adamw_config(const AdamWConfig& config);

// Checks the gradient's dtype: float32, or the bfloat16 / float16 of a weight the model computes
// in that dtype (its gradient carries no more bits; widening it is exact).
Status validate_adamw_grad_dtype(DType grad_dtype);

// Elements per chunk: chunk i covers [i * chunk, min(num_elements, (i + 1) * chunk)). A multiple
// of 4 (16-byte accesses on the GPU), at least 4.
int64_t adamw_chunk(int64_t num_elements, int64_t num_partials);

}  // namespace nodrop
