"""Where a request stands in time: its place in the scheduler's order (aged class rank, then
deadline), and the hard timeouts that end it. Pure: `now` is the scheduler's clock.

    arrival ──────────────────────────────────────────────> now
       ├── queue ──┤ first scheduled
       ├──── ttft ────┤ first token
                      ├ token ┤ each gap between two tokens (restarts with every token)
       ├────────────── total ──────────────┤ last token
"""

from __future__ import annotations

from inferd.engine.sched.request import Request, RequestStatus


def order_key(req: Request, now: float, aging_seconds: float) -> tuple[int, float, float, int]:
    """Sort key, smaller first: (aged rank, deadline, arrival, id). A waiting request's rank
    drops by one per `aging_seconds` it has waited (0: no aging), so a low class never starves."""
    rank = req.rank
    if aging_seconds > 0 and req.status == RequestStatus.WAITING:
        rank = max(0, rank - int((now - req.arrival_time) // aging_seconds))
    return rank, deadline(req), req.arrival_time, req.seq_id


def deadline(req: Request) -> float:
    """When it should have its first token: the earliest of its class's TTFT target and its own
    hard limits on the way there (queue, TTFT, total)."""
    t = req.timeouts
    limit = req.priority_class.ttft_target
    for value in (t.queue, t.ttft, t.total):
        if value is not None and value < limit:
            limit = value
    return req.arrival_time + limit


def expired(req: Request, now: float) -> str | None:
    """The kind of hard timeout `req` has passed ("queue", "ttft", "token", "total"), or None."""
    if req.timeout_kind is not None:
        return req.timeout_kind  # its last token came too late (see SchedulerAccounting.on_token)
    t = req.timeouts
    age = now - req.arrival_time
    if req.first_scheduled_time is None and t.queue is not None and age > t.queue:
        return "queue"
    if req.first_token_time is None and t.ttft is not None and age > t.ttft:
        return "ttft"
    if req.last_token_time is not None and t.token is not None and now - req.last_token_time > t.token:
        return "token"
    if t.total is not None and age > t.total:
        return "total"
    return None
