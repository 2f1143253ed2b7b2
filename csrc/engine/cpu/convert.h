// Scalar conversions between the engine's storage dtypes and float32 (CPU engine only).
#pragma once

#include <cstdint>
#include <cstring>

#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_float(uint16_t bits) {
  _Float16 half;
  std::memcpy(&half, &bits, sizeof(half));
  return static_cast<float>(half);
}

inline uint16_t float_to_f16(float value) {
  const _Float16 half = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return bits;
}

// Element i of a buffer of `dtype`, as float.
inline float load(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kFloat16: return f16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.0f;
}

inline void store(void* data, DType dtype, int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(data)[i] = value; break;
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = float_to_f16(value); break;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = float_to_bf16(value); break;
  }
}

// n contiguous elements of `dtype` to float32, and back.
inline void to_float(const void* src, DType dtype, int64_t n, float* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src, dtype, i);
}

inline void from_float(const float* src, int64_t n, DType dtype, void* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) store(dst, dtype, i, src[i]);
}

}  // namespace nodrop::cpu
