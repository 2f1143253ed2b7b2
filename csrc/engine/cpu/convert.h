// Scalar conversions between the engine's storage dtypes and float32 (CPU engine only).
#pragma once

#include <cmath>
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

// float32 to E4M3 (float8_e4m3fn: 4 exponent bits, bias 7, 3 mantissa bits, no infinities,
// largest finite 448), rounded to nearest even. Inputs past +-448 round to NaN, as a
// conversion does: callers saturate first. NaN keeps its sign.
inline uint8_t float_to_e4m3(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7f;  // NaN
  if (magnitude > 0x43e80000u) return sign | 0x7f;  // past 464, which ties to 448 (even)
  if (magnitude < 0x3c800000u) {  // below 2^-6, E4M3's smallest normal: steps of 2^-9
    float abs_value;
    std::memcpy(&abs_value, &magnitude, sizeof(abs_value));
    // Exact: a power-of-two scaling; nearbyint rounds half to even in the default mode.
    return sign | static_cast<uint8_t>(std::nearbyint(abs_value * 512.0f));
  }
  // Round the 23 mantissa bits to 3, to nearest even (a carry moves into the exponent), then
  // rebias the exponent from 127 to 7.
  const uint32_t rounded = magnitude + 0x7ffffu + ((magnitude >> 20) & 1u);
  return sign | static_cast<uint8_t>((rounded >> 20) - ((127 - 7) << 3));
}

// E4M3 (float8_e4m3fn) to float32, exactly: codes 0x7f and 0xff are NaN, there are no
// infinities.
inline float e4m3_to_float(uint8_t code) {
  const int exponent = (code >> 3) & 15, mantissa = code & 7;
  if ((code & 0x7f) == 0x7f) return std::nanf("");
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return code & 0x80 ? -magnitude : magnitude;
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
