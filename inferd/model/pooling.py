"""What a pooling model does after its trunk: the final hidden states of a prompt pooled into one
vector (its last token's, their mean, or the first token's), then sentence-transformers' dense
layers, then scaled to length 1.

    trunk ─ final norm ─ hidden [T, H] ─ pool (last | mean | cls) ─ [H] ─ Dense ... ─ Normalize ─ vector

The engine pools (engine/worker/runner.py: a prompt's rows may come in several chunks, so mean
pooling sums per chunk); `Pooler.project` does the rest, per finished request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inferd.text.errors import ModelLoadError

POOLING_METHODS = ("last", "mean", "cls")


@dataclass
class DenseLayer:
    """One sentence-transformers `Dense` module: y = activation(x Wᵀ + b)."""

    weight: torch.Tensor  # [out, in] float32
    bias: torch.Tensor | None  # [out] float32
    activation: str = "identity"  # "identity" or "tanh" (sentence-transformers' default for Dense)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [B, in] -> [B, out]
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.tanh(y) if self.activation == "tanh" else y


@dataclass
class Pooler:
    """How a model's hidden states become one vector; read from the checkpoint (its
    sentence-transformers modules), the family's table, and the settings' [model] keys."""

    method: str  # "last", "mean" or "cls"
    normalize: bool
    dense: list[DenseLayer] = field(default_factory=list)
    matryoshka: bool = False  # its vectors may be cut to a prefix and normalized again
    hidden_size: int = 0

    @property
    def dimensions(self) -> int:
        return self.dense[-1].weight.shape[0] if self.dense else self.hidden_size

    def project(self, pooled: torch.Tensor) -> torch.Tensor:  # [B, hidden] float32 -> [B, dimensions] float32
        """The dense layers, then the normalization, over pooled hidden states."""
        x = pooled.float()
        for layer in self.dense:
            x = layer(x)
        return torch.nn.functional.normalize(x, dim=-1) if self.normalize else x


def load_pooler(folder: str | None, hidden_size: int, method: str | None = None,
                normalize: bool | None = None) -> Pooler:
    """A model's pooler: `method` and `normalize` as the settings say (None: as the checkpoint's
    sentence-transformers modules say; without them, last-token pooling for a Qwen3 trunk saved
    alone (Qwen3-Embedding's layout), mean pooling otherwise, normalized). `folder`: a Hugging Face
    folder; None or a GGUF file: the defaults."""
    if method is not None and method not in POOLING_METHODS:
        raise ModelLoadError(f"pooling method {method!r} (supported: {', '.join(POOLING_METHODS)})")
    path = Path(folder) if folder else None
    if path is not None and path.is_dir():
        config = _read_json(path / "config.json")
        if (path / "modules.json").is_file():
            pooler = _from_modules(path, hidden_size)
        else:
            last = "Qwen3Model" in (config.get("architectures") or [])
            pooler = Pooler("last" if last else "mean", True, hidden_size=hidden_size)
        pooler.matryoshka = _matryoshka(config) or _matryoshka(_read_json(path / "config_sentence_transformers.json"))
    else:
        pooler = Pooler("mean", True, hidden_size=hidden_size)
    if method is not None:
        pooler.method = method
    if normalize is not None:
        pooler.normalize = normalize
    return pooler


# ------------------------------------------------------------------------ sentence-transformers

# Pooling's modes as sentence-transformers names them -> ours; the others (max, weightedmean,
# mean_sqrt_len_tokens, several concatenated) are refused
_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
# sentence-transformers before 5's config.json: a flag per mode
_MODE_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
# the modules inferd runs, each after one of these (None: first)
_AFTER: dict[str, tuple[str | None, ...]] = {"Transformer": (None,), "Pooling": ("Transformer",),
                                             "Dense": ("Pooling", "Dense"), "Normalize": ("Pooling", "Dense")}


def _from_modules(folder: Path, hidden_size: int) -> Pooler:
    """modules.json's chain: the Transformer (the trunk itself), a Pooling, Dense layers, a
    Normalize last; any other module, or another order, is refused rather than run otherwise."""
    pooler = Pooler("mean", False, hidden_size=hidden_size)
    previous = None
    for module in _read_json(folder / "modules.json", list):
        kind = str(module.get("type", "")) if isinstance(module, dict) else repr(module)
        name = kind.rsplit(".", 1)[-1]
        if not kind.startswith("sentence_transformers.") or name not in _AFTER:
            raise ModelLoadError(f"{folder}/modules.json: module {kind!r} is not one inferd runs "
                                 f"(supported: {', '.join(_AFTER)})")
        if previous not in _AFTER[name]:
            raise ModelLoadError(f"{folder}/modules.json: {name} after {previous or 'nothing'} (inferd runs "
                                 "Transformer, Pooling, Dense ..., Normalize in that order)")
        sub = folder / str(module.get("path") or "")
        if name == "Pooling":
            pooler.method = _pooling_method(sub, hidden_size)
        elif name == "Dense":
            pooler.dense.append(_dense(sub, pooler.dimensions))
        elif name == "Normalize":
            pooler.normalize = True
        previous = name
    if previous in (None, "Transformer"):
        raise ModelLoadError(f"{folder}/modules.json: no Pooling module")
    return pooler


def _pooling_method(folder: Path, hidden_size: int) -> str:
    config = _read_json(folder / "config.json")
    mode = config.get("pooling_mode")  # (sentence-transformers 5+; before, a flag per mode)
    if mode is None:
        modes = [m for key, m in _MODE_FLAGS.items() if config.get(key)] or ["mean"]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _MODES:
        raise ModelLoadError(f"{folder}/config.json: pooling mode {mode!r} is not supported "
                             f"(supported: {', '.join(_MODES)})")
    width = config.get("embedding_dimension", config.get("word_embedding_dimension", hidden_size))
    if width != hidden_size:
        raise ModelLoadError(f"{folder}/config.json: pooling over {width} dimensions, but the model's hidden size "
                             f"is {hidden_size}")
    return _MODES[mode]


def _dense(folder: Path, in_features: int) -> DenseLayer:
    """One Dense module: its config.json and its weights (model.safetensors: linear.weight, linear.bias)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _read_json(folder / "config.json")
    # (sentence-transformers' default activation is tanh)
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation not in _ACTIVATIONS:
        raise ModelLoadError(f"{folder}/config.json: Dense activation {activation!r} is not supported "
                             f"(supported: {', '.join(_ACTIVATIONS)})")
    if config.get("use_residual"):
        raise ModelLoadError(f"{folder}/config.json: a Dense with use_residual is not supported")
    weights_file = folder / "model.safetensors"
    if not weights_file.is_file():
        # NOTE: a pytorch_model.bin is a pickle, which may run code when read: refused, not unpickled
        pickled = (folder / "pytorch_model.bin").is_file()
        found = " (only pytorch_model.bin, a pickle inferd does not read: convert it to safetensors)" if pickled else ""
        raise ModelLoadError(f"{folder}: no model.safetensors for the Dense layer{found}")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{weights_file}: truncated or corrupt safetensors file ({e})") from None
    weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
    expected = (int(config.get("out_features", -1)), int(config.get("in_features", -1)))
    if weight is None or tuple(weight.shape) != expected or expected[1] != in_features:
        shape = None if weight is None else tuple(weight.shape)
        raise ModelLoadError(f"{weights_file}: linear.weight {shape}, but the config says {expected} after "
                             f"{in_features} dimensions")
    if bool(config.get("bias", True)) != (bias is not None) or (bias is not None and bias.shape != weight.shape[:1]):
        raise ModelLoadError(f"{weights_file}: linear.bias does not match the config's bias = "
                             f"{config.get('bias', True)}")
    return DenseLayer(weight.float(), None if bias is None else bias.float(), _ACTIVATIONS[activation])


def _matryoshka(config: dict[str, Any]) -> bool:
    """Trained so that a prefix of its vectors is a vector too: config.json's `is_matryoshka` or
    `matryoshka_dimensions` (vLLM's keys; sentence-transformers writes neither)."""
    return bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))


def _read_json(path: Path, kind: type = dict) -> Any:
    """A JSON file of the folder ({} when absent, for an optional dict)."""
    if not path.is_file():
        if kind is dict:
            return {}
        raise ModelLoadError(f"{path}: missing")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None
    if not isinstance(value, kind):
        raise ModelLoadError(f"{path}: expected a JSON {'object' if kind is dict else 'array'}")
    return value
