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
from inferd.model.quant import DenseLinear, Linear, fuse, make_linear


@dataclass
class StepAttention:
    """What every layer's attention needs for one step; built once by the runner."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (negative: padding, skipped)
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) are prefill chunks, the rest decodes
    prefill: object | None  # the attention backend's plans (see inferd.model.attention)
    decode: object | None
    # tokens [0, dense_rows) multiply by packed layers' dense copies (quant.SplitLinear): the
    # prefill rows of long prompts, which the runner puts first
    dense_rows: int = 0


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
        bias = (
            torch.cat([w[f"{prefix}.q_bias"], w[f"{prefix}.k_bias"], w[f"{prefix}.v_bias"]])
            if cfg.attention_bias
            else None
        )  # [q+2kv] or None
        dtype = w[f"{prefix}.attn_norm"].dtype
        parts = [w[f"{prefix}.{name}"] for name in ("q", "k", "v")]
        # packed weights: long prompts' prefill rows on a dense copy, the rest packed (quant.SplitLinear)
        self.qkv = make_linear(fuse(parts), bias, dtype, split=True)  # [q+2kv, hidden]
        self.o = make_linear(w[f"{prefix}.o"], None, dtype, split=True)  # [hidden, q]
        self.gate_up = make_linear(fuse([w[f"{prefix}.gate"], w[f"{prefix}.up"]]), None, dtype, split=True)  # [2 * intermediate, hidden]
        self.down = make_linear(w[f"{prefix}.down"], None, dtype, split=True)  # [hidden, intermediate]
        self.scale = cfg.head_dim**-0.5

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
        p, d = attn.num_prefill_tokens, attn.dense_rows
        qkv = self.qkv(self.attn_norm(x), d)  # [T, q + 2 kv]
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        qk = _rope(qk, cos, sin)  # q and k heads rotated in one go
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        key_cache, value_cache = kv_cache
        self.attention.write_kv(k, v, key_cache, value_cache, attn.slot_mapping)
        parts = []
        if attn.prefill is not None:
            parts.append(self.attention.prefill(q[:p], key_cache, value_cache, attn.prefill, self.scale))
        if attn.decode is not None:
            parts.append(self.attention.decode(q[p:], key_cache, value_cache, attn.decode, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        x = x + self.o(out.reshape(t, cfg.q_size), d)
        # mlp
        gate, up = self.gate_up(self.mlp_norm(x), d).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up, d)


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
        # [vocab, hidden]; a tied head has its own entry only when packed (quant.pack_weights)
        self.lm_head = make_linear(weights.get("lm_head", self.embed), None, dtype)
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
        for op in self.linears():
            for dense in (op, getattr(op, "dense", None)):  # (a SplitLinear's prefill copy)
                if isinstance(dense, DenseLinear):
                    dense.min_rows = self.min_rows

    def linears(self) -> list[Linear]:
        return [op for layer in self.layers for op in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

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
        return self.lm_head(x).float()


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
