// The block products' shared pieces (cpu_matmul.cpp's VNNI kernel, cpu_matmul_tiles.cpp's AMX
// one): the weights' layout constants, the activations' quantization and a block's float32 step.
// Both kernels quantize with quantize_row and add each block's exact integer dot product with
// add_block, so a row's result is the same bits on either.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#if defined(INFERD_AVX512) && defined(__AVX512VNNI__)
#define INFERD_VNNI 1
#endif

namespace inferd_blocks {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kQ4Bytes = 320, kQ8Bytes = 608;
constexpr float kWideLevels = 32639.0f;  // 16-bit activations' largest code: 127 x 256 + 127

// A row's activations, 8 bits per input (unsigned: +128 for q8's VNNI product) or 16, per block
// the scale dx and (q4) the float sum of the block's inputs.
struct QuantizedRows {
  std::vector<int8_t> codes;  // [M, K x bytes per code]
  std::vector<float> scale;   // [M, K / 32]
  std::vector<float> sum;     // [M, K / 32]
};

// How a row's codes are kept: signed bytes, unsigned ones (q + 128: q8's VNNI product), or
// 16-bit codes split into two signed bytes (q4's wide product).
enum class Codes { kSigned, kUnsigned, kSplit };

#ifdef INFERD_VNNI
// codes = round-half-even(x * (L / max |x|)), one float32 product each, as
// inferd.kernels.reference.quantize_rows computes them; L = 127, or kWideLevels when split:
// q = 256 h + l (h = (q + 128) >> 8 in -127..127, l in -128..127), so a block's dot product is
// 256 x (weights . h) + (weights . l), two 8-bit sums, exact. Split codes keep per block the
// 32 high bytes, then the 32 low.
template <typename T>
inline void quantize_row(const T* x, int64_t k, Codes kind, int8_t* codes, float* scale, float* sum) {
  const float levels = kind == Codes::kSplit ? kWideLevels : 127.0f;
  const int64_t stride = kind == Codes::kSplit ? 2 * kBlock : kBlock;
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 lo = inferd_simd::load16<T>(x + b * kBlock), hi = inferd_simd::load16<T>(x + b * kBlock + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(top > 0.0f ? levels / top : 0.0f);
    int8_t* out = codes + b * stride;
    for (int half = 0; half < 2; ++half) {
      __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(half ? hi : lo, inverse), kNearest));
      if (kind == Codes::kSplit) {
        const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + kBlock + half * 16),
                         _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(h, 8))));
        q = h;
      } else if (kind == Codes::kUnsigned) {
        q = _mm512_add_epi32(q, _mm512_set1_epi32(128));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + half * 16), _mm512_cvtepi32_epi8(q));
    }
    scale[b] = top / levels;
    sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
}

// A block's step for one row and 16 outputs: its exact integer dot product, scaled by the
// weights' d and the row's dx, added to the sum; q4 adds the minimums m times the inputs' sum.
template <bool kQ4>
inline __m512 add_block(__m512 acc, __m512i dot, __m512 d, __m512 m, float dx, float sum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
  if constexpr (kQ4) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(sum), acc);
  return acc;
}
#endif

}  // namespace inferd_blocks
