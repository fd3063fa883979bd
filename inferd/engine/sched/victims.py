"""Whom the scheduler preempts: the choice alone, pure. These read the running and waiting lists and
never change them; the scheduler, their one writer, does the preempting (scheduler.py's `_preempt`).

Victims are the lowest class first, then (vtc) the tenant furthest over its share, then the
cheapest to resume (fewest computed tokens); a request that was resumed is not chosen again
before it has made progress, unless nothing else can give way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.sched.fairness import FairShare, RankView
from inferd.engine.sched.request import Request
from inferd.settings.policy import PriorityClass


def protected(req: Request) -> bool:
    """Resumed after a preemption and has not produced a token since: no thrashing."""
    return req.num_preemptions > 0 and len(req.output_ids) <= req.progress_mark


def lowest(running: Sequence[Request], needy: Request, strictly_lower: bool, fair: FairShare | None) -> Request | None:
    """Whom to preempt so that `needy` can run: the lowest class, then (vtc) the tenant furthest
    over its share, then the cheapest to resume. A running `needy` competes (it may give way)."""

    def worse(r: Request) -> tuple[int, float, int, float, int]:
        counter = 0.0 if fair is None else fair.counter(r.tenant)
        return r.rank, counter, -r.num_computed_tokens, r.arrival_time, r.seq_id

    pool = [r for r in running if r.rank > needy.rank] if strictly_lower else \
        [r for r in running if r.rank >= needy.rank]
    if not pool:
        return None
    unprotected = [r for r in pool if not protected(r)]
    if unprotected:
        return max(unprotected, key=worse)
    # NOTE: everyone left was just resumed. Giving way in order (lowest class, cheapest)
    # still lets the most important of them progress, so nothing waits forever.
    victim = max(pool, key=worse)
    return None if victim is needy else victim


def over_shed_cap(running: Sequence[Request], classes: Sequence[PriorityClass], max_running: int) -> list[Request]:
    """Load shedding's level 2: each sheddable class's running requests past `max_running`, the
    cheapest to resume first (protected ones aside)."""
    out: list[Request] = []
    for cls in classes:
        if cls.sheddable:
            members = [r for r in running if r.priority_class is cls and not protected(r)]
            members.sort(key=lambda r: r.num_computed_tokens)
            out += members[: max(0, len(members) - max_running)]
    return out


def fair_victim(fair: FairShare | None, needy: Request, view: Callable[[], RankView], need: int) -> Request | None:
    """(vtc) The request to preempt so that `needy`'s tenant, below its share of the rank's seats
    or blocks (`view()`), gets `need` more; None under fcfs, or when none may give."""
    if fair is None or not fair.shared:  # (one tenant, the common case: no O(n) view)
        return None
    given = fair.victim(needy, view(), need, lambda r: not protected(r))
    if given is not None:
        fair.record_preemption(given.tenant)
    return given


def rank_view(fair: FairShare, rank: int, waiting: Sequence[Request], running: Sequence[Request],
              block_manager: BlockManager, max_num_seqs: int, by_blocks: bool) -> RankView:
    """(vtc) The rank's seats, or its blocks, between its tenants now."""
    bm = block_manager
    capacity, held = ((bm.pool.num_blocks, lambda r: bm.num_held_blocks(r.seq_id)) if by_blocks
                      else (max_num_seqs, lambda r: 1))
    return fair.rank_view(rank, itertools.chain(waiting, running), running, capacity, held)
