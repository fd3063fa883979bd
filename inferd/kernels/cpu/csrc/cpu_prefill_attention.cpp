// Paged prefill attention for the CPU: each sequence's chunk of query rows attends to its context
// (the cached prefix and the chunk itself, causally; the last `window` positions on a sliding
// layer), K and V read in place from their blocks: no gather of the context, no padded mask.
// bfloat16 queries over a bfloat16 or 8-bit cache (inferd/kernels/kv_quant.py), on AVX512-BF16
// (VDPBF16PS: pairs of bfloat16 products summed into float32).
//
// A task is (sequence, KV head, a tile of up to kLanes query lanes): the tile's rows times the
// group's query heads, one lane each. Keys go by in tiles of kKeyTile at fixed positions (0, 32,
// 64, ...). The queries lie in lanes, so a key's scores for every lane come from broadcasting the
// key's bfloat16 pairs straight from its cache row, and the softmax runs across keys lane by
// lane (online: a running maximum and total per lane, no horizontal sums). The weights, rounded
// to bfloat16, multiply V the same way, V's pairs broadcast.
//
// Batch-invariant by construction: a lane's result depends on its own query, position and keys
// alone. Its arithmetic runs over the same key tiles, in the same order, whatever else shares
// its task, chunk or batch; a key it may not see gets the score -inf and the weight 0 (exactly),
// and a tile with no key it may see leaves its state untouched. So a prompt prefilled whole or
// in chunks of any size gets the same bits. Its specification is inferd.kernels.reference's
// prefill_attention (equal to within bfloat16 rounding: tests/kernels/test_cpu_prefill_attention.py).
//
// Built with the other kernels (inferd/kernels/cpu/build.py); where the CPU lacks AVX512-BF16,
// prefill_attention_available() is false and inferd.kernels.ops keeps the reference for prefill.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_kv8.h"
#include "cpu_ops.h"
#include "cpu_simd.h"

#if defined(INFERD_AVX512) && defined(__AVX512BF16__)
#define INFERD_PREFILL 1
#endif

namespace {

#ifdef INFERD_PREFILL
constexpr int64_t kVectors = 6;              // 16-lane vectors of query lanes per task
constexpr int64_t kLanes = 16 * kVectors;    // 96: rows x group heads (a 3:1 group: 32 rows)
constexpr int64_t kKeyTile = 32;             // keys per tile
constexpr int64_t kKeyStep = 4;              // keys scored at once (4 x 6 accumulators)
constexpr int64_t kDimStep = 4;              // value columns summed at once (4 x 6 accumulators)
constexpr int64_t kMaxDim = 512;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shapes {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, table_width, query_row_stride;
  float scale;
  int64_t window;  // 0: every position
  float softcap;   // 0: none
  int64_t rows;    // query rows per task: kLanes / group
};

struct Task {
  int64_t seq, kv_head, first;  // the rows [first, first + rows) of sequence seq's chunk
  int64_t cost;                 // keys x rows: the heaviest run first
};

// One thread's scratch, reused across tasks and calls.
struct Scratch {
  std::vector<uint32_t> queries;  // [dim / 2][kLanes]: the lanes' bfloat16 pairs
  std::vector<float> scores;      // [kKeyTile][kLanes], then the weights
  std::vector<uint32_t> weights;  // [kKeyTile / 2][kLanes]: bfloat16 pairs of two keys' weights
  std::vector<uint32_t> values;   // [kKeyTile / 2][dim]: bfloat16 pairs (key 2i, key 2i + 1) per column
  std::vector<c10::BFloat16> rows8;  // [2][kKeyTile][dim]: an 8-bit tile's K and V as bfloat16 (exact)
  std::vector<float> out;         // [dim][kLanes]: unnormalized sums
  alignas(64) float top[kLanes], total[kLanes];
  alignas(64) float rescale[kLanes];  // the tile's factor for the sums so far
  alignas(64) int32_t position[kLanes];  // each lane's query position; -1: an unused lane

