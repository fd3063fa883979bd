"""Hyper-parameters of a decoder model (a Hugging Face config.json or GGUF metadata is read into
them by the model's family, inferd.model.families.registry)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferd.text.errors import ModelLoadError
from inferd.model.layers.gated_deltanet import LinearAttention
from inferd.model.layers.moe import Experts
from inferd.model.layers.rope import Rope

# the families (inferd.model.families.registry): what a GGUF's general.architecture or a config.json's
# model_type may say
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                           "gpt_oss", "gemma4", "qwen3_next", "qwen3_5", "qwen3_5_moe")
LAYER_TYPES = ("full", "sliding", "linear")
# NOTE: RoPE's tables hold every position the model declares ([max_position_embeddings,
# rotary_dim] each: decoder.py), so what a file declares is what the loader allocates. 2^24
# positions is past the longest context any open model was trained for (Llama 4 Scout's 10M),
# and 2^28 table entries (1 GiB in float32; a 1M-token context of 256-wide heads) past every
# family's real checkpoints: a corrupt or hostile file declaring more is refused, not allocated.
MAX_POSITIONS = 2**24
MAX_ROPE_ENTRIES = 2**28
# (name, least, most): sizes a file declares, checked before anything divides by or allocates them
_SIZES = (("vocab_size", 1, 2**31 - 1), ("hidden_size", 1, 2**31 - 1), ("num_layers", 0, 2**16),
          ("num_heads", 1, 2**16), ("num_kv_heads", 1, 2**16), ("head_dim", 1, 2**16),
          ("max_position_embeddings", 1, MAX_POSITIONS))


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
    # a sliding layer's query sees a key iff q_pos - k_pos < W (bidirectional: |q_pos - k_pos| < W)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full", "sliding" or "linear" (linear attention) per layer; () all full
    # sliding layers' own RoPE (Gemma 3: base 10k where full layers have 1M and linear scaling)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    partial_rotary_factor: float = 1.0  # the share of each head RoPE rotates (Phi-4-mini: 0.75)
    output_bias: bool = False  # attention's output projection has a bias (gpt-oss)
    attention_sinks: bool = False  # one learned logit per head joins each softmax's denominator (gpt-oss)
    experts: Experts | None = None  # a mixture of experts in place of the MLP (in every layer but its dense_layers)
    # Gemma 4 (inferd.model.gemma4): its own decoder layer reads these
    norm_float32: bool = False  # RMSNorm's x̂·w taken in float32, then rounded (not x̂ rounded first)
    full_head_dim: int | None = None  # full-attention layers' head size (global_head_dim); None: head_dim
    full_kv_heads: int | None = None  # full-attention layers' KV heads; None: num_kv_heads
    # per layer, the layer whose KV cache it attends over: itself, or (a KV-shared layer, which
    # holds no cache and computes only its queries) an earlier layer of its kind; (): each its own
    kv_sources: tuple[int, ...] = ()
    value_norm: bool = False  # values RMS-normed per head, with no weight, before the cache
    keys_as_values: bool = False  # full layers have no v projection: values are the k projection's output
    double_wide_mlp: bool = False  # KV-shared layers' MLP is 2 x intermediate_size wide
    per_layer_input_size: int = 0  # per-layer embeddings: each layer's width (0: none)
    per_layer_vocab_size: int = 0  # and their vocabulary
    # Qwen3-Next, Qwen3.5 (inferd.model.hybrid): Gated DeltaNet in the layers layer_types marks "linear"
    linear_attention: LinearAttention | None = None
    attn_output_gate: bool = False  # attention's output times σ(a gate q's projection also gives), per head
    # a multimodal checkpoint read as its language model alone: the vision tower is not loaded
    vision_tower_skipped: bool = False
    # every token attends to every other of its prompt, not only to those before it (EmbeddingGemma:
    # an encoder, whose prompt the engine computes in one chunk and never continues)
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name, least, most in _SIZES:
            if not least <= getattr(self, name) <= most:
                raise ModelLoadError(f"{name} {getattr(self, name)} is out of range ({least} to {most})")
        widest = max(self.head_dim, self.full_head_dim or 0)
        if self.max_position_embeddings * widest > MAX_ROPE_ENTRIES:
            raise ModelLoadError(f"max_position_embeddings {self.max_position_embeddings} x head size {widest} is more "
                                 f"RoPE table than any real model has (at most {MAX_ROPE_ENTRIES} entries)")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ModelLoadError(f"layer types {unknown} (supported: {', '.join(LAYER_TYPES)})")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ModelLoadError("sliding layers without a sliding_window")
        if ("linear" in self.layer_types) != (self.linear_attention is not None):
            raise ModelLoadError("linear-attention layers without their shapes, or shapes without the layers")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ModelLoadError(f"unsupported activation {self.activation!r} (supported: silu, gelu_tanh)")
        for local in (False, True):
            self.rope(local).check(self.name or self.architecture)
        self._check_kv_sources()

    def _check_kv_sources(self) -> None:
        if not self.kv_sources:
            return
        if len(self.kv_sources) != self.num_layers:
            raise ModelLoadError(f"{len(self.kv_sources)} KV sources for {self.num_layers} layers")
        for layer, source in enumerate(self.kv_sources):
            if not (source == layer or (source < layer and self.kv_sources[source] == source
                                        and self.kv_shape(source) == self.kv_shape(layer)
                                        and self.is_sliding(source) == self.is_sliding(layer))):
                raise ModelLoadError(f"layer {layer} cannot read layer {source}'s KV cache")

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

    def head_dim_of(self, layer: int) -> int:
        return self.full_head_dim if self.full_head_dim and not self.is_sliding(layer) else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.full_kv_heads if self.full_kv_heads and not self.is_sliding(layer) else self.num_kv_heads

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of the layer's cache."""
        return self.kv_heads_of(layer), self.head_dim_of(layer)

    @property
    def has_layer_shapes(self) -> bool:
        """Layers differ in KV shape, or some read another's cache (Gemma 4): the KV layout says so."""
        return bool(self.kv_sources) or any(self.kv_shape(i) != self.kv_shape(0) for i in range(self.num_layers))

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer] if self.kv_sources else layer

    def intermediate_of(self, layer: int) -> int:
        """The dense MLP's width: twice as wide in KV-shared layers with double_wide_mlp (Gemma 4)."""
        wide = self.double_wide_mlp and self.kv_source(layer) != layer
        return self.intermediate_size * (2 if wide else 1)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding" in self.layer_types

    def is_linear(self, layer: int) -> bool:
        """The layer is linear attention (Gated DeltaNet): a state slot, no KV blocks."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear"

    @property
    def has_linear_layers(self) -> bool:
        return "linear" in self.layer_types

    def rope(self, local: bool = False) -> Rope:
        """The RoPE of full layers, or (`local`) of sliding ones where the family gives them their own."""
        head_dim = self.head_dim if local else self.full_head_dim or self.head_dim
        rotary_dim = int(head_dim * self.partial_rotary_factor)
        rotary_dim -= rotary_dim % 2
        if local and self.local_rope_theta is not None:
            return Rope(self.local_rope_theta, rotary_dim, self.local_rope_scaling, self.max_position_embeddings)
        original = int((self.rope_scaling or {}).get("original_max_position_embeddings") or 0)
        return Rope(self.rope_theta, rotary_dim, self.rope_scaling, self.max_position_embeddings,
                    long=bool(original) and self.max_position_embeddings > original)
