// Shared helpers for the engine tests: half-precision conversions, typed buffers with canary
// regions, read-fenced input copies, seeded random data and error measures.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "nodrop/engine_cpu.h"

namespace nodrop_test {

using nodrop::DType;
using nodrop::Status;

// ---- float <-> bf16 / fp16 (round to nearest even) -------------------------------------------

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_fp16(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (absx < 0x38800000u) {  // below 2^-14: subnormal half, exact multiple of 2^-24
    const float scaled = bits_float(absx) * 16777216.0f;  // exact (power of two)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  uint32_t r = absx - 0x38000000u;  // rebias the exponent from 127 to 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// Rounds a value to what `dtype` can hold, returned as double (for references built from the
// exact inputs the engine sees).
inline double round_to(DType dtype, double v) {
  const float f = static_cast<float>(v);
  switch (dtype) {
    case DType::kFloat32: return f;
    case DType::kFloat16: return fp16_to_float(float_to_fp16(f));
    case DType::kBFloat16: return bf16_to_float(float_to_bf16(f));
  }
  return f;
}

inline int64_t bytes_of(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

inline const char* short_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
  }
  return "?";
}

// The brief's tolerance: max abs error / max abs reference.
inline double tolerance(DType in, DType out = DType::kFloat32) {
  return (in == DType::kFloat32 && out == DType::kFloat32) ? 1e-5 : 1e-2;
}

// ---- buffers ------------------------------------------------------------------------------

constexpr int64_t kGuardBytes = 256;
constexpr unsigned char kCanary = 0xA5;

// n elements of T between two canary regions; write past either end and canaries_intact() fails.
template <typename T>
class Guarded {
 public:
  Guarded(int64_t n, T fill)
      : n_(std::max<int64_t>(n, 0)), storage_(2 * kGuardBytes + n_ * sizeof(T), kCanary) {
    std::fill_n(data(), n_, fill);
  }
  T* data() { return reinterpret_cast<T*>(storage_.data() + kGuardBytes); }
  const T* data() const { return reinterpret_cast<const T*>(storage_.data() + kGuardBytes); }
  T& operator[](int64_t i) { return data()[i]; }
  const T& operator[](int64_t i) const { return data()[i]; }
  int64_t size() const { return n_; }
  std::vector<T> vec() const { return std::vector<T>(data(), data() + n_); }
  bool canaries_intact() const {
    const auto intact = [](const unsigned char* p) {
      return std::all_of(p, p + kGuardBytes, [](unsigned char c) { return c == kCanary; });
    };
    return intact(storage_.data()) && intact(storage_.data() + kGuardBytes + n_ * sizeof(T));
  }

 private:
  int64_t n_;
  std::vector<unsigned char> storage_;  // malloc'd: 16-byte aligned, and so is data()
};

// A float buffer of any engine dtype, with canaries. New arrays hold NaN ("poison"), so a value
// the engine never wrote fails every comparison.
class Array {
 public:
  Array(DType dtype, int64_t n)
      : dtype_(dtype), n_(n), bytes_(n * bytes_of(dtype), 0) {
    fill(std::numeric_limits<double>::quiet_NaN());
  }
  DType dtype() const { return dtype_; }
  int64_t size() const { return n_; }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  bool canaries_intact() const { return bytes_.canaries_intact(); }

  double at(int64_t i) const {
    const unsigned char* p = bytes_.data() + i * bytes_of(dtype_);
    if (dtype_ == DType::kFloat32) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return dtype_ == DType::kFloat16 ? fp16_to_float(h) : bf16_to_float(h);
  }
  void set(int64_t i, double v) {
    unsigned char* p = bytes_.data() + i * bytes_of(dtype_);
    const float f = static_cast<float>(v);
    if (dtype_ == DType::kFloat32) {
      std::memcpy(p, &f, 4);
      return;
    }
    const uint16_t h = dtype_ == DType::kFloat16 ? float_to_fp16(f) : float_to_bf16(f);
    std::memcpy(p, &h, 2);
  }
  void fill(double v) {
    for (int64_t i = 0; i < n_; ++i) set(i, v);
  }
  std::vector<double> values() const {
    std::vector<double> out(n_);
    for (int64_t i = 0; i < n_; ++i) out[i] = at(i);
    return out;
  }
  // The raw bytes, for bitwise comparisons.
  std::vector<unsigned char> raw() const { return bytes_.vec(); }

 private:
  DType dtype_;
  int64_t n_;
  Guarded<unsigned char> bytes_;
};

// A read-only copy of some bytes placed right before an inaccessible page: reading one byte past
// the end crashes the test (each ctest test is its own process), which canaries cannot catch.
class Fenced {
 public:
  Fenced(const void* src, int64_t bytes) {
    const int64_t page = sysconf(_SC_PAGESIZE);
    const int64_t data_pages = (bytes + page - 1) / page;
    map_bytes_ = (data_pages + 1) * page;
    void* m = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) std::abort();
    map_ = static_cast<unsigned char*>(m);
    mprotect(map_ + data_pages * page, page, PROT_NONE);
    data_ = map_ + data_pages * page - bytes;  // element-aligned: `bytes` is a whole number of them
    if (bytes > 0) std::memcpy(data_, src, bytes);
  }
  explicit Fenced(const Array& a) : Fenced(a.data(), a.size() * bytes_of(a.dtype())) {}
  template <typename T>
  explicit Fenced(const std::vector<T>& v) : Fenced(v.data(), v.size() * sizeof(T)) {}
  Fenced(const Fenced&) = delete;
  Fenced& operator=(const Fenced&) = delete;
  ~Fenced() { munmap(map_, map_bytes_); }
  const void* data() const { return data_; }
  template <typename T>
  const T* as() const { return reinterpret_cast<const T*>(data_); }

 private:
  unsigned char* map_ = nullptr;
  unsigned char* data_ = nullptr;
  int64_t map_bytes_ = 0;
};

// ---- parallel runner ---------------------------------------------------------------------------

// A ParallelRunner in the way of XLA's intra-op pool: parallel_for hands the indices out to
// `workers` threads. calls() tells whether the engine used it, i.e. whether a test's shape is big
// enough to exercise the parallel path at all.
class ThreadRunner : public nodrop::ParallelRunner {
 public:
  explicit ThreadRunner(int64_t workers) : workers_(workers) {}
  int64_t num_workers() const override { return workers_; }
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) override {
    ++calls_;
    std::atomic<int64_t> next{0};
    std::vector<std::thread> threads;
    for (int64_t w = 0; w < workers_; ++w)
      threads.emplace_back([&] {
        for (int64_t i = next++; i < n; i = next++) fn(i);
      });
    for (std::thread& t : threads) t.join();
  }
  int64_t calls() const { return calls_; }

