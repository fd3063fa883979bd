"""When a block product runs on AMX tiles (csrc/cpu_matmul_tiles.cpp) rather than on the VNNI
kernel (csrc/cpu_matmul.cpp). The two give a row the same bits, so the choice is speed alone,
and it is measured, per weight shape, the first time a model with that shape loads: Ollama saw
AMX lose at one row (PR #9203), and tiles pay a store and a reload per block that VNNI keeps in
registers. Nothing is measured where AMX is absent or masked (INFERD_AMX=off): every row count
then takes the VNNI kernel, as before tiles existed.

- `tile_rows`: the row count from which a shape's products take the tiles (a decode batch);
- `tiles_beat_dense`: whether a prompt's rows are faster on the tiles than on a layer's dense
  bfloat16 copy (which inferd otherwise keeps for prefill: oneDNN capped at AVX-512 BF16).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from inferd.settings import environment

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 4, 8, 16, 32, 64, 128)  # a decode batch's row counts, timed on both kernels
PROMPT_ROWS = 512  # a prefill chunk's rows, timed on the tiles and on the dense copy
_tile_rows: dict[tuple[tuple[int, ...], int, int], int | None] = {}
_beats_dense: dict[tuple[tuple[int, ...], int, int], bool] = {}


def usable() -> bool:
    """AMX's int8 tiles are there, granted to this process, and not masked (INFERD_AMX=off)."""
    from inferd.kernels import cpu

    return environment.AMX.get() != "off" and cpu.block_matmul_available() and torch.ops.inferd_cpu.amx_usable()


def tile_rows(weight: torch.Tensor, bits: int, activation_bits: int) -> int | None:
    """The smallest probed row count from which the tiles beat VNNI at it and every larger one
    probed; None: never, or no AMX here. Measured once per shape (both kernels, best of 5)."""
    if not usable():
        return None
    key = (tuple(weight.shape), bits, activation_bits)
    if key not in _tile_rows:
        k = weight.shape[1] * 32
        wins = []
        for rows in PROBE_ROWS:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            vnni = best_seconds(lambda: torch.ops.inferd_cpu.block_matmul(x, weight, bits, activation_bits))
            tiles = best_seconds(lambda: torch.ops.inferd_cpu.block_matmul_tiles(x, weight, bits, activation_bits))
            wins.append(tiles < vnni)
        _tile_rows[key] = next((rows for i, rows in enumerate(PROBE_ROWS) if all(wins[i:])), None)
        log.info("block products %s (%d-bit weights, %d-bit inputs): AMX tiles from %s rows", list(weight.shape),
                 bits, activation_bits, _tile_rows[key])
    return _tile_rows[key]


def tiles_beat_dense(weight: torch.Tensor, bits: int, activation_bits: int) -> bool:
    """A prompt's PROMPT_ROWS rows run faster on the tiles than on a dense bfloat16 copy of the
    weights; False with no AMX here. Measured once per shape (before any copy is made: the
    dense side's time depends on the shape alone, so it multiplies by a stand-in)."""
    if not usable():
        return False
    key = (tuple(weight.shape), bits, activation_bits)
    if key not in _beats_dense:
        n, k = weight.shape[0] * 16, weight.shape[1] * 32
        x = torch.randn(PROMPT_ROWS, k, dtype=torch.bfloat16)
        dense = torch.randn(n, k, dtype=torch.bfloat16)
        tiles = best_seconds(lambda: torch.ops.inferd_cpu.block_matmul_tiles(x, weight, bits, activation_bits))
        _beats_dense[key] = tiles < best_seconds(lambda: torch.nn.functional.linear(x, dense))
        log.info("block products %s: a prompt's rows on %s", list(weight.shape),
                 "AMX tiles (no dense copy kept)" if _beats_dense[key] else "the dense bf16 copy")
    return _beats_dense[key]


def best_seconds(call: Callable[[], object], repeats: int = 5) -> float:
    call()  # (a first call pays for its buffers)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
