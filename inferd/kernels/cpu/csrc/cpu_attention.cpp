// Paged attention for the CPU, one query row at a time: row i attends to the first seq_lens[i]
// positions of its block table (the last `window` of them on a sliding layer), read straight from
// the cache (no gather), in float32; scores optionally soft-capped (tanh(s / cap) * cap) and, with
// sinks (gpt-oss), each head's softmax given one more logit that has no value: it enters once,
// in the merge of the row's spans (its denominator only). A decode step passes one row per
// sequence; a short prompt's prefill one row per token, each with its context up to itself
// (inferd/engine/worker/runner.py).
//
// Work is cut into tasks of (row, KV head, span of at most kSpan positions), each run whole by
// one thread: a task's `group` query heads share every K/V row it reads, converted to float32
// once. A row's spans are cut from its own length (never from the batch) and, when it has more
// than one, merged in span order: every sum has an order fixed by the row alone, so a row's
// result does not depend on what else is in the batch or how tasks are shared among threads. It
// is batch-invariant by construction. Long contexts still spread over every thread (a single
// sequence at 4k positions is 8 spans per KV head). Its specification is
// `inferd.kernels.reference` (equal to within rounding; tests/kernels/test_cpu_attention.py).
//
// With AVX-512 (-march=native on such a CPU) the dot products, the softmax and the weighted sum
// run on 16-lane registers written out below; elsewhere the same loops in plain C++.
//
// decode_attention_8bit reads an 8-bit cache (inferd/kernels/kv_quant.py): float8 codes (e4m3fn or
// e5m2) and an int8 exponent per (slot, KV head). Each K/V row is dequantized exactly as it is
// loaded, float(code) * 2**exponent (cpu_kv8.h), then runs the same arithmetic in the same order.
//
// Built once per machine by inferd/kernels/cpu/build.py (g++ -O3 -march=native) and registered as
// torch.ops.inferd_cpu.decode_attention (and decode_attention_8bit), so it runs on torch's own
// thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kv8.h"
#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kSpan = 512;     // positions per task: a short context is one task per KV head
constexpr int64_t kMaxGroup = 8;   // query heads per KV head held in registers; more go in passes
constexpr int64_t kMaxDim = 512;  // (Gemma 4's full layers)

// exp(x) for x <= 0 (scores less their maximum), Cephes' expf polynomial: x = n ln2 + r,
// |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n put in the exponent bits; relative error
// ~1e-7, the same for every batch.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

using inferd_kv8::E4m3;
using inferd_kv8::E5m2;
using inferd_kv8::kEightBit;
using inferd_kv8::load_row;
using inferd_kv8::pow2;

struct Shapes {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width, query_row_stride;
  float scale;
  int64_t window;  // 0: every position; else only the last `window` (sliding-window layers)
  float softcap;   // 0: none
};

// One span's partial result for one (row, KV head): per query head of the group, the scores'
// maximum, the sum of exp(score - max) and the unnormalized weighted sum of values.
struct Partial {
  float* top;    // [group]
  float* total;  // [group]
  float* acc;    // [group, dim]
};

// A span's K and V rows: their addresses and (8-bit caches) their scales, 2**exponent.
template <typename C>
struct SpanRows {
  const C* const* keys;    // [len]
  const C* const* values;  // [len]
  const float* key_scales;    // [len] (8-bit only)
  const float* value_scales;  // [len] (8-bit only)
  int64_t len;
};

#ifdef INFERD_AVX512
using inferd_kv8::load16;
using inferd_simd::exp16;

