"""The token masks of a step's constrained rows, filled on a worker thread while the model runs:
`MaskFiller.start` before the forward, the future's result after it.

llguidance is imported only once a constrained row shows up, so the engine runs without it
(the GPU check's bare Python, for one).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from inferd.engine.protocol import ConstraintError


def _matcher(constraint: Any) -> Any:
    """The llguidance matcher of a grammar constraint (engine/structured/grammar.py), or of the
    grammar a thinking budget wraps (budget.py); None for any other."""
    return getattr(constraint, "matcher", None)


def fill_masks(rows: Sequence[tuple[int, Any]], masks: np.ndarray, executor: Any) -> dict[int, Exception]:
    """Fill `masks[row]` for each (row, constraint): the grammar rows in one parallel call
    (llguidance's thread pool, without the GIL), any other constraint on its own. The rows whose
    constraint failed, by row: that row's request fails alone."""
    grammars = [(_matcher(c), row) for row, c in rows if _matcher(c) is not None]
    if grammars:
        executor.unsafe_compute_mask_ptr(grammars, masks.ctypes.data, masks.shape[1] * 4, masks.shape[0])
    failed: dict[int, Exception] = {}
    for row, constraint in rows:
        try:
            if _matcher(constraint) is not None:
                constraint.check()
                if _matcher(constraint) is None:  # a best-effort grammar let go: the row is free
                    masks[row] = -1
                if hasattr(constraint, "narrow"):  # a thinking budget over the grammar (budget.py)
                    constraint.narrow(masks[row])
            else:
                constraint.fill_mask(masks[row])
            if not masks[row].any():
                raise ConstraintError("the grammar allows no next token")
        except Exception as e:  # noqa: BLE001 - a constraint is per-request code: its failure is that request's
            failed[row] = e
            masks[row] = -1  # the row samples unconstrained, then fails
    return failed


class MaskFiller:
    """Fills a step's masks on a worker thread, so that they are ready when the model's logits
    are: `start` before the forward, `result` after it. Rows without a constraint allow all."""

    def __init__(self, vocab_size: int) -> None:
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inferd-grammar")
        self._executor: Any = None  # llguidance.LLExecutor, made for the first constrained step

    def start(self, constraints: Sequence[Any]) -> Future[tuple[np.ndarray, dict[int, Exception]]] | None:
        """Begin filling one mask per row (None: no row is constrained)."""
        rows = [(i, c) for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        if self._executor is None and any(_matcher(c) is not None for _, c in rows):
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=2)
        masks = np.full((len(constraints), self.words), -1, dtype=np.int32)  # [B, W]: all allowed
        return self._pool.submit(lambda: (masks, fill_masks(rows, masks, self._executor)))