 private:
  int64_t workers_;
  std::atomic<int64_t> calls_{0};
};

// ---- data and comparisons -------------------------------------------------------------------

// Uniform values in [lo, hi], rounded to the array's dtype. Fixed seed per call site.
inline Array random_array(DType dtype, int64_t n, std::mt19937& rng, double lo = -1.0,
                          double hi = 1.0) {
  Array a(dtype, n);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t i = 0; i < n; ++i) a.set(i, dist(rng));
  return a;
}

inline std::vector<float> random_floats(int64_t n, std::mt19937& rng, double lo = -1.0,
                                        double hi = 1.0) {
  std::vector<float> v(n);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (auto& x : v) x = static_cast<float>(dist(rng));
  return v;
}

// max |got - want| / max |want| (max |got - want| when want is all zero). A non-finite value in
// `got` (an unwritten NaN-poisoned element) gives infinity.
inline double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    max_err = std::max(max_err, std::abs(got[i] - want[i]));
    max_ref = std::max(max_ref, std::abs(want[i]));
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Index of the first element in [begin, end) that is not exactly +-0, or -1 when all are.
inline int64_t first_nonzero(const std::vector<double>& v, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i)
    if (!(v[i] == 0.0)) return i;  // NaN is "nonzero" too
  return -1;
}

inline bool mentions(const Status& s, const std::string& word) {
  return s.message().find(word) != std::string::npos;
}

constexpr DType kAllDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

}  // namespace nodrop_test

namespace nodrop {
// Lets GoogleTest (and so ctest's test names) print a dtype parameter by name.
inline void PrintTo(DType dtype, std::ostream* os) { *os << nodrop_test::short_name(dtype); }
}  // namespace nodrop
