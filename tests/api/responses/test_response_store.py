"""The Responses API's store on a fake clock: its time to live, its count and byte bounds per
owner, owners kept apart, running background responses never evicted for room (refused instead)
but stopped when they expire, and a storm that leaves nothing past the bounds."""

from __future__ import annotations

import random
from dataclasses import dataclass

from inferd.api.responses.store import ResponseStore, Stored, json_size


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeLive:
    """A background response's live part: its events' bytes, running until stopped."""

    bytes: int = 0
    running: bool = True
    stopped: str | None = None

    def stop(self, reason: str) -> None:
        self.running, self.stopped = False, reason


def finished(response_id: str, owner: str = "tenant:a", text: str = "hi") -> Stored:
    entry = Stored(response_id, owner)
    entry.finish({"id": response_id, "output_text": text}, [{"role": "user", "content": text}])
    return entry


def ids(store: ResponseStore) -> list[str]:
    return [entry.id for entry in store]


def test_a_response_expires_after_its_time_to_live_and_is_counted() -> None:
    clock = Clock()
    store = ResponseStore(max_count=10, max_bytes=10**6, ttl=60, clock=clock)
    store.put(finished("r1"))
    clock.now += 30
    store.put(finished("r2"))
    clock.now += 29.9
    assert store.get("tenant:a", "r1") is not None
    clock.now += 0.1  # r1 is 60 s old
    assert store.get("tenant:a", "r1") is None and ids(store) == ["r2"]
    clock.now += 30
    assert store.sweep() == 1 and store.held == 0
    assert store.evictions == {"ttl": 2, "capacity": 0}


def test_the_count_bound_evicts_the_oldest_per_owner() -> None:
    store = ResponseStore(max_count=2, max_bytes=10**6, ttl=60, clock=Clock())
    for i in range(3):
        store.put(finished(f"a{i}"))
    store.put(finished("b0", owner="tenant:b"))
    assert ids(store) == ["a1", "a2", "b0"]  # b's response did not push out a's
    assert store.evictions == {"ttl": 0, "capacity": 1}


def test_the_byte_bound_counts_the_json_text() -> None:
    one = finished("r0", text="y" * 100).size()  # (every id below is as long)
    assert one == json_size({"id": "r0", "output_text": "y" * 100}) + json_size([{"role": "user", "content": "y" * 100}])
    store = ResponseStore(max_count=100, max_bytes=3 * one, ttl=60, clock=Clock())
    for i in range(5):
        store.put(finished(f"r{i}", text="y" * 100))
    assert ids(store) == ["r2", "r3", "r4"] and store.size() <= 3 * one
    store.put(finished("huge", text="y" * 4 * one))  # over the bound alone: not kept at all
    assert ids(store) == ["r2", "r3", "r4"] and store.evictions["capacity"] == 3


def test_owners_never_see_each_others_responses() -> None:
    store = ResponseStore(max_count=10, max_bytes=10**6, ttl=60, clock=Clock())
    store.put(finished("r1", owner="tenant:a"))
    assert store.get("tenant:b", "r1") is None and store.delete("tenant:b", "r1") is None
    assert store.get("tenant:a", "r1") is not None
    assert store.delete("tenant:a", "r1") is not None and store.held == 0
    assert store.evictions == {"ttl": 0, "capacity": 0}  # a delete is not an eviction


def test_running_responses_are_refused_room_not_evicted_and_stopped_when_they_expire() -> None:
    clock = Clock()
    store = ResponseStore(max_count=2, max_bytes=1000, ttl=60, clock=clock)
    lives = [FakeLive(), FakeLive()]
    for i, live in enumerate(lives):
        store.put(Stored(f"bg{i}", "tenant:a", live))
    assert not store.has_room("tenant:a") and store.has_room("tenant:b")
    store.put(finished("done"))  # over the count: the finished one goes, not a running one
    assert ids(store) == ["bg0", "bg1"] and not any(live.stopped for live in lives)
    lives[0].bytes = 2000  # its events grew past the bytes bound: still not evicted while it runs
    store.fit("tenant:a")
    assert ids(store) == ["bg0", "bg1"]
    lives[1].running = False  # bg1 ended: now it may go for room
    store.fit("tenant:a")
    assert ids(store) == ["bg0"] and store.has_room("tenant:a")
    clock.now += 60
    assert store.sweep() == 1 and lives[0].stopped is not None and "ttl" in lives[0].stopped
    assert store.evictions == {"ttl": 1, "capacity": 2}


def test_a_storm_of_stored_responses_leaves_nothing_past_the_bounds() -> None:
    clock, rng = Clock(), random.Random(7)
    store = ResponseStore(max_count=50, max_bytes=20_000, ttl=30, clock=clock)
    owners = [f"tenant:{i}" for i in range(4)]
    for i in range(2000):
        clock.now += rng.random() * 0.05
        owner = rng.choice(owners)
        store.put(finished(f"r{i}", owner, text="z" * rng.randrange(1, 400)))
        if i % 97 == 0:
            store.delete(owner, f"r{i - rng.randrange(1, 50)}")
        for o in owners:
            mine = [e for e in store if e.owner == o]
            assert len(mine) <= 50 and sum(e.size() for e in mine) <= 20_000
        assert all(clock.now - e.stored_at < 30 for e in store)
    clock.now += 30
    store.sweep()
    assert store.held == 0 and store.size() == 0 and not store._owners  # nothing left, no empty tables
    assert sum(store.evictions.values()) > 1500
