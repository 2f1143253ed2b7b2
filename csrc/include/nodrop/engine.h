// nodrop engine: framework-free MoE kernels on raw pointers and shapes.
//
// Nothing here knows about JAX or XLA. Every function has the same contract on every backend;
// the CPU implementations live in namespace nodrop::cpu (csrc/engine/cpu/).
//
// Conventions (see DESIGN.md):
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
#include <functional>
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

// How the CPU engine runs work in parallel. The FFI layer hands it XLA's own intra-op thread pool,
// so nodrop's threads never compete with XLA's; a null runner runs everything on the calling
// thread (and lets oneDNN use its own OpenMP threads).
class ParallelRunner {
 public:
  virtual ~ParallelRunner() = default;
  virtual int64_t num_workers() const = 0;
  // Calls fn(i) once for every i in [0, n); returns when all calls have finished.
  virtual void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) = 0;
};

enum class ScoreFunction : int32_t { kSoftmax = 0, kSigmoid = 1 };

// Top-k routing. Selection uses score + expert_bias (bias optional, DeepSeek-V3's aux-loss-free
// balancing); the returned weights use the unbiased score. With num_groups > 1 the experts are
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

namespace cpu {

// out[M, N] = for each group g: lhs[rows_g] @ rhs[g]   (rhs [G, K, N])
//   or, with transpose_rhs:      lhs[rows_g] @ rhs[g]^T (rhs [G, N, K]).
// lhs and rhs share in_dtype; accumulation is float32; rows past the last group are zero.
Status grouped_matmul(const void* lhs, const void* rhs, DType in_dtype, const int32_t* group_sizes,
                      int64_t M, int64_t K, int64_t N, int64_t G, bool transpose_rhs, void* out,
                      DType out_dtype, bool checked, ParallelRunner* runner = nullptr);

// Ragged contraction (the weight gradient): out[g] = lhs[rows_g]^T @ rhs[rows_g] -> [G, K, N],
// with lhs [M, K] and rhs [M, N] sharing in_dtype; an empty group gives zeros.
Status grouped_matmul_contract(const void* lhs, const void* rhs, DType in_dtype,
                               const int32_t* group_sizes, int64_t M, int64_t K, int64_t N,
                               int64_t G, void* out, DType out_dtype, bool checked,
                               ParallelRunner* runner = nullptr);

// Counting sort of the T*k (token, slot) pairs by expert: fills row_map [T*k] and
// group_sizes [E]. Out-of-range ids are dropped (row_map -1, in no group) or, with `checked`,
// an error.
Status sort_by_expert(const int32_t* ids, int64_t T, int64_t k, int64_t E, bool checked,
                      int32_t* row_map, int32_t* group_sizes);

// dst[T*k, H]: dst[row_map[t*k+s]] = weight[t, s] * src[t] (weight 1 when weights is null);
// rows that no slot maps to are zero. Row-map entries outside [0, T*k) are skipped.
void scatter_rows(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                  int64_t T, int64_t k, int64_t H, void* dst, ParallelRunner* runner = nullptr);

// dst[T, H]: dst[t] = sum_s weight[t, s] * src[row_map[t*k+s]] (weight 1 when weights is null),
// summed in float32 in slot order; entries outside [0, T*k) contribute nothing.
void gather_rows(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                 int64_t T, int64_t k, int64_t H, void* dst, ParallelRunner* runner = nullptr);

// out[T, k] float32: out[t, s] = <a[t], rows[row_map[t*k+s]]>, zero for an out-of-range entry.
// a [T, H] and rows [T*k, H] share dtype.
void gather_row_dots(const void* a, const void* rows, DType dtype, const int32_t* row_map,
                     int64_t T, int64_t k, int64_t H, float* out,
                     ParallelRunner* runner = nullptr);

// logits [T, E] float32, expert_bias [E] or null -> weights [T, k] float32, ids [T, k] int32.
Status topk_router(const float* logits, const float* expert_bias, const RouterConfig& config,
                   float* weights, int32_t* ids, ParallelRunner* runner = nullptr);

// Gradient of topk_router's weights with respect to the logits (the choice of ids is piecewise
// constant): grad_logits [T, E] from logits, the forward's ids and grad_weights [T, k].
Status topk_router_grad(const float* logits, const int32_t* ids, const float* grad_weights,
                        const RouterConfig& config, float* grad_logits,
                        ParallelRunner* runner = nullptr);

}  // namespace cpu
}  // namespace nodrop
