"""A pooling request's answer (embeddings, scores): what its pooled hidden state becomes, and
what the door is told a model's pooler makes."""

from __future__ import annotations

import torch

from inferd.engine.protocol import PoolerInfo
from inferd.engine.sched.request import Request
from inferd.model.pooling import Pooler


def pooled_answers(requests: list[Request], pooled: dict[int, torch.Tensor | float],
                   pooler: Pooler | None) -> dict[int, tuple[list[float] | None, float | None]]:
    """seq_id -> (vector, score): embeddings projected together (the pooler's dense layers and
    normalization, one batch), scores as the runner read them."""
    embedded = [r.seq_id for r in requests if r.pooling is not None and r.pooling.task == "embed"]
    vectors: dict[int, list[float]] = {}
    if embedded:
        assert pooler is not None
        projected = pooler.project(torch.stack([pooled[s] for s in embedded]))  # type: ignore[misc]
        vectors = dict(zip(embedded, projected.tolist()))
    return {r.seq_id: (vectors.get(r.seq_id), value if isinstance(value := pooled[r.seq_id], float) else None)
            for r in requests}


def pooler_info(pooler: Pooler | None, task: str, bidirectional: bool, max_model_len: int,
                step_tokens: int) -> PoolerInfo | None:
    """What /v1/embeddings may ask of a model (None: nothing, a "score" model or embeddings off)."""
    if pooler is None or task == "score":
        return None
    # (bidirectional attention: a prompt is computed in one step, so a step's tokens bound it)
    longest = min(max_model_len - 1, step_tokens) if bidirectional else max_model_len - 1
    return PoolerInfo(pooler.method, pooler.normalize, pooler.dimensions, pooler.matryoshka, longest)
