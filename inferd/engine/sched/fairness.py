"""Weighted fair sharing between tenants inside a priority class: the virtual token counter (VTC)
of "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024). Pure: no torch, no clock.

Each tenant (None: the requests that name no tenant, as one) has a counter, the tokens computed
for it (prompt and output) divided by its weight. Classes still come first; inside a class the
scheduler admits the backlogged tenant with the smallest counter first and preempts the one with
the largest.

A step admits several requests at once, so `order` simulates VTC admission by admission: per
tenant a queue in the base order (deadline, arrival), and the head of the tenant with the
smallest *simulated* counter goes next, which adds its remaining tokens / weight to it. Counters
A = 100, B = 60, every prompt 30 tokens, weights 1:

    base order   a1 a2 a3 b1 b2 b3
    simulated    B 60: b1 -> B 90: b2 -> A 100: a1 -> B 120: b3 -> A 130: a2, a3
    fair order   b1 b2 a1 b3 a2 a3

Seats and blocks: admission order alone cannot help a tenant when another holds every seat (or
the KV pool) with long requests: nothing frees until they end. So inside a rank, a backlogged
tenant holding less than half its weighted share of the seats (or of the blocks) may take one
from the tenant furthest over its share that has been served at least as much (`victim`). The
shares are of the rank's capacity between the tenants with requests in it, by weight; the giver
must stay at or above its share. Above half its share a tenant gets seats as they free, first
while its counter is the lower (admission order), so near equal shares nothing is preempted and
two tenants cannot hand a seat back and forth (64 seats, two tenants of weight 1, shares 32):

    heavy 64, light 0 + 1 waiting      light 0 < 16, heavy 64 - 1 >= 32: heavy gives one
    heavy 48, light 16 + 1 waiting     light holds half its share: it waits for a seat to free
    heavy 30 + 1 waiting, light 34     heavy 30 >= 16: the same, whichever counter is lower

Lifting: a tenant that comes back from idle (or is new) starts at max(its counter, floor), the
floor being the smallest counter of the tenants that stayed active, or, when none did, of the
last active set. Idle time banks no credit, and a tenant over its share when it left still is:

    A  ──────────────────────────────   active throughout, counter 500 now
    B  ──┐  idle (counter 80)   ┌─────   returns at max(80, 500) = 500, not 420 ahead of A
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from inferd.engine.protocol import TenantSnapshot
from inferd.engine.sched.plan import SchedulerOutput
from inferd.engine.sched.request import Request

Tenant = str | None  # None: every request that names no tenant, together


@dataclass(slots=True)
class _Account:
    weight: float = 1.0  # its latest request's
    counter: float = 0.0  # virtual tokens: served / weight, lifted on return from idle
    served: int = 0  # tokens computed for it
    requests: int = 0  # its unfinished requests in the scheduler (waiting or running)


@dataclass(slots=True)
class RankView:
    """One rank's seats or blocks at one moment: each tenant's weighted share and holdings."""

    capacity: int
    weights: dict[Tenant, float]  # the tenants with requests in the rank
    holdings: dict[Tenant, int]  # what their running requests hold
    running: list[Request]  # the rank's running requests
    held: Callable[[Request], int]  # what one running request holds

    def share(self, tenant: Tenant) -> float:
        weight = self.weights.get(tenant)
        return self.capacity if weight is None else self.capacity * weight / sum(self.weights.values())

    def fits(self, tenant: Tenant, need: int) -> bool:
        """`tenant` holds less than half its share and `need` more keep it at or below the share,
        with another tenant to share with (fairness.py's docstring: why half)."""
        if len(self.weights) < 2:
            return False
        held, share = self.holdings.get(tenant, 0), self.share(tenant)
        return held < share / 2 and held + need <= share


class FairShare:
    """The tenants' counters, owned by the scheduler: `enter`/`leave` as its requests come and go,
    `charge` what each step computed, `lift` once per schedule(), then `order` its candidates."""

    def __init__(self) -> None:
        self._accounts: dict[Tenant, _Account] = {}
        self._active: set[Tenant] = set()  # tenants with requests at the last lift()
        self._last_active: set[Tenant] = set()  # the last non-empty such set
        self._changed = False  # a tenant became active or idle since the last lift()
        self._step: dict[Tenant, int] = {}  # charge_step's tally (kept: no dict per step)
        # fairness preemptions each tenant gave up, since start (kept when its account goes idle:
        # /metrics counts them)
        self._taken: Counter[Tenant] = Counter()

    def enter(self, tenant: Tenant, weight: float) -> None:
        """A request of `tenant` was queued (its weight becomes the tenant's)."""
        account = self._accounts.get(tenant)
        if account is None:
            account = self._accounts[tenant] = _Account()
        account.weight = weight
        account.requests += 1
        self._changed |= account.requests == 1

    def leave(self, tenant: Tenant) -> None:
        """A request of `tenant` finished."""
        account = self._accounts[tenant]
        account.requests -= 1
        self._changed |= account.requests == 0

    def charge(self, tenant: Tenant, tokens: int, weight: float | None = None) -> None:
        """`tokens` were computed for `tenant` (weight: its new weight; None: unchanged)."""
        account = self._accounts.get(tenant)
        if account is None:
            account = self._accounts[tenant] = _Account()
        if weight is not None:
            account.weight = weight
        account.served += tokens
        account.counter += tokens / account.weight

    def charge_step(self, out: SchedulerOutput) -> None:
        """Charge each chunk of a step that ran to its request's tenant (a dict update per chunk)."""
        if len(self._active) == 1:
            # NOTE: the plan holds only requests of the tenants active at the lift() of its
            # schedule(): with one (the common, untenanted case) no chunk needs looking at
            for tenant in self._active:
                self.charge(tenant, out.num_tokens)
            return
        step = self._step
        for chunks in (out.prefills, out.decodes):
            for chunk in chunks:
                tenant = chunk.request.tenant
                step[tenant] = step.get(tenant, 0) + chunk.num_tokens
        for tenant, tokens in step.items():
            self.charge(tenant, tokens)
        step.clear()

    @property
    def shared(self) -> bool:
        """More than one tenant had requests at the last lift(): only then can a share be short."""
        return len(self._active) > 1

    def victim(self, needy: Request, rank: RankView, need: int, may_give: Callable[[Request], bool]) -> Request | None:
        """A running request of `needy`'s rank to preempt so that `needy` gets `need` more units
        (seats or blocks, as `rank` counts them): None unless `needy`'s tenant holds less than half
        its weighted share and stays at or below it, and the giver, served at least as much, stays
        at or above its own (see the module's docstring). The giver is the tenant furthest over its
        share; the request it gives up is one `may_give` allows, preempted least often, then the
        cheapest to resume, then the latest."""
        if not rank.fits(needy.tenant, need):
            return None
        served = self.counter(needy.tenant)
        # (the giver must also have been served at least as much: admission order follows the
        # counters, so a seat taken from a tenant served less would be handed back at once)
        over = sorted((t for t, held in rank.holdings.items()
                       if t != needy.tenant and held > rank.share(t) and self.counter(t) >= served),
                      key=lambda t: (rank.holdings[t] / rank.share(t), self.counter(t)), reverse=True)
        for tenant in over:
            givable = [r for r in rank.running if r.tenant == tenant and may_give(r)
                       and 0 < rank.held(r) <= rank.holdings[tenant] - rank.share(tenant)]
            if givable:
                return min(givable, key=lambda r: (r.num_preemptions, r.num_computed_tokens, -(r.arrival_time or 0.0)))
        return None

    def rank_view(self, rank: int, contenders: Iterable[Request], running: Iterable[Request], capacity: int,
                  held: Callable[[Request], int]) -> RankView:
        """One rank's capacity split between the tenants with requests in it (`contenders`,
        waiting and running), by weight, and what each holds of it now."""
        weights: dict[Tenant, float] = {}
        for r in contenders:
            if r.rank == rank and r.tenant not in weights:
                account = self._accounts.get(r.tenant)
                weights[r.tenant] = r.tenant_weight if account is None else account.weight
        members = [r for r in running if r.rank == rank]
        holdings: dict[Tenant, int] = {}
        for r in members:
            holdings[r.tenant] = holdings.get(r.tenant, 0) + held(r)
        return RankView(capacity, weights, holdings, members, held)

    def record_preemption(self, tenant: Tenant) -> None:
        """A request of `tenant` gave its seat or blocks to a tenant below its share."""
        self._taken[tenant] += 1

    def counter(self, tenant: Tenant) -> float:
        account = self._accounts.get(tenant)
        return 0.0 if account is None else account.counter

    def lift(self) -> None:
        """Once per schedule(): lift each tenant active now but not at the last call to the floor
        (see the module's docstring), and forget idle tenants the floor would lift anyway."""
        if not self._changed:
            return
        self._changed = False
        accounts = self._accounts
        active = {tenant for tenant, account in accounts.items() if account.requests}
        stayed = active & self._active
        floor = min((accounts[t].counter for t in stayed or self._last_active), default=0.0)
        for tenant in active - self._active:
            accounts[tenant].counter = max(accounts[tenant].counter, floor)
        self._active = active
        if not active:
            return
        self._last_active = active
        # NOTE: tenants are bounded upstream (the configuration names them), but one dict entry
        # per tenant ever seen is still dropped here once idle at or below the smallest active
        # counter: that minimum never falls, so its return would lift it to a floor at least as
        # high, and forgetting it changes no order (only its served_tokens restart from 0).
        lowest = min(accounts[t].counter for t in active)
        # (one that gave up seats stays: /metrics counts them per tenant, a counter never falls)
        for tenant in [t for t, a in accounts.items() if not a.requests and a.counter <= lowest
                       and t not in self._taken]:
            del accounts[tenant]

    def order(self, candidates: list[Request], key: Callable[[Request], Sequence[Any]]) -> list[Request]:
        """`candidates` in the fair order: by `key`'s first item (the aged rank) first, then within
        each rank the tenants' queues merged by simulated counter (see the module's docstring).
        All of one tenant (the common, untenanted case): exactly `sorted(candidates, key=key)`."""
        first = candidates[0].tenant if candidates else None
        if all(r.tenant == first for r in candidates):
            candidates.sort(key=key)
            return candidates
        keyed = sorted(((key(r), r) for r in candidates), key=lambda kr: kr[0])
        ordered: list[Request] = []
        for _, group in itertools.groupby(keyed, key=lambda kr: kr[0][0]):
            ordered += self._merge(list(group))
        return ordered

    def _merge(self, group: list[tuple[Sequence[Any], Request]]) -> list[Request]:
        """One rank's candidates (in base order), tenant by tenant as VTC would admit them."""
        queues: dict[Tenant, deque[tuple[Sequence[Any], Request]]] = {}
        for item in group:
            queues.setdefault(item[1].tenant, deque()).append(item)
        if len(queues) == 1:
            return [r for _, r in group]
        # (simulated counter, head's base key, tenant): base keys are unique, so ties end there
        heap = [(self.counter(tenant), queue[0][0], tenant) for tenant, queue in queues.items()]
        heapq.heapify(heap)
        ordered = []
        while heap:
            virtual, _, tenant = heapq.heappop(heap)
            queue = queues[tenant]
            req = queue.popleft()[1]
            ordered.append(req)
            if queue:
                account = self._accounts.get(tenant)
                weight = req.tenant_weight if account is None else account.weight
                virtual += (req.num_tokens - req.num_computed_tokens) / weight
                heapq.heappush(heap, (virtual, queue[0][0], tenant))
        return ordered

    def snapshot(self, waiting: Iterable[Request], running: Iterable[Request]) -> tuple[TenantSnapshot, ...]:
        """Every tenant known now (untenanted first, then by name), with its queues' sizes."""
        num_waiting = Counter(r.tenant for r in waiting)
        num_running = Counter(r.tenant for r in running)
        return tuple(
            TenantSnapshot(tenant, a.weight, a.counter, a.served, num_waiting[tenant], num_running[tenant],
                           self._taken[tenant])
            for tenant, a in sorted(self._accounts.items(), key=lambda ta: (ta[0] is not None, ta[0] or ""))
        )