// Scores, softmax and weighted values of `group` (<= kMaxGroup) query heads over positions
// [first, end): K and V rows read once each, converted in registers.
template <typename C, int kChunks>  // kChunks = head_dim / 16
void attend_span(const float* q, int64_t group, const SpanRows<C>& rows, const Shapes& s, float* scores,
                 Partial part) {
  const int64_t len = rows.len;
  __m512 qv[kMaxGroup][kChunks];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < kChunks; ++c) qv[g][c] = _mm512_loadu_ps(q + g * kChunks * 16 + c * 16);
  for (int64_t l = 0; l < len; ++l) {
    __m512 k[kChunks];
    const float key_scale = kEightBit<C> ? rows.key_scales[l] : 1.0f;
    for (int c = 0; c < kChunks; ++c) k[c] = load16(rows.keys[l] + c * 16, key_scale);
    for (int64_t g = 0; g < group; ++g) {
      __m512 sum = _mm512_mul_ps(qv[g][0], k[0]);
      for (int c = 1; c < kChunks; ++c) sum = _mm512_fmadd_ps(qv[g][c], k[c], sum);
      scores[g * len + l] = _mm512_reduce_add_ps(sum) * s.scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* w = scores + g * len;
    if (s.softcap > 0.0f)
      for (int64_t l = 0; l < len; ++l) w[l] = std::tanh(w[l] / s.softcap) * s.softcap;
    __m512 top16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t l = 0;
    for (; l + 16 <= len; l += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(w + l));
    float top = _mm512_reduce_max_ps(top16);
    for (; l < len; ++l) top = std::max(top, w[l]);
    const __m512 top_v = _mm512_set1_ps(top);
    __m512 total16 = _mm512_setzero_ps();
    for (l = 0; l + 16 <= len; l += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(w + l), top_v));
      _mm512_storeu_ps(w + l, e);
      total16 = _mm512_add_ps(total16, e);
    }
    float total = _mm512_reduce_add_ps(total16);
    for (; l < len; ++l) total += (w[l] = exp_nonpositive(w[l] - top));
    part.top[g] = top;
    part.total[g] = total;
  }
  __m512 acc[kMaxGroup][kChunks];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < kChunks; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; ++l) {
    __m512 v[kChunks];
    const float value_scale = kEightBit<C> ? rows.value_scales[l] : 1.0f;
    for (int c = 0; c < kChunks; ++c) v[c] = load16(rows.values[l] + c * 16, value_scale);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * len + l]);
      for (int c = 0; c < kChunks; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(part.acc + g * kChunks * 16 + c * 16, acc[g][c]);
}
#endif

// The same arithmetic in plain C++ (any head size that is a multiple of 16; any CPU).
template <typename C>
void attend_span_plain(const float* q, int64_t group, const SpanRows<C>& rows, int64_t dim, const Shapes& s,
                       float* scores, Partial part) {
  const int64_t len = rows.len;
  float row[kMaxDim];
  for (int64_t l = 0; l < len; ++l) {
    load_row(rows.keys[l], kEightBit<C> ? rows.key_scales[l] : 1.0f, dim, row);
    for (int64_t g = 0; g < group; ++g) {
      float sum = 0.0f;
      for (int64_t d = 0; d < dim; ++d) sum += q[g * dim + d] * row[d];
      scores[g * len + l] = sum * s.scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* w = scores + g * len;
    if (s.softcap > 0.0f)
      for (int64_t l = 0; l < len; ++l) w[l] = std::tanh(w[l] / s.softcap) * s.softcap;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < len; ++l) top = std::max(top, w[l]);
    float total = 0.0f;
    for (int64_t l = 0; l < len; ++l) total += (w[l] = exp_nonpositive(w[l] - top));
    part.top[g] = top;
    part.total[g] = total;
  }
  std::fill(part.acc, part.acc + group * dim, 0.0f);
  for (int64_t l = 0; l < len; ++l) {
    load_row(rows.values[l], kEightBit<C> ? rows.value_scales[l] : 1.0f, dim, row);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * len + l];
      for (int64_t d = 0; d < dim; ++d) part.acc[g * dim + d] += w * row[d];
    }
  }
}

template <typename C>
void attend_span_any(const float* q, int64_t group, const SpanRows<C>& rows, const Shapes& s, float* scores,
                     Partial part) {
#ifdef INFERD_AVX512
  switch (s.head_dim) {
    case 64: return attend_span<C, 4>(q, group, rows, s, scores, part);
    case 128: return attend_span<C, 8>(q, group, rows, s, scores, part);
    case 32: return attend_span<C, 2>(q, group, rows, s, scores, part);
    case 16: return attend_span<C, 1>(q, group, rows, s, scores, part);
    case 256: return attend_span<C, 16>(q, group, rows, s, scores, part);
    case 512: return attend_span<C, 32>(q, group, rows, s, scores, part);
    default: break;
  }
#endif
  attend_span_plain<C>(q, group, rows, s.head_dim, s, scores, part);
}

