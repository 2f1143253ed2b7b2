// The FP8 blockwise-scaled grouped matmul on the CPU: the CUDA kernel's numerics in plain loops
// (the reference backend; correct first, vectorisable inner loops, one row block per worker).
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "engine/cpu/convert.h"
#include "engine/cpu/parallel.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {
namespace {

constexpr int64_t kScaleBlock = 128;  // the recipe's 1 x 128 and 128 x 128 scale blocks
constexpr int64_t kLanes = 8;         // independent partial sums of a dot (K is a multiple of 16)

Status fail(const std::string& message) {
  return Status::Error("grouped_matmul_fp8_blockwise: " + message);
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

}  // namespace

Status grouped_matmul_fp8_blockwise(const void* lhs, const float* lhs_scales, const void* rhs,
                                    const float* rhs_scales, const int32_t* group_sizes,
                                    int64_t M, int64_t K, int64_t N, int64_t G, void* out,
                                    bool checked, ParallelRunner* runner) {
  const std::pair<const char*, int64_t> dims[] = {{"M", M}, {"K", K}, {"N", N}, {"G", G}};
  for (const auto& [name, value] : dims) {
    if (value < 0) return fail(std::string(name) + " = " + std::to_string(value) + " is negative");
  }
  // The GPU's rules, so that both engines refuse the same calls.
  if (K % 16 != 0) {
    return fail("K = " + std::to_string(K) + " must be a multiple of 16 (as on the GPU): pad it");
  }
  if (N % 8 != 0) {
    return fail("N = " + std::to_string(N) + " must be a multiple of 8 (as on the GPU): pad it");
  }
  const int64_t KB = (K + kScaleBlock - 1) / kScaleBlock, NB = (N + kScaleBlock - 1) / kScaleBlock;
  struct Buffer {
    const char* name;
    const void* data;
    int64_t elements;
  };
  const Buffer buffers[] = {{"lhs", lhs, M * K},           {"lhs_scales", lhs_scales, M * KB},
                            {"rhs", rhs, G * N * K},       {"rhs_scales", rhs_scales, G * NB * KB},
                            {"group_sizes", group_sizes, G}, {"out", out, M * N}};
  for (const Buffer& buffer : buffers) {
    if (buffer.elements > 0 && buffer.data == nullptr) {
      return fail(std::string(buffer.name) + " is null");
    }
  }
  std::vector<int64_t> offsets(G + 1);
  Status status = clamp_group_offsets(group_sizes, G, M, checked, "group_sizes", offsets.data());
  if (!status.ok()) return status;
  uint16_t* result = static_cast<uint16_t*>(out);
  const int64_t used_rows = offsets[G];
  std::fill(result + used_rows * N, result + M * N, uint16_t{0});  // bf16 zero
  if (used_rows == 0 || N == 0) return Status::Ok();

  // Every expert that owns a row, decoded once.
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
      const float* row_scales = lhs_scales + m * KB;
      for (int64_t n = 0; n < N; ++n) {
        const float* w = weights.data() + (g * N + n) * K;
        const float* w_scales = rhs_scales + (g * NB + n / kScaleBlock) * KB;
        float acc = 0.0f;
        for (int64_t kb = 0; kb < KB; ++kb) {
          const int64_t begin = kb * kScaleBlock, length = std::min(K - begin, kScaleBlock);
          acc += dot(row.data() + begin, w + begin, length) * (row_scales[kb] * w_scales[kb]);
        }
        result[m * N + n] = float_to_bf16(acc);
      }
    }
  });
  return Status::Ok();
}

}  // namespace nodrop::cpu
