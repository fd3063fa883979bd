// Paged attention for the CPU, one query row at a time: row i attends to the first seq_lens[i]
// positions of its block table (the last `window` of them on a sliding layer), read straight from
// the cache (no gather), in float32; scores optionally soft-capped (tanh(s / cap) * cap). A decode
// step passes one row per sequence; a short prompt's prefill one row per token, each with its
// context up to itself (inferd/engine/runner.py).
//
// Each (row, KV head) pair is one task, run whole by one thread, and every sum in it has a fixed
// order (compiled once, over a 64-byte aligned scratch buffer): a row's result does not depend
// on what else is in the batch or how the tasks are shared among threads, so it is
// batch-invariant by construction. Its specification is `inferd.kernels.reference` (equal to
// within rounding; tests/kernels/test_cpu_attention.py).
//
// Built once per machine by inferd/kernels/cpu.py (g++ -O3 -march=native) and registered as
// torch.ops.inferd_cpu.decode_attention, so it runs on torch's own thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// q · k. The compiler vectorizes it with its own fixed order of additions (-fassociative-math
// lets it reassociate); the order depends on the head size only, never on the batch.
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// exp(x) for x <= 0 (scores less their maximum), Cephes' expf polynomial: x = n ln2 + r,
// |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n put in the exponent bits. Written as plain
// arithmetic so that the compiler vectorizes the loop around it (libm's expf stays scalar); the
// relative error is ~1e-7, the same for every batch.
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

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

struct Shapes {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width, query_row_stride;
  float scale;
  int64_t window;  // 0: every position; else only the last `window` (sliding-window layers)
  float softcap;   // 0: none
};

// One sequence's one KV head: its `group` query heads against keys [first, end) of the sequence.
template <typename T>
void attend(const T* query, const T* key_cache, const T* value_cache, const int32_t* table, int64_t end,
            int64_t kv_head, const Shapes& s, T* out, std::vector<float>& scratch) {
  const int64_t group = s.num_heads / s.num_kv_heads, dim = s.head_dim;
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, end - s.window) : 0, len = end - first;
  // NOTE: 64-byte aligned. The vectorized sums peel iterations until a pointer is aligned, so
  // an address that moved with the batch (the heap) would move the order of additions too.
  scratch.resize(group * dim * 2 + dim + group * len + kLanes);
  const auto address = reinterpret_cast<uintptr_t>(scratch.data());
  float* q = reinterpret_cast<float*>((address + 63) & ~uintptr_t{63});  // [group, dim]
  float* acc = q + group * dim;         // [group, dim]
  float* row = acc + group * dim;       // [dim]: one key or value row in float32
  float* weights = row + dim;           // [group, len]: scores, then exp(score - max)
  for (int64_t g = 0; g < group; ++g) load_row(query + (kv_head * group + g) * dim, q + g * dim, dim);

  auto cache_row = [&](const T* cache, int64_t position) {
    const int64_t slot = static_cast<int64_t>(table[position / s.block_size]) * s.block_size + position % s.block_size;
    return cache + (slot * s.num_kv_heads + kv_head) * dim;
  };
  for (int64_t l = 0; l < len; ++l) {
    load_row(cache_row(key_cache, first + l), row, dim);
    for (int64_t g = 0; g < group; ++g) weights[g * len + l] = dot(q + g * dim, row, dim) * s.scale;
  }
  if (s.softcap > 0.0f)
    for (int64_t i = 0; i < group * len; ++i) weights[i] = std::tanh(weights[i] / s.softcap) * s.softcap;
  std::vector<float> total(group, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    float* w = weights + g * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < len; ++l) top = std::max(top, w[l]);
    for (int64_t l = 0; l < len; ++l) w[l] = exp_nonpositive(w[l] - top);
    for (int64_t l = 0; l < len; ++l) total[g] += w[l];
  }
  std::fill(acc, acc + group * dim, 0.0f);
  for (int64_t l = 0; l < len; ++l) {
    load_row(cache_row(value_cache, first + l), row, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float w = weights[g * len + l];
      float* a = acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += w * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = 1.0f / total[g];
    T* o = out + (kv_head * group + g) * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d] * inverse);
  }
}

at::Tensor decode_attention(const at::Tensor& query,        // [N, heads, dim], rows may be strided
                            const at::Tensor& key_cache,    // [blocks, block_size, kv_heads, dim]
                            const at::Tensor& value_cache,  // [blocks, block_size, kv_heads, dim]
                            const at::Tensor& block_tables, // [N, width] int32
                            const at::Tensor& seq_lens,     // [N] int32: context length, the new token included
                            double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "decode_attention: query [N, H, D], caches [B, S, KV, D]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "decode_attention: query rows must be dense");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "decode_attention: block tables and lengths are int32");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "decode_attention: query and cache dtypes differ");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t n = query.size(0);
  const Shapes s{query.size(1), key_cache.size(2), query.size(2), key_cache.size(1), tables.size(1),
                 query.stride(0), static_cast<float>(scale), window, static_cast<float>(softcap)};
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && s.head_dim % kLanes == 0,
              "decode_attention: heads a multiple of KV heads, head size a multiple of 16");
  auto out = at::empty({n, s.num_heads, s.head_dim}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "inferd_cpu_decode_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = key_cache.data_ptr<scalar_t>();
    const scalar_t* v = value_cache.data_ptr<scalar_t>();
    const int32_t* t = tables.data_ptr<int32_t>();
    const int32_t* l = lens.data_ptr<int32_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // grain 1: even three tasks (one sequence, three KV heads) are shared by the threads
    at::parallel_for(0, n * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / s.num_kv_heads, kv_head = task % s.num_kv_heads;
        attend<scalar_t>(q + seq * s.query_row_stride, k, v, t + seq * s.table_width, l[seq], kv_head, s,
                         o + seq * s.num_heads * s.head_dim, scratch);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(inferd_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
