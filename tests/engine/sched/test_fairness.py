"""Fair sharing between tenants inside a class (VTC), with a fake clock and fabricated model
outputs: the counters, lifting on return from idle, the fair order of one step's admissions,
weighted shares over a simulated minute, and what it must leave alone (class order, aging,
timeouts, fcfs). The last test runs the real default model: the engine's side (tenants of every
choice, the published shares).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engine.config import EngineConfig
from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.protocol import EngineRequest, Histogram, TenantSnapshot
from inferd.engine.sched.fairness import FairShare
from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.sched.scheduler import Scheduler, SchedulerOutput
from inferd.text.sampling_params import SamplingParams
from inferd.settings.policy import PriorityClass, SchedulingPolicy, ShedConfig, Timeouts

MAX_MODEL_LEN = 1024
HI = PriorityClass("interactive", 0, ttft_target=1.0)
LO = PriorityClass("batch", 9, ttft_target=30.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 64, budget: int = 64,
         **policy: object) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    policy.setdefault("classes", (HI, LO))
    policy.setdefault("default_class", "interactive")
    policy.setdefault("aging_seconds", 0.0)
    policy.setdefault("shedding", ShedConfig(enabled=False))
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, budget, SchedulingPolicy(**policy), clock=clock), clock  # type: ignore[arg-type]


def req(s: Scheduler, clock: FakeClock, seq_id: int, tenant: str | None, prompt_len: int = 8,
        cls: PriorityClass = HI, weight: float = 1.0, max_tokens: int = 1, timeouts: Timeouts | None = None) -> Request:
    """A request of `tenant` arriving now, queued."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    r = Request(seq_id, [seq_id * 1000 + i for i in range(prompt_len)], params, MAX_MODEL_LEN, priority_class=cls,
                timeouts=timeouts or Timeouts(), arrival_time=clock.now, tenant=tenant, tenant_weight=weight)
    s.add(r)
    return r


def step(s: Scheduler, clock: FakeClock | None = None, dt: float = 0.0) -> SchedulerOutput:
    """One step with made-up tokens; requests that reach their max_tokens finish."""
    plan = s.schedule()
    if clock is not None:
        clock.now += dt
    s.update(plan, {c.request.seq_id: 7 for c in plan.chunks if c.samples})
    for c in plan.chunks:
        if c.request.status == RequestStatus.RUNNING and c.request.num_tokens >= c.request.max_total_tokens:
            s.finish(c.request, RequestStatus.FINISHED_LENGTH)
    return plan


def admitted(plan: SchedulerOutput) -> list[int]:
    return [r.seq_id for r in plan.started]


def finish_all(s: Scheduler) -> None:
    for r in [*s.running, *s.waiting]:
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    s.block_manager.check_invariants()
    assert s.block_manager.num_used_blocks == 0
    if s.fair is not None:
        assert all(t.waiting == t.running == 0 for t in s.tenants_snapshot())


def tenant(s: Scheduler, name: str | None) -> TenantSnapshot:
    return next(t for t in s.tenants_snapshot() if t.name == name)


# ------------------------------------------------------------------------------- counters


def test_charge_adds_tokens_over_the_weight() -> None:
    fair = FairShare()
    fair.enter("a", 2.0)
    fair.charge("a", 100)
    assert fair.counter("a") == 50.0
    fair.charge("a", 30, weight=3.0)  # a new weight counts from now on
    assert fair.counter("a") == 60.0 and fair.counter("nobody") == 0.0
    (snap,) = fair.snapshot([], [])
    assert snap == TenantSnapshot("a", 3.0, 60.0, 130, 0, 0)


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    fair = FairShare()
    fair.enter("a", 1.0)
    fair.enter("b", 1.0)
    fair.lift()
    fair.charge("a", 100)
    fair.charge("b", 120)
    fair.leave("b")  # b goes idle at 120 ...
    fair.lift()
    fair.charge("a", 900)  # ... while a is served alone, up to 1000
    fair.enter("b", 1.0)
    fair.enter("new", 1.0)  # a tenant never seen comes in at the same level
    fair.lift()
    assert fair.counter("b") == fair.counter("new") == 1000.0 and fair.counter("a") == 1000.0
    fair.lift()  # nothing changed since: no lift
    fair.charge("b", 50)
    assert fair.counter("b") == 1050.0