  void fit(int64_t dim) {
    queries.resize(dim / 2 * kLanes);
    scores.resize(kKeyTile * kLanes);
    weights.resize(kKeyTile / 2 * kLanes);
    values.resize(kKeyTile / 2 * dim);
    rows8.resize(2 * kKeyTile * dim);
    out.resize(dim * kLanes);
  }
};

inline float exp1(float x) { return _mm512_cvtss_f32(inferd_simd::exp16(_mm512_set1_ps(x))); }
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512bh pair(const uint32_t* p) { return as_bh(_mm512_set1_epi32(static_cast<int32_t>(*p))); }

// Scores of keys [0, count) of the tile (rows: their bfloat16 addresses, count <= kKeyTile) for
// every lane, scaled, capped and masked (-inf where a lane may not see the key) into w.scores.
void score_tile(const c10::BFloat16* const* keys, int64_t count, int64_t tile_start, const Shapes& s,
                Scratch& w) {
  const int64_t pairs = s.head_dim / 2;
  static const c10::BFloat16 zeros[kMaxDim] = {};
  __m512i lane_position[kVectors];
  for (int64_t v = 0; v < kVectors; ++v)
    lane_position[v] = _mm512_loadu_si512(reinterpret_cast<const __m512i*>(w.position + 16 * v));
  for (int64_t k0 = 0; k0 < count; k0 += kKeyStep) {
    const uint32_t* key[kKeyStep];
    for (int64_t i = 0; i < kKeyStep; ++i)
      key[i] = reinterpret_cast<const uint32_t*>(k0 + i < count ? keys[k0 + i] : zeros);
    __m512 acc[kKeyStep][kVectors];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const uint32_t* q = w.queries.data() + p * kLanes;
      for (int64_t v = 0; v < kVectors; ++v) {
        const __m512bh qv = as_bh(_mm512_loadu_si512(reinterpret_cast<const __m512i*>(q + 16 * v)));
        for (int64_t i = 0; i < kKeyStep; ++i) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], qv, pair(key[i] + p));
      }
    }
    for (int64_t i = 0; i < kKeyStep && k0 + i < count; ++i) {
      const int32_t position = static_cast<int32_t>(tile_start + k0 + i);
      const __m512i at = _mm512_set1_epi32(position);
      for (int64_t v = 0; v < kVectors; ++v) {
        __m512 score = _mm512_mul_ps(acc[i][v], _mm512_set1_ps(s.scale));
        if (s.softcap > 0.0f) {
          alignas(64) float lanes[16];
          _mm512_storeu_ps(lanes, score);
          for (float& x : lanes) x = std::tanh(x / s.softcap) * s.softcap;
          score = _mm512_loadu_ps(lanes);
        }
        // a lane sees the key iff key <= its position (and, windowed, key > position - window)
        __mmask16 sees = _mm512_cmp_epi32_mask(at, lane_position[v], _MM_CMPINT_LE);
        if (s.window > 0)
          sees &= _mm512_cmp_epi32_mask(at, _mm512_sub_epi32(lane_position[v], _mm512_set1_epi32(s.window)),
                                        _MM_CMPINT_NLE);
        _mm512_storeu_ps(w.scores.data() + (k0 + i) * kLanes + 16 * v,
                        _mm512_mask_blend_ps(sees, _mm512_set1_ps(kNegInf), score));
      }
    }
  }
}

