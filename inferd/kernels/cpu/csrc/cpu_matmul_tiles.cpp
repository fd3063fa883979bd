// The block products on AMX tiles: the same packed weights, quantized activations and float32
// steps as cpu_matmul.cpp's VNNI kernel, but a block's integer dot products for 16 rows x 16
// outputs come from one TDPBSSD (signed bytes x signed bytes, exact int32 sums) instead of 8 x 16
// VPDPBUSD. Each row's result is the same bits as the VNNI kernel's (add_block, cpu_blocks.h):
// the integers are equal, and the float steps are the same in the same order.
//
//   A tile: 16 rows x 32 bytes of activation codes (a block; wide: its high bytes, then its low)
//   B tile: 8 rows x 64 bytes, the block's weights as the packing lays them out already
//           (row j: for each of the 16 outputs, its codes 4j .. 4j + 3), q4's nibbles unpacked
//   C tile: 16 rows x 16 int32
//
// Linux hands a process the tiles' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA), which amx_usable() makes once. The tiles run behind a two-function face,
// so the same kernel also runs on EmulatedTiles, plain C++ with TDPBSSD's arithmetic: tests check
// the layout and the bit-identity on every machine, and the instructions themselves where the
// CPU has them (tests/kernels/test_cpu_matmul.py). Which kernel a layer's call takes is chosen by
// measurement at load, per shape and row count (inferd.kernels.ops): Ollama saw AMX lose at one
// row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "cpu_blocks.h"
#include "cpu_ops.h"
#include "cpu_simd.h"

#if defined(INFERD_VNNI) && defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define INFERD_TILES 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define INFERD_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#endif

namespace {

#ifdef INFERD_TILES
using namespace inferd_blocks;
constexpr int64_t kTileRows = 16;

// the tiles' roles (AMX tile registers): the sums, the activations, the weights
constexpr int kC = 0, kA = 1, kB = 2;

// TDPBSSD's arithmetic in plain C++: c[r][n] = sum over the block's 32 inputs of a[r][i] x b[i / 4][4n + i % 4]
struct EmulatedTiles {
  static void begin() {}
  static void end() {}
  static void dot(int32_t* c, const int8_t* a, int64_t a_stride, const int8_t* b) {
    for (int r = 0; r < kTileRows; ++r)
      for (int n = 0; n < 16; ++n) {
        int32_t total = 0;
        for (int i = 0; i < kBlock; ++i) total += int32_t{a[r * a_stride + i]} * int32_t{b[(i / 4) * 64 + 4 * n + i % 4]};
        c[r * 16 + n] = total;
      }
  }
};

// The tiles themselves. begin() sets this thread's tile configuration, end() releases it.
struct AmxTiles {
  INFERD_AMX_TARGET static void begin() {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1
    auto shape = [&](int tile, int rows, int bytes) {
      config[16 + 2 * tile] = static_cast<uint8_t>(bytes);
      config[48 + tile] = static_cast<uint8_t>(rows);
    };
    shape(kC, kTileRows, 64);
    shape(kA, kTileRows, kBlock);
    shape(kB, kBlock / 4, 64);
    _tile_loadconfig(config);
  }
  INFERD_AMX_TARGET static void end() { _tile_release(); }
  INFERD_AMX_TARGET static void dot(int32_t* c, const int8_t* a, int64_t a_stride, const int8_t* b) {
    // (the intrinsics take the tile numbers as literals: kC = 0, kA = 1, kB = 2)
    _tile_zero(0);
    _tile_loadd(1, a, a_stride);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
  }
};

bool cpu_has_amx() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx >> 24 & 1) && (edx >> 25 & 1);  // AMX-TILE, AMX-INT8
}

// 16 outputs (one weight tile) for the rows [r0, r0 + rows) of the padded codes, every block.
template <typename Tiles, bool kQ4, bool kWide, typename T>
void tile_rows(const uint8_t* tile, int64_t blocks, const QuantizedRows& q, int64_t k, int64_t r0, int64_t rows,
               T* out, int64_t out_stride) {
  const int64_t code_bytes = kWide ? 2 : 1, row_stride = k * code_bytes;
  alignas(64) int32_t dots[kTileRows * 16], lows[kTileRows * 16];
  alignas(64) int8_t unpacked[kBlock / 4 * 64];
  __m512 acc[kTileRows];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = tile + b * (kQ4 ? kQ4Bytes : kQ8Bytes);
    const int8_t* weights = reinterpret_cast<const int8_t*>(p);
    __m512 d, m = _mm512_setzero_ps();
    if constexpr (kQ4) {  // rows 0..3: inputs 0..15 (low nibbles); rows 4..7: inputs 16..31
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + j * 64);
        _mm512_store_si512(unpacked + j * 64, _mm512_and_si512(v, low_nibbles));
        _mm512_store_si512(unpacked + (j + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles));
      }
      weights = unpacked;
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    } else {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 512)));
    }
    const int8_t* a = q.codes.data() + r0 * row_stride + b * kBlock * code_bytes;
    Tiles::dot(dots, a, row_stride, weights);
    if constexpr (kWide) Tiles::dot(lows, a + kBlock, row_stride, weights);
    for (int64_t r = 0; r < rows; ++r) {
      __m512i dot = _mm512_load_si512(dots + r * 16);
      if constexpr (kWide) dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), _mm512_load_si512(lows + r * 16));
      const int64_t at = (r0 + r) * blocks + b;
      acc[r] = add_block<kQ4>(acc[r], dot, d, m, q.scale[at], kQ4 ? q.sum[at] : 0.0f);
    }
  }
  for (int64_t r = 0; r < rows; ++r) inferd_simd::store16<T>(out + r * out_stride, acc[r]);
}

