"""The decoder a checkpoint runs: the DecoderModel every family shares (inferd.model.decoder),
Gemma 4's, which has layers of its own (inferd.model.gemma4), or the hybrid one of Qwen3-Next and
Qwen3.5, with linear-attention layers (inferd.model.hybrid)."""

from __future__ import annotations

import torch

from inferd.model.decoder import DecoderModel
from inferd.model.families.config import ModelConfig
from inferd.model.gemma4 import Gemma4Model
from inferd.model.hybrid import HybridModel


def decoder_for(cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> DecoderModel:
    model = Gemma4Model if cfg.architecture == "gemma4" else HybridModel if cfg.has_linear_layers else DecoderModel
    return model(cfg, weights, dtype)
