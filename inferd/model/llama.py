"""A Llama-family decoder (Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2) over a paged KV cache.

One forward runs a whole step: the flattened tokens of every sequence (prefill chunks first,
then single decode tokens), their positions, and per-step attention plans built by the runner.
q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.model.attention import TorchAttention
from inferd.model.config import ModelConfig
from inferd.model.errors import ModelLoadError


@dataclass
class StepAttention:
    """What every layer's attention needs for one step; built once by the runner."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (negative: padding, skipped)
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) are prefill chunks, the rest decodes
    prefill: object | None  # the attention backend's plans (see inferd.model.attention)
    decode: object | None


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight  # [hidden]
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers (float32 statistics), which the token-exact tests rely on.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, attention: TorchAttention) -> None:
        self.cfg = cfg
        self.attention = attention
        self.attn_norm = RMSNorm(w[f"{prefix}.attn_norm"], cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(w[f"{prefix}.mlp_norm"], cfg.rms_norm_eps)
        self.qkv = torch.cat([w[f"{prefix}.q"], w[f"{prefix}.k"], w[f"{prefix}.v"]])  # [q+2kv, hidden]
        self.qkv_bias = (
            torch.cat([w[f"{prefix}.q_bias"], w[f"{prefix}.k_bias"], w[f"{prefix}.v_bias"]])
            if cfg.attention_bias
            else None
        )  # [q+2kv] or None
        self.o = w[f"{prefix}.o"]  # [hidden, q]
        self.gate_up = torch.cat([w[f"{prefix}.gate"], w[f"{prefix}.up"]])  # [2 * intermediate, hidden]
        self.down = w[f"{prefix}.down"]  # [hidden, intermediate]
        self.scale = cfg.head_dim**-0.5
        self.min_rows = 1  # 2: batch-invariant products (`linear`)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, n_kv, head_dim]
        attn: StepAttention,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        # attention
        qkv = linear(self.attn_norm(x), self.qkv, self.qkv_bias, self.min_rows)  # [T, q + 2 kv]
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        qk = _rope(qk, cos, sin)  # q and k heads rotated in one go
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        key_cache, value_cache = kv_cache
        self.attention.write_kv(k, v, key_cache, value_cache, attn.slot_mapping)
        p = attn.num_prefill_tokens
        parts = []
        if attn.prefill is not None:
            parts.append(self.attention.prefill(q[:p], key_cache, value_cache, attn.prefill, self.scale))
        if attn.decode is not None:
            parts.append(self.attention.decode(q[p:], key_cache, value_cache, attn.decode, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        x = x + linear(out.reshape(t, cfg.q_size), self.o, None, self.min_rows)
        # mlp
        gate, up = linear(self.mlp_norm(x), self.gate_up, None, self.min_rows).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down, None, self.min_rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int) -> torch.Tensor:
    """F.linear, with at least `min_rows` rows. NOTE: on the CPU, oneDNN's bf16 product takes
    another path for one row than for two or more, and real activations then differ in the
    last bits (random test data does not show it); rows 2..N are bit-identical to each other.
    So the batch-invariant mode (min_rows 2) runs a lone row beside a zero row."""
    if x.shape[0] < min_rows:
        padded = torch.cat([x, x.new_zeros(min_rows - x.shape[0], x.shape[1])])
        return F.linear(padded, weight, bias)[: x.shape[0]]
    return F.linear(x, weight, bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # rotate-half RoPE (transformers' convention): x * cos + cat(-x2, x1) * sin, written as
    # x * cos + cat(x2, x1) * cat(-sin, sin), which is bit-identical and one op shorter.
    # x: [T, heads, head_dim], cos / signed_sin: [T, head_dim]
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[:, None, :]


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        check_shapes(cfg, weights)
        self.cfg = cfg
        self.dtype = dtype
        # the engine swaps in CudaAttention on a GPU (set_attention), once it knows the cache shape
        self.attention = TorchAttention()
        self.min_rows = 1
        self.embed = weights["embed"]  # [vocab, hidden]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head"]  # [vocab, hidden]
        self.norm = RMSNorm(weights["norm"], cfg.rms_norm_eps)
        self.layers = [DecoderLayer(cfg, weights, f"layers.{i}", self.attention) for i in range(cfg.num_layers)]
        # Rotary tables for every position, computed once like transformers does per forward.
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, cfg.rope_inv_freq())  # [max_pos, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        half = cfg.head_dim // 2
        self.cos = emb.cos().to(dtype)  # [max_pos, head_dim]
        self.signed_sin = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1).to(dtype)  # [max_pos, head_dim]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def set_attention(self, attention: TorchAttention) -> None:
        self.attention = attention
        for layer in self.layers:
            layer.attention = attention

    def set_batch_invariant(self, on: bool) -> None:
        """Every row's result the same bits whatever else is in the batch (`linear`; the
        attention backend pads its contexts, select_attention)."""
        self.min_rows = 2 if on else 1
        for layer in self.layers:
            layer.min_rows = self.min_rows

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        attn: StepAttention,
        logits_indices: torch.Tensor,  # [S] int64: the tokens whose next-token logits are wanted
    ) -> torch.Tensor:  # [S, vocab] float32
        x = self.embed[input_ids]  # [T, hidden]
        cos, sin = self.cos[positions], self.signed_sin[positions]  # [T, head_dim]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, attn)
        x = self.norm(x[logits_indices])  # [S, hidden]: the final norm and head only where sampled
        return linear(x, self.lm_head, None, self.min_rows).float()


def check_shapes(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> None:
    """Every tensor the config implies is present with the implied shape (one-line errors)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    expected: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        expected["lm_head"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"layers.{n}"
        expected |= {
            f"{p}.attn_norm": (h,), f"{p}.mlp_norm": (h,),
            f"{p}.q": (cfg.q_size, h), f"{p}.k": (cfg.kv_size, h), f"{p}.v": (cfg.kv_size, h),
            f"{p}.o": (h, cfg.q_size), f"{p}.gate": (i, h), f"{p}.up": (i, h), f"{p}.down": (h, i),
        }
        if cfg.attention_bias:
            expected |= {f"{p}.q_bias": (cfg.q_size,), f"{p}.k_bias": (cfg.kv_size,), f"{p}.v_bias": (cfg.kv_size,)}
    for name, shape in expected.items():
        if name not in w:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        if tuple(w[name].shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(w[name].shape)}, but the config implies {shape}"
            )