def test_a_tenant_over_its_share_keeps_its_excess_when_it_comes_back() -> None:
    fair = FairShare()
    for t in ("a", "b"):
        fair.enter(t, 1.0)
    fair.lift()
    fair.charge("a", 100)
    fair.charge("b", 500)
    fair.leave("b")
    fair.lift()
    fair.enter("b", 1.0)
    fair.lift()
    assert fair.counter("b") == 500.0  # max(its own, a's 100)


def test_when_everyone_was_idle_the_floor_is_the_last_active_sets_smallest() -> None:
    fair = FairShare()
    for t in ("a", "b"):
        fair.enter(t, 1.0)
    fair.lift()
    fair.charge("a", 50)
    fair.charge("b", 50)
    fair.leave("b")  # b idle at 50
    fair.lift()
    fair.charge("a", 350)  # a alone up to 400, then idle too
    fair.leave("a")
    fair.lift()
    for t in ("a", "b"):  # both back in the same step: no old difference below 400 survives
        fair.enter(t, 1.0)
    fair.lift()
    assert fair.counter("a") == fair.counter("b") == 400.0


def test_idle_tenants_at_or_below_the_floor_are_forgotten() -> None:
    fair = FairShare()
    for t in ("a", "b", "c"):
        fair.enter(t, 1.0)
    fair.lift()
    fair.charge("a", 100)
    fair.charge("b", 10)
    fair.charge("c", 900)
    fair.leave("b")
    fair.leave("c")
    fair.lift()
    # b (10 <= a's 100) would come back at a's level anyway; c (over its share) is remembered
    assert [t.name for t in fair.snapshot([], [])] == ["a", "c"]


def test_the_fair_order_interleaves_tenants_admission_by_admission() -> None:
    # the module docstring's example: counters A = 100, B = 60, every prompt 30 tokens
    s, clock = make()
    fair = s.fair
    assert fair is not None
    reqs = {name: req(s, clock, i, name[0].upper(), prompt_len=30)
            for i, name in enumerate(("a1", "a2", "a3", "b1", "b2", "b3"))}
    fair.lift()
    fair.charge("A", 100)
    fair.charge("B", 60)
    ordered = fair.order(list(reqs.values()), lambda r: (0, 0.0, r.arrival_time, r.seq_id))
    names = {id(r): name for name, r in reqs.items()}
    assert [names[id(r)] for r in ordered] == ["b1", "b2", "a1", "b3", "a2", "a3"]
    finish_all(s)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["a", "b", None]), st.integers(1, 50)),
                min_size=1, max_size=30),
       st.lists(st.integers(0, 500), min_size=3, max_size=3))
def test_the_fair_order_keeps_ranks_and_each_tenants_own_order(
        specs: list[tuple[int, str | None, int]], counters: list[int]) -> None:
    fair = FairShare()
    for name, counter in zip(("a", "b", None), counters):
        fair.enter(name, 1.0)
        fair.charge(name, counter)
    params = SamplingParams(max_tokens=1)
    candidates = [Request(i, [1] * size, params, MAX_MODEL_LEN, rank=rank, arrival_time=float(-i), tenant=name)
                  for i, (rank, name, size) in enumerate(specs)]

    def key(r: Request) -> tuple[int, float, float, int]:
        return r.rank, 0.0, r.arrival_time, r.seq_id

    ordered = fair.order(list(candidates), key)
    base = sorted(candidates, key=key)
    assert sorted(r.seq_id for r in ordered) == sorted(r.seq_id for r in candidates)
    assert [r.rank for r in ordered] == [r.rank for r in base]  # classes first, as before
    for name in ("a", "b", None):  # a tenant's own requests keep the base order
        assert [r for r in ordered if r.tenant == name] == [r for r in base if r.tenant == name]
    if len({r.tenant for r in candidates}) == 1:
        assert ordered == base  # the fast path: exactly today's order


