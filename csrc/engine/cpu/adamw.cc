// CPU AdamW step: one chunk of the elements per parallel task, each summed in element order.
#include <algorithm>

#include "engine/adamw_element.h"
#include "engine/cpu/convert.h"
#include "engine/cpu/parallel.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {

Status adamw_update(const float* param, const void* grad, DType grad_dtype, const float* mu,
                    const float* nu, const float* scalars, const AdamWConfig& config,
                    float* param_out, float* mu_out, float* nu_out, float* partials,
                    ParallelRunner* runner) {
  Status status = validate_adamw_config(config);
  if (!status.ok()) return status;
  status = validate_adamw_grad_dtype(grad_dtype);
  if (!status.ok()) return status;
  const AdamWScalars s{scalars[0], scalars[1], scalars[2], scalars[3]};
  const bool clip = adamw_clips(s, config);
  const int64_t n = config.num_elements, chunk = adamw_chunk(n, config.num_partials);
  auto run_chunk = [&](int64_t i) {
    float sums[kAdamWSums] = {};
    const int64_t end = std::min(n, (i + 1) * chunk);
    for (int64_t j = i * chunk; j < end; ++j) {
      float p = param[j], m = mu[j], v = nu[j];
      adamw_element(p, load(grad, grad_dtype, j), m, v, s, config, clip, sums);
      param_out[j] = p;
      mu_out[j] = m;
      nu_out[j] = v;
    }
    std::copy(sums, sums + kAdamWSums, partials + i * kAdamWSums);
  };
  if (runner == nullptr || config.num_partials == 1) {
    for (int64_t i = 0; i < config.num_partials; ++i) run_chunk(i);
  } else {
    runner->parallel_for(config.num_partials, run_chunk);
  }
  return Status::Ok();
}

}  // namespace nodrop::cpu
