"""Pausing a request (its reader is behind): not scheduled, its KV blocks kept, its place kept;
resumed, it goes on from where it stopped; finished while paused, it leaves the count."""

from __future__ import annotations

from test_scheduler_policy import make, req, scheduled, step

from inferd.engine.sched.request import RequestStatus


def test_a_paused_request_is_skipped_and_keeps_its_blocks() -> None:
    s, clock = make()
    a, b = req(s, clock, 1, 8), req(s, clock, 2, 8)
    step(s)  # both prefilled
    blocks = s.block_manager.block_table(a.seq_id)
    s.pause(a, True)
    assert s.paused == 1
    for _ in range(3):
        assert scheduled(step(s)) == [2]
    assert s.block_manager.block_table(a.seq_id) == blocks and len(a.output_ids) == 1
    s.pause(a, False)
    assert s.paused == 0 and sorted(scheduled(step(s))) == [1, 2]
    assert len(a.output_ids) == 2 and len(b.output_ids) == 5


def test_a_paused_waiting_request_is_not_admitted_and_a_finish_clears_the_count() -> None:
    s, clock = make()
    a = req(s, clock, 1, 8)
    s.pause(a, True)
    assert scheduled(step(s)) == [] and a.status == RequestStatus.WAITING
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert s.paused == 0 and not s.has_work()
    s.pause(a, True)  # finished: ignored
    assert s.paused == 0
