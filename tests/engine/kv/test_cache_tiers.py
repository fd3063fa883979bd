"""The prefix cache's tiers (kv/cache_tiers.py): session retention's eviction order, the host
tier's offloads and onloads, and why a prompt missed; then a hypothesis state machine that keeps a
fake KV cache and a fake host tier and checks every sequence reads back its own prefix."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.protocol import Session


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(bm: BlockManager, seq: int, tokens: list[int], session: Session | None = None, tenant: str | None = None,
        root: bytes = b"") -> int:
    """A prompt allocated, computed, and ended (retained for its session); returns its hit."""
    hit = bm.allocate(seq, len(tokens), tokens, root=root)
    assert hit is not None
    bm.commit(seq, len(tokens), lambda a, b: tokens[a:b])
    bm.retain(seq, session, tenant, lambda a, b: tokens[a:b])
    bm.free(seq)
    bm.check_invariants()
    return hit


def prompt(tag: int, blocks: int, bs: int = 4) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * bs + 1)]  # (the last token is never cached)


def fill(bm: BlockManager, first_seq: int, count: int, blocks: int) -> None:
    """`count` anonymous prompts of `blocks` full blocks each, all distinct."""
    for i in range(count):
        run(bm, first_seq + i, prompt(100 + first_seq + i, blocks))


# ---- retention ----

def test_a_sessions_blocks_outlive_anonymous_traffic() -> None:
    clock = Clock()
    bm = BlockManager(8, 4, clock=clock)
    mine = prompt(1, 3)
    run(bm, 0, mine, Session("s", ttl=60))
    fill(bm, 1, 6, 3)  # 18 blocks of anonymous traffic through an 8-block pool
    assert bm.cached_prefix(mine) == 12
    clock.now = 61  # expired: evicted after anonymous blocks, but before any live session's
    run(bm, 10, prompt(2, 2), Session("t", ttl=60))
    fill(bm, 11, 2, 3)  # short by one block: the expired session's tail goes, not the live one's
    assert bm.cached_prefix(mine) == 8 and bm.cached_prefix(prompt(2, 2)) == 8


def test_without_a_session_the_prefix_is_evicted() -> None:
    bm = BlockManager(8, 4)
    mine = prompt(1, 3)
    run(bm, 0, mine)
    fill(bm, 1, 6, 3)
    assert bm.cached_prefix(mine) == 0


def test_lower_priority_sessions_go_first() -> None:
    bm = BlockManager(8, 4, clock=Clock())
    low, high = prompt(1, 3), prompt(2, 3)
    run(bm, 0, high, Session("high", ttl=60, priority=2))
    run(bm, 1, low, Session("low", ttl=60, priority=0))
    fill(bm, 2, 1, 3)  # needs 4 blocks, 2 free: two of a session's go, the low one's tail
    assert bm.cached_prefix(high) == 12 and bm.cached_prefix(low) == 4


def test_a_newer_state_releases_the_older() -> None:
    bm = BlockManager(8, 4, clock=Clock())
    old, new = prompt(1, 3), prompt(2, 3)
    run(bm, 0, old, Session("s", ttl=60))
    run(bm, 1, new, Session("s", ttl=60))  # (a compacted conversation: nothing shared)
    fill(bm, 2, 1, 3)  # needs 4 blocks, 2 free: two of the old state's go (anonymous now), none of the new's
    assert bm.cached_prefix(old) == 4 and bm.cached_prefix(new) == 12
    assert bm.tiers.retention.released_blocks == 3


def test_a_tenant_holds_at_most_its_share() -> None:
    bm = BlockManager(8, 4, clock=Clock(), session_share=0.25)  # 2 blocks a tenant
    mine = prompt(1, 3)
    run(bm, 0, mine, Session("a\0s", ttl=60), tenant="a")
    fill(bm, 1, 6, 3)
    assert bm.cached_prefix(mine) == 8  # its head only
    run(bm, 20, prompt(2, 2), Session("a\0t", ttl=60), tenant="a")  # the tenant's newer session: the older lets go
    fill(bm, 21, 6, 3)
    assert bm.cached_prefix(mine) == 0 and bm.cached_prefix(prompt(2, 2)) == 8


def test_sessions_sharing_a_prefix_keep_it_while_either_lives() -> None:
    clock = Clock()
    bm = BlockManager(8, 4, clock=clock)
    shared = prompt(1, 2)
    a, b = shared[:-1] + [7, 7, 7, 7, 7], shared[:-1] + [8, 8, 8, 8, 8]
    run(bm, 0, a, Session("a", ttl=10))
    run(bm, 1, b, Session("b", ttl=100))
    clock.now = 50  # a expired, b alive: the shared blocks wait with b
    fill(bm, 2, 2, 3)
    assert bm.cached_prefix(b) == 12 and bm.cached_prefix(shared) == 8


# ---- the host tier ----

def test_an_evicted_prefix_comes_back_from_the_host_tier() -> None:
    bm = BlockManager(4, 4, num_tier_blocks=8)
    mine = prompt(1, 2)
    run(bm, 0, mine)
    fill(bm, 1, 2, 2)
    offloads, onloads = bm.tiers.take_copies()
    assert len(offloads) == 3 and onloads == []  # (mine, then the first filler's head)
    assert bm.cached_prefix(mine) == 8  # from the host tier
    hit = bm.allocate(9, len(mine), mine)
    assert hit == 8
    report = bm.tiers.report(9, mine, b"", None)
    assert (report.cached_tokens, report.host_tokens, report.miss) == (8, 8, None)
    offloads, onloads = bm.tiers.take_copies()
    assert sorted(device for _, device in onloads) == sorted(bm.block_table(9)[:2])
    bm.check_invariants()


def test_the_tier_keeps_reused_blocks_over_one_time_ones() -> None:
    bm = BlockManager(2, 4, num_tier_blocks=2)
    hot = prompt(1, 1)
    run(bm, 0, hot)
    run(bm, 1, hot)  # reused: protected once offloaded
    fill(bm, 2, 6, 1)  # a scan of one-time prompts through a 2-block tier
    bm.tiers.take_copies()
    assert bm.cached_prefix(hot) == 4


# ---- why a prompt missed ----

def test_miss_reasons() -> None:
    bm = BlockManager(6, 4, clock=Clock())

    def report(seq: int, tokens: list[int], root: bytes = b"", session: Session | None = None) -> str | None:
        assert bm.allocate(seq, len(tokens), tokens, root=root) is not None
        miss = bm.tiers.report(seq, tokens, root, session).miss
        bm.commit(seq, len(tokens), lambda a, b: tokens[a:b])
        bm.retain(seq, session, None, lambda a, b: tokens[a:b])
        bm.free(seq)
        return miss

    first = prompt(1, 2)
    assert report(0, first) == "cold"
    assert report(1, first) is None
    assert report(2, first[:4] + [9, 9, 9, 9, 9]) == "diverged within tokens 4-7"
    assert report(3, first, root=b"tenant-b") == "another tenant's namespace"
    convo = prompt(2, 2)
    assert report(4, convo, session=Session("s", ttl=60)) == "cold"
    assert report(5, convo[:-1] + [5, 5, 5, 5, 5], session=Session("s", ttl=60)) is None  # all of it came back
    edited = convo[:6] + [0] * 7
    assert report(6, edited, session=Session("s", ttl=60)) == "diverged at token 6"
    fill(bm, 7, 3, 2)
    assert report(20, first) == "evicted"


# ---- the state machine ----

class TieredMachine(RuleBasedStateMachine):
    """Random prompts sharing prefixes, some in sessions, through a small pool with a host tier:
    the copies the manager asks for are made on a fake KV cache and a fake tier (a prefix id per
    slot), and every live sequence must read back exactly its own prefix."""

    @initialize(num_blocks=st.integers(3, 12), tier=st.integers(0, 12), share=st.sampled_from([0.3, 1.0]))
    def setup(self, num_blocks: int, tier: int, share: float) -> None:
        self.bs = 2
        self.clock = Clock()
        self.bm = BlockManager(num_blocks, self.bs, num_tier_blocks=tier, clock=self.clock, session_share=share)
        self.cache = [-1] * (num_blocks * self.bs)
        self.tier = [-1] * (tier * self.bs)
        self.live: dict[int, list[int]] = {}
        self.prompts: list[list[int]] = [[]]
        self.next_seq = 0

    def _ids(self, tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[:p + 1]) for p in range(len(tokens))]

    def _copy(self, src: list, s: int, dst: list, d: int) -> None:
        dst[d * self.bs:(d + 1) * self.bs] = src[s * self.bs:(s + 1) * self.bs]

    @rule(data=st.data(), suffix=st.lists(st.integers(0, 1), min_size=1, max_size=9),
          session=st.sampled_from([None, "a", "b"]), tenant=st.sampled_from([None, "t"]))
    def allocate(self, data: st.DataObject, suffix: list[int], session: str | None, tenant: str | None) -> None:
        base = data.draw(st.sampled_from(self.prompts))
        tokens = base[:data.draw(st.integers(0, len(base)))] + suffix
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        hit = self.bm.allocate(seq, len(tokens), tokens)
        if hit is None:
            return
        offloads, onloads = self.bm.tiers.take_copies()
        for device, host in offloads:  # (the runner's order: every offload, then every onload)
            self._copy(self.cache, device, self.tier, host)
        for host, device in onloads:
            self._copy(self.tier, host, self.cache, device)
        table, ids = self.bm.block_table(seq), self._ids(tokens)
        for p in range(hit):  # the reused part must hold this prompt's prefix
            assert self.cache[table[p // self.bs] * self.bs + p % self.bs] == ids[p]
        for p in range(hit, len(tokens)):
            self.cache[table[p // self.bs] * self.bs + p % self.bs] = ids[p]
        self.bm.commit(seq, len(tokens), lambda a, b: tokens[a:b])
        self.live[seq] = tokens
        self.prompts.append(tokens)
        self.sessions = getattr(self, "sessions", {})
        self.sessions[seq] = (Session(f"{tenant}\0{session}", ttl=5) if session else None, tenant)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live.pop(seq)
        session, tenant = self.sessions.pop(seq)
        self.bm.retain(seq, session, tenant, lambda a, b: tokens[a:b])
        self.bm.free(seq)

    @rule(seconds=st.sampled_from([1.0, 10.0]))
    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check_invariants()
            for seq, tokens in self.live.items():
                table, ids = self.bm.block_table(seq), self._ids(tokens)
                assert [self.cache[table[p // self.bs] * self.bs + p % self.bs] for p in range(len(tokens))] == ids


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=30, stateful_step_count=25, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
