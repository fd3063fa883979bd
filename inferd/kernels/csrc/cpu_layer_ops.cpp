// A decoder layer's small bfloat16 ops, one native call each instead of the 6-10 torch ops they
// take in Python (at one to a few rows per step, dispatch is most of their time):
//
//   rms_norm(x, w, eps)            w * bf16(x * rsqrt(mean(x^2) + eps))       (Llama's RMSNorm)
//   add_rms_norm_(x, delta, w, eps) x = bf16(x + delta) in place, then rms_norm(x, w, eps)
//   silu_mul(gate_up)              bf16(silu(gate)) * up, gate and up the two halves of each row
//
// Each rounds to bfloat16 where the torch code it replaces does (inferd/model/decoder.py). The
// one sum (a row's squares) runs on 16-lane registers in a fixed order that depends on the row's
// length alone (explicit unaligned loads: no peeling by address), so a row's result does not
// depend on the batch. Rows are shared among threads only when there are many.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INFERD_LAYER_AVX512 1
#endif

namespace {

using bf16 = c10::BFloat16;

#ifdef INFERD_LAYER_AVX512
inline __m512 load_bf16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 round_bf16(__m512 v) {  // to the nearest bfloat16, ties to even (finite values), as float
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline void store_bf16(bf16* p, __m512 v) {  // v already a bfloat16 value
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
// e^x, Cephes' polynomial (as cpu_attention.cpp's), x clamped to [-87, 88]
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
#endif

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              op, ": x is [T, H] bfloat16 with dense rows");
  TORCH_CHECK(x.size(1) % 16 == 0, op, ": the row length is a multiple of 16");
}

// Rows at once per thread: a handful of rows runs on the calling thread (no wake-up)
int64_t grain(int64_t row_length) { return std::max<int64_t>(1, 65536 / row_length); }

#ifdef INFERD_LAYER_AVX512
void norm_row(const bf16* x, const bf16* weight, int64_t h, float eps, bf16* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 v = load_bf16(x + i);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(h);
  const __m512 inverse = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(x + i), inverse));
    store_bf16(out + i, round_bf16(_mm512_mul_ps(load_bf16(weight + i), normed)));
  }
}
#else
void norm_row(const bf16* x, const bf16* weight, int64_t h, float eps, bf16* out) {
  float lanes[16] = {};
  for (int64_t i = 0; i < h; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += static_cast<float>(x[i + j]) * static_cast<float>(x[i + j]);
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  const float inverse = 1.0f / std::sqrt(total / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i)
    out[i] = bf16(static_cast<float>(weight[i]) * static_cast<float>(bf16(static_cast<float>(x[i]) * inverse)));
}
#endif

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: weight is [H] bfloat16");
  const int64_t t = x.size(0), h = x.size(1);
  auto out = at::empty({t, h}, x.options());
  const bf16* px = x.data_ptr<bf16>();
  const bf16* pw = weight.data_ptr<bf16>();
  bf16* po = out.data_ptr<bf16>();
  at::parallel_for(0, t, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(px + r * x.stride(0), pw, h, static_cast<float>(eps), po + r * h);
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(delta, "add_rms_norm_");
  TORCH_CHECK(x.is_contiguous() && delta.sizes() == x.sizes(), "add_rms_norm_: x contiguous, delta its shape");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm_: weight is [H] bfloat16");
  const int64_t t = x.size(0), h = x.size(1);
  auto out = at::empty({t, h}, x.options());
  bf16* px = x.data_ptr<bf16>();
  const bf16* pd = delta.data_ptr<bf16>();
  const bf16* pw = weight.data_ptr<bf16>();
  bf16* po = out.data_ptr<bf16>();
  at::parallel_for(0, t, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* row = px + r * h;
      const bf16* d = pd + r * delta.stride(0);
#ifdef INFERD_LAYER_AVX512
      for (int64_t i = 0; i < h; i += 16)
        store_bf16(row + i, round_bf16(_mm512_add_ps(load_bf16(row + i), load_bf16(d + i))));
#else
      for (int64_t i = 0; i < h; ++i) row[i] = bf16(static_cast<float>(row[i]) + static_cast<float>(d[i]));
#endif
      norm_row(row, pw, h, static_cast<float>(eps), po + r * h);
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(n % 16 == 0, "silu_mul: each half a multiple of 16");
  auto out = at::empty({t, n}, gate_up.options());
  const bf16* pg = gate_up.data_ptr<bf16>();
  bf16* po = out.data_ptr<bf16>();
  at::parallel_for(0, t, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* g = pg + r * gate_up.stride(0);
      const bf16* u = g + n;
      bf16* o = po + r * n;
#ifdef INFERD_LAYER_AVX512
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 gate = load_bf16(g + i);
        const __m512 silu = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                           exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
        store_bf16(o + i, round_bf16(_mm512_mul_ps(silu, load_bf16(u + i))));
      }
#else
      for (int64_t i = 0; i < n; ++i) {
        const float gate = static_cast<float>(g[i]);
        o[i] = bf16(static_cast<float>(bf16(gate / (1.0f + std::exp(-gate)))) * static_cast<float>(u[i]));
      }
#endif
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferd_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm_));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
