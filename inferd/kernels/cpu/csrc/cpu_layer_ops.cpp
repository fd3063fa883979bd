// A decoder layer's small bfloat16 ops, one native call each instead of the 6-10 torch ops they
// take in Python (at one to a few rows per step, dispatch is most of their time):
//
//   rms_norm(x, w, eps)            w * bf16(x * rsqrt(mean(x^2) + eps))       (Llama's RMSNorm)
//   add_rms_norm_(x, delta, w, eps) x = bf16(x + delta) in place, then rms_norm(x, w, eps)
//   silu_mul(gate_up)              bf16(silu(gate)) * up, gate and up the two halves of each row
//   rope_write_kv(qkv, cos, sin, key_cache, value_cache, slots, H, KV)
//                                  q and k rotated (rotate-half RoPE over the whole head:
//                                  bf16(bf16(x * cos) + bf16(roll(x, D / 2) * signed_sin))), k and v
//                                  written to their cache slots (negative: padding, skipped), q returned
//
// Each rounds to bfloat16 where the torch code it replaces does (inferd/model/decoder.py). The
// one sum (a row's squares) runs on 16-lane registers in a fixed order that depends on the row's
// length alone (explicit unaligned loads: no peeling by address), so a row's result does not
// depend on the batch. Rows are shared among threads only when there are many.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

using bf16 = c10::BFloat16;

#ifdef INFERD_AVX512
using inferd_simd::exp16;
using inferd_simd::round_bf16;
inline __m512 load_bf16(const bf16* p) { return inferd_simd::load16<bf16>(p); }
inline void store_bf16(bf16* p, __m512 v) { inferd_simd::store16<bf16>(p, v); }  // rounded to bfloat16
#endif

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              op, ": x is [T, H] bfloat16 with dense rows");
  TORCH_CHECK(x.size(1) % 16 == 0, op, ": the row length is a multiple of 16");
}

// Rows at once per thread: a handful of rows runs on the calling thread (no wake-up)
int64_t grain(int64_t row_length) { return std::max<int64_t>(1, 65536 / row_length); }

#ifdef INFERD_AVX512
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
#ifdef INFERD_AVX512
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
#ifdef INFERD_AVX512
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

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                         at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                         int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "rope_write_kv");
  const int64_t t = qkv.size(0), heads = num_heads + 2 * num_kv_heads, d = qkv.size(1) / heads;
  TORCH_CHECK(qkv.size(1) == heads * d && d % 32 == 0, "rope_write_kv: qkv is [T, (H + 2 KV) x D], D a multiple of 32");
  for (const at::Tensor* table : {&cos, &signed_sin})
    TORCH_CHECK(table->scalar_type() == at::kBFloat16 && table->is_contiguous() && table->size(0) == t &&
                table->size(1) == d, "rope_write_kv: cos and signed_sin are [T, D] bfloat16");
  for (const at::Tensor* cache : {&key_cache, &value_cache})
    TORCH_CHECK(cache->scalar_type() == at::kBFloat16 && cache->is_contiguous() && cache->dim() == 4 &&
                cache->size(2) == num_kv_heads && cache->size(3) == d,
                "rope_write_kv: the caches are [blocks, block_size, KV, D] bfloat16");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == t, "rope_write_kv: slots are [T] int64");
  const int64_t slots = key_cache.size(0) * key_cache.size(1), half = d / 2;
  auto q = at::empty({t, num_heads, d}, qkv.options());
  const bf16* px = qkv.data_ptr<bf16>();
  const bf16* pc = cos.data_ptr<bf16>();
  const bf16* ps = signed_sin.data_ptr<bf16>();
  const int64_t* pslot = slot_mapping.data_ptr<int64_t>();
  bf16* pq = q.data_ptr<bf16>();
  bf16* pk = key_cache.data_ptr<bf16>();
  bf16* pv = value_cache.data_ptr<bf16>();
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(pslot[r] < slots, "rope_write_kv: slot ", pslot[r], " is past the cache's ", slots);
  at::parallel_for(0, t, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* row = px + r * qkv.stride(0);
      const bf16* c = pc + r * d;
      const bf16* s = ps + r * d;
      const int64_t slot = pslot[r];
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        const bf16* x = row + h * d;
        bf16* out = h < num_heads ? pq + (r * num_heads + h) * d
                    : slot >= 0   ? pk + (slot * num_kv_heads + h - num_heads) * d : nullptr;
        if (out == nullptr) continue;
        for (int64_t i = 0; i < d; i += 16) {
          const int64_t j = (i + half) % d;  // roll(x, D / 2): out[i] takes x[i - D / 2]
#ifdef INFERD_AVX512
          const __m512 a = round_bf16(_mm512_mul_ps(load_bf16(x + i), load_bf16(c + i)));
          const __m512 b = round_bf16(_mm512_mul_ps(load_bf16(x + j), load_bf16(s + i)));
          store_bf16(out + i, _mm512_add_ps(a, b));
#else
          for (int64_t l = 0; l < 16; ++l) {
            const float a = static_cast<float>(bf16(static_cast<float>(x[i + l]) * static_cast<float>(c[i + l])));
            const float b = static_cast<float>(bf16(static_cast<float>(x[j + l]) * static_cast<float>(s[i + l])));
            out[i + l] = bf16(a + b);
          }
#endif
        }
      }
      if (slot >= 0)
        std::copy_n(row + (num_heads + num_kv_heads) * d, num_kv_heads * d, pv + slot * num_kv_heads * d);
    }
  });
  return q;
}

}  // namespace

// the entry points bindings.cpp registers (cpu_ops.h); the work stays in this file's namespace
namespace inferd_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return ::add_rms_norm_(x, delta, weight, eps);
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return ::silu_mul(gate_up); }

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                         at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                         int64_t num_heads, int64_t num_kv_heads) {
  return ::rope_write_kv(qkv, cos, signed_sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads);
}

}  // namespace inferd_cpu
