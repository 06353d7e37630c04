// bfloat16 and float16 tensors: the storage types of bf16/fp16 models. Every method takes them
// through the registry (MethodInfo::functions<bfloat16>()): inputs are widened to float32 (whole,
// or a block at a time for the kernelized methods' bfloat16 calls), the float32 kernels run
// (softmax statistics, linear states and normalisers accumulate in float32), and the output and
// gradients are rounded once, to nearest even; exact attention's bfloat16 calls multiply in
// bfloat16 where the CPU can. What a method saves for its backward (lse, den, state) stays
// float32. docs/precision.md states what the rounding costs.
#pragma once

#include <cstdint>
#include <bit>
#include <type_traits>

#include "linattn/tensor.h"

namespace linattn {

// Raw 16-bit storage; arithmetic happens after widening to float.
struct bfloat16 {
  uint16_t bits;  // no initialiser: a trivial type, which Buffer may memset
};
struct float16 {
  uint16_t bits;  // no initialiser: a trivial type, which Buffer may memset
};

template <class T>
inline constexpr bool is_low_precision_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

// What T's values are accumulated and saved in: float for the 16-bit types, T otherwise.
template <class T>
using accumulator_t = std::conditional_t<is_low_precision_v<T>, float, T>;

// The one-value conversions: the reference the bulk ones (simd.h) are tested against.
inline float to_float(bfloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }

// Round to nearest, ties to even; NaN stays NaN (quiet), ±inf stays ±inf.
inline bfloat16 to_bfloat16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}

// IEEE binary16, written out so that the header needs no compiler extension.
inline float to_float(float16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = x.bits & 0x3FFu;
  const uint32_t magnitude =
      exponent == 0    ? std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 5.9604644775390625e-8f)  // m · 2^-24
      : exponent == 31 ? (0xFFu << 23) | (mantissa << 13)
                       : ((exponent + 112u) << 23) | (mantissa << 13);
  return std::bit_cast<float>(magnitude | sign);
}

inline float16 to_float16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return {static_cast<uint16_t>(sign | 0x7E00u)};  // NaN
  if (a >= 0x477FF000u) return {static_cast<uint16_t>(sign | 0x7C00u)}; // rounds past 65504: inf
  if (a < 0x38800000u) {  // below 2^-14: a subnormal or zero, m = round(|f| · 2^24)
    const float scaled = std::bit_cast<float>(a) * 16777216.0f;  // exact (a power of two)
    // Round to nearest even with the float unit's own rounding: adding 2^23 leaves the integer
    // part in the low mantissa bits.
    return {static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(scaled + 8388608.0f) - 0x4B000000u))};
  }
  const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
  return {static_cast<uint16_t>(sign | (rounded >> 13))};
}

template <class T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, bfloat16>) return to_bfloat16(f);
  else return to_float16(f);
}

// The whole view widened to float32 (Highway, run-time dispatched).
template <class T>
Tensor<float> widen(TensorView<const T> x);
// x rounded to T; Error naming `what` and the dtype when a finite value rounds to ±inf.
template <class T>
Tensor<T> narrow(const Tensor<float>& x, const char* what);

}  // namespace linattn