// Where a row's attended positions start and how many spans cover them.
struct RowSpans {
  int64_t first, end, count;
};

inline RowSpans row_spans(int64_t end, const Shapes& s) {
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, end - s.window) : 0;
  return {first, end, std::max<int64_t>(1, (end - first + kSpan - 1) / kSpan)};
}

// One layer's cache: K and V [blocks, block_size, kv_heads, dim] and, 8-bit, their exponents
// [blocks, block_size, kv_heads] int8 (null otherwise).
template <typename C>
struct Caches {
  const C* keys;
  const C* values;
  const int8_t* key_exponents;
  const int8_t* value_exponents;
};

// One task: row `seq`, KV head `kv_head`, span `span` of the row; its partial into `part`.
template <typename Q, typename C>
void run_task(const Q* query, const Caches<C>& cache, const int32_t* table, const RowSpans& rs, int64_t kv_head,
              int64_t span, const Shapes& s, Partial part) {
  const int64_t group = s.num_heads / s.num_kv_heads, dim = s.head_dim;
  const int64_t begin = rs.first + span * kSpan, len = std::min(kSpan, rs.end - begin);
  // per thread, reused across calls: q, scores, the span's K/V scales and row addresses
  thread_local std::vector<float> scratch;
  thread_local std::vector<const C*> addresses;
  scratch.resize(kMaxGroup * dim + kMaxGroup * kSpan + 2 * kSpan);
  addresses.resize(2 * kSpan);
  float* q = scratch.data();
  float* scores = q + kMaxGroup * dim;
  float* key_scales = scores + kMaxGroup * kSpan;
  const SpanRows<C> rows{addresses.data(), addresses.data() + kSpan, key_scales, key_scales + kSpan, len};
  for (int64_t l = 0; l < len; ++l) {
    const int64_t position = begin + l;
    const int64_t slot = static_cast<int64_t>(table[position / s.block_size]) * s.block_size + position % s.block_size;
    const int64_t at = slot * s.num_kv_heads + kv_head;  // the (slot, KV head) row
    addresses[l] = cache.keys + at * dim;
    addresses[kSpan + l] = cache.values + at * dim;
    if constexpr (kEightBit<C>) {
      key_scales[l] = pow2(cache.key_exponents[at]);
      key_scales[kSpan + l] = pow2(cache.value_exponents[at]);
    }
  }
  // heads of the group in passes of at most kMaxGroup (the registers a pass holds)
  for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
    const int64_t n = std::min(kMaxGroup, group - g0);
    for (int64_t g = 0; g < n; ++g)
      for (int64_t d = 0; d < dim; ++d)
        q[g * dim + d] = static_cast<float>(query[(kv_head * group + g0 + g) * dim + d]);
    attend_span_any<C>(q, n, rows, s, scores, Partial{part.top + g0, part.total + g0, part.acc + g0 * dim});
  }
}

// A row's spans merged in span order (the usual rescaling by exp(top_i - top)) and normalized;
// `sinks` (the group's first head's, or null) joins the maximum and the total, not the sum of values.
template <typename T>
void merge(const float* tops, const float* totals, const float* accs, int64_t count, int64_t group, int64_t dim,
           int64_t stride, const float* sinks, T* out) {
  // partial i of head g: tops[i * stride + g], accs[(i * stride + g) * dim ...]
  for (int64_t g = 0; g < group; ++g) {
    float top = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < count; ++i) top = std::max(top, tops[i * stride + g]);
    float total = sinks ? exp_nonpositive(sinks[g] - top) : 0.0f, acc[kMaxDim] = {};
    for (int64_t i = 0; i < count; ++i) {
      const float factor = exp_nonpositive(tops[i * stride + g] - top);
      total += factor * totals[i * stride + g];
      const float* a = accs + (i * stride + g) * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] += factor * a[d];
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[d] * inverse);
  }
}