template <typename Tiles>
void run_tiles(const at::Tensor& input, const at::Tensor& weight, int64_t format, bool wide,
                                 at::Tensor& out) {
  const int64_t m = input.size(0), k = input.size(1), tiles = weight.size(0), blocks = weight.size(1);
  const int64_t n = tiles * kTile, unit = format == 4 ? kQ4Bytes : kQ8Bytes, padded = (m + 15) / 16 * 16;
  const Codes kind = wide ? Codes::kSplit : Codes::kSigned;  // (q8 too: signed x signed, no offset)
  const int64_t code_bytes = wide ? 2 : 1;
  // codes padded to whole tiles of rows with zeros (their results are never stored)
  QuantizedRows q{std::vector<int8_t>(padded * k * code_bytes, 0), std::vector<float>(m * blocks),
                  std::vector<float>(m * blocks)};
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, input.scalar_type(), "inferd_block_matmul_tiles", [&] {
    const scalar_t* px = input.data_ptr<scalar_t>();
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize_row(px + r * k, k, kind, q.codes.data() + r * k * code_bytes, q.scale.data() + r * blocks,
                     q.sum.data() + r * blocks);
    });
    const uint8_t* w = weight.data_ptr<uint8_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    const int64_t row_tiles = padded / kTileRows;
    at::parallel_for(0, tiles * row_tiles, 1, [&](int64_t begin, int64_t end) {
      Tiles::begin();
      for (int64_t item = begin; item < end; ++item) {
        const int64_t t = item / row_tiles, r0 = item % row_tiles * kTileRows, rows = std::min(kTileRows, m - r0);
        const uint8_t* tile = w + t * blocks * unit;
        scalar_t* o = po + r0 * n + t * kTile;
        if (wide)
          tile_rows<Tiles, true, true>(tile, blocks, q, k, r0, rows, o, n);
        else if (format == 4)
          tile_rows<Tiles, true, false>(tile, blocks, q, k, r0, rows, o, n);
        else
          tile_rows<Tiles, false, false>(tile, blocks, q, k, r0, rows, o, n);
      }
      Tiles::end();
    });
  });
}
#endif  // INFERD_TILES

}  // namespace

namespace inferd_cpu {

bool amx_usable() {
#ifdef INFERD_TILES
  static bool usable = [] {
    // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it, the first tile
    // instruction is SIGILL
    return cpu_has_amx() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

at::Tensor block_matmul_tiles(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t activation_bits,
                              bool emulate) {
  TORCH_CHECK(format == 4 || format == 8, "block_matmul_tiles: format is 4 or 8");
  TORCH_CHECK(activation_bits == 8 || (activation_bits == 16 && format == 4),
              "block_matmul_tiles: activations of 8 bits, or 16 for q4 weights");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "block_matmul_tiles: x [M, K], weight uint8 [N / 16, K / 32, bytes]");
#ifndef INFERD_TILES
  TORCH_CHECK(false, "block_matmul_tiles: this build has no tile kernel (it needs AVX-512 VNNI)");
  return x;
#else
  TORCH_CHECK(emulate || amx_usable(), "block_matmul_tiles: this CPU has no usable AMX (emulate runs it in C++)");
  const int64_t unit = format == 4 ? kQ4Bytes : kQ8Bytes;
  TORCH_CHECK(x.size(1) == weight.size(1) * kBlock && weight.size(2) == unit,
              "block_matmul_tiles: weight does not match x's inputs");
  const auto input = x.contiguous();
  auto out = at::empty({x.size(0), weight.size(0) * kTile}, x.options());
  if (x.size(0) == 0) return out;
  if (emulate)
    run_tiles<EmulatedTiles>(input, weight, format, activation_bits == 16, out);
  else
    run_tiles<AmxTiles>(input, weight, format, activation_bits == 16, out);
  return out;
#endif
}

}  // namespace inferd_cpu
