// AdamW's arithmetic on one element and the sums of its statistics (engine.h, AdamWConfig):
// the one definition that the CPU (cpu/adamw.cc) and the GPU (cuda/adamw.cu) engines both run,
// so their parameters and moments agree bit for bit (neither contracts a multiply and an add
// into an FMA: x86-64's baseline has none, and adamw.cu is compiled with -fmad=false).
#pragma once

#include <cmath>

#include "nodrop/engine.h"

#ifdef __CUDACC__
#define NODROP_HOST_DEVICE __host__ __device__
#else
#define NODROP_HOST_DEVICE
#endif

namespace nodrop {

// The run-time scalars of a step, as the device holds them (engine.h: scalars [4]).
struct AdamWScalars {
  float step_size;
  float grad_norm;
  float bias_correction1;
  float bias_correction2;
};

// 2^-70 and 2^70: the scales of tree_stats' second and third sums.
inline constexpr float kAdamWScaleDown = 8.470329472543003e-22f;
inline constexpr float kAdamWScaleUp = 1.1805916207174113e21f;

NODROP_HOST_DEVICE inline bool adamw_finite(float x) {
#ifdef __CUDA_ARCH__
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

NODROP_HOST_DEVICE inline float adamw_sqrt(float x) {
#ifdef __CUDA_ARCH__
  return sqrtf(x);  // correctly rounded, as nvcc's default -prec-sqrt=true makes it
#else
  return std::sqrt(x);
#endif
}

// Updates param, mu and nu from grad and adds the update's statistics to sums[kAdamWSums].
// clip: the gradient is rescaled (grad_norm >= max_grad_norm > 0).
NODROP_HOST_DEVICE inline void adamw_element(float& param, float grad, float& mu, float& nu,
                                             const AdamWScalars& s, const AdamWConfig& c,
                                             bool clip, float* sums) {
  const float g = clip ? (grad / s.grad_norm) * c.max_grad_norm : grad;
  mu = (1.0f - c.b1) * g + c.b1 * mu;
  nu = (1.0f - c.b2) * (g * g) + c.b2 * nu;
  float u = (mu / s.bias_correction1) / (adamw_sqrt(nu / s.bias_correction2) + c.eps);
  if (c.weight_decay != 0.0f) u = u + c.weight_decay * param;
  u = s.step_size * u;
  if (c.update_scale != 1.0f) u = c.update_scale * u;
  param = param + u;
  const float square = u * u, down = u * kAdamWScaleDown, up = u * kAdamWScaleUp;
  sums[0] += square;
  sums[1] += down * down;
  sums[2] += up * up;
  sums[3] += (adamw_finite(u) && adamw_finite(param)) ? 0.0f : 1.0f;
  sums[4] += adamw_finite(square) ? 0.0f : 1.0f;
}

// Whether this step clips the gradient (optax.clip_by_global_norm: grad_norm < max keeps it; a
// NaN norm rescales, and so turns every value NaN).
NODROP_HOST_DEVICE inline bool adamw_clips(const AdamWScalars& s, const AdamWConfig& c) {
  return c.max_grad_norm > 0.0f && !(s.grad_norm < c.max_grad_norm);
}

}  // namespace nodrop