// Every row's attention into `out` [N, heads, dim]: tasks (row, span, KV head), then the merges.
template <typename Q, typename C>
void run_rows(const Q* q, const Caches<C>& cache, const int32_t* tables, const int32_t* lens, int64_t n,
              const Shapes& s, const float* sink, Q* out) {
  const int64_t group = s.num_heads / s.num_kv_heads, dim = s.head_dim;
  // tasks: per row, its spans x KV heads; task_start[i] is row i's first
  std::vector<RowSpans> spans(n);
  std::vector<int64_t> task_start(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    spans[i] = row_spans(lens[i], s);
    task_start[i + 1] = task_start[i] + spans[i].count * s.num_kv_heads;
  }
  const int64_t num_tasks = task_start[n];
  // partials of every task: [task, group] tops and totals, [task, group, dim] sums
  std::vector<float> tops(num_tasks * group), totals(num_tasks * group), accs(num_tasks * group * dim);
  // task order: row, then span, then KV head
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    int64_t seq = std::upper_bound(task_start.begin(), task_start.end(), begin) - task_start.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_start[seq + 1]) ++seq;
      const int64_t local = task - task_start[seq];
      const int64_t span = local / s.num_kv_heads, kv_head = local % s.num_kv_heads;
      const Partial part{tops.data() + task * group, totals.data() + task * group, accs.data() + task * group * dim};
      run_task<Q, C>(q + seq * s.query_row_stride, cache, tables + seq * s.table_width, spans[seq], kv_head, span, s,
                     part);
      if (spans[seq].count == 1)  // the merge of one span, done at once
        merge<Q>(part.top, part.total, part.acc, 1, group, dim, group, sink ? sink + kv_head * group : nullptr,
                 out + seq * s.num_heads * dim + kv_head * group * dim);
    }
  });
  if (num_tasks == n * s.num_kv_heads) return;  // every row was one span
  at::parallel_for(0, n * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.num_kv_heads, kv_head = item % s.num_kv_heads;
      if (spans[seq].count == 1) continue;
      const int64_t first = task_start[seq] + kv_head;  // the row's span 0 of this KV head
      merge<Q>(tops.data() + first * group, totals.data() + first * group, accs.data() + first * group * dim,
               spans[seq].count, group, dim, s.num_kv_heads * group, sink ? sink + kv_head * group : nullptr,
               out + seq * s.num_heads * dim + kv_head * group * dim);
    }
  });
}

// The arguments both entry points share, checked; their shapes.
Shapes checked_shapes(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                      double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "decode_attention: query [N, H, D], caches [B, S, KV, D]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "decode_attention: query rows must be dense");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes(),
              "decode_attention: caches must be contiguous, of one shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "decode_attention: block tables and lengths are int32");
  const Shapes s{query.size(1), key_cache.size(2), query.size(2), key_cache.size(1), block_tables.size(1),
                 query.stride(0), static_cast<float>(scale), window, static_cast<float>(softcap)};
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && s.head_dim % kLanes == 0 && s.head_dim <= kMaxDim &&
                  key_cache.size(3) == s.head_dim,
              "decode_attention: heads a multiple of KV heads, head size a multiple of 16 (at most 512)");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == s.num_heads &&
                         sinks->is_contiguous() && sinks->device().is_cpu()),
              "decode_attention: sinks are float32 [heads], contiguous, on the CPU");
  return s;
}

at::Tensor decode_attention(const at::Tensor& query,        // [N, heads, dim], rows may be strided
                            const at::Tensor& key_cache,    // [blocks, block_size, kv_heads, dim]
                            const at::Tensor& value_cache,  // [blocks, block_size, kv_heads, dim]
                            const at::Tensor& block_tables, // [N, width] int32
                            const at::Tensor& seq_lens,     // [N] int32: context length, the new token included
                            double scale, int64_t window, double softcap,
                            const std::optional<at::Tensor>& sinks) {  // [heads] float32, or none
  const Shapes s = checked_shapes(query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap, sinks);
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "decode_attention: query and cache dtypes differ");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  auto out = at::empty({query.size(0), s.num_heads, s.head_dim}, query.options());
  if (query.size(0) == 0) return out;
  const float* sink = sinks ? sinks->data_ptr<float>() : nullptr;  // head h's: sink[h]
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "inferd_cpu_decode_attention", [&] {
    const Caches<scalar_t> cache{key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), nullptr, nullptr};
    run_rows<scalar_t, scalar_t>(query.data_ptr<scalar_t>(), cache, tables.data_ptr<int32_t>(),
                                 lens.data_ptr<int32_t>(), query.size(0), s, sink, out.data_ptr<scalar_t>());
  });
  return out;
}

