// Linear attention's decode step (Gated DeltaNet, Qwen3.5 / Qwen3-Next): one token for each of B
// sequences, each reading and writing its state slot in place. The spec is conv_step and
// delta_step in inferd/kernels/linear_attention.py.
//
//   conv_step(x [B, C], weight [C, K], conv_states [S, K-1, C], slots [B], fresh [B]) -> y [B, C]
//       y = silu(round(sum_k window[k] * weight[:, k])), window = (the slot's K-1 inputs, or zeros
//       if fresh) then x; the slot then holds the window's last K-1 rows
//   delta_step(q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv] float32,
//              states [S, Hv, dk, dv] float32, slots [B], fresh [B]) -> o [B, Hv, dv]
//       q, k l2-normed (q also scaled by dk^-0.5), S = S * e^g; S += k (beta (v - k S)); o = q S
//
// A task is (row, channel block) for the conv and (row, value head) for the delta rule; each runs
// alone in a fixed order (sums over k and over the state's dk rows run sequentially, 16 lanes
// wide over columns), so a row's result does not depend on the batch.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

constexpr int64_t kMaxTaps = 8;  // conv widths the face binds this kernel for
constexpr int64_t kMaxHeadDim = 256;  // q and k of one head, normalized, on the stack
constexpr int64_t kLanes = 16;
constexpr int64_t kChannelBlock = 1024;  // conv channels per task

void check_slots(const at::Tensor& slots, const at::Tensor& fresh, int64_t rows, const char* op) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == rows, op,
              ": slots are int64 [B]");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.dim() == 1 && fresh.size(0) == rows, op,
              ": fresh is bool [B]");
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// out[i] = silu(v[i]): 16 lanes at a time where AVX-512 is there (e^x by cpu_simd.h's polynomial)
template <typename T> void silu_row(const float* v, int64_t n, T* out) {
  int64_t i = 0;
#ifdef INFERD_AVX512
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(v + i);
    const __m512 e = inferd_simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    inferd_simd::store16<T>(out + i, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(silu(v[i]));
}

// ---------------------------------------------------------------------------------------- conv

// channels [c0, c1) of one row; loops run along channels (contiguous: vectorized), taps outside
template <typename T>
void conv_block(const T* x, const T* weight, T* history, bool fresh, int64_t c0, int64_t c1, int64_t taps,
                int64_t channels, T* y) {
  const int64_t n = c1 - c0;
  float acc[kChannelBlock], w[kChannelBlock];
  for (int64_t j = 0; j < taps; ++j) {
    for (int64_t c = 0; c < n; ++c) w[c] = static_cast<float>(weight[(c0 + c) * taps + j]);
    // tap j reads history row j (zeros if fresh), the last tap the new input
    const T* in = j + 1 < taps ? history + j * channels + c0 : x + c0;
    if (j + 1 < taps && fresh) {
      if (j == 0) std::fill(acc, acc + n, 0.0f);
      continue;
    }
    if (j == 0) {
      for (int64_t c = 0; c < n; ++c) acc[c] = static_cast<float>(in[c]) * w[c];
    } else {
      for (int64_t c = 0; c < n; ++c) acc[c] += static_cast<float>(in[c]) * w[c];
    }
  }
  // rounded to T before the SiLU, as transformers' conv1d output is
  for (int64_t c = 0; c < n; ++c) acc[c] = static_cast<float>(static_cast<T>(acc[c]));
  silu_row<T>(acc, n, y + c0);
  // the history shifts by one row, the new input last
  for (int64_t j = 0; j + 2 < taps; ++j) {
    T* row = history + j * channels + c0;
    if (fresh) std::fill(row, row + n, T(0.0f));
    else std::copy(row + channels, row + channels + n, row);
  }
  std::copy(x + c0, x + c1, history + (taps - 2) * channels + c0);
}

at::Tensor conv_step(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_states, const at::Tensor& slots,
                     const at::Tensor& fresh) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "conv_step: x is [B, C] with dense rows");
  const int64_t rows = x.size(0), channels = x.size(1), taps = weight.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == channels && weight.is_contiguous() && taps >= 2 &&
                  taps <= kMaxTaps, "conv_step: weight is [C, K] contiguous, 2 <= K <= 8");
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.size(1) == taps - 1 && conv_states.size(2) == channels &&
                  conv_states.is_contiguous(), "conv_step: conv_states is [S, K-1, C] contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.scalar_type() == conv_states.scalar_type(),
              "conv_step: x, weight and conv_states share a dtype");
  check_slots(slots, fresh, rows, "conv_step");
  auto y = at::empty({rows, channels}, x.options());
  const auto slot_ids = slots.contiguous();
  const auto fresh_ids = fresh.contiguous();
  const int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "inferd_cpu_conv_step", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    const scalar_t* pw = weight.data_ptr<scalar_t>();
    scalar_t* ps = conv_states.data_ptr<scalar_t>();
    scalar_t* py = y.data_ptr<scalar_t>();
    const int64_t* s = slot_ids.data_ptr<int64_t>();
    const bool* f = fresh_ids.data_ptr<bool>();
    at::parallel_for(0, rows * blocks, 4, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / blocks, c0 = (task % blocks) * kChannelBlock;
        conv_block<scalar_t>(px + row * x.stride(0), pw, ps + s[row] * (taps - 1) * channels, f[row], c0,
                             std::min(c0 + kChannelBlock, channels), taps, channels, py + row * channels);
      }
    });
  });
  return y;
}

