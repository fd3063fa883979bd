// Reading a K or V row as float32, in the model's dtype or in 8 bits (inferd/kernels/kv_quant.py:
// float8 codes, e4m3fn or e5m2, and a row's scale 2**exponent): exact, float(code) * 2**exponent.
// With AVX-512 a code goes through F16C's float16 conversion, which is exact: e5m2 is float16's
// top byte, e4m3 shifted into float16's layout is value / 2**8.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <type_traits>

#include "cpu_simd.h"

namespace inferd_kv8 {

using E4m3 = c10::Float8_e4m3fn;
using E5m2 = c10::Float8_e5m2;
template <typename C> constexpr bool kEightBit = std::is_same_v<C, E4m3> || std::is_same_v<C, E5m2>;

// 2**e as a float, exactly for e >= -149 (kv_quant's exponents reach -127: a subnormal)
inline float pow2(int32_t e) {
  return __builtin_bit_cast(float, e >= -126 ? (e + 127) << 23 : int32_t{1} << (e + 149));
}

// A K or V row as float32 into `row` [dim]; an 8-bit row times its scale (2**exponent).
template <typename C>
inline void load_row(const C* p, float scale, int64_t dim, float* row) {
  for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(p[d]);
  if constexpr (kEightBit<C>)
    for (int64_t d = 0; d < dim; ++d) row[d] *= scale;
}

#ifdef INFERD_AVX512
// 16 codes as float32 (exact): e5m2 is float16's top byte; e4m3's exponent and mantissa put in
// float16's bits 13..7 (the exponent field's top bit 0) make float16 of value / 2**8 (the biases
// differ by 8), subnormals included.
inline __m512 load_codes16(const E5m2* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
}
inline __m512 load_codes16(const E4m3* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f));
}

// 16 elements of a K or V row as float32; an 8-bit row's times its scale (2**exponent)
template <typename C>
inline __m512 load16(const C* p, float scale) {
  if constexpr (kEightBit<C>)
    return _mm512_mul_ps(load_codes16(p), _mm512_set1_ps(scale));
  else
    return inferd_simd::load16<C>(p);
}
#endif

}  // namespace inferd_kv8
