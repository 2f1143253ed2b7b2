// Backend-independent parts of the engine API: dtypes, group-size clamping, router and AdamW
// config checks.
#include <algorithm>
#include <cmath>
#include <string>

#include "nodrop/engine.h"

namespace nodrop {

int64_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

Status clamp_group_offsets(const int32_t* sizes, int64_t num_groups, int64_t rows, bool checked,
                           const char* name, int64_t* offsets) {
  offsets[0] = 0;
  int64_t total = 0;  // the unclamped sum, for the checked-mode message
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t size = sizes[g];
    if (checked && size < 0) {
      return Status::Error(std::string(name) + "[" + std::to_string(g) + "] = " +
                           std::to_string(size) + " is negative");
    }
    total += std::max<int64_t>(size, 0);
    offsets[g + 1] = std::min(rows, offsets[g] + std::max<int64_t>(size, 0));
  }
  if (checked && total > rows) {
    return Status::Error(std::string(name) + " sum to " + std::to_string(total) + " but there are only " +
                         std::to_string(rows) + " rows");
  }
  return Status::Ok();
}

Status validate_router_config(const RouterConfig& c) {
  auto fail = [](const std::string& what) { return Status::Error("router config: " + what); };
  if (c.num_tokens < 0) return fail("num_tokens must be >= 0, got " + std::to_string(c.num_tokens));
  if (c.num_experts < 1) return fail("num_experts must be >= 1, got " + std::to_string(c.num_experts));
  if (c.score_function != ScoreFunction::kSoftmax && c.score_function != ScoreFunction::kSigmoid) {
    return fail("unknown score_function " + std::to_string(static_cast<int>(c.score_function)));
  }
  if (c.k < 1 || c.k > c.num_experts) {
    return fail("k must be in [1, " + std::to_string(c.num_experts) + "], got " + std::to_string(c.k));
  }
  if (c.num_groups < 1 || c.num_experts % c.num_groups != 0) {
    return fail("num_groups must divide num_experts=" + std::to_string(c.num_experts) + ", got " +
                std::to_string(c.num_groups));
  }
  if (c.topk_groups < 1 || c.topk_groups > c.num_groups) {
    return fail("topk_groups must be in [1, " + std::to_string(c.num_groups) + "], got " +
                std::to_string(c.topk_groups));
  }
  const int64_t allowed = c.topk_groups * (c.num_experts / c.num_groups);
  if (c.k > allowed) {
    return fail("k=" + std::to_string(c.k) + " exceeds the " + std::to_string(allowed) +
                " experts in the topk_groups=" + std::to_string(c.topk_groups) + " chosen groups");
  }
  return Status::Ok();
}

Status validate_adamw_config(const AdamWConfig& c) {
  auto fail = [](const std::string& what) { return Status::Error("adamw config: " + what); };
  auto number = [](double x) { return std::to_string(x); };
  if (c.num_elements < 0) {
    return fail("num_elements must be >= 0, got " + std::to_string(c.num_elements));
  }
  if (c.num_partials < 1) {
    return fail("num_partials must be >= 1, got " + std::to_string(c.num_partials));
  }
  if (!(c.b1 >= 0.0f && c.b1 < 1.0f)) return fail("b1 must be in [0, 1), got " + number(c.b1));
  if (!(c.b2 >= 0.0f && c.b2 < 1.0f)) return fail("b2 must be in [0, 1), got " + number(c.b2));
  if (!(c.eps >= 0.0f && std::isfinite(c.eps))) {
    return fail("eps must be finite and >= 0, got " + number(c.eps));
  }
  if (!(c.weight_decay >= 0.0f && std::isfinite(c.weight_decay))) {
    return fail("weight_decay must be finite and >= 0, got " + number(c.weight_decay));
  }
  if (!std::isfinite(c.update_scale)) {
    return fail("update_scale must be finite, got " + number(c.update_scale));
  }
  if (std::isnan(c.max_grad_norm)) return fail("max_grad_norm must not be NaN");
  return Status::Ok();
}

Status validate_adamw_grad_dtype(DType grad_dtype) {
  switch (grad_dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16: return Status::Ok();
  }
  return Status::Error("adamw: grad_dtype must be float32, float16 or bfloat16, got DType " +
                       std::to_string(static_cast<int32_t>(grad_dtype)));
}

int64_t adamw_chunk(int64_t num_elements, int64_t num_partials) {
  const int64_t per_partial = (num_elements + num_partials - 1) / std::max<int64_t>(num_partials, 1);
  return std::max<int64_t>(4, (per_partial + 3) / 4 * 4);
}

}  // namespace nodrop
