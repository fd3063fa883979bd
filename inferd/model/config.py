"""Hyper-parameters of a Llama-family model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from inferd.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" or "qwen2"
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
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> torch.Tensor:
        """`[head_dim // 2]` float32 inverse frequencies, with Llama-3 / linear scaling applied."""
        inv_freq = 1.0 / (
            self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim)
        )
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return inv_freq
        if kind == "linear":
            return inv_freq / float(scaling["factor"])
        if kind == "llama3":
            return _llama3_inv_freq(inv_freq, scaling)
        if kind == "factors":  # per-frequency divisors stored in a GGUF's rope_freqs tensor
            return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
        raise ModelLoadError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "")
    if "Qwen2ForCausalLM" in archs or model_type == "qwen2":
        arch = "qwen2"
    elif any(a in ("LlamaForCausalLM", "MistralForCausalLM") for a in archs) or model_type in ("llama", "mistral"):
        arch = "llama"
        if cfg.get("sliding_window") and model_type == "mistral":
            raise ModelLoadError(f"{source}: Mistral with sliding-window attention is not supported")
    else:
        raise ModelLoadError(f"{source}: unsupported architecture {archs or model_type!r} "
                             "(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=_hf_rope_scaling(cfg),
            name=cfg.get("_name_or_path", "") or source,
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks {e.args[0]!r}") from None


def _hf_rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else dict(scaling)


def config_from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    arch = meta.get("general.architecture", "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{name}")
        return value

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts: only uniform ones are supported
        if len(set(num_kv_heads)) != 1:
            raise ModelLoadError(f"{source}: per-layer KV head counts are not supported")
        num_kv_heads = num_kv_heads[0]
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{source}: unsupported rope scaling type {scaling_type!r}")
    tokens = meta.get("tokenizer.ggml.tokens")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // num_heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings=False,  # decided by the loader: tied when output.weight is absent
        attention_bias=arch == "qwen2",
        rope_scaling=rope_scaling,
        name=meta.get("general.name", source),
    )
