"""The decoder every family runs (inferd.model.families.registry): Llama's, with the switches the other
families set, over a paged KV cache.

One forward runs a whole step: the flattened tokens of every sequence (prefill chunks first,
then single decode tokens), their positions, and per-step attention plans built by the runner.
q/k/v and gate/up projections are fused into one matmul each.

The switches (ModelConfig): RMSNorm as x̂·w or x̂·(1 + w); q/k norms per head; sandwich norms
around attention and the MLP; SiLU or GELU-tanh gate; embeddings scaled; attention scale,
logit soft-cap and sliding window per layer; a second RoPE table for sliding layers; partial
rotary; a final-logit soft-cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.kernels import cpu
from inferd.model.layers.attention import TorchAttention
from inferd.model.families.config import ModelConfig
from inferd.text.errors import ModelLoadError
from inferd.model.layers.quant import DenseLinear, Linear, fuse, make_linear
from inferd.model.layers.rope import rotate


@dataclass
class LayerAttention:
    """Where a layer writes and what it attends over, for one step: layers whose KV share block
    tables (a KV group, inferd.engine.kv.groups) share one of these."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (negative: padding, skipped)
    prefill: object | None  # the attention backend's plans (see inferd.model.layers.attention), the
    decode: object | None  # layer's window in them