// The online softmax's step over the tile's `count` scores, lane by lane: the running maximum and
// total updated, the sums so far rescaled, the tile's weights rounded to bfloat16 and paired.
void weigh_tile(int64_t count, Scratch& w) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  for (int64_t v = 0; v < kVectors; ++v) {
    const int64_t lane = 16 * v;
    const __m512 old_top = _mm512_loadu_ps(w.top + lane);
    __m512 top = old_top;
    for (int64_t k = 0; k < count; ++k) top = _mm512_max_ps(top, _mm512_loadu_ps(w.scores.data() + k * kLanes + lane));
    // nothing seen before: the sums are 0, scaled by 0; nothing seen in this tile: by exactly 1
    const __mmask16 fresh = _mm512_cmp_ps_mask(old_top, neg_inf, _CMP_EQ_OQ);
    const __m512 factor = _mm512_maskz_mov_ps(
        ~fresh, inferd_simd::exp16(_mm512_mask_blend_ps(fresh, _mm512_sub_ps(old_top, top), _mm512_setzero_ps())));
    __m512 total = _mm512_mul_ps(_mm512_loadu_ps(w.total + lane), factor);
    for (int64_t k = 0; k < kKeyTile; ++k) {
      __m512 weight = _mm512_setzero_ps();
      if (k < count) {
        const __m512 score = _mm512_loadu_ps(w.scores.data() + k * kLanes + lane);
        const __mmask16 seen = _mm512_cmp_ps_mask(score, neg_inf, _CMP_NEQ_OQ);
        weight = _mm512_maskz_mov_ps(seen, inferd_simd::round_bf16(inferd_simd::exp16(_mm512_sub_ps(score, top))));
      }
      total = _mm512_add_ps(total, weight);
      _mm512_storeu_ps(w.scores.data() + k * kLanes + lane, weight);
    }
    _mm512_storeu_ps(w.top + lane, top);
    _mm512_storeu_ps(w.total + lane, total);
    _mm512_storeu_ps(w.rescale + lane, factor);
    // pairs of weights (key 2i low, key 2i + 1 high), each already a bfloat16 in float's top half
    for (int64_t i = 0; i < kKeyTile / 2; ++i) {
      const __m512i low = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(w.scores.data() + 2 * i * kLanes + lane)), 16);
      const __m512i high = _mm512_castps_si512(_mm512_loadu_ps(w.scores.data() + (2 * i + 1) * kLanes + lane));
      _mm512_storeu_si512(reinterpret_cast<__m512i*>(w.weights.data() + i * kLanes + lane), _mm512_or_si512(low, high));
    }
  }
}

// The tile's weighted values added to the lanes' sums, rescaled first: V's rows paired per
// column, then out[d][lane] += w(2i) v(2i)[d] + w(2i + 1) v(2i + 1)[d] over the tile's key pairs.
void add_values(const c10::BFloat16* const* values, int64_t count, int64_t dim, Scratch& w) {
  static const c10::BFloat16 zeros[kMaxDim] = {};
  for (int64_t i = 0; i < kKeyTile / 2; ++i) {
    const auto* a = reinterpret_cast<const uint16_t*>(2 * i < count ? values[2 * i] : zeros);
    const auto* b = reinterpret_cast<const uint16_t*>(2 * i + 1 < count ? values[2 * i + 1] : zeros);
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)));
      _mm512_storeu_si512(w.values.data() + i * dim + d, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
    }
  }
  const int64_t key_pairs = (count + 1) / 2;
  for (int64_t d0 = 0; d0 < dim; d0 += kDimStep) {
    __m512 acc[kDimStep][kVectors];
    for (int64_t j = 0; j < kDimStep; ++j)
      for (int64_t v = 0; v < kVectors; ++v)
        acc[j][v] = _mm512_mul_ps(_mm512_loadu_ps(w.out.data() + (d0 + j) * kLanes + 16 * v),
                                  _mm512_loadu_ps(w.rescale + 16 * v));
    for (int64_t i = 0; i < key_pairs; ++i) {
      const uint32_t* column = w.values.data() + i * dim + d0;
      for (int64_t v = 0; v < kVectors; ++v) {
        const __m512bh weight = as_bh(_mm512_loadu_si512(reinterpret_cast<const __m512i*>(w.weights.data() + i * kLanes + 16 * v)));
        for (int64_t j = 0; j < kDimStep; ++j) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], weight, pair(column + j));
      }
    }
    for (int64_t j = 0; j < kDimStep; ++j)
      for (int64_t v = 0; v < kVectors; ++v) _mm512_storeu_ps(w.out.data() + (d0 + j) * kLanes + 16 * v, acc[j][v]);
  }
}

