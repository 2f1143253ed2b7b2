// The FP8 grouped matmuls on the CPU: the forward and the weight gradient, blockwise-scaled and
// with one scale per tensor (tensorwise). The CUDA kernels' numerics in plain loops (the
// reference backend; correct first, vectorisable inner loops, one block of output rows per
// worker).
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "engine/cpu/arguments.h"
#include "engine/cpu/convert.h"
#include "engine/cpu/parallel.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {
namespace {

constexpr int64_t kScaleBlock = 128;  // the recipe's 1 x 128 and 128 x 128 scale blocks
constexpr int64_t kLanes = 8;  // independent partial sums of a dot (of a multiple of 16 elements)

// Every GEMM here writes bfloat16 rows of N elements, 16-byte aligned on the GPU.
Status n_not_a_multiple_of_8(const char* function, int64_t N) {
  return Status::Error(std::string(function) + ": N = " + std::to_string(N) +
                       " must be a multiple of 8 (as on the GPU): pad it");
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int code = 0; code < 256; ++code) t[code] = e4m3_to_float(static_cast<uint8_t>(code));
    return t;
  }();
  return table;
}

void decode(const uint8_t* codes, int64_t n, float* values) {
  const auto& table = e4m3_table();
  for (int64_t i = 0; i < n; ++i) values[i] = table[codes[i]];
}

// The float32 dot of a and b over [0, n), n a multiple of kLanes: kLanes running sums (which the
// compiler vectorises) added in a fixed order, so the result never depends on the build.
float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  for (int64_t k = 0; k < n; k += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += a[k + j] * b[k + j];
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

// The ragged-rows forwards once their arguments are checked: the GPU's rules (so that both
// engines refuse the same calls), the clamped groups, rows past them zeroed, each expert that
// owns a row decoded once; then out[m, n] = bf16(product(lhs[m], rhs[g, n], m, g, n)) for each
// row m of group g, both operands decoded to float32.
template <typename Product>
Status grouped_rows_forward(const char* function, const void* lhs, const void* rhs,
                            const int32_t* group_sizes, int64_t M, int64_t K, int64_t N,
                            int64_t G, void* out, bool checked, ParallelRunner* runner,
                            const Product& product) {
  if (K % 16 != 0) {
    return Status::Error(std::string(function) + ": K = " + std::to_string(K) +
                         " must be a multiple of 16 (as on the GPU): pad it");
  }
  if (N % 8 != 0) return n_not_a_multiple_of_8(function, N);
  std::vector<int64_t> offsets(G + 1);
  Status status = clamp_group_offsets(group_sizes, G, M, checked, "group_sizes", offsets.data());
  if (!status.ok()) return status;
  uint16_t* result = static_cast<uint16_t*>(out);
  // K = 0 contracts nothing: zeros whatever the scales, as on the GPU.
  const int64_t used_rows = K == 0 ? 0 : offsets[G];
  std::fill(result + used_rows * N, result + M * N, uint16_t{0});  // bf16 zero
  if (used_rows == 0 || N == 0) return Status::Ok();

  std::vector<float> weights(G * N * K);
  parallel_blocks(runner, G, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      if (offsets[g + 1] > offsets[g]) {
        decode(static_cast<const uint8_t*>(rhs) + g * N * K, N * K, weights.data() + g * N * K);
      }
    }
  });
  parallel_blocks(runner, used_rows, 16, [&](int64_t first, int64_t last) {
    std::vector<float> row(K);
    // The group of row `first`, then advanced as the rows pass group ends.
    int64_t g = std::upper_bound(offsets.begin(), offsets.end(), first) - offsets.begin() - 1;
    for (int64_t m = first; m < last; ++m) {
      while (offsets[g + 1] <= m) ++g;
      decode(static_cast<const uint8_t*>(lhs) + m * K, K, row.data());
      for (int64_t n = 0; n < N; ++n) {
        result[m * N + n] =
            float_to_bf16(product(row.data(), weights.data() + (g * N + n) * K, m, g, n));
      }
    }
  });
  return Status::Ok();
}