// ---------------------------------------------------------------------------------------- delta rule

// a head's vector, l2-normed in float32 (eps 1e-6) and multiplied by `scale`
template <typename T> void l2norm(const T* x, int64_t dim, float scale, float* out) {
  float lanes[kLanes] = {};
  for (int64_t i = 0; i < dim; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = static_cast<float>(x[i + j]);
      lanes[j] += v * v;
    }
  float total = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) total += lanes[j];
  const float inverse = 1.0f / std::sqrt(total + 1e-6f);
  for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<float>(x[i]) * inverse * scale;
}

// one (row, value head): state [dk, dv] updated in place (zeros first if fresh), o [dv]
template <typename T>
void delta_head(const float* q, const float* k, const T* v, float decay, float beta, float* state, bool fresh,
                int64_t dk, int64_t dv, T* o) {
  float memory[kMaxHeadDim] = {}, delta[kMaxHeadDim], out[kMaxHeadDim] = {};
  // decay the state and read what it predicts for k: memory = k S
  for (int64_t i = 0; i < dk; ++i) {
    float* s = state + i * dv;
    if (fresh) {
      for (int64_t j = 0; j < dv; ++j) s[j] = 0.0f;
      continue;
    }
    for (int64_t j = 0; j < dv; ++j) {
      s[j] *= decay;
      memory[j] += s[j] * k[i];
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (static_cast<float>(v[j]) - memory[j]) * beta;
  // write the correction, then read with q
  for (int64_t i = 0; i < dk; ++i) {
    float* s = state + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      s[j] += k[i] * delta[j];
      out[j] += s[j] * q[i];
    }
  }
  for (int64_t j = 0; j < dv; ++j) o[j] = static_cast<T>(out[j]);
}

at::Tensor delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots, const at::Tensor& fresh) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "delta_step: q, k [B, Hk, dk], v [B, Hv, dv]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "delta_step: q, k, v heads are dense");
  const int64_t rows = q.size(0), key_heads = q.size(1), dk = q.size(2), value_heads = v.size(1), dv = v.size(2);
  TORCH_CHECK(value_heads % key_heads == 0, "delta_step: value heads a multiple of key heads");
  TORCH_CHECK(dk % kLanes == 0 && dk <= kMaxHeadDim && dv <= kMaxHeadDim,
              "delta_step: dk a multiple of 16, dk and dv at most 256");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "delta_step: q, k, v dtypes differ");
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == rows && t->size(1) == value_heads &&
                    t->stride(1) == 1, "delta_step: g and beta are float32 [B, Hv] with dense rows");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.dim() == 4 && states.size(1) == value_heads &&
                  states.size(2) == dk && states.size(3) == dv && states.is_contiguous(),
              "delta_step: states are float32 [S, Hv, dk, dv] contiguous");
  check_slots(slots, fresh, rows, "delta_step");
  auto o = at::empty({rows, value_heads, dv}, v.options());
  const auto slot_ids = slots.contiguous();
  const auto fresh_ids = fresh.contiguous();
  const int64_t group = value_heads / key_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "inferd_cpu_delta_step", [&] {
    const scalar_t* pq = q.data_ptr<scalar_t>();
    const scalar_t* pk = k.data_ptr<scalar_t>();
    const scalar_t* pv = v.data_ptr<scalar_t>();
    const float* pg = g.data_ptr<float>();
    const float* pb = beta.data_ptr<float>();
    float* ps = states.data_ptr<float>();
    scalar_t* po = o.data_ptr<scalar_t>();
    const int64_t* s = slot_ids.data_ptr<int64_t>();
    const bool* f = fresh_ids.data_ptr<bool>();
    at::parallel_for(0, rows * value_heads, 1, [&](int64_t begin, int64_t end) {
      float qn[kMaxHeadDim], kn[kMaxHeadDim];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / value_heads, head = task % value_heads, key_head = head / group;
        // NOTE: a key head's normalization is redone for each of its value heads: dk flops
        // against the dk x dv of the state, and each task stays on its own
        l2norm(pq + row * q.stride(0) + key_head * q.stride(1), dk, scale, qn);
        l2norm(pk + row * k.stride(0) + key_head * k.stride(1), dk, 1.0f, kn);
        delta_head<scalar_t>(qn, kn, pv + row * v.stride(0) + head * v.stride(1),
                             std::exp(pg[row * g.stride(0) + head]), pb[row * beta.stride(0) + head],
                             ps + (s[row] * value_heads + head) * dk * dv, f[row], dk, dv,
                             po + (row * value_heads + head) * dv);
      }
    });
  });
  return o;
}

}  // namespace

// the entry points bindings.cpp registers (cpu_ops.h); the work stays in this file's namespace
namespace inferd_cpu {

at::Tensor conv_step(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_states, const at::Tensor& slots,
                     const at::Tensor& fresh) {
  return ::conv_step(x, weight, conv_states, slots, fresh);
}

at::Tensor delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots, const at::Tensor& fresh) {
  return ::delta_step(q, k, v, g, beta, states, slots, fresh);
}

}  // namespace inferd_cpu