// An 8-bit K or V row as bfloat16 (exact: e4m3 and e5m2 times a power of two fit bfloat16)
template <typename C>
void widen_row(const C* row, float scale, int64_t dim, c10::BFloat16* into) {
  for (int64_t d = 0; d < dim; d += 16)
    inferd_simd::store16(into + d, inferd_kv8::load16(row + d, scale));
}

template <typename C>
struct Caches {
  const C* keys;
  const C* values;
  const int8_t* key_exponents;  // 8-bit only
  const int8_t* value_exponents;
};

struct Sequences {
  const c10::BFloat16* query;
  const int32_t* tables;      // [N, width]
  const int32_t* seq_lens;    // [N]
  const int32_t* query_starts;  // [N + 1]: sequence i's rows are [starts[i], starts[i + 1])
  const float* sinks;         // [heads] or null
  c10::BFloat16* out;
};

template <typename C>
void run_task(const Task& task, const Sequences& seqs, const Caches<C>& cache, const Shapes& s, Scratch& w) {
  const int64_t dim = s.head_dim, group = s.group;
  const int64_t row0 = seqs.query_starts[task.seq], num_rows = seqs.query_starts[task.seq + 1] - row0;
  const int64_t start = seqs.seq_lens[task.seq] - num_rows;  // the chunk's first position
  const int64_t rows = std::min(s.rows, num_rows - task.first);
  const int32_t* table = seqs.tables + task.seq * s.table_width;
  // lane = row * group + head: its query's pairs, its position
  std::fill(w.queries.begin(), w.queries.end(), 0u);
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    const int64_t r = lane / group, g = lane % group;
    w.position[lane] = r < rows ? static_cast<int32_t>(start + task.first + r) : -1;
    w.top[lane] = kNegInf;
    w.total[lane] = 0.0f;
    if (r >= rows) continue;
    const auto* q = reinterpret_cast<const uint32_t*>(
        seqs.query + (row0 + task.first + r) * s.query_row_stride + (task.kv_head * group + g) * dim);
    for (int64_t p = 0; p < dim / 2; ++p) w.queries[p * kLanes + lane] = q[p];
  }
  std::fill(w.out.begin(), w.out.end(), 0.0f);
  const int64_t last = start + task.first + rows - 1;  // the task's last position
  const int64_t first_key = s.window > 0 ? std::max<int64_t>(0, start + task.first - s.window + 1) : 0;
  const c10::BFloat16* keys[kKeyTile];
  const c10::BFloat16* values[kKeyTile];
  for (int64_t tile = first_key / kKeyTile * kKeyTile; tile <= last; tile += kKeyTile) {
    const int64_t count = std::min(kKeyTile, last + 1 - tile);
    for (int64_t k = 0; k < count; ++k) {
      const int64_t position = tile + k;
      const int64_t slot = static_cast<int64_t>(table[position / s.block_size]) * s.block_size + position % s.block_size;
      const int64_t at = slot * s.num_kv_heads + task.kv_head;
      if constexpr (inferd_kv8::kEightBit<C>) {
        c10::BFloat16* key = w.rows8.data() + k * dim;
        c10::BFloat16* value = w.rows8.data() + (kKeyTile + k) * dim;
        widen_row(cache.keys + at * dim, inferd_kv8::pow2(cache.key_exponents[at]), dim, key);
        widen_row(cache.values + at * dim, inferd_kv8::pow2(cache.value_exponents[at]), dim, value);
        keys[k] = key;
        values[k] = value;
      } else {
        keys[k] = cache.keys + at * dim;
        values[k] = cache.values + at * dim;
      }
    }
    score_tile(keys, count, tile, s, w);
    weigh_tile(count, w);
    add_values(values, count, dim, w);
  }
  // normalized (a sink joins the maximum and the total, not the sum of values) and written out
  for (int64_t lane = 0; lane < rows * group; ++lane) {
    const int64_t r = lane / group, head = task.kv_head * group + lane % group;
    float top = w.top[lane], total = w.total[lane], factor = 1.0f;
    if (seqs.sinks != nullptr) {
      const float sink = seqs.sinks[head], joint = std::max(top, sink);
      factor = exp1(top - joint);
      total = total * factor + exp1(sink - joint);
    }
    const float inverse = factor / total;
    c10::BFloat16* o = seqs.out + ((row0 + task.first + r) * s.num_heads + head) * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<c10::BFloat16>(w.out[d * kLanes + lane] * inverse);
  }
}