// The ragged contractions once their arguments are checked: the GPU's rule on N, the clamped
// groups, rhs_t's columns decoded once; then out[g, k, n] = bf16(sum(row, w, begin, blocks, k,
// n)), row and w being lhs_t[k] and rhs_t[n] over group g's blocks [begin, begin + blocks)
// decoded to float32. An empty group gives zeros, whatever the scales.
template <typename Sum>
Status grouped_contract(const char* function, const void* lhs_t, const void* rhs_t,
                        const int32_t* group_sizes, int64_t M, int64_t K, int64_t N, int64_t G,
                        void* out, bool checked, ParallelRunner* runner, const Sum& sum) {
  const int64_t P = kFp8Block * fp8_contract_blocks(M, G);
  if (N % 8 != 0) return n_not_a_multiple_of_8(function, N);
  std::vector<int64_t> offsets(G + 1);
  Status status = clamp_group_offsets(group_sizes, G, M, checked, "group_sizes", offsets.data());
  if (!status.ok()) return status;
  // Group g's blocks are [first_block[g], first_block[g + 1]), as quantize_fp8_transposed lays
  // them out; the columns of its last block past its rows are not its own (as on the GPU, whose
  // contraction is exactly the group's rows), so they decode as zeros.
  std::vector<int64_t> first_block(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    first_block[g + 1] = first_block[g] + (offsets[g + 1] - offsets[g] + kFp8Block - 1) / kFp8Block;
  }
  const int64_t used = first_block[G] * kFp8Block;  // the columns any group reads
  auto decode_group = [&](const void* operand, int64_t row, int64_t g, float* values) {
    const int64_t rows = offsets[g + 1] - offsets[g];
    const int64_t width = (first_block[g + 1] - first_block[g]) * kFp8Block;
    decode(static_cast<const uint8_t*>(operand) + row * P + first_block[g] * kFp8Block, rows,
           values);
    std::fill(values + rows, values + width, 0.0f);
  };

  // rhs_t's used columns, decoded once.
  std::vector<float> rhs(N * used);
  parallel_blocks(runner, N, 1, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        decode_group(rhs_t, n, g, rhs.data() + n * used + first_block[g] * kFp8Block);
      }
    }
  });
  // One output row (g, k) at a time: its N sums over the group's blocks.
  uint16_t* result = static_cast<uint16_t*>(out);
  parallel_blocks(runner, G * K, 1, [&](int64_t first, int64_t last) {
    std::vector<float> row;
    for (int64_t i = first; i < last; ++i) {
      const int64_t g = i / K, k = i % K;
      const int64_t begin = first_block[g], blocks = first_block[g + 1] - begin;
      if (blocks == 0) {  // an empty group: zeros, as on the GPU
        std::fill(result + i * N, result + (i + 1) * N, uint16_t{0});  // bf16 zero
        continue;
      }
      row.resize(blocks * kFp8Block);
      decode_group(lhs_t, k, g, row.data());
      for (int64_t n = 0; n < N; ++n) {
        result[i * N + n] =
            float_to_bf16(sum(row.data(), rhs.data() + n * used + begin * kFp8Block, begin,
                              blocks, k, n));
      }
    }
  });
  return Status::Ok();
}

}  // namespace

Status grouped_matmul_fp8_blockwise(const void* lhs, const float* lhs_scales, const void* rhs,
                                    const float* rhs_scales, const int32_t* group_sizes,
                                    int64_t M, int64_t K, int64_t N, int64_t G, void* out,
                                    bool checked, ParallelRunner* runner) {
  const int64_t KB = (K + kScaleBlock - 1) / kScaleBlock, NB = (N + kScaleBlock - 1) / kScaleBlock;
  const char* function = "grouped_matmul_fp8_blockwise";
  Status status = check_arguments(
      function, {{"M", M}, {"K", K}, {"N", N}, {"G", G}},
      {{"lhs", lhs, M * K}, {"lhs_scales", lhs_scales, M * KB}, {"rhs", rhs, G * N * K},
       {"rhs_scales", rhs_scales, G * NB * KB}, {"group_sizes", group_sizes, G},
       {"out", out, M * N}});
  if (!status.ok()) return status;
  return grouped_rows_forward(
      function, lhs, rhs, group_sizes, M, K, N, G, out, checked, runner,
      [&](const float* row, const float* w, int64_t m, int64_t g, int64_t n) {
        const float* row_scales = lhs_scales + m * KB;
        const float* w_scales = rhs_scales + (g * NB + n / kScaleBlock) * KB;
        float acc = 0.0f;
        for (int64_t kb = 0; kb < KB; ++kb) {
          const int64_t begin = kb * kScaleBlock, length = std::min(K - begin, kScaleBlock);
          acc += dot(row + begin, w + begin, length) * (row_scales[kb] * w_scales[kb]);
        }
        return acc;
      });
}