# ----------------------------------------------------------------------------- scheduling


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
def test_a_newcomer_is_not_stuck_behind_another_tenants_backlog(fairness: str) -> None:
    s, clock = make(budget=16, fairness=fairness)  # two 8-token prompts per step
    backlog = [req(s, clock, i, "a") for i in range(10)]
    assert admitted(step(s, clock, 0.05)) == [0, 1]
    assert admitted(step(s, clock, 0.05)) == [2, 3]
    newcomer = [req(s, clock, 100 + i, "b") for i in range(2)]
    order = []
    while s.has_work():
        order += admitted(step(s, clock, 0.05))
    if fairness == "vtc":  # b starts level with a (no credit for never having run) and alternates
        assert order == [4, 100, 5, 101, 6, 7, 8, 9]
    else:  # arrival order: b waits for all of a's backlog
        assert order == [4, 5, 6, 7, 8, 9, 100, 101]
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in backlog + newcomer)
    finish_all(s)


def test_weights_two_to_one_split_a_minute_of_service_two_to_one() -> None:
    s, clock = make(num_blocks=512, max_num_seqs=6, budget=48)
    served = {"gold": 0, "free": 0}
    ids = iter(range(10**6))

    def top_up() -> None:  # both tenants always backlogged: 4 waiting each
        for name, weight in (("gold", 2.0), ("free", 1.0)):
            for _ in range(4 - sum(1 for r in s.waiting if r.tenant == name)):
                req(s, clock, next(ids), name, prompt_len=24, weight=weight, max_tokens=24)

    while clock.now < 1060.0:  # 60 s of 50 ms steps
        top_up()
        for c in step(s, clock, 0.05).chunks:
            served[c.request.tenant] += c.num_tokens
    assert 1.7 <= served["gold"] / served["free"] <= 2.3, served
    gold, free = tenant(s, "gold"), tenant(s, "free")
    assert (gold.weight, free.weight) == (2.0, 1.0)
    assert gold.served_tokens == served["gold"] and free.served_tokens == served["free"]
    assert abs(gold.virtual_tokens - free.virtual_tokens) < 0.1 * free.virtual_tokens
    finish_all(s)


def test_a_higher_class_goes_first_whatever_the_counters() -> None:
    s, clock = make(budget=8)
    for i in range(3):  # a is far ahead of b
        req(s, clock, i, "a")
    req(s, clock, 3, "b", cls=LO)
    while len(s.waiting) > 1:
        step(s, clock, 0.05)
    req(s, clock, 10, "a", cls=HI)
    req(s, clock, 11, "b", cls=LO)
    assert tenant(s, "a").virtual_tokens > tenant(s, "b").virtual_tokens
    assert admitted(step(s, clock, 0.05)) == [10]
    assert admitted(step(s, clock, 0.05)) == [3]
    finish_all(s)


def test_aging_still_lifts_a_waiting_request_over_a_lower_counter() -> None:
    s, clock = make(budget=8, aging_seconds=10.0)
    old = req(s, clock, 0, "a", cls=LO)
    req(s, clock, 1, "b", cls=LO)
    assert s.fair is not None
    s.fair.charge("a", 1000)  # a is far over its share
    clock.now += 5  # old: 5 s waited, still a batch request: b's goes first
    assert admitted(step(s, clock)) == [1]
    clock.now += 6  # old: 11 s waited, one class up: ahead of b's new batch request
    req(s, clock, 2, "b", cls=LO)
    assert tenant(s, "a").virtual_tokens > tenant(s, "b").virtual_tokens
    assert admitted(step(s, clock)) == [old.seq_id]
    assert admitted(step(s, clock)) == [2]
    finish_all(s)