// Tasks of every sequence's chunk: (rows, KV head) tiles, the heaviest first; threads take them
// in turn (a task's result does not depend on which thread runs it).
template <typename C>
void run_sequences(const Sequences& seqs, int64_t num_seqs, const Caches<C>& cache, const Shapes& s) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t num_rows = seqs.query_starts[i + 1] - seqs.query_starts[i];
    const int64_t start = seqs.seq_lens[i] - num_rows;
    for (int64_t first = 0; first < num_rows; first += s.rows) {
      const int64_t rows = std::min(s.rows, num_rows - first), end = start + first + rows;
      const int64_t keys = s.window > 0 ? std::min(end, s.window + rows) : end;
      for (int64_t h = 0; h < s.num_kv_heads; ++h) tasks.push_back({i, h, first, keys * rows});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    scratch.fit(s.head_dim);
    for (int64_t t = next++; t < num_tasks; t = next++) run_task<C>(tasks[t], seqs, cache, s, scratch);
  });
}
#endif  // INFERD_PREFILL

// The arguments both entry points share, checked; their shapes.
struct Checked {
#ifdef INFERD_PREFILL
  Shapes shapes;
#endif
  at::Tensor tables, seq_lens, query_starts, out;
};

Checked check(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
              double scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
#ifndef INFERD_PREFILL
  TORCH_CHECK(false, "prefill_attention: this build has no AVX512-BF16 (prefill_attention_available() is false)");
  return {};
#else
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "prefill_attention: query [T, H, D], caches [B, S, KV, D]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16, "prefill_attention: the query is bfloat16");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "prefill_attention: query rows must be dense");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes(),
              "prefill_attention: caches must be contiguous, of one shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_starts.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  query_starts.numel() == seq_lens.numel() + 1 && block_tables.size(0) == seq_lens.numel(),
              "prefill_attention: block tables [N, width], lengths [N] and query starts [N + 1], int32");
  const int64_t heads = query.size(1), kv_heads = key_cache.size(2), dim = query.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kLanes && dim % 16 == 0 && dim <= kMaxDim &&
                  key_cache.size(3) == dim,
              "prefill_attention: heads a multiple of KV heads (at most 96 per KV head), head size a multiple "
              "of 16 (at most 512)");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == heads &&
                         sinks->is_contiguous()),
              "prefill_attention: sinks are float32 [heads], contiguous");
  Checked c{Shapes{heads, kv_heads, heads / kv_heads, dim, key_cache.size(1), block_tables.size(1), query.stride(0),
                   static_cast<float>(scale), window, static_cast<float>(softcap),
                   std::max<int64_t>(1, kLanes / (heads / kv_heads))},
            block_tables.contiguous(), seq_lens.contiguous(), query_starts.contiguous(),
            at::empty({query.size(0), heads, dim}, query.options())};
  const int32_t* starts = c.query_starts.data_ptr<int32_t>();
  const int32_t* lens = c.seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[seq_lens.numel()] == query.size(0),
              "prefill_attention: query starts run from 0 to the number of query rows");
  for (int64_t i = 0; i < seq_lens.numel(); ++i)
    TORCH_CHECK(starts[i + 1] >= starts[i] && lens[i] >= starts[i + 1] - starts[i] &&
                    (lens[i] + c.shapes.block_size - 1) / c.shapes.block_size <= c.shapes.table_width,
                "prefill_attention: sequence ", i, " has more query rows than context, or more context than its "
                "block table holds");
  return c;