template <typename Q, typename C>
void run_rows_8bit(const at::Tensor& query, const at::Tensor& key_codes, const at::Tensor& key_exponents,
                   const at::Tensor& value_codes, const at::Tensor& value_exponents, const at::Tensor& tables,
                   const at::Tensor& lens, const Shapes& s, const float* sink, at::Tensor& out) {
  const Caches<C> cache{static_cast<const C*>(key_codes.data_ptr()), static_cast<const C*>(value_codes.data_ptr()),
                        key_exponents.data_ptr<int8_t>(), value_exponents.data_ptr<int8_t>()};
  run_rows<Q, C>(static_cast<const Q*>(query.data_ptr()), cache, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                 query.size(0), s, sink, static_cast<Q*>(out.data_ptr()));
}

at::Tensor decode_attention_8bit(const at::Tensor& query,            // [N, heads, dim] bfloat16 or float32
                                 const at::Tensor& key_codes,        // [blocks, block_size, kv_heads, dim] float8
                                 const at::Tensor& key_exponents,    // [blocks, block_size, kv_heads] int8
                                 const at::Tensor& value_codes,      // as key_codes
                                 const at::Tensor& value_exponents,  // as key_exponents
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                 int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  const Shapes s = checked_shapes(query, key_codes, value_codes, block_tables, seq_lens, scale, window, softcap, sinks);
  const auto format = key_codes.scalar_type();
  TORCH_CHECK((format == at::kFloat8_e4m3fn || format == at::kFloat8_e5m2) && value_codes.scalar_type() == format,
              "decode_attention_8bit: K and V codes are both float8_e4m3fn or both float8_e5m2");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat,
              "decode_attention_8bit: the query is bfloat16 or float32");
  for (const at::Tensor* e : {&key_exponents, &value_exponents})
    TORCH_CHECK(e->scalar_type() == at::kChar && e->is_contiguous() && e->sizes() == key_codes.sizes().slice(0, 3),
                "decode_attention_8bit: exponents are int8 [blocks, block_size, kv_heads], contiguous");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  auto out = at::empty({query.size(0), s.num_heads, s.head_dim}, query.options());
  if (query.size(0) == 0) return out;
  const float* sink = sinks ? sinks->data_ptr<float>() : nullptr;
  const bool e4m3 = format == at::kFloat8_e4m3fn;
  if (query.scalar_type() == at::kBFloat16) {
    (e4m3 ? run_rows_8bit<c10::BFloat16, E4m3> : run_rows_8bit<c10::BFloat16, E5m2>)(
        query, key_codes, key_exponents, value_codes, value_exponents, tables, lens, s, sink, out);
  } else {
    (e4m3 ? run_rows_8bit<float, E4m3> : run_rows_8bit<float, E5m2>)(
        query, key_codes, key_exponents, value_codes, value_exponents, tables, lens, s, sink, out);
  }
  return out;
}

}  // namespace

// the entry points bindings.cpp registers (cpu_ops.h); the work stays in this file's namespace
namespace inferd_cpu {

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                            double softcap, const std::optional<at::Tensor>& sinks) {
  return ::decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, window, softcap, sinks);
}

at::Tensor decode_attention_8bit(const at::Tensor& query, const at::Tensor& key_codes, const at::Tensor& key_exponents,
                                 const at::Tensor& value_codes, const at::Tensor& value_exponents,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                 int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  return ::decode_attention_8bit(query, key_codes, key_exponents, value_codes, value_exponents, block_tables,
                                 seq_lens, scale, window, softcap, sinks);
}

}  // namespace inferd_cpu
