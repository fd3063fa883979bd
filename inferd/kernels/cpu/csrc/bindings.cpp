// Every CPU kernel registered as a torch op, in one place: torch.ops.inferd_cpu.NAME
// (inferd/kernels/cpu/__init__.py calls them; inferd/kernels/reference.py is each one's spec).
#include <torch/library.h>

#include "cpu_ops.h"

TORCH_LIBRARY(inferd_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::decode_attention));
  m.def("decode_attention_8bit(Tensor query, Tensor key_codes, Tensor key_exponents, Tensor value_codes, "
        "Tensor value_exponents, Tensor block_tables, Tensor seq_lens, float scale, int window, float softcap, "
        "Tensor? sinks=None) -> Tensor");
  m.impl("decode_attention_8bit", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::decode_attention_8bit));
  m.def("prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_starts, float scale, int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::prefill_attention));
  m.def("prefill_attention_8bit(Tensor query, Tensor key_codes, Tensor key_exponents, Tensor value_codes, "
        "Tensor value_exponents, Tensor block_tables, Tensor seq_lens, Tensor query_starts, float scale, int window, "
        "float softcap, Tensor? sinks=None) -> Tensor");
  m.impl("prefill_attention_8bit", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::prefill_attention_8bit));
  m.def("prefill_attention_available() -> bool", [] { return inferd_cpu::prefill_attention_available(); });

  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::rms_norm));
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::add_rms_norm_));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::silu_mul));
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
  m.impl("rope_write_kv", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::rope_write_kv));

  m.def("conv_step(Tensor x, Tensor weight, Tensor(a!) conv_states, Tensor slots, Tensor fresh) -> Tensor");
  m.impl("conv_step", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::conv_step));
  m.def("delta_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, Tensor slots, "
        "Tensor fresh) -> Tensor");
  m.impl("delta_step", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::delta_step));

  m.def("block_matmul(Tensor x, Tensor weight, int format, int activation_bits=8) -> Tensor");
  m.impl("block_matmul", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::block_matmul));
  m.def("block_matmul_available() -> bool", [] { return inferd_cpu::block_matmul_available(); });
  m.def("block_matmul_tiles(Tensor x, Tensor weight, int format, int activation_bits=8, bool emulate=False) -> Tensor");
  m.impl("block_matmul_tiles", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::block_matmul_tiles));
  m.def("amx_usable() -> bool", [] { return inferd_cpu::amx_usable(); });
}