Status grouped_matmul_fp8_tensorwise(const void* lhs, const float* lhs_scale, const void* rhs,
                                     const float* rhs_scales, const int32_t* group_sizes,
                                     int64_t M, int64_t K, int64_t N, int64_t G, void* out,
                                     bool checked, ParallelRunner* runner) {
  const char* function = "grouped_matmul_fp8_tensorwise";
  Status status = check_arguments(
      function, {{"M", M}, {"K", K}, {"N", N}, {"G", G}},
      {{"lhs", lhs, M * K}, {"lhs_scale", lhs_scale, 1}, {"rhs", rhs, G * N * K},
       {"rhs_scales", rhs_scales, G}, {"group_sizes", group_sizes, G}, {"out", out, M * N}});
  if (!status.ok()) return status;
  // One scale per operand: the dot over all of K, scaled once (the GPU's fast accumulation).
  return grouped_rows_forward(
      function, lhs, rhs, group_sizes, M, K, N, G, out, checked, runner,
      [&](const float* row, const float* w, int64_t, int64_t g, int64_t) {
        return dot(row, w, K) * (lhs_scale[0] * rhs_scales[g]);
      });
}

Status grouped_matmul_fp8_blockwise_contract(const void* lhs_t, const float* lhs_scales,
                                             const void* rhs_t, const float* rhs_scales,
                                             const int32_t* group_sizes, int64_t M, int64_t K,
                                             int64_t N, int64_t G, void* out, bool checked,
                                             ParallelRunner* runner) {
  const int64_t PB = fp8_contract_blocks(M, G), P = kFp8Block * PB;
  const char* function = "grouped_matmul_fp8_blockwise_contract";
  Status status = check_arguments(
      function, {{"M", M}, {"K", K}, {"N", N}, {"G", G}},
      {{"lhs_t", lhs_t, K * P}, {"lhs_scales", lhs_scales, PB * K}, {"rhs_t", rhs_t, N * P},
       {"rhs_scales", rhs_scales, PB * N}, {"group_sizes", group_sizes, G},
       {"out", out, G * K * N}});
  if (!status.ok()) return status;
  // The group's blocks in order, each one's sum scaled as it is added.
  return grouped_contract(
      function, lhs_t, rhs_t, group_sizes, M, K, N, G, out, checked, runner,
      [&](const float* row, const float* w, int64_t begin, int64_t blocks, int64_t k,
          int64_t n) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          acc += dot(row + b * kFp8Block, w + b * kFp8Block, kFp8Block) *
                 (lhs_scales[(begin + b) * K + k] * rhs_scales[(begin + b) * N + n]);
        }
        return acc;
      });
}

Status grouped_matmul_fp8_tensorwise_contract(const void* lhs_t, const float* lhs_scale,
                                              const void* rhs_t, const float* rhs_scale,
                                              const int32_t* group_sizes, int64_t M, int64_t K,
                                              int64_t N, int64_t G, void* out, bool checked,
                                              ParallelRunner* runner) {
  const int64_t P = kFp8Block * fp8_contract_blocks(M, G);
  const char* function = "grouped_matmul_fp8_tensorwise_contract";
  Status status = check_arguments(
      function, {{"M", M}, {"K", K}, {"N", N}, {"G", G}},
      {{"lhs_t", lhs_t, K * P}, {"lhs_scale", lhs_scale, 1}, {"rhs_t", rhs_t, N * P},
       {"rhs_scale", rhs_scale, 1}, {"group_sizes", group_sizes, G}, {"out", out, G * K * N}});
  if (!status.ok()) return status;
  // One scale per operand: the dot over all the group's columns, scaled once (the GPU's
  // accumulation, fast or promoted, differs only in how its float32 sums round).
  return grouped_contract(
      function, lhs_t, rhs_t, group_sizes, M, K, N, G, out, checked, runner,
      [&](const float* row, const float* w, int64_t, int64_t blocks, int64_t, int64_t) {
        return dot(row, w, blocks * kFp8Block) * (lhs_scale[0] * rhs_scale[0]);
      });
}

}  // namespace nodrop::cpu
