"""The scheduler's accounting with a fake clock and fabricated tokens: per-class counters and
latency samples, the snapshots the engine publishes, and the late-token marks on requests.
"""

from __future__ import annotations

import pytest

from inferd.engine.sched.accounting import SchedulerAccounting, requests_snapshot
from inferd.engine.kv.block_manager import BlockManager
from inferd.settings.policy import PriorityClass, SchedulingPolicy, ShedConfig, Timeouts
from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.sched.scheduler import Scheduler
from inferd.text.sampling_params import SamplingParams

MAX_MODEL_LEN = 1024
HI = PriorityClass("interactive", 0, ttft_target=1.0, tpot_target=0.5)
LO = PriorityClass("batch", 9, ttft_target=30.0, tpot_target=2.0)
POLICY = SchedulingPolicy(classes=(HI, LO), default_class="interactive", aging_seconds=0.0,
                          shedding=ShedConfig(enabled=False))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(seq_id: int, prompt_len: int, cls: PriorityClass, n: int = 1, timeouts: Timeouts | None = None,
            arrival: float | None = None) -> Request:
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompt = [seq_id * 100 + i for i in range(prompt_len)]
    r = Request(seq_id, prompt, params, MAX_MODEL_LEN, priority_class=cls, timeouts=timeouts or Timeouts(),
                arrival_time=arrival)
    r.forks = [Request(seq_id + i, prompt, params, MAX_MODEL_LEN, index=i, group_id=seq_id) for i in range(1, n)]
    return r


def sample_all(s: Scheduler, clock: FakeClock, dt: float) -> None:
    """One step whose model run takes `dt` seconds; every sampling chunk (and pending fork) gets a token."""
    plan = s.schedule()
    clock.now += dt
    sampled = {r.seq_id: 7 for c in plan.chunks if c.samples for r in (c.request, *c.request.forks_pending)}
    s.update(plan, sampled)


def test_class_snapshot_through_a_request_life() -> None:
    clock = FakeClock()
    s = Scheduler(BlockManager(64, 4), 8, 64, POLICY, clock=clock)
    a, b = request(1, 10, HI), request(2, 6, LO)
    s.add(a)
    s.add(b)
    clock.now += 2.0
    hi, lo = s.snapshot()
    assert (hi.name, hi.waiting, hi.queued_tokens, hi.oldest_wait, hi.running) == ("interactive", 1, 10, 2.0, 0)
    assert (lo.name, lo.waiting, lo.queued_tokens, lo.oldest_wait) == ("batch", 1, 6, 2.0)

    sample_all(s, clock, 0.5)  # scheduled at 1002 (2 s queued), first tokens at 1002.5
    hi, lo = s.snapshot()
    assert (hi.waiting, hi.running, hi.kv_blocks_used, lo.kv_blocks_used) == (0, 1, 3, 2)
    assert (hi.queued_token_seconds, lo.queued_token_seconds) == (20.0, 12.0)  # tokens x 2 s waited
    assert (hi.prompt_tokens, hi.cached_prompt_tokens, hi.generation_tokens) == (10, 0, 1)
    assert (hi.ttft_p50, hi.queue_time_p95, lo.ttft_p95) == (2.5, 2.0, 2.5)
    assert hi.deadline_misses == {"ttft": 1} and lo.deadline_misses == {}  # targets 1 s and 30 s
    assert hi.histograms["ttft"].counts[hi.histograms["ttft"].bounds.index(3.0)] == 1

    sample_all(s, clock, 1.0)
    sample_all(s, clock, 1.0)
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    hi, lo = s.snapshot()
    assert (hi.running, hi.generation_tokens, lo.generation_tokens) == (0, 3, 3)
    assert hi.finished == {"length": 1} and hi.tpot_p50 == 1.0 and lo.tpot_p50 is None
    assert hi.deadline_misses == {"ttft": 1, "tpot": 1}
    assert hi.histograms["itl"].total == 2.0 and hi.histograms["e2e"].total == 4.5
    assert s.stats["interactive"].e2e.percentile(50) == 4.5


def test_requests_snapshot_names_the_group_and_the_choice() -> None:
    clock = FakeClock()
    s = Scheduler(BlockManager(64, 4), 8, 64, POLICY, clock=clock)
    s.add(request(10, 5, HI, n=2))
    s.add(request(20, 3, LO))
    snaps = s.requests_snapshot(10)
    assert [(r.group_id, r.index, r.state, r.ttft) for r in snaps] == [(10, 0, "waiting", None), (20, 0, "waiting", None)]
    sample_all(s, clock, 0.25)
    clock.now += 1.0
    snaps = s.requests_snapshot(10)
    assert [(r.group_id, r.index, r.class_name, r.state) for r in snaps] == [
        (10, 0, "interactive", "running"), (20, 0, "batch", "running"), (10, 1, "interactive", "running")]
    assert [(r.age, r.ttft, r.prompt_tokens, r.output_tokens) for r in snaps] == [
        (1.25, 0.25, 5, 1), (1.25, 0.25, 3, 1), (1.25, 0.25, 5, 1)]
    assert len(s.requests_snapshot(2)) == 2

    swapped = request(30, 4, LO, arrival=999.0)
    swapped.swapped = True
    assert requests_snapshot([swapped], 1000.0)[0].state == "swapped"


def test_on_token_marks_late_tokens_and_feeds_the_shedder() -> None:
    seen: list[tuple[str, float, float]] = []
    acct = SchedulerAccounting(POLICY, 0.0, lambda name, ttft, now: seen.append((name, ttft, now)))
    r = request(1, 4, HI, timeouts=Timeouts(ttft=3.0, token=0.5), arrival=10.0)
    acct.on_token(r, 12.0)
    assert (r.first_token_time, r.last_token_time, r.timeout_kind) == (12.0, 12.0, None)
    assert seen == [("interactive", 2.0, 12.0)]
    acct.on_token(r, 12.5)  # a gap of exactly the per-token timeout is in time
    assert r.timeout_kind is None
    acct.on_token(r, 13.25)
    assert r.timeout_kind == "token" and r.last_token_time == 13.25
    assert acct.stats["interactive"].generation_tokens == 3 and list(acct.stats["interactive"].itl.recent) == [0.5, 0.75]

    late = request(2, 4, HI, timeouts=Timeouts(ttft=3.0), arrival=10.0)
    acct.on_token(late, 13.5)
    assert late.timeout_kind == "ttft" and acct.stats["interactive"].deadline_misses["ttft"] == 2


def test_queued_token_seconds_integrate_only_forward() -> None:
    acct = SchedulerAccounting(POLICY, 100.0, lambda *_: None)
    waiting = [request(1, 8, HI, arrival=100.0), request(2, 4, LO, arrival=100.0)]
    acct.on_step(101.5, waiting)
    acct.on_step(101.0, waiting)  # the clock stepped back: nothing, and the next step counts from here
    acct.on_step(102.0, waiting)
    assert acct.stats["interactive"].queued_token_seconds == pytest.approx(8 * 2.5)
    assert acct.stats["batch"].queued_token_seconds == pytest.approx(4 * 2.5)


def test_scheduler_counters_are_the_accountings() -> None:
    s = Scheduler(BlockManager(8, 4), 8, 64, POLICY)
    assert s.stats is s.accounting.stats and s.preemptions is s.accounting.preemptions
    assert s.timeouts is s.accounting.timeouts and s.num_preemptions == 0
