"""Hyper-parameters of a decoder model (a Hugging Face config.json or GGUF metadata is read into
them by the model's family, inferd.model.families.registry)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferd.text.errors import ModelLoadError
from inferd.model.layers.moe import Experts
from inferd.model.layers.rope import Rope

# the families (inferd.model.families.registry): what a GGUF's general.architecture or a config.json's
# model_type may say
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                           "gpt_oss")
@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the family (SUPPORTED_ARCHITECTURES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # a non-default RoPE variant (rope.py)
    name: str = ""
    # What the families beyond Llama change; the defaults are Llama's (families.py sets them).
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): 1 for Gemma's x̂·(1 + w)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too (Gemma 2/3)
    activation: str = "silu"  # the MLP's gate: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # embeddings times this (Gemma: √hidden)
    query_scale: float | None = None  # attention's score scale; None: head_dim^-0.5
    attn_softcap: float | None = None  # scores s -> tanh(s / c) · c (Gemma 2)
    final_softcap: float | None = None  # logits likewise (Gemma 2): changes sampling, not greedy
    sliding_window: int | None = None  # a sliding layer's query sees a key iff q_pos - k_pos < W
    layer_types: tuple[str, ...] = ()  # "full" or "sliding" per layer; () all full
    # sliding layers' own RoPE (Gemma 3: base 10k where full layers have 1M and linear scaling)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    partial_rotary_factor: float = 1.0  # the share of each head RoPE rotates (Phi-4-mini: 0.75)
    output_bias: bool = False  # attention's output projection has a bias (gpt-oss)
    attention_sinks: bool = False  # one learned logit per head joins each softmax's denominator (gpt-oss)
    experts: Experts | None = None  # a mixture of experts in place of the MLP (in every layer but its dense_layers)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ModelLoadError("sliding layers without a sliding_window")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ModelLoadError(f"unsupported activation {self.activation!r} (supported: silu, gelu_tanh)")
        for local in (False, True):
            self.rope(local).check(self.name or self.architecture)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def is_sparse(self, layer: int) -> bool:
        """The layer's MLP is a mixture of experts."""
        return self.experts is not None and layer not in self.experts.dense_layers

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding" in self.layer_types

    def rope(self, local: bool = False) -> Rope:
        """The RoPE of full layers, or (`local`) of sliding ones where the family gives them their own."""
        rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        rotary_dim -= rotary_dim % 2
        if local and self.local_rope_theta is not None:
            return Rope(self.local_rope_theta, rotary_dim, self.local_rope_scaling, self.max_position_embeddings)
        original = int((self.rope_scaling or {}).get("original_max_position_embeddings") or 0)
        return Rope(self.rope_theta, rotary_dim, self.rope_scaling, self.max_position_embeddings,
                    long=bool(original) and self.max_position_embeddings > original)
