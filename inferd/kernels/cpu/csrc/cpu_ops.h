// The CPU kernels' entry points, one declaration each: defined in cpu_attention.cpp,
// cpu_prefill_attention.cpp, cpu_layer_ops.cpp, cpu_linear_attention.cpp, cpu_matmul.cpp and
// cpu_matmul_tiles.cpp, registered as torch ops (inferd_cpu::*) in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace inferd_cpu {

// paged decode attention, one query row per sequence (cpu_attention.cpp); sinks: [heads] float32 or none
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                            double softcap, const std::optional<at::Tensor>& sinks);
// the same over an 8-bit cache (inferd/kernels/kv_quant.py): float8 codes [B, S, KV, D], int8 exponents [B, S, KV]
at::Tensor decode_attention_8bit(const at::Tensor& query, const at::Tensor& key_codes, const at::Tensor& key_exponents,
                                 const at::Tensor& value_codes, const at::Tensor& value_exponents,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                 int64_t window, double softcap, const std::optional<at::Tensor>& sinks);

// paged prefill attention, a chunk of query rows per sequence, bfloat16 on AVX512-BF16
// (cpu_prefill_attention.cpp); query_starts [N + 1] int32: sequence i's rows are [starts[i], starts[i + 1])
bool prefill_attention_available();
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_starts, double scale, int64_t window, double softcap,
                             const std::optional<at::Tensor>& sinks);
at::Tensor prefill_attention_8bit(const at::Tensor& query, const at::Tensor& key_codes,
                                  const at::Tensor& key_exponents, const at::Tensor& value_codes,
                                  const at::Tensor& value_exponents, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, const at::Tensor& query_starts, double scale,
                                  int64_t window, double softcap, const std::optional<at::Tensor>& sinks);

// a decoder layer's small bfloat16 ops (cpu_layer_ops.cpp)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                         at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                         int64_t num_heads, int64_t num_kv_heads);

// linear attention's decode step, one token per sequence, states updated in place (cpu_linear_attention.cpp)
at::Tensor conv_step(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_states, const at::Tensor& slots,
                     const at::Tensor& fresh);
at::Tensor delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots, const at::Tensor& fresh);

// products over block-quantized weights on AVX-512 VNNI (cpu_matmul.cpp)
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t activation_bits);
bool block_matmul_available();
// the same products on AMX tiles, the same bits (cpu_matmul_tiles.cpp); emulate: TDPBSSD in C++, any CPU
at::Tensor block_matmul_tiles(const at::Tensor& x, const at::Tensor& weight, int64_t format, int64_t activation_bits,
                              bool emulate);
bool amx_usable();

}  // namespace inferd_cpu
