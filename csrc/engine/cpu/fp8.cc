// FP8 quantisation on the CPU: the reference numerics of nodrop.ops.fp8, row by row.
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/cpu/convert.h"
#include "engine/cpu/parallel.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {

namespace {

constexpr float kE4M3Max = 448.0f;

// The scale of a block whose largest magnitude is amax (finite: no NaN or inf seen).
float block_scale(float amax, bool finite) {
  if (!finite) return std::nanf("");
  const float scale = amax * (1.0f / kE4M3Max);  // as nodrop.ops.fp8: times the reciprocal
  return scale > 0.0f ? scale : 1.0f;
}

}  // namespace

Status quantize_fp8(const void* x, DType dtype, int64_t M, int64_t C, int64_t block, uint8_t* q,
                    float* scale, ParallelRunner* runner) {
  if (M < 0 || C < 0) return Status::Error("quantize_fp8: negative shape");
  if (block < 1) return Status::Error("quantize_fp8: block must be at least 1, got " +
                                      std::to_string(block));
  const int64_t blocks = (C + block - 1) / block;
  parallel_blocks(runner, M, 1, [&](int64_t first, int64_t last) {
    std::vector<float> values(C);
    for (int64_t row = first; row < last; ++row) {
    to_float(static_cast<const char*>(x) + row * C * dtype_size(dtype), dtype, C, values.data());
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * block, end = std::min(C, begin + block);
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = begin; i < end; ++i) {
        finite = finite && std::isfinite(values[i]);
        amax = std::max(amax, std::fabs(values[i]));
      }
      const float s = block_scale(amax, finite);
      scale[row * blocks + b] = s;
      const float inverse = 1.0f / s;
      for (int64_t i = begin; i < end; ++i) {
        // std::clamp keeps NaN (a non-finite block's values stay NaN).
        const float v = values[i] * inverse;
        q[row * C + i] = float_to_e4m3(std::isnan(v) ? v : std::clamp(v, -kE4M3Max, kE4M3Max));
      }
    }
    }
  });
  return Status::Ok();
}

}  // namespace nodrop::cpu