@dataclass
class StepAttention:
    """What every layer's attention needs for one step; built once by the runner."""

    layers: list[LayerAttention]  # per layer
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) are prefill chunks, the rest decodes
    # tokens [0, dense_rows) multiply by packed layers' dense copies (quant.SplitLinear): the
    # prefill rows of long prompts, which the runner puts first
    dense_rows: int = 0


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
        # Gemma's x̂·(1 + w) scales in float32 (as its transformers code does), Llama's x̂·w in
        # the model's dtype: the token-exact tests rely on the same arithmetic
        self.weight = weight if not offset else offset + weight.float()  # [dim]
        self.offset = offset
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * self.weight).to(dtype)
        return self.weight * x.to(dtype)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, attention: TorchAttention,
                 index: int) -> None:
        self.cfg = cfg
        self.attention = attention
        self.index = index
        self.sliding = cfg.is_sliding(index)

        def norm(name: str) -> RMSNorm:
            return RMSNorm(w[f"{prefix}.{name}"], cfg.rms_norm_eps, cfg.norm_offset)

        self.attn_norm, self.mlp_norm = norm("attn_norm"), norm("mlp_norm")
        self.q_norm, self.k_norm = (norm("q_norm"), norm("k_norm")) if cfg.qk_norm else (None, None)
        self.post_attn_norm, self.post_mlp_norm = ((norm("post_attn_norm"), norm("post_mlp_norm"))
                                                   if cfg.sandwich_norms else (None, None))
        self.act = F.silu if cfg.activation == "silu" else _gelu_tanh
        bias = (
            torch.cat([w[f"{prefix}.q_bias"], w[f"{prefix}.k_bias"], w[f"{prefix}.v_bias"]])
            if cfg.attention_bias
            else None
        )  # [q+2kv] or None
        dtype = w[f"{prefix}.attn_norm"].dtype
        parts = [w[f"{prefix}.{name}"] for name in ("q", "k", "v")]
        # packed weights: long prompts' prefill rows on a dense copy, the rest packed (quant.SplitLinear).
        # qkv's and down's inputs (the normed residual, SiLU(gate) x up) have outliers inside their
        # blocks of 32: on 8-bit codes each costs the default model ~0.5% of perplexity on the book,
        # so they take 16-bit ones (+0.42% in all, against +1.39%; bench/RESULTS.md, issue 30)
        self.qkv = make_linear(fuse(parts), bias, dtype, split=True, wide_inputs=True)  # [q+2kv, hidden]
        self.o = make_linear(w[f"{prefix}.o"], None, dtype, split=True)  # [hidden, q]
        self.gate_up = make_linear(fuse([w[f"{prefix}.gate"], w[f"{prefix}.up"]]), None, dtype, split=True)  # [2 * intermediate, hidden]
        self.down = make_linear(w[f"{prefix}.down"], None, dtype, split=True, wide_inputs=True)  # [hidden, intermediate]
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_softcap
        # Llama's glue on the CPU in bfloat16 (the default serving path): norms, residual + norm
        # and SiLU x up as one native op each (inferd.kernels.cpu), the same roundings
        self.native = (dtype == torch.bfloat16 and self.attn_norm.weight.device.type == "cpu" and not cfg.norm_offset
                       and not cfg.sandwich_norms and cfg.activation == "silu" and cfg.hidden_size % 16 == 0
                       and cfg.intermediate_size % 16 == 0 and cpu.available())
        # and RoPE over whole heads with the cache write as one op (q/k norms go between: not then)
        self.native_rope = (self.native and cfg.partial_rotary_factor == 1.0 and cfg.head_dim % 32 == 0
                            and not cfg.qk_norm)

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin: [T, rotary_dim] each
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, n_kv, head_dim]
        attn: StepAttention,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        # attention
        p, d = attn.num_prefill_tokens, attn.dense_rows
        eps = cfg.rms_norm_eps
        normed = cpu.rms_norm(x, self.attn_norm.weight, eps) if self.native else self.attn_norm(x)
        qkv = self.qkv(normed, d)  # [T, q + 2 kv]
        key_cache, value_cache = kv_cache
        plans = attn.layers[self.index]
        if self.native_rope and key_cache.dtype == torch.bfloat16:
            q = cpu.rope_write_kv(qkv, *rope, key_cache, value_cache, plans.slot_mapping, cfg.num_heads, cfg.num_kv_heads)
        else:
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qk[:, : cfg.num_heads]), self.k_norm(qk[:, cfg.num_heads :])], dim=1)
            qk = rotate(qk, *rope)  # q and k heads rotated in one go
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
            self.attention.write_kv(k, v, key_cache, value_cache, plans.slot_mapping)
        prefill, decode = plans.prefill, plans.decode
        parts = []
        if prefill is not None:
            parts.append(self.attention.prefill(q[:p], key_cache, value_cache, prefill, self.scale, self.softcap))
        if decode is not None:
            parts.append(self.attention.decode(q[p:], key_cache, value_cache, decode, self.scale, self.softcap))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = self.o(out.reshape(t, cfg.q_size), d)
        if self.native:  # x + out, in place (x is this forward's own), and the MLP's norm of it
            out = self.down(cpu.silu_mul(self.gate_up(cpu.add_rms_norm_(x, out, self.mlp_norm.weight, eps), d)), d)
            return x + out
        x = x + (out if self.post_attn_norm is None else self.post_attn_norm(out))
        # mlp
        gate, up = self.gate_up(self.mlp_norm(x), d).chunk(2, dim=-1)
        out = self.down(self.act(gate) * up, d)
        return x + (out if self.post_mlp_norm is None else self.post_mlp_norm(out))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class DecoderModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        check_shapes(cfg, weights)
        self.cfg = cfg
        self.dtype = dtype
        # the engine swaps in CudaAttention on a GPU (set_attention), once it knows the cache shape
        self.attention = TorchAttention()
        self.min_rows = 1
        self.embed = weights["embed"]  # [vocab, hidden]
        # (Gemma's √hidden, rounded to the weights' dtype as transformers does)
        self.embed_scale = None if cfg.embed_scale == 1.0 else torch.tensor(cfg.embed_scale, dtype=self.embed.dtype)
        # [vocab, hidden]; a tied head has its own entry only when packed (quant.pack_weights)
        self.lm_head = make_linear(weights.get("lm_head", self.embed), None, dtype)
        self.norm = RMSNorm(weights["norm"], cfg.rms_norm_eps, cfg.norm_offset)
        self.layers = [DecoderLayer(cfg, weights, f"layers.{i}", self.attention, i) for i in range(cfg.num_layers)]
        # Rotary tables for every position, computed once like transformers does per forward;
        # sliding layers have their own where the family gives them another RoPE (Gemma 3)
        self.rope = cfg.rope().tables(cfg.max_position_embeddings, dtype)  # cos, signed sin: [max_pos, rotary_dim]
        local = cfg.rope(local=True)
        self.local_rope = (local.tables(cfg.max_position_embeddings, dtype)
                           if cfg.has_sliding_layers and local != cfg.rope() else None)

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
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = self.rope[0][positions], self.rope[1][positions]  # [T, rotary_dim] each
        local = rope if self.local_rope is None else (self.local_rope[0][positions], self.local_rope[1][positions])
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, local if layer.sliding else rope, kv_cache, attn)
        x = x[logits_indices]  # [S, hidden]: the final norm and head only where sampled
        x = cpu.rms_norm(x, self.norm.weight, self.cfg.rms_norm_eps) if self.layers[0].native else self.norm(x)
        logits = self.lm_head(x).float()
        if self.cfg.final_softcap is not None:
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


def check_shapes(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> None:
    """Every tensor the config implies is present with the implied shape, and nothing else is
    (a tensor the maths would not use means the config and the checkpoint disagree)."""
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
        if cfg.qk_norm:
            expected |= {f"{p}.q_norm": (cfg.head_dim,), f"{p}.k_norm": (cfg.head_dim,)}
        if cfg.sandwich_norms:
            expected |= {f"{p}.post_attn_norm": (h,), f"{p}.post_mlp_norm": (h,)}
    for name, shape in expected.items():
        if name not in w:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        if tuple(w[name].shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(w[name].shape)}, but the config implies {shape}"
            )
    unused = sorted(set(w) - set(expected) - {"lm_head"})  # (a tied head's packed copy: quant.pack_weights)
    if unused:
        raise ModelLoadError(f"tensors the config does not use: {', '.join(unused[:5])}"
                             f"{f' and {len(unused) - 5} more' if len(unused) > 5 else ''}")
