// FP8 quantisation on the CPU: the reference numerics of nodrop.ops.fp8, row by row, the
// weight gradient's transposed operands block by block, and the experts' weights for the input
// gradient and, transposed, for the forward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "engine/cpu/arguments.h"
#include "engine/cpu/convert.h"
#include "engine/cpu/parallel.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {

namespace {

constexpr float kE4M3Max = 448.0f;

// The scale of a block whose largest magnitude is amax (finite: no NaN or inf seen); 1 where
// amax / 448 is below float32's smallest normal number (a block of zeros, or one whose scale's
// reciprocal would overflow).
float block_scale(float amax, bool finite) {
  if (!finite) return std::nanf("");
  const float scale = amax * (1.0f / kE4M3Max);  // as nodrop.ops.fp8: times the reciprocal
  return scale >= std::numeric_limits<float>::min() ? scale : 1.0f;
}

// x * inverse (the reciprocal of its block's scale), saturated to +-448 and rounded to E4M3. NaN
// stays NaN (a non-finite block's values), which std::clamp would not promise.
uint8_t quantize_value(float x, float inverse) {
  const float v = x * inverse;
  return float_to_e4m3(std::isnan(v) ? v : std::clamp(v, -kE4M3Max, kE4M3Max));
}

// quantize_fp8, or with given_scale (not null) every block at that scale, no amax taken: the
// codes x * (1 / *given_scale) rounded and saturated alike (quantize_fp8_transposed's given
// scale).
Status quantize_blocks(const void* x, DType dtype, int64_t M, int64_t C, int64_t block,
                       const float* given_scale, uint8_t* q, float* scale,
                       ParallelRunner* runner) {
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
      for (int64_t i = begin; i < end && !given_scale; ++i) {
        finite = finite && std::isfinite(values[i]);
        amax = std::max(amax, std::fabs(values[i]));
      }
      const float s = given_scale ? *given_scale : block_scale(amax, finite);
      scale[row * blocks + b] = s;
      const float inverse = 1.0f / s;
      for (int64_t i = begin; i < end; ++i) q[row * C + i] = quantize_value(values[i], inverse);
    }
    }
  });
  return Status::Ok();
}

}  // namespace

Status quantize_fp8(const void* x, DType dtype, int64_t M, int64_t C, int64_t block, uint8_t* q,
                    float* scale, ParallelRunner* runner) {
  return quantize_blocks(x, dtype, M, C, block, nullptr, q, scale, runner);
}

Status permute_rows_fp8(const void* src, DType dtype, const int32_t* row_map, int64_t T,
                        int64_t k, int64_t H, const float* given_scale, void* dst,
                        uint8_t* q, float* scale, ParallelRunner* runner) {
  const int64_t slots = T * k, blocks = (H + kFp8Block - 1) / kFp8Block;
  Status status = check_arguments(
      "permute_rows_fp8", {{"T", T}, {"k", k}, {"H", H}},
      {{"src", src, T * H}, {"row_map", row_map, slots}, {"dst", dst, slots * H},
       {"q", q, slots * H}, {"scale", scale, slots * blocks}});
  if (!status.ok()) return status;
  // Each token quantised once, then its codes and scales moved as permute_rows moves it: a row
  // is a copy of its token, so its blocks are the token's.
  std::vector<uint8_t> token_q(T * H);
  std::vector<float> token_scale(T * blocks);
  status = quantize_blocks(src, dtype, T, H, kFp8Block, given_scale, token_q.data(),
                           token_scale.data(), runner);
  if (!status.ok()) return status;
  permute_rows(src, dtype, row_map, nullptr, T, k, H, dst, runner);
  std::fill(q, q + slots * H, 0);
  // A row no slot maps to: zero, codes 0, scale 1 (or the given one).
  std::fill(scale, scale + slots * blocks, given_scale ? *given_scale : 1.0f);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t row = row_map[i];
    if (row < 0 || row >= slots) continue;
    std::copy_n(token_q.data() + (i / k) * H, H, q + row * H);
    std::copy_n(token_scale.data() + (i / k) * blocks, blocks, scale + row * blocks);
  }
  return Status::Ok();
}