def test_timeouts_still_fire() -> None:
    s, clock = make(max_num_seqs=1)
    req(s, clock, 0, "a", max_tokens=100)
    queued = req(s, clock, 1, "b", timeouts=Timeouts(queue=2.0))
    step(s, clock, 1.0)
    assert step(s, clock, 1.1).timed_out == []
    plan = step(s, clock)
    assert plan.timed_out == [queued] and queued.timeout_kind == "queue"
    # it left its tenant's count: b, idle below a's counter, is forgotten (it would come back level)
    assert [t.name for t in s.tenants_snapshot()] == ["a"]
    finish_all(s)


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
def test_a_victim_within_a_class_comes_from_the_tenant_over_its_share(fairness: str) -> None:
    s, clock = make(max_num_seqs=2, fairness=fairness)
    big = req(s, clock, 0, "a", prompt_len=12, cls=LO, max_tokens=50)  # a: 12 tokens served
    small = req(s, clock, 1, "b", prompt_len=4, cls=LO, max_tokens=50)  # b: 4
    step(s, clock, 0.05)
    clock.now += 1
    req(s, clock, 2, "c", cls=HI)  # both seats taken by batch work: one gives its seat up
    plan = step(s, clock, 0.05)
    # vtc: a is further over its share, though it costs more to resume; fcfs: the cheaper one
    assert plan.preempted == ([big] if fairness == "vtc" else [small])
    finish_all(s)


def test_fcfs_keeps_the_base_order_and_counts_nothing() -> None:
    s, clock = make(budget=8, fairness="fcfs")
    for i in range(6):
        req(s, clock, i, ("a", "b")[i >= 4])  # b comes last
        clock.now += 0.01
    order = []
    while s.has_work():
        order += admitted(step(s, clock, 0.05))
    assert order == list(range(6))
    assert s.fair is None and s.tenants_snapshot() == ()
    finish_all(s)


def test_requests_without_a_tenant_share_one_counter_in_the_base_order() -> None:
    s, clock = make(budget=8)
    for i in range(4):
        req(s, clock, i, None)
        clock.now += 0.01
    order = []
    while s.has_work():
        order += admitted(step(s, clock, 0.05))
    assert order == [0, 1, 2, 3]
    (untenanted,) = s.tenants_snapshot()
    assert untenanted.name is None and untenanted.served_tokens == 4 * 8
    finish_all(s)


def test_the_tenant_snapshot_counts_waiting_and_running() -> None:
    s, clock = make(budget=8)
    req(s, clock, 0, "a", max_tokens=10)
    req(s, clock, 1, "a")
    req(s, clock, 2, "b", weight=3.0)
    step(s, clock, 0.05)
    a, b = tenant(s, "a"), tenant(s, "b")
    assert (a.running, a.waiting, b.running, b.waiting) == (1, 1, 0, 1)
    assert a.served_tokens == 8 and b.weight == 3.0
    assert [r.tenant for r in s.requests_snapshot(10)] == ["a", "a", "b"]
    finish_all(s)


def test_policy_rejects_an_unknown_fairness() -> None:
    with pytest.raises(ValueError, match="fairness must be 'vtc' or 'fcfs'"):
        SchedulingPolicy(fairness="lottery")


# -------------------------------------------------------------------------------- engine


def test_the_engine_passes_the_tenant_to_every_choice_and_publishes_the_shares(float32_weights: tuple) -> None:
    engine = LLMEngine(*float32_weights, EngineConfig.of(dtype="float32", kv_cache_memory=32 * 2**20))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = engine.tokenizer.encode("The sky is")
    engine.add_request(EngineRequest(1, prompt, params, "interactive", n=2, tenant="acme", tenant_weight=2.0))
    engine.add_request(EngineRequest(2, prompt, params, "interactive"))
    assert [(r.tenant, r.tenant_weight) for r in engine.requests.values()] == \
        [("acme", 2.0), ("acme", 2.0), (None, 1.0)]  # the root, its fork, the other
    engine.step()
    snap = engine.snapshot(1, 0.0, Histogram(), Histogram())
    assert [(t.name, t.weight, t.running) for t in snap.tenants] == [(None, 1.0, 1), ("acme", 2.0, 2)]
    assert sorted(r.tenant or "" for r in snap.requests) == ["", "acme", "acme"]
    while engine.has_work():
        engine.step()
    acme = next(t for t in engine.snapshot(1, 0.0, Histogram(), Histogram()).tenants if t.name == "acme")
    # one prompt (the choices share it) and each choice's decodes: 4 tokens, the last not computed
    assert acme.served_tokens == len(prompt) + 2 * 3 and acme.virtual_tokens == acme.served_tokens / 2.0
