// The CPU kernels' shared AVX-512 pieces: 16 lanes loaded from float, bfloat16 or double,
// stored back with bfloat16's rounding (nearest, ties to even, as c10::BFloat16(float) does for
// finite values), and e^x by Cephes' polynomial. Each is one fixed sequence of instructions, so
// a lane's result never depends on its neighbours (batch invariance rests on that).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#define INFERD_AVX512 1

namespace inferd_simd {

template <typename T> inline __m512 load16(const T* p) {
  alignas(64) float lanes[16];
  for (int i = 0; i < 16; ++i) lanes[i] = static_cast<float>(p[i]);
  return _mm512_load_ps(lanes);
}
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <> inline __m512 load16<double>(const double* p) {
  const __m256 lo = _mm512_cvtpd_ps(_mm512_loadu_pd(p)), hi = _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// to the nearest bfloat16, as float (its low 16 bits zero)
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

template <typename T> inline void store16(T* dst, __m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  for (int i = 0; i < 16; ++i) dst[i] = static_cast<T>(lanes[i]);
}
template <> inline void store16<float>(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
template <> inline void store16<c10::BFloat16>(c10::BFloat16* dst, __m512 v) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(high));
}

// e^x for x clamped to [-87, 88]: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial,
// 2^n put in the exponent bits; relative error ~1e-7
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

}  // namespace inferd_simd

#endif