namespace {

// The weight gradient's row blocks (engine.h): the first row of each, group by group, and its
// end (a group's last block ends at the group's end); group_sizes clamped as
// clamp_group_offsets.
Status contract_row_blocks(const int32_t* group_sizes, int64_t M, int64_t G, bool checked,
                           std::vector<int64_t>& block_begin, std::vector<int64_t>& block_end) {
  std::vector<int64_t> offsets(G + 1);
  const Status status =
      clamp_group_offsets(group_sizes, G, M, checked, "group_sizes", offsets.data());
  if (!status.ok()) return status;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t row = offsets[g]; row < offsets[g + 1]; row += kFp8Block) {
      block_begin.push_back(row);
      block_end.push_back(std::min(offsets[g + 1], row + kFp8Block));
    }
  }
  return Status::Ok();
}

}  // namespace

Status quantize_fp8_transposed(const void* x, DType dtype, const int32_t* group_sizes, int64_t M,
                               int64_t C, int64_t G, const float* given_scale, uint8_t* q_t,
                               float* scale, bool checked, ParallelRunner* runner) {
  const int64_t PB = fp8_contract_blocks(M, G), P = kFp8Block * PB;
  Status status = check_arguments(
      "quantize_fp8_transposed", {{"M", M}, {"C", C}, {"G", G}},
      {{"x", x, M * C}, {"group_sizes", group_sizes, G}, {"q_t", q_t, C * P},
       {"scale", scale, PB * C}});
  if (!status.ok()) return status;
  std::vector<int64_t> block_begin, block_end;
  status = contract_row_blocks(group_sizes, M, G, checked, block_begin, block_end);
  if (!status.ok()) return status;
  const int64_t used = static_cast<int64_t>(block_begin.size());
  std::fill(scale + used * C, scale + PB * C, given_scale ? *given_scale : 1.0f);
  for (int64_t c = 0; c < C; ++c) std::fill(q_t + c * P + used * kFp8Block, q_t + (c + 1) * P, 0);
  parallel_blocks(runner, used, 1, [&](int64_t first, int64_t last) {
    std::vector<float> values(kFp8Block * C), amax(C), inverse(C);
    std::vector<char> finite(C);
    for (int64_t b = first; b < last; ++b) {
      const int64_t rows = block_end[b] - block_begin[b];
      to_float(static_cast<const char*>(x) + block_begin[b] * C * dtype_size(dtype), dtype,
               rows * C, values.data());
      std::fill(amax.begin(), amax.end(), 0.0f);
      std::fill(finite.begin(), finite.end(), 1);
      for (int64_t j = 0; j < rows && !given_scale; ++j) {
        for (int64_t c = 0; c < C; ++c) {
          const float v = values[j * C + c];
          finite[c] = finite[c] && std::isfinite(v);
          amax[c] = std::max(amax[c], std::fabs(v));
        }
      }
      for (int64_t c = 0; c < C; ++c) {
        const float s = given_scale ? *given_scale : block_scale(amax[c], finite[c]);
        scale[b * C + c] = s;
        inverse[c] = 1.0f / s;
      }
      for (int64_t c = 0; c < C; ++c) {
        uint8_t* column = q_t + c * P + b * kFp8Block;  // the block's 128 columns of row c
        for (int64_t j = 0; j < rows; ++j) column[j] = quantize_value(values[j * C + c], inverse[c]);
        std::fill(column + rows, column + kFp8Block, 0);
      }
    }
  });
  return Status::Ok();
}

Status transpose_fp8_codes(const uint8_t* q, const int32_t* group_sizes, int64_t M, int64_t C,
                           int64_t G, uint8_t* q_t, bool checked, ParallelRunner* runner) {
  const int64_t PB = fp8_contract_blocks(M, G), P = kFp8Block * PB;
  Status status = check_arguments(
      "transpose_fp8_codes", {{"M", M}, {"C", C}, {"G", G}},
      {{"q", q, M * C}, {"group_sizes", group_sizes, G}, {"q_t", q_t, C * P}});
  if (!status.ok()) return status;
  std::vector<int64_t> block_begin, block_end;
  status = contract_row_blocks(group_sizes, M, G, checked, block_begin, block_end);
  if (!status.ok()) return status;
  const int64_t used = static_cast<int64_t>(block_begin.size());
  for (int64_t c = 0; c < C; ++c) std::fill(q_t + c * P + used * kFp8Block, q_t + (c + 1) * P, 0);
  parallel_blocks(runner, used, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t rows = block_end[b] - block_begin[b];
      for (int64_t c = 0; c < C; ++c) {
        uint8_t* column = q_t + c * P + b * kFp8Block;
        for (int64_t j = 0; j < rows; ++j) column[j] = q[(block_begin[b] + j) * C + c];
        std::fill(column + rows, column + kFp8Block, 0);
      }
    }
  });
  return Status::Ok();
}

