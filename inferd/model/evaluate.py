"""Perplexity of a model on a text: how packed weights (inferd.model.layers.quant) compare with dense ones.

Non-overlapping windows, each prefilled from position 0 into the first blocks of a paged cache
(`kv_layers`, per layer (keys, values) as inferd.engine.worker.kv_cache.KVCache holds them); the
perplexity is exp of the mean negative log-likelihood of every token after a window's first.
Full-attention and hybrid models: every attention layer gets the same table and no window, and
the linear-attention layers (KVCache's state slots) start each window afresh in slot 0. Layers
in 8 bits (kv_quant.QuantizedCache) are written and read through the reference, whatever backend
the model has, which is put back after.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from inferd.kernels.kv_quant import QuantizedCache
from inferd.kernels.linear_attention import StatePlan
from inferd.kernels.ops import TorchAttention
from inferd.kernels.reference import Cache
from inferd.kernels.tensors import device_tensor
from inferd.model.decoder import DecoderModel, LayerAttention, StepAttention
from inferd.model.layers.linear import DENSE_PREFILL_MIN_TOKENS


def perplexity(model: DecoderModel, kv_layers: list[tuple[Cache, Cache]], block_size: int, token_ids: list[int],
               window: int = 512) -> float:
    fmt = next((k.format for k, _ in kv_layers if isinstance(k, QuantizedCache)), None)
    backend = model.attention
    if fmt == backend.kv_format:
        return _perplexity(model, kv_layers, block_size, token_ids, window)
    # NOTE: the model's layer ops bind their KV write to the cache's format (ops.layer_ops)
    model.set_attention(TorchAttention(backend.kv_block, fmt))
    try:
        return _perplexity(model, kv_layers, block_size, token_ids, window)
    finally:
        model.set_attention(backend)


def _perplexity(model: DecoderModel, kv_layers: list[tuple[Cache, Cache]], block_size: int, token_ids: list[int],
                window: int) -> float:
    device = model.device
    total_nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window + 1]
        inputs, targets = chunk[:-1], chunk[1:]
        n = len(inputs)
        table = list(range(-(-n // block_size)))
        positions = torch.arange(n, device=device)
        # blocks 0, 1, ... in order: slot p is position p
        plans = LayerAttention(positions, model.attention.plan_prefill([table], [n], [n], block_size, device), None)
        attn = StepAttention(
            layers=[plans] * model.cfg.num_layers,
            num_prefill_tokens=n,
            dense_rows=n if n >= DENSE_PREFILL_MIN_TOKENS else 0,  # as the runner would
            state=StatePlan.build([n], [0], [True], [], 0, device) if model.cfg.has_linear_layers else None,
        )
        logits = model.forward(device_tensor(inputs, torch.int64, device), positions, kv_layers, attn, positions)
        total_nll += F.cross_entropy(logits, device_tensor(targets, torch.int64, device), reduction="sum").item()
        count += len(targets)
    return math.exp(total_nll / count)
