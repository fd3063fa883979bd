"""The Responses API's store: what `store: true` keeps, per owner, bounded in count, bytes and time.

    owner ("tenant:acme", "key:<digest>", or "anyone" on an open server: streaming/resume.py's
    caller_of) -> its responses, oldest first           (count and bytes are bounded per owner)
    every response, oldest first                        (one time to live for all: the order
                                                         they expire in, so a sweep stops at the
                                                         first that has not)

A response is kept from when it starts (a background one) or ends (the others) until one of:
its time to live runs out (`ttl`), its owner's store is over `max_count` responses or
`max_bytes` (its oldest finished responses go first; one over `max_bytes` alone goes at once),
or its owner deletes it. Evictions are counted by reason.

A background response still running is never evicted for room: a new one is refused instead
(`has_room`), so at most `max_count` run per owner; its time to live still ends it (stopped:
its request aborted). Its events count against `max_bytes`, which its finished neighbours make
room for when it is put and when it ends (while it runs, its events are bounded by its
max_output_tokens: streaming/resume.py's event_bound).

Pure: no event loop, no HTTP, no threads (the pure-policy contract); the clock is injected, so
its tests need no sleeps. The HTTP side is stored.py.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

EVICTION_REASONS = ("ttl", "capacity")  # inferd_responses_evicted_total's label values


class Live(Protocol):
    """What the store needs of a background response: its events' size, whether its generation
    still runs, and how to stop it."""

    @property
    def bytes(self) -> int: ...

    @property
    def running(self) -> bool: ...

    def stop(self, reason: str) -> None: ...


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON text: what a kept response is accounted as."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


class Stored:
    """One kept response: its final reply and the conversation it ends (the next turn's history)
    once finished; a background one's events and generation (`live`) from the start."""

    def __init__(self, response_id: str, owner: str, live: Live | None = None) -> None:
        self.id = response_id
        self.owner = owner
        self.live = live
        self.stored_at = 0.0  # the store's clock when it was put
        self.response: dict[str, Any] | None = None  # None while it runs
        self.conversation: list[dict[str, Any]] = []  # as chat-template messages
        self._bytes = 0

    def finish(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.response, self.conversation = response, conversation
        self._bytes = json_size(response) + json_size(conversation)

    @property
    def running(self) -> bool:
        return self.live is not None and self.live.running

    def size(self) -> int:
        return self._bytes + (self.live.bytes if self.live is not None else 0)


class ResponseStore:
    """Owner -> its kept responses, within the bounds (the module's docstring)."""

    def __init__(self, max_count: int, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count = max_count  # per owner
        self.max_bytes = max_bytes  # per owner
        self.ttl = ttl  # seconds from being put
        self.clock = clock
        self.evictions = dict.fromkeys(EVICTION_REASONS, 0)
        self._owners: dict[str, OrderedDict[str, Stored]] = {}
        self._by_age: OrderedDict[str, Stored] = OrderedDict()  # ids are unique across owners

    @property
    def held(self) -> int:
        return len(self._by_age)

    def size(self) -> int:
        """Bytes of every response held (what /metrics shows)."""
        return sum(entry.size() for entry in self._by_age.values())

    def __iter__(self) -> Iterator[Stored]:
        return iter(list(self._by_age.values()))

    def has_room(self, owner: str) -> bool:
        """Whether one more background response may run for `owner` (its running ones are never
        evicted for room)."""
        self.sweep()
        return sum(entry.running for entry in self._owners.get(owner, {}).values()) < self.max_count

    def put(self, entry: Stored) -> None:
        """Keep `entry`, then evict to the bounds (`entry` too, if it alone is over them)."""
        self.sweep()
        entry.stored_at = self.clock()
        self._owners.setdefault(entry.owner, OrderedDict())[entry.id] = entry
        self._by_age[entry.id] = entry
        self.fit(entry.owner)

    def get(self, owner: str, response_id: str) -> Stored | None:
        """`owner`'s response of that id; None when unknown, expired, evicted, or another's."""
        self.sweep()
        return self._owners.get(owner, {}).get(response_id)

    def holds(self, entry: Stored) -> bool:
        """Whether `entry` is still kept (not deleted, evicted or expired and swept)."""
        return self._by_age.get(entry.id) is entry

    def delete(self, owner: str, response_id: str) -> Stored | None:
        """Forget `owner`'s response (its owner's choice: no eviction is counted); the caller
        stops it if it runs."""
        entry = self.get(owner, response_id)
        if entry is not None:
            self._forget(entry)
        return entry

    def sweep(self) -> int:
        """Evict every response past its time to live; how many."""
        deadline, evicted = self.clock() - self.ttl, 0
        while self._by_age:
            oldest = next(iter(self._by_age.values()))
            if oldest.stored_at > deadline:
                break
            self._evict(oldest, "ttl")
            evicted += 1
        return evicted

    def fit(self, owner: str) -> None:
        """Evict `owner`'s oldest finished responses until its store is within the bounds (or
        only running ones are left); called as a running one grows or ends, too."""
        entries = self._owners.get(owner)
        for entry in list(entries.values()) if entries else []:
            if not entry.running and entry.size() > self.max_bytes:  # (over it alone: the others stay)
                self._evict(entry, "capacity")
        entries = self._owners.get(owner)
        while entries and (len(entries) > self.max_count or sum(e.size() for e in entries.values()) > self.max_bytes):
            victim = next((e for e in entries.values() if not e.running), None)
            if victim is None:
                return
            self._evict(victim, "capacity")

    def close(self) -> None:
        """Shutdown: everything forgotten, the running ones stopped."""
        for entry in list(self._by_age.values()):
            self._forget(entry)
            if entry.running:
                entry.live.stop("the server is shutting down")  # type: ignore[union-attr]

    def _evict(self, entry: Stored, reason: str) -> None:
        self._forget(entry)
        self.evictions[reason] += 1
        if entry.running:
            entry.live.stop(f"the response was evicted from the store ({reason})")  # type: ignore[union-attr]

    def _forget(self, entry: Stored) -> None:
        self._by_age.pop(entry.id, None)
        entries = self._owners.get(entry.owner)
        if entries is not None:
            entries.pop(entry.id, None)
            if not entries:  # (no empty table kept per owner)
                del self._owners[entry.owner]