namespace {

// quantize_fp8_weights (transposed false: q [G, K, N], scale [G, KB, NB]) or
// quantize_fp8_weights_transposed (q [G, N, K], scale [G, NB, KB]): the same blocks and codes,
// laid out for the input gradient or for the forward.
Status quantize_weight_blocks(const char* function, const void* w, DType dtype, int64_t G,
                              int64_t K, int64_t N, const float* given_scale, bool transposed,
                              uint8_t* q, float* scale, ParallelRunner* runner) {
  const int64_t KB = (K + kFp8Block - 1) / kFp8Block, NB = (N + kFp8Block - 1) / kFp8Block;
  Status status = check_arguments(function, {{"G", G}, {"K", K}, {"N", N}},
                                  {{"w", w, G * K * N},
                                   {transposed ? "q_t" : "q", q, G * N * K},
                                   {"scale", scale, G * NB * KB}});
  if (!status.ok()) return status;
  // One task per 128-row block of an expert: its rows read once, each of its 128 x 128 blocks
  // scaled on its own (or at the expert's given scale).
  parallel_blocks(runner, G * KB, 1, [&](int64_t first, int64_t last) {
    std::vector<float> values(kFp8Block * N);
    for (int64_t task = first; task < last; ++task) {
      const int64_t g = task / KB, kb = task % KB, k0 = kb * kFp8Block;
      const int64_t rows = std::min(kFp8Block, K - k0);
      to_float(static_cast<const char*>(w) + (g * K + k0) * N * dtype_size(dtype), dtype,
               rows * N, values.data());
      for (int64_t nb = 0; nb < NB; ++nb) {
        const int64_t n0 = nb * kFp8Block, columns = std::min(kFp8Block, N - n0);
        float amax = 0.0f;
        bool finite = true;
        for (int64_t r = 0; r < rows && !given_scale; ++r) {
          for (int64_t c = n0; c < n0 + columns; ++c) {
            finite = finite && std::isfinite(values[r * N + c]);
            amax = std::max(amax, std::fabs(values[r * N + c]));
          }
        }
        const float s = given_scale ? given_scale[g] : block_scale(amax, finite);
        scale[transposed ? (g * NB + nb) * KB + kb : (g * KB + kb) * NB + nb] = s;
        const float inverse = 1.0f / s;
        // Each layout's codes written in its own order: runs along its rows.
        for (int64_t i = 0; i < (transposed ? columns : rows); ++i) {
          for (int64_t j = 0; j < (transposed ? rows : columns); ++j) {
            const int64_t r = transposed ? j : i, c = n0 + (transposed ? i : j);
            const int64_t at = transposed ? (g * N + c) * K + k0 + r : (g * K + k0 + r) * N + c;
            q[at] = quantize_value(values[r * N + c], inverse);
          }
        }
      }
    }
  });
  return Status::Ok();
}

}  // namespace

Status quantize_fp8_weights(const void* w, DType dtype, int64_t G, int64_t K, int64_t N,
                            const float* given_scale, uint8_t* q, float* scale,
                            ParallelRunner* runner) {
  return quantize_weight_blocks("quantize_fp8_weights", w, dtype, G, K, N, given_scale,
                                /*transposed=*/false, q, scale, runner);
}

Status quantize_fp8_weights_transposed(const void* w, DType dtype, int64_t G, int64_t K,
                                       int64_t N, const float* given_scale, uint8_t* q_t,
                                       float* scale, ParallelRunner* runner) {
  return quantize_weight_blocks("quantize_fp8_weights_transposed", w, dtype, G, K, N,
                                given_scale, /*transposed=*/true, q_t, scale, runner);
}

}  // namespace nodrop::cpu
