// Products over block-quantized weights for the CPU, on AVX-512 VNNI's 8-bit dot products
// (the arithmetic llama.cpp does for Q4_1 x Q8 and Q8_0 x Q8): each row of activations is
// quantized to 8 bits per block of 32 inputs (its own scale: max |x| / 127), and each block of a
// weight row meets it as an exact integer dot product, scaled in float32.
//
//   q4: w = code * d + m, codes 0..15       block = d * dx * sum(code * qx) + m * sum(x)
//   q8: w = code * d, codes -127..127       block = d * dx * sum(code * qx)
//
// A row's output adds its blocks in input order, one float32 sum per output; nothing in it
// depends on the other rows of the call, on how many there are or on which thread ran it: the
// products are batch-invariant by construction, so every row may take this path whatever the
// batch (the test: tests/kernels/test_cpu_matmul.py). Weights are streamed once per 8 rows,
// 16 outputs at a time; threads share the outputs.
//
// Weight layout (inferd/model/quant.py packs it): per tile of 16 outputs and block of 32 inputs,
//   q4: 4 x 64 bytes of codes (vector j, lane n, byte i: code[n][4j + i] | code[n][16 + 4j + i] << 4),
//       16 fp16 scales d, 16 fp16 minimums m                                    (320 bytes)
//   q8: 8 x 64 bytes of codes (vector j, lane n, byte i: code[n][4j + i]), 16 fp16 scales d,
//       16 int32 (-128 * sum of the block's codes: the activations enter as unsigned qx + 128)
//                                                                                 (608 bytes)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#if defined(INFERD_AVX512) && defined(__AVX512VNNI__)
#define INFERD_VNNI 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kRows = 8;  // rows sharing one pass over the weights
constexpr int64_t kQ4Bytes = 320, kQ8Bytes = 608;

bool vnni_available() {
#ifdef INFERD_VNNI
  return true;
#else
  return false;
#endif
}

// A row's activations, 8 bits per input: codes (unsigned: +128 for q8's product), per block the
// scale dx and (q4) the float sum of the block's inputs.
struct QuantizedRows {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scale;   // [M, K / 32]
  std::vector<float> sum;     // [M, K / 32]
};

#ifdef INFERD_VNNI
using inferd_simd::load16;
using inferd_simd::store16;

// codes = round-half-even(x * (127 / max |x|)), one float32 product each, as
// inferd.kernels.reference.quantize_rows_q8 computes them
template <typename T>
void quantize_row(const T* x, int64_t k, bool offset, int8_t* codes, float* scale, float* sum) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 lo = load16<T>(x + b * kBlock), hi = load16<T>(x + b * kBlock + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512i qlo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, inverse), kNearest));
    __m512i qhi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, inverse), kNearest));
    if (offset) {  // q8's product takes the activations unsigned: q + 128
      qlo = _mm512_add_epi32(qlo, _mm512_set1_epi32(128));
      qhi = _mm512_add_epi32(qhi, _mm512_set1_epi32(128));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * kBlock), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * kBlock + 16), _mm512_cvtepi32_epi8(qhi));
    scale[b] = top / 127.0f;
    sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
}
#endif

#ifdef INFERD_VNNI
// One tile of 16 outputs for up to kRows rows: out[r][n] for n in the tile.
template <bool kQ4, typename T>
inline void tile_rows(const uint8_t* tile, int64_t blocks, const int8_t* codes, const float* scale, const float* sum,
                      int64_t k, int64_t rows, T* out, int64_t out_stride) {
  __m512 acc[kRows];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = tile + b * (kQ4 ? kQ4Bytes : kQ8Bytes);
    __m512i w[8];
    __m512 d, m;
    __m512i init;
    if constexpr (kQ4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + j * 64);
        w[j] = _mm512_and_si512(v, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(p + j * 64);
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 512)));
      init = _mm512_loadu_si512(p + 544);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* x = reinterpret_cast<const int32_t*>(codes + r * k + b * kBlock);  // 8 groups of 4 codes
      __m512i dot = kQ4 ? _mm512_setzero_si512() : init;
      if constexpr (kQ4) {  // unsigned weight codes x signed activations
        // quads 0..3 are inputs 0..15 (low nibbles), 4..7 inputs 16..31 (high)
        for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(x[j]));
      } else {  // unsigned activations (+128) x signed weight codes
        for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, _mm512_set1_epi32(x[j]), w[j]);
      }
      const float dx = scale[r * (k / kBlock) + b];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
      if constexpr (kQ4) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[r * (k / kBlock) + b]), acc[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) store16<T>(out + r * out_stride, acc[r]);
}
#endif

at::Tensor block_matmul(const at::Tensor& x,       // [M, K] float32 or bfloat16
                        const at::Tensor& weight,  // uint8 [N / 16, K / 32, 320 or 608] (see above)
                        int64_t format) {          // 4: q4, 8: q8
  TORCH_CHECK(vnni_available(), "block_matmul: this build has no AVX-512 VNNI");
  TORCH_CHECK(format == 4 || format == 8, "block_matmul: format is 4 or 8");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "block_matmul: x [M, K], weight uint8 [N / 16, K / 32, bytes]");
  const int64_t m = x.size(0), k = x.size(1), tiles = weight.size(0), blocks = weight.size(1);
  const int64_t n = tiles * kTile, unit = format == 4 ? kQ4Bytes : kQ8Bytes;
  TORCH_CHECK(k == blocks * kBlock && weight.size(2) == unit, "block_matmul: weight does not match x's inputs");
  const auto input = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#ifdef INFERD_VNNI
  QuantizedRows q{std::vector<int8_t>(m * k), std::vector<float>(m * blocks), std::vector<float>(m * blocks)};
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "inferd_block_matmul", [&] {
    const scalar_t* px = input.data_ptr<scalar_t>();
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize_row(px + r * k, k, format == 8, q.codes.data() + r * k, q.scale.data() + r * blocks,
                     q.sum.data() + r * blocks);
    });
    const uint8_t* w = weight.data_ptr<uint8_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    // each thread a run of tiles, every row: the grain keeps a call on few rows from splitting finer than needed
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t r0 = 0; r0 < m; r0 += kRows) {
          const int64_t rows = std::min(kRows, m - r0);
          scalar_t* o = po + r0 * n + t * kTile;
          if (format == 4)
            tile_rows<true, scalar_t>(w + t * blocks * unit, blocks, q.codes.data() + r0 * k, q.scale.data() + r0 * blocks,
                            q.sum.data() + r0 * blocks, k, rows, o, n);
          else
            tile_rows<false, scalar_t>(w + t * blocks * unit, blocks, q.codes.data() + r0 * k, q.scale.data() + r0 * blocks,
                             q.sum.data() + r0 * blocks, k, rows, o, n);
        }
    });
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferd_cpu, m) {
  m.def("block_matmul(Tensor x, Tensor weight, int format) -> Tensor");
  m.impl("block_matmul", c10::DispatchKey::CPU, TORCH_FN(block_matmul));
  m.def("block_matmul_available() -> bool", [] { return vnni_available(); });
}
