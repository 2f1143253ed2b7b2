// CPU token permutation: counting sort by expert, and the three row movers (scatter, gather,
// row dot products) that permute and un-permute are made of. Each output row is written by
// exactly one thread, so there are no atomics and results do not depend on the thread count.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cpu/convert.h"
#include "engine/cpu/parallel.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {
namespace {

// Elements per parallel block: smaller loops are not worth waking another thread for.
constexpr int64_t kMinBlockElems = 1 << 14;

int64_t min_rows(int64_t H) { return std::max<int64_t>(1, kMinBlockElems / std::max<int64_t>(H, 1)); }

template <typename T>
struct Storage;  // float <-> storage element for one dtype, so the row loops are monomorphic

template <>
struct Storage<float> {
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};

struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

template <>
struct Storage<BF16> {
  static float load(BF16 v) { return bf16_to_float(v.bits); }
  static BF16 store(float v) { return {float_to_bf16(v)}; }
};

template <>
struct Storage<F16> {
  static float load(F16 v) { return f16_to_float(v.bits); }
  static F16 store(float v) { return {float_to_f16(v)}; }
};

template <typename Fn>
void dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); break;
    case DType::kFloat16: fn(F16{}); break;
    case DType::kBFloat16: fn(BF16{}); break;
  }
}

bool in_range(int32_t row, int64_t num_rows) { return row >= 0 && row < num_rows; }

}  // namespace

Status sort_by_expert(const int32_t* ids, int64_t T, int64_t k, int64_t E, bool checked,
                      int32_t* row_map, int32_t* group_sizes) {
  const int64_t slots = T * k;
  std::vector<int64_t> next_row(E + 1, 0);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t e = ids[i];
    if (e < 0 || e >= E) {
      if (checked) {
        return Status::Error("ids[" + std::to_string(i / k) + ", " + std::to_string(i % k) +
                             "] = " + std::to_string(e) + " is not an expert in [0, " +
                             std::to_string(E) + ")");
      }
      continue;
    }
    ++next_row[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    group_sizes[e] = static_cast<int32_t>(next_row[e + 1]);
    next_row[e + 1] += next_row[e];
  }
  // Visiting slots in (token, slot) order makes the order inside each expert (token, slot).
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t e = ids[i];
    row_map[i] = (e < 0 || e >= E) ? -1 : static_cast<int32_t>(next_row[e]++);
  }
  return Status::Ok();
}

void permute_rows(const void* src, DType dtype, const int32_t* row_map, const float* weights,
                  int64_t T, int64_t k, int64_t H, void* dst, ParallelRunner* runner) {
  const int64_t num_rows = T * k;
  // Rows no slot maps to (dropped slots) must read as zero.
  std::vector<char> written(num_rows, 0);
  for (int64_t i = 0; i < num_rows; ++i) {
    if (in_range(row_map[i], num_rows)) written[row_map[i]] = 1;
  }
  dispatch(dtype, [&](auto tag) {
    using T_ = decltype(tag);
    const T_* in = static_cast<const T_*>(src);
    T_* out = static_cast<T_*>(dst);
    parallel_blocks(runner, num_rows, min_rows(H), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (!written[r]) std::memset(out + r * H, 0, H * sizeof(T_));
      }
      for (int64_t i = begin; i < end; ++i) {
        const int32_t row = row_map[i];
        if (!in_range(row, num_rows)) continue;
        const T_* x = in + (i / k) * H;
        T_* y = out + static_cast<int64_t>(row) * H;
        if (weights == nullptr) {
          std::memcpy(y, x, H * sizeof(T_));
        } else {
          const float w = weights[i];
          for (int64_t h = 0; h < H; ++h) y[h] = Storage<T_>::store(w * Storage<T_>::load(x[h]));
        }
      }
    });
  });
}

void unpermute(const void* src, DType dtype, const int32_t* row_map, const float* weights,
               int64_t T, int64_t k, int64_t H, void* dst, ParallelRunner* runner) {
  const int64_t num_rows = T * k;
  dispatch(dtype, [&](auto tag) {
    using T_ = decltype(tag);
    const T_* in = static_cast<const T_*>(src);
    T_* out = static_cast<T_*>(dst);
    parallel_blocks(runner, T, min_rows(H), [&](int64_t begin, int64_t end) {
      std::vector<float> acc(H);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = 0; s < k; ++s) {  // fixed slot order: the sum is deterministic
          const int32_t row = row_map[t * k + s];
          if (!in_range(row, num_rows)) continue;
          const float w = weights == nullptr ? 1.0f : weights[t * k + s];
          const T_* x = in + static_cast<int64_t>(row) * H;
          for (int64_t h = 0; h < H; ++h) acc[h] += w * Storage<T_>::load(x[h]);
        }
        for (int64_t h = 0; h < H; ++h) out[t * H + h] = Storage<T_>::store(acc[h]);
      }
    });
  });
}

void gather_row_dots(const void* a, const void* rows, DType dtype, const int32_t* row_map,
                     int64_t T, int64_t k, int64_t H, float* out, ParallelRunner* runner) {
  const int64_t num_rows = T * k;
  dispatch(dtype, [&](auto tag) {
    using T_ = decltype(tag);
    const T_* lhs = static_cast<const T_*>(a);
    const T_* rhs = static_cast<const T_*>(rows);
    parallel_blocks(runner, num_rows, min_rows(H), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int32_t row = row_map[i];
        if (!in_range(row, num_rows)) {
          out[i] = 0.0f;
          continue;
        }
        const T_* x = lhs + (i / k) * H;
        const T_* y = rhs + static_cast<int64_t>(row) * H;
        double dot = 0.0;  // double keeps long rows accurate to float32 rounding
        for (int64_t h = 0; h < H; ++h) {
          dot += static_cast<double>(Storage<T_>::load(x[h])) * Storage<T_>::load(y[h]);
        }
        out[i] = static_cast<float>(dot);
      }
    });
  });
}

}  // namespace nodrop::cpu
