"""The priority scheduler: continuous batching with chunked prefill, classes, deadlines,
preemption and load shedding. Pure and synchronous: no torch, an injected clock, called once
per engine step.

One `schedule()`:

    1. timeouts      end every request past a queue, TTFT, per-token or total deadline
    2. shedding      the load shedder's level caps the sheddable classes (running, max_tokens)
    3. decodes       every running request with one token to compute (and its drafts, while the
                     budget lasts: engine/spec/), most important first
    4. prefills      chunks of running prefills and admissions of waiting requests, merged in
                     order (class, then the tenants' fair shares, then earliest deadline),
                     within the step's token budget

Order is (rank, deadline, arrival): rank is the class's position (0 = most important), less
one per `aging_seconds` a request has waited, so a low class is never starved; the deadline
is the earliest of the request's TTFT target and its hard deadlines (engine/sched/deadlines.py).
With `fairness = "vtc"` tenants share each rank: the next is the head, in that order, of the
tenant with the fewest tokens served per weight, this step's admissions counted (fairness.py).
When blocks or `max_num_seqs` run short, a waiting request may preempt running requests of a *lower
class*; a running one that needs a block may preempt requests of its own class or lower
(victims.py). With vtc, a tenant below half its share of a rank's seats (or blocks) may take them
from one over its share (fairness.py). A preempted request either frees its blocks and recomputes
later (reusing the prefix cache) or has them copied to host memory (swap); it keeps its arrival, so
it keeps its place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from inferd.engine.protocol import ClassSnapshot, RequestSnapshot, TenantSnapshot
from inferd.engine.sched import victims
from inferd.engine.sched.accounting import SchedulerAccounting, requests_snapshot
from inferd.engine.kv.block_manager import BlockManager
from inferd.engine.sched.deadlines import expired, order_key
from inferd.engine.sched.fairness import FairShare, RankView
from inferd.engine.sched.plan import ScheduledChunk, SchedulerOutput
from inferd.settings.policy import PriorityClass, SchedulingPolicy
from inferd.engine.sched.request import Request, RequestStatus
from inferd.engine.sched.shedding import LoadShedder

# what an admission attempt tells the loop over candidates
_ADMITTED, _SKIP, _STOP = 0, 1, 2  # skip: a limit of the request's class; stop: the engine is full


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: SchedulingPolicy | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy = policy or SchedulingPolicy()
        self.clock = clock
        self.classes = {c.name: c for c in policy.classes}
        self._ranks = {c.name: rank for rank, c in enumerate(policy.ranked)}
        num_blocks = block_manager.pool.num_blocks
        self._reserve = {c.name: math.ceil(c.kv_reserve * num_blocks) for c in policy.classes}
        self.shedder = LoadShedder(policy.shedding, policy.classes)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.accounting = acct = SchedulerAccounting(policy, clock(), self.shedder.observe)
        # its counters, where the engine reads them: per class; totals by preemption mode, timeout kind
        self.stats, self.preemptions, self.timeouts = acct.stats, acct.preemptions, acct.timeouts
        self._applied_level = 0
        self.paused = 0  # requests paused now (a slow reader)
        self.fair = FairShare() if policy.fairness == "vtc" else None  # None: fcfs, nothing counted
        # per schedule() call
        self._budget = 0
        self._pooling_budget = 0  # (what is left of the step's tokens for pooling prompts)
        self._scheduled: dict[int, tuple[ScheduledChunk, list[tuple[int, int]]]] = {}

    def reserve_blocks(self, cls: PriorityClass) -> int:
        """Blocks `cls` may not use: its kv_reserve, kept free for more important classes."""
        return self._reserve[cls.name]

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    def add(self, request: Request) -> None:
        """Queue a request of one of this policy's classes, with its timeouts as given (the
        door tightened the class's by the request's own)."""
        cls = request.priority_class
        assert cls is not None and self.classes.get(cls.name) == cls, f"a class this policy lacks: {cls}"
        request.rank = self._ranks[cls.name]
        if request.arrival_time is None:
            request.arrival_time = self.clock()
        if self._applied_level >= 3 and request.priority_class.sheddable:
            request.token_cap = self.policy.shedding.max_tokens
        self.waiting.append(request)
        if self.fair is not None:
            self.fair.enter(request.tenant, request.tenant_weight)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pause(self, req: Request, paused: bool) -> None:
        """Skip (or resume) an unfinished request's steps; it keeps its blocks and its place."""
        if not req.status.finished and req.paused != paused:
            req.paused = paused
            self.paused += 1 if paused else -1

    # ------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        self._budget = self.max_num_batched_tokens
        self._pooling_budget = self.policy.pooling_step_tokens  # (none in a step that prefills another prompt)
        self._scheduled = {}
        self.accounting.on_step(now, self.waiting)
        self._expire(now, out)
        if self.fair is not None:
            self.fair.lift()  # tenants back from idle start at the active ones' level
        self._shed(self.shedder.update(now), out)

        # decodes: one token each, most important first (the order only matters when the
        # budget cannot cover them all; victims for short blocks are chosen by rank anyway)
        if len(self.running) > self._budget:
            self.running.sort(key=lambda r: order_key(r, now, self.policy.aging_seconds))
        bm = self.block_manager
        spare = self._budget - len(self.running)  # (what drafts may take: every decode has its token first)
        for req in list(self.running):
            if self._budget <= 0:
                break
            if req.status == RequestStatus.RUNNING and req.num_tokens - req.num_computed_tokens == 1 and not req.paused:
                # (the common case inline: blocks suffice; _grow preempts when they do not)
                reserve = self._reserve[req.priority_class.name]
                drafts = req.draft_ids[:max(0, spare)]  # (short of blocks for them: none, never a preemption)
                copies = bm.append(req.seq_id, 1 + len(drafts), reserve=reserve) if drafts else None
                if copies is None:
                    drafts, copies = [], bm.append(req.seq_id, 1, reserve=reserve)
                if copies is None:
                    self._grow(req, 1, out)
                else:
                    spare -= len(drafts)
                    out.block_copies += copies
                    self._add_chunk(out, req, 1 + len(drafts), copies, drafts)

        # prefills: running chunks and admissions, merged in order
        candidates = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1] + self.waiting
        if self.paused:  # (rare: skipped until resumed, their blocks kept)
            candidates = [r for r in candidates if not r.paused]
        if self.fair is None:
            candidates.sort(key=lambda r: order_key(r, now, self.policy.aging_seconds))
        else:  # each rank shared between its tenants
            candidates = self.fair.order(candidates, lambda r: order_key(r, now, self.policy.aging_seconds))
        self._prefill_and_admit(candidates, now, out)
        if bm.state is not None:
            out.state_ops = bm.state.take_ops()
        out.offloads, out.onloads = bm.tiers.take_copies()
        return out

    def _prefill_and_admit(self, candidates: list[Request], now: float, out: SchedulerOutput) -> None:
        """Step 4 over the merged candidates, within what is left of the step's budget."""
        held_back: set[str] = set()  # classes at a limit of their own (KV reserve, shedding)
        admitting = True
        stopped: set[object] = set()  # (vtc) tenants a request of which found the engine full
        for req in candidates:
            if self._budget <= 0:
                break
            if req in out.preempted:
                admitting = False  # a victim of this step waits for the next; no one overtakes it
                continue
            if req.seq_id in self._scheduled or req.priority_class.name in held_back:
                continue
            if req.status == RequestStatus.RUNNING:
                n = min(req.num_tokens - req.num_computed_tokens, self._room(req))
                if n <= 0:
                    continue
                if not self._grow(req, n, out):
                    admitting = False  # nobody new may take what this one could not get
            elif req.status == RequestStatus.WAITING and (admitting or self.fair is not None
                                                          and req.tenant not in stopped):
                verdict = self._admit(req, now, out, fair_only=not admitting)
                if verdict == _STOP:
                    admitting = False
                    stopped.add(req.tenant)
                elif verdict == _SKIP:  # nor may a later request of its class
                    held_back.add(req.priority_class.name)
            # NOTE: requests already running go on even after admissions stop. Whoever stopped
            # them found no one to preempt, so the rest are at least as important, and their
            # progress is what frees the seat or the blocks it waits for.

    # ------------------------------------------------------------------- growing and admitting

    def _grow(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Room for `n` more tokens of a running request, preempting others (or itself) if
        needed; schedules the chunk. False when it got nothing this step."""
        bm, reserve = self.block_manager, self._reserve[req.priority_class.name]
        while (copies := bm.append(req.seq_id, n, reserve=reserve)) is None:
            victim = self._pick_victim(req, strictly_lower=False)
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is req:
                return False
        out.block_copies += copies
        self._add_chunk(out, req, n, copies)
        return True

    def _admit(self, req: Request, now: float, out: SchedulerOutput, fair_only: bool = False) -> int:
        """Start (or resume) a waiting request if the engine and its class allow. `fair_only`:
        admissions have stopped for this step, but a tenant below its fair share may still come in,
        by what is free or by fairness preemption only."""
        cls = req.priority_class
        if fair_only and not (self.fair is not None and self.fair.shared
                              and self._rank_view(req.rank, False).fits(req.tenant, 1)):
            return _STOP  # (not below half its share of the seats: RankView.fits)

        def victim(by_blocks: bool, need: int) -> Request | None:
            lower = None if fair_only else self._pick_victim(req, strictly_lower=True)
            return lower if lower is not None else victims.fair_victim(
                self.fair, req, lambda: self._rank_view(req.rank, by_blocks), need)

        bm, reserve = self.block_manager, self._reserve[cls.name]
        if self._applied_level >= 2 and cls.sheddable and self.policy.shedding.max_running <= sum(
                1 for r in self.running if r.priority_class is cls):
            return _SKIP
        while len(self.running) + 1 + len(req.forks_pending) > self.max_num_seqs:
            if (given := victim(False, 1 + len(req.forks_pending))) is None:
                return _STOP
            self._preempt(given, out)

        if req.swapped:
            while (pairs := bm.swap_in(req.seq_id, reserve=reserve)) is None:
                if (given := victim(True, bm.num_swapped_blocks(req.seq_id))) is None:
                    return _SKIP if bm.can_swap_in(req.seq_id) else _STOP
                self._preempt(given, out)
            out.swap_in += pairs
            req.swapped = False
            self._start(req, now, out)
            n = min(req.num_tokens - req.num_computed_tokens, self._room(req))
            # (the table may already cover a token whose step was taken back when it was swapped)
            grow = max(0, req.num_computed_tokens + n - bm.num_tokens(req.seq_id))
            copies = bm.append(req.seq_id, grow, reserve=reserve)
            if copies is not None and n > 0:  # else it runs from the next step on
                out.block_copies += copies
                self._add_chunk(out, req, n, copies)
            return _ADMITTED

        tokens = req.token_ids(0, req.num_tokens) if req.reuses_cached_prefix else None
        while True:
            cached = bm.cached_prefix(tokens, req.cache_salt)
            n = min(req.num_tokens - cached, self._room(req))
            if n <= 0 or req.one_chunk and n < req.num_tokens - cached:
                return _SKIP  # (the pooling share is spent; a bidirectional prompt runs whole, next step)
            if bm.allocate(req.seq_id, cached + n, tokens, reserve=reserve, root=req.cache_salt) is not None:
                break
            need = max(1, -(-(cached + n) // bm.block_size) - cached // bm.block_size)
            if (given := victim(True, need)) is None:  # short for everyone, or only for this class (its KV reserve)?
                return _SKIP if bm.can_allocate(cached + n, tokens, root=req.cache_salt) else _STOP
            self._preempt(given, out)
        req.num_computed_tokens = cached
        if req.num_preemptions == 0:
            self.accounting.on_cached(req, bm.tiers.report(req.seq_id, tokens, req.cache_salt, req.session))
        self._start(req, now, out)
        self._add_chunk(out, req, n, [])
        return _ADMITTED

    def _room(self, req: Request) -> int:
        """The step's tokens left for this request: a pooling prompt's share is capped (a chat's
        next token never waits behind a long step of embeddings), but a whole bidirectional prompt
        runs (its step is the exception)."""
        if req.pooling is None or req.one_chunk:
            return self._budget
        return min(self._budget, self._pooling_budget)

    def _start(self, req: Request, now: float, out: SchedulerOutput) -> None:
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        req.progress_mark = len(req.output_ids)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            self.accounting.on_start(req, now)
            out.started.append(req)

    def _add_chunk(self, out: SchedulerOutput, req: Request, n: int, copies: list[tuple[int, int]],
                   drafts: list[int] | None = None) -> None:
        bm = self.block_manager
        chunk = ScheduledChunk(req, req.num_computed_tokens, n, bm.block_tables(req.seq_id), drafts=drafts or [])
        if bm.state is not None:  # (a hybrid model's) the chunk's state slot, and its checkpoints if caching
            chunk.state_slot = bm.state.slot(req.seq_id)
            if bm.enable_prefix_caching:
                chunk.state_saves = bm.state.plan_saves(req.seq_id, chunk.start, chunk.start + n, bm.block_size,
                                                        chunk.is_decode)
        (out.decodes if chunk.is_decode else out.prefills).append(chunk)
        self._scheduled[req.seq_id] = (chunk, copies)
        self._budget -= n
        if req.pooling is not None:
            self._pooling_budget -= n
        elif not chunk.is_decode:  # a generation's prompt: this step's pooling share is given to it
            self._pooling_budget = 0

    # ------------------------------------------------------------------------------ preemption

    def _pick_victim(self, needy: Request, strictly_lower: bool) -> Request | None:
        return victims.lowest(self.running, needy, strictly_lower, self.fair)

    def _rank_view(self, rank: int, by_blocks: bool) -> RankView:
        assert self.fair is not None
        return victims.rank_view(self.fair, rank, self.waiting, self.running, self.block_manager,
                                 self.max_num_seqs, by_blocks)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        scheduled = self._scheduled.pop(req.seq_id, None)
        if scheduled is not None:  # it was given a chunk earlier in this step: take it back
            chunk, copies = scheduled
            (out.decodes if chunk.is_decode else out.prefills).remove(chunk)
            for pair in copies:
                out.block_copies.remove(pair)
            self._budget += chunk.num_tokens
            if req.pooling is not None:
                self._pooling_budget += chunk.num_tokens
            if chunk.drafts:  # (their room too: a swapped-out table holds its tokens only)
                self.block_manager.truncate(req.seq_id, chunk.start + 1)
        mode = "recompute"
        if self.policy.preemption_mode == "swap":
            pairs = self.block_manager.swap_out(req.seq_id)
            if pairs is not None:
                mode = "swap"
                # NOTE: a copy-on-write taken back above never ran: its destination holds
                # nothing yet, so that block's contents come from the source
                cow = {dst: src for src, dst in scheduled[1]} if scheduled else {}
                out.swap_out += [(cow.get(device, device), host) for device, host in pairs]
                req.swapped = True
        if mode == "recompute":
            self.block_manager.free(req.seq_id)
            req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.accounting.on_preempt(req, mode)
        self.waiting.insert(0, req)  # (the order is by key; the front is where it usually sorts)
        out.preempted.append(req)

    # ---------------------------------------------------------------------- timeouts, shedding

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        for req in [*self.running, *self.waiting]:
            if kind := expired(req, now):
                req.timeout_kind = kind
                self.accounting.on_timeout(req, kind)
                self.finish(req, RequestStatus.FINISHED_TIMEOUT)
                out.timed_out.append(req)

    def _shed(self, level: int, out: SchedulerOutput) -> None:
        """Apply the shedder's level to the sheddable classes (level 1 acts at the door)."""
        shed = self.policy.shedding
        if level >= 2:
            for victim in victims.over_shed_cap(self.running, self.policy.classes, shed.max_running):
                self._preempt(victim, out)
        if (level >= 3) != (self._applied_level >= 3):
            cap = shed.max_tokens if level >= 3 else None
            for req in [*self.running, *self.waiting]:
                if req.priority_class.sheddable:
                    req.token_cap = cap
        self._applied_level = level

    # -------------------------------------------------------------------- results, snapshots

    def update(self, out: SchedulerOutput, sampled: dict[int, int], accepted: dict[int, list[int]] | None = None) -> None:
        """Record a finished step: computed counts and the token each request sampled, after the
        drafts it verified and `accepted` (a rejected draft's room is given back). Pending forks
        (n > 1) share their root's blocks (copy-on-write later) from its first token, each with its own."""
        now = self.clock()
        bm = self.block_manager
        block_size = bm.block_size
        acct = self.accounting
        on_token = acct.on_token  # (bound once: called per token)
        for chunks in (out.prefills, out.decodes):  # out.chunks' order, without the copy
            for chunk in chunks:
                req = chunk.request
                drafts = accepted.get(req.seq_id, []) if chunk.drafts and accepted else []
                if chunk.drafts:  # the last token and the accepted drafts are computed, not the rest
                    req.num_computed_tokens += 1 + len(drafts)
                    bm.truncate(req.seq_id, req.num_computed_tokens)
                    req.output_ids += drafts  # (before commit, which hashes them)
                else:
                    req.num_computed_tokens += chunk.num_tokens
                if req.num_computed_tokens // block_size != chunk.start // block_size:  # a block filled up
                    bm.commit(req.seq_id, req.num_computed_tokens, req.token_ids)
                if chunk.start < len(req.prompt_ids):
                    acct.on_prefill(req, chunk.start)
                for _ in drafts:
                    on_token(req, now)
                token = sampled.get(req.seq_id)
                if token is None:
                    continue
                if req.forks and not req.output_ids:  # req.forks_pending, without a list per call
                    self._start_forks(req, sampled, now)
                req.output_ids.append(token)
                on_token(req, now)
        if self.fair is not None:  # (fcfs counts nothing)
            self.fair.charge_step(out)

    def _start_forks(self, root: Request, sampled: dict[int, int], now: float) -> None:
        """At the root's first token each fork takes its blocks, class, deadlines and timeline."""
        for fork in root.forks:
            self.block_manager.fork(root.seq_id, fork.seq_id)
            fork.priority_class, fork.rank, fork.timeouts = root.priority_class, root.rank, root.timeouts
            fork.arrival_time, fork.first_scheduled_time = root.arrival_time, root.first_scheduled_time
            fork.token_cap = root.token_cap
            fork.status = RequestStatus.RUNNING
            fork.num_computed_tokens = root.num_computed_tokens
            fork.output_ids.append(sampled[fork.seq_id])
            self.accounting.on_token(fork, now)
            self.running.append(fork)
            if self.fair is not None:
                self.fair.enter(fork.tenant, fork.tenant_weight)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stopped, length, aborted, timed out) and return its blocks at once."""
        if req.status.finished:
            return  # an abort racing a finish: already freed
        self.pause(req, False)  # (a paused one leaves the count)
        bm = self.block_manager
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            bm.retain(req.seq_id, req.session, req.tenant, req.token_ids)  # (its session's next turn: kv/retention.py)
            bm.free(req.seq_id)
        elif req in self.waiting:
            self.waiting.remove(req)
            if req.swapped:
                bm.free_swapped(req.seq_id)
                req.swapped = False
        else:  # never queued here: a fork that never started (its group ended before the prompt did)
            req.status = status
            return
        if self.fair is not None:
            self.fair.leave(req.tenant)
        req.status = status
        self.accounting.on_finish(req, status, self.clock())

    def requests_snapshot(self, limit: int) -> list[RequestSnapshot]:
        """Up to `limit` unfinished requests, running ones first."""
        return requests_snapshot([*self.running, *self.waiting][:limit], self.clock())

    def snapshot(self) -> list[ClassSnapshot]:
        """Every class's state now, most important first (O(waiting + running))."""
        return self.accounting.snapshot(self.clock(), self.waiting, self.running, self.block_manager.num_held_blocks)

    def tenants_snapshot(self) -> tuple[TenantSnapshot, ...]:
        """Every tenant's fair share now (none under fcfs)."""
        return () if self.fair is None else self.fair.snapshot(self.waiting, self.running)
