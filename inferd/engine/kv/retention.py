"""Session retention: a session's newest prefix kept ahead of anonymous blocks for a while (no
tensors here). An agent's turn ends, its tool runs for seconds, and its next turn extends the
same conversation: under load the pause is when its prefix would be evicted.

The prefix cache asks this module, when a cached block loses its last reference, whether a session
holds the block's key (then the block waits here, not in the anonymous LRU), and, when the
anonymous blocks run out, which held block goes next:

    evicted first:  anonymous blocks, least recently freed first         (prefix_cache.py)
                    then blocks of expired sessions
                    then live sessions' blocks, lowest priority first, then soonest to expire
    in a session:   tail first (a tail is no use without its head)

A session holds the keys of its newest state (prompt and output so far) from when a request of
it ends until `ttl` after; a newer state releases what the older one held and the newer does not
(a conversation compacted or edited). A tenant's sessions hold at most `limit(tenant)` keys: past
it, its least recently used sessions let go, so one tenant cannot pin the pool. Holding is a
matter of order only: a held block is still allocatable when nothing else is left.

Several sessions may hold one key (a shared system prompt): a held block waits with its best
holder (the one that would keep it longest), and moves on when that one lets go or expires.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from inferd.engine.kv.errors import BlockError
from inferd.engine.protocol import Session

MAX_SESSIONS = 1024  # past this many, expired sessions are forgotten (their blocks turn anonymous)
MAX_SESSION_TOKENS = 1 << 15  # tokens of a session's state kept to tell where a later turn diverged


@dataclass(eq=False)
class HeldSession:
    key: str  # tenant-scoped (the door's)
    tenant: str | None
    priority: int
    expires: float  # on the engine's clock
    keys: list[bytes]  # the cache keys it holds, in chain order (per KV group, tagged)
    tokens: array  # its newest state's leading tokens (kv/misses.py: where a later turn diverged)
    parked: OrderedDict[int, None] = field(default_factory=OrderedDict)  # its held blocks no sequence uses


class Retention:
    """Which sessions hold which cache keys, and the held blocks that no sequence uses.
    `limit(tenant)`: the keys one tenant's sessions may hold; `to_anonymous(block)`: hand a
    parked block that nobody holds any more back to the prefix cache's LRU."""

    def __init__(self, clock: Callable[[], float], limit: Callable[[str | None], int],
                 to_anonymous: Callable[[int], None], key_of: Callable[[int], bytes | None]) -> None:
        self.clock = clock
        self.limit = limit
        self._to_anonymous = to_anonymous
        self._key_of = key_of
        self.sessions: OrderedDict[str, HeldSession] = OrderedDict()  # least recently used first
        self._holders: dict[bytes, list[HeldSession]] = {}
        self._parked_in: dict[int, HeldSession] = {}  # parked block -> the session it waits with
        self.released_blocks = 0  # metrics: held keys let go by a newer state or a tenant's limit

    # ---- queries ----

    @property
    def num_parked(self) -> int:
        return len(self._parked_in)

    @property
    def num_held_keys(self) -> int:
        return len(self._holders)

    def holds(self, key: bytes) -> bool:
        return key in self._holders

    def is_parked(self, block_id: int) -> bool:
        return block_id in self._parked_in

    def session(self, key: str) -> HeldSession | None:
        return self.sessions.get(key)

    # ---- the prefix cache's calls ----

    def park(self, block_id: int, key: bytes) -> bool:
        """A cached block lost its last reference: keep it with its best holder (True), or False
        if no session holds its key."""
        holders = self._holders.get(key)
        if not holders:
            return False
        best = max(holders, key=self._standing)
        best.parked[block_id] = None
        self._parked_in[block_id] = best
        return True

    def unpark(self, block_id: int) -> None:
        """A parked block is referenced again (a prefix hit)."""
        session = self._parked_in.pop(block_id)
        del session.parked[block_id]

    def victim(self) -> int | None:
        """Take the held block to evict next (see the module's order), or None if none waits."""
        now = self.clock()
        while True:
            waiting = [s for s in self.sessions.values() if s.parked]
            if not waiting:
                return None
            worst = min(waiting, key=self._standing)
            block_id, _ = worst.parked.popitem(last=False)
            del self._parked_in[block_id]
            key = self._key_of(block_id)
            if worst.expires <= now and key is not None:  # (it may wait with a live holder instead)
                alive = [s for s in self._holders.get(key, ()) if s.expires > now]
                if alive:
                    best = max(alive, key=self._standing)
                    best.parked[block_id] = None
                    self._parked_in[block_id] = best
                    continue
            return block_id

    # ---- the block manager's calls ----

    def retain(self, session: Session, tenant: str | None, keys: Sequence[bytes], tokens: Sequence[int]) -> None:
        """A request of `session` ended: hold `keys` (its state's blocks, in chain order) until
        `session.ttl` from now, instead of what the session held before."""
        now = self.clock()
        old = self.sessions.pop(session.key, None)
        keys = list(keys[:self.limit(tenant)])  # (alone over its tenant's limit: its head only)
        held = HeldSession(session.key, tenant, session.priority, now + session.ttl, keys,
                           array("i", tokens[:MAX_SESSION_TOKENS]))
        self.sessions[session.key] = held
        for key in keys:
            self._holders.setdefault(key, []).append(held)
        if old is not None:
            self._let_go(old, keep=set(keys))
        spent = sum(len(s.keys) for s in self.sessions.values() if s.tenant == tenant)
        for other in [s for s in self.sessions.values() if s.tenant == tenant and s is not held]:
            if spent <= self.limit(tenant):
                break
            spent -= len(other.keys)
            del self.sessions[other.key]
            self._let_go(other)
        if len(self.sessions) > MAX_SESSIONS:
            for stale in [s for s in self.sessions.values() if s.expires <= now][:len(self.sessions) - MAX_SESSIONS]:
                del self.sessions[stale.key]
                self._let_go(stale)

    # ---- internals ----

    def _standing(self, session: HeldSession) -> tuple[bool, int, float]:
        """Higher: kept longer (alive before expired, then priority, then the later expiry)."""
        return session.expires > self.clock(), session.priority, session.expires

    def _let_go(self, session: HeldSession, keep: set[bytes] = frozenset()) -> None:  # type: ignore[assignment]
        """Drop a session's holds (a newer state keeps `keep`); its parked blocks wait with their
        next best holder, or turn anonymous."""
        for key in session.keys:
            holders = self._holders[key]
            holders.remove(session)
            if not holders:
                del self._holders[key]
            if key not in keep:
                self.released_blocks += 1
        for block_id in list(session.parked):
            del self._parked_in[block_id]
            key = self._key_of(block_id)
            if key is None or not self.park(block_id, key):
                self._to_anonymous(block_id)
        session.parked.clear()

    def check_invariants(self) -> None:
        """Every parked block waits with a session holding its key; holder lists match the sessions."""
        counted = 0
        for session in self.sessions.values():
            for key in session.keys:
                if session not in self._holders.get(key, ()):
                    raise BlockError(f"session {session.key!r} holds a key it is not filed under")
            for block_id in session.parked:
                if self._parked_in.get(block_id) is not session or self._key_of(block_id) not in session.keys:
                    raise BlockError(f"parked block {block_id} misfiled under session {session.key!r}")
            counted += len(session.parked)
        if counted != len(self._parked_in):
            raise BlockError(f"{len(self._parked_in)} parked blocks, {counted} in sessions")
        if sum(len(h) for h in self._holders.values()) != sum(len(s.keys) for s in self.sessions.values()):
            raise BlockError("holder lists and sessions' keys differ")
