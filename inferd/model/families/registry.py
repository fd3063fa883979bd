"""The model families inferd serves, each a short description over the decoder's building blocks.

Every family is the Llama decoder (inferd.model.decoder) with some switches set: norm kind,
q/k norms, sandwich norms, MLP activation, embedding scale, attention scale and soft-caps,
sliding-window layers, per-layer RoPE, partial rotary. A family says

- which Hugging Face architectures (config.json's `architectures` / `model_type`) it reads,
- how its config.json sets those switches (`read`: config.json -> ModelConfig fields),
- its tensors' names in a Hugging Face checkpoint (per layer, suffix -> canonical name), and
  which fused tensors split into canonical ones at load (Phi-3's qkv_proj, gate_up_proj),
- the config keys that change the maths which it does not implement (`refuse`): a checkpoint
  setting one is refused with its name rather than served wrong,
- and the same for a GGUF file as llama.cpp's converter writes one: its architecture name,
  tensor names and metadata keys, and the converter's own conventions (Gemma's norms stored as
  1 + w, Llama's q/k rows interleaved for its RoPE, Phi-3's fused tensors).

Gemma 4 (families/gemma4.py) also runs layers of its own (inferd.model.gemma4), and so do the
hybrid families, Qwen3-Next and Qwen3.5 (families/hybrid.py; inferd.model.hybrid).

Adding a family: a `Family(...)` entry below; a new switch goes into ModelConfig, the decoder
and every attention backend (inferd.kernels.ops), with a test that fails with it off.
"""

from __future__ import annotations

from typing import Any

from inferd.model.families.config import ModelConfig
from inferd.model.families.dense import DENSE_FAMILIES
from inferd.model.families.family import GGUF_TOP_NAMES, TOP_NAMES, Family, rope_variant
from inferd.model.families.gemma4 import GEMMA4
from inferd.model.families.hybrid import HYBRID_FAMILIES
from inferd.model.families.sparse import SPARSE_FAMILIES
from inferd.text.errors import ModelLoadError

__all__ = ["GGUF_TOP_NAMES", "TOP_NAMES", "Family", "config_from_gguf", "config_from_hf", "family_of", "gguf_family"]

FAMILIES = DENSE_FAMILIES + SPARSE_FAMILIES + (GEMMA4,) + HYBRID_FAMILIES
BY_GGUF = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture}
BY_NAME = {f.name: f for f in FAMILIES}


def family_of(cfg: dict[str, Any], source: str) -> Family:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type", "")
    for family in FAMILIES:
        if any(a in family.hf_architectures for a in archs) or model_type in family.model_types:
            return family
    supported = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
    raise ModelLoadError(f"{source}: unsupported architecture {archs or model_type!r} (supported: {supported})")


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    family = family_of(cfg, source)
    multimodal = any(a in family.multimodal for a in cfg.get("architectures") or [])
    if multimodal:
        cfg = _language_model(cfg, source)
    for key, implemented in family.refuse.items():
        if key in cfg and cfg[key] not in (implemented, None):
            raise ModelLoadError(f"{source}: config.json sets {key} = {cfg[key]!r}, which inferd does not "
                                 f"implement for {family.name} (only {implemented!r})")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}
        fields: dict[str, Any] = dict(
            architecture=family.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            # (a mixture of experts in every layer may give only its experts' size)
            intermediate_size=int(cfg["intermediate_size" if "intermediate_size" in cfg else "moe_intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope_variant(cfg.get("rope_scaling") or rope) if "full_attention" not in rope else None,
            name=cfg.get("_name_or_path", "") or source,
            vision_tower_skipped=multimodal,
        )
        fields |= family.read(cfg)
        scaling = fields["rope_scaling"]
        # (proportional RoPE reads its own factor: rope.py)
        if scaling is not None and "partial_rotary_factor" in scaling and scaling.get("rope_type") != "proportional":
            fields["partial_rotary_factor"] = float(scaling["partial_rotary_factor"])
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks {e.args[0]!r}") from None
    try:
        return ModelConfig(**fields)
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None


def _language_model(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """A multimodal checkpoint's config.json as its language model's: text_config, with the top
    level's architectures, name, tied head and quantization (the vision tower's keys are not read)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: config.json of a {cfg['architectures'][0]} has no text_config")
    kept = ("architectures", "_name_or_path", "tie_word_embeddings", "quantization_config")
    return text | {key: cfg[key] for key in kept if key in cfg}


def gguf_family(meta: dict[str, Any], source: str) -> Family:
    arch = meta.get("general.architecture", "")
    if not isinstance(arch, str) or arch not in BY_GGUF:
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r} in a GGUF (supported: {', '.join(BY_GGUF)})")
    return BY_GGUF[arch]


def config_from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    """The config a GGUF's metadata gives. The file's reader checks its layout, not what its
    values mean: a value of the wrong type (a string or a list for a count), or one that divides
    by zero, is a ModelLoadError naming the file, as a missing key is."""
    try:
        return _config_from_gguf(meta, source)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, KeyError) as e:
        raise ModelLoadError(f"{source}: malformed GGUF metadata ({type(e).__name__}: {e})") from None


def _config_from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    family = gguf_family(meta, source)
    arch = family.gguf_architecture

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{name}")
        return value

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    # per-layer arrays: their one value, or None where layers differ (the family's reader must say)
    num_kv_heads = _uniform(key("attention.head_count_kv", num_heads))
    ffn = meta.get(f"{arch}.feed_forward_length")
    per_layer_ffn = isinstance(ffn, list) and _uniform(ffn) is None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
    elif scaling_type == "yarn":
        rope_scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                        "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
                        "beta_fast": float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                        "beta_slow": float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{source}: unsupported rope scaling type {scaling_type!r}")
    tokens = meta.get("tokenizer.ggml.tokens")
    common: dict[str, Any] = dict(
        architecture=family.name,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0)),
        hidden_size=hidden,
        # (a mixture of experts in every layer may give only its experts' size)
        intermediate_size=None if per_layer_ffn else int(_uniform(ffn) or key("expert_feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=None if num_kv_heads is None else int(num_kv_heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                     or hidden // num_heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings=False,  # decided by the loader: tied when output.weight is absent
        rope_scaling=rope_scaling,
        name=meta.get("general.name", source),
    )
    assert family.read_gguf is not None
    try:
        fields = common | family.read_gguf(key, common)
        for name, field in (("attention.head_count_kv", "num_kv_heads"), ("feed_forward_length", "intermediate_size")):
            if fields[field] is None:
                raise ModelLoadError(f"per-layer {arch}.{name} {meta[f'{arch}.{name}']} is not supported for "
                                     f"{family.name} (only one value for every layer)")
        return ModelConfig(**fields)
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None


def _uniform(value: Any) -> Any:
    """A GGUF value that may be a per-layer array: the value, the array's one value, or None."""
    if isinstance(value, list):
        return value[0] if value and len(set(value)) == 1 else None
    return value
