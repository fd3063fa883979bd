// Products over block-quantized weights for the CPU, on AVX-512 VNNI's 8-bit dot products
// (the arithmetic llama.cpp does for Q4_1 x Q8 and Q8_0 x Q8): each row of activations is
// quantized to 8 bits per block of 32 inputs (its own scale: max |x| / 127), and each block of a
// weight row meets it as an exact integer dot product, scaled in float32.
//
//   q4: w = code * d + m, codes 0..15       block = d * dx * sum(code * qx) + m * sum(x)
//   q8: w = code * d, codes -127..127       block = d * dx * sum(code * qx)
//
// q4 weights also meet activations quantized to 16 bits (max |x| / 32639 per block, each code
// split into two bytes: twice the 8-bit work): a layer whose inputs have outliers inside a block
// (a decoder's qkv and down products) keeps bf16's precision there. The block's integer
// sum stays exact (15 x 32639 x 32 < 2^24, so its float32 is exact too).
//
// A row's output adds its blocks in input order, one float32 sum per output; nothing in it
// depends on the other rows of the call, on how many there are or on which thread ran it: the
// products are batch-invariant by construction, so every row may take this path whatever the
// batch (the test: tests/kernels/test_cpu_matmul.py). Weights are streamed once per 8 rows,
// 16 outputs at a time; threads share the outputs.
//
// Weight layout (inferd/model/layers/quant.py packs it): per tile of 16 outputs and block of 32 inputs,
//   q4: 4 x 64 bytes of codes (vector j, lane n, byte i: code[n][4j + i] | code[n][16 + 4j + i] << 4),
//       16 fp16 scales d, 16 fp16 minimums m                                    (320 bytes)
//   q8: 8 x 64 bytes of codes (vector j, lane n, byte i: code[n][4j + i]), 16 fp16 scales d,
//       16 int32 (-128 * sum of the block's codes: the activations enter as unsigned qx + 128)
//                                                                                 (608 bytes)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_blocks.h"
#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

using namespace inferd_blocks;
constexpr int64_t kRows = 8;  // rows sharing one pass over the weights

bool vnni_available() {
#ifdef INFERD_VNNI
  return true;
#else
  return false;
#endif
}

#ifdef INFERD_VNNI
using inferd_simd::store16;
#endif

#ifdef INFERD_VNNI
// One tile of 16 outputs for up to kRows rows: out[r][n] for n in the tile. kWide (q4 only):
// the activations are split codes (quantize_row), two dot products a row.
template <bool kQ4, bool kWide, typename T, int rows>
inline void tile_rows(const uint8_t* tile, int64_t blocks, const int8_t* codes, const float* scale, const float* sum,
                      int64_t k, T* out, int64_t out_stride) {
  __m512 acc[rows];
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = tile + b * (kQ4 ? kQ4Bytes : kQ8Bytes);
    __m512i w[8];
    __m512 d, m = _mm512_setzero_ps();
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
    for (int r = 0; r < rows; ++r) {
      // 8 groups of 4 codes (wide: 8 of the high bytes, then 8 of the low)
      const int32_t* x = reinterpret_cast<const int32_t*>(codes + (r * k + b * kBlock) * (kWide ? 2 : 1));
      __m512i dot = kQ4 ? _mm512_setzero_si512() : init;
      if constexpr (kWide) {
        __m512i low_bytes = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
          dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(x[j]));
          low_bytes = _mm512_dpbusd_epi32(low_bytes, w[j], _mm512_set1_epi32(x[8 + j]));
        }
        dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), low_bytes);
      } else if constexpr (kQ4) {  // unsigned weight codes x signed activations
        // quads 0..3 are inputs 0..15 (low nibbles), 4..7 inputs 16..31 (high)
        for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(x[j]));
      } else {  // unsigned activations (+128) x signed weight codes
        for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, _mm512_set1_epi32(x[j]), w[j]);
      }
      acc[r] = add_block<kQ4>(acc[r], dot, d, m, scale[r * (k / kBlock) + b], kQ4 ? sum[r * (k / kBlock) + b] : 0.0f);
    }
  }
  for (int r = 0; r < rows; ++r) store16<T>(out + r * out_stride, acc[r]);
}
#endif

// f(std::integral_constant<int, rows>) for rows in 1 .. kRows
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

at::Tensor block_matmul(const at::Tensor& x,       // [M, K] float32 or bfloat16
                        const at::Tensor& weight,  // uint8 [N / 16, K / 32, 320 or 608] (see above)
                        int64_t format,            // 4: q4, 8: q8
                        int64_t activation_bits) { // 8, or 16 (q4 only)
  TORCH_CHECK(vnni_available(), "block_matmul: this build has no AVX-512 VNNI");
  TORCH_CHECK(format == 4 || format == 8, "block_matmul: format is 4 or 8");
  TORCH_CHECK(activation_bits == 8 || (activation_bits == 16 && format == 4),
              "block_matmul: activations of 8 bits, or 16 for q4 weights");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "block_matmul: x [M, K], weight uint8 [N / 16, K / 32, bytes]");
  const int64_t m = x.size(0), k = x.size(1), tiles = weight.size(0), blocks = weight.size(1);
  const int64_t n = tiles * kTile, unit = format == 4 ? kQ4Bytes : kQ8Bytes;
  TORCH_CHECK(k == blocks * kBlock && weight.size(2) == unit, "block_matmul: weight does not match x's inputs");
  const auto input = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#ifdef INFERD_VNNI
  const bool wide = activation_bits == 16;
  const Codes kind = wide ? Codes::kSplit : format == 8 ? Codes::kUnsigned : Codes::kSigned;
  QuantizedRows q{std::vector<int8_t>(m * k * (wide ? 2 : 1)), std::vector<float>(m * blocks),
                  std::vector<float>(m * blocks)};
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "inferd_block_matmul", [&] {
    const scalar_t* px = input.data_ptr<scalar_t>();
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize_row(px + r * k, k, kind, q.codes.data() + r * k * (wide ? 2 : 1), q.scale.data() + r * blocks,
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
          const uint8_t* tile = w + t * blocks * unit;
          const float *scales = q.scale.data() + r0 * blocks, *sums = q.sum.data() + r0 * blocks;
          // the row count a compile-time constant: the rows' chains unrolled side by side
          with_rows(rows, [&](auto count) {
            constexpr int kCount = decltype(count)::value;
            if (wide)
              tile_rows<true, true, scalar_t, kCount>(tile, blocks, q.codes.data() + r0 * k * 2, scales, sums, k, o, n);
            else if (format == 4)
              tile_rows<true, false, scalar_t, kCount>(tile, blocks, q.codes.data() + r0 * k, scales, sums, k, o, n);
            else
              tile_rows<false, false, scalar_t, kCount>(tile, blocks, q.codes.data() + r0 * k, scales, sums, k, o, n);
          });
        }
    });
  });
#endif
  return out;
}

}  // namespace

// the entry points bindings.cpp registers (cpu_ops.h); the work stays in this file's namespace
namespace inferd_cpu {

at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t activation_bits) {
  return ::block_matmul(x, weight, format, activation_bits);
}

bool block_matmul_available() { return vnni_available(); }

}  // namespace inferd_cpu