#endif
}

}  // namespace

// the entry points bindings.cpp registers (cpu_ops.h)
namespace inferd_cpu {

bool prefill_attention_available() {
#ifdef INFERD_PREFILL
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_starts, double scale, int64_t window, double softcap,
                             const std::optional<at::Tensor>& sinks) {
  Checked c = check(query, key_cache, value_cache, block_tables, seq_lens, query_starts, scale, window, softcap, sinks);
#ifdef INFERD_PREFILL
  TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16 && value_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: the caches are bfloat16 (8 bits: prefill_attention_8bit)");
  if (query.size(0) == 0) return c.out;
  const Sequences seqs{query.data_ptr<c10::BFloat16>(), c.tables.data_ptr<int32_t>(), c.seq_lens.data_ptr<int32_t>(),
                       c.query_starts.data_ptr<int32_t>(), sinks ? sinks->data_ptr<float>() : nullptr,
                       c.out.data_ptr<c10::BFloat16>()};
  const Caches<c10::BFloat16> cache{key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>(),
                                    nullptr, nullptr};
  run_sequences(seqs, seq_lens.numel(), cache, c.shapes);
#endif
  return c.out;
}

at::Tensor prefill_attention_8bit(const at::Tensor& query, const at::Tensor& key_codes,
                                  const at::Tensor& key_exponents, const at::Tensor& value_codes,
                                  const at::Tensor& value_exponents, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, const at::Tensor& query_starts, double scale,
                                  int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  Checked c = check(query, key_codes, value_codes, block_tables, seq_lens, query_starts, scale, window, softcap, sinks);
#ifdef INFERD_PREFILL
  const auto format = key_codes.scalar_type();
  TORCH_CHECK((format == at::kFloat8_e4m3fn || format == at::kFloat8_e5m2) && value_codes.scalar_type() == format,
              "prefill_attention_8bit: K and V codes are both float8_e4m3fn or both float8_e5m2");
  for (const at::Tensor* e : {&key_exponents, &value_exponents})
    TORCH_CHECK(e->scalar_type() == at::kChar && e->is_contiguous() && e->sizes() == key_codes.sizes().slice(0, 3),
                "prefill_attention_8bit: exponents are int8 [blocks, block_size, kv_heads], contiguous");
  if (query.size(0) == 0) return c.out;
  const Sequences seqs{query.data_ptr<c10::BFloat16>(), c.tables.data_ptr<int32_t>(), c.seq_lens.data_ptr<int32_t>(),
                       c.query_starts.data_ptr<int32_t>(), sinks ? sinks->data_ptr<float>() : nullptr,
                       c.out.data_ptr<c10::BFloat16>()};
  auto run = [&](auto codes) {
    using C = decltype(codes);
    const Caches<C> cache{static_cast<const C*>(key_codes.data_ptr()), static_cast<const C*>(value_codes.data_ptr()),
                          key_exponents.data_ptr<int8_t>(), value_exponents.data_ptr<int8_t>()};
    run_sequences(seqs, seq_lens.numel(), cache, c.shapes);
  };
  if (format == at::kFloat8_e4m3fn)
    run(inferd_kv8::E4m3{});
  else
    run(inferd_kv8::E5m2{});
#endif
  return c.out;
}

}  // namespace inferd_cpu
