"""First-come-first-served continuous batching with chunked prefill (no torch here).

Each `schedule()` gives every running request the tokens it has not computed yet (one for a
decoding request, a chunk for one still in prefill) within the step's token budget, then
admits waiting requests while blocks, `max_num_seqs` and the budget allow. When blocks run
short, the most recently admitted request is preempted by recomputation: its blocks are freed
and it waits at the front of the queue to re-prefill prompt + output later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from inferd.engine.block_manager import BlockManager
from inferd.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # position of the first new token
    num_tokens: int  # new tokens computed this step
    block_table: list[int]  # the request's blocks (read-only for the runner)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token, so a next token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledChunk] = field(default_factory=list)  # chunks of more than one token
    decodes: list[ScheduledChunk] = field(default_factory=list)  # one token each
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decodes)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since start, for metrics

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # running requests first, oldest first, so a preemption hits the newest
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # append is check-then-act in one call: None (nothing changed) when blocks are short
            while (copies := bm.append(req.request_id, n)) is None:
                victim = running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if copies is None:
                break  # req itself was preempted: nothing after it is left
            if copies:
                out.block_copies += copies
            self._add_chunk(out, req, n)
            budget -= n
            i += 1

        # then admit waiting requests while blocks, sequences and the budget allow
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if len(self.running) + 1 + len(req.forks_pending) > self.max_num_seqs:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if bm.allocate(req.request_id, n) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(out, req, n)
            budget -= n
        return out

    def _add_chunk(self, out: SchedulerOutput, req: Request, n: int) -> None:
        chunk = ScheduledChunk(req, req.num_computed_tokens, n, self.block_manager.block_table(req.request_id))
        (out.decodes if n == 1 else out.prefills).append(chunk)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> None:
        """Record a finished step: computed counts and the sampled token of each request.

        A request with pending forks (n > 1) hands its blocks to them at its first token: each
        fork shares the prompt's blocks (copy-on-write later) and starts with its own token.
        """
        for chunks in (out.prefills, out.decodes):  # out.chunks' order, without the copy
            for chunk in chunks:
                req = chunk.request
                req.num_computed_tokens += chunk.num_tokens
                token = sampled.get(req.request_id)
                if token is None:
                    continue
                if req.forks and not req.output_ids:  # req.forks_pending, without a list per call
                    for fork in req.forks:
                        self.block_manager.fork(req.request_id, fork.request_id)
                        fork.num_computed_tokens = req.num_computed_tokens
                        fork.output_ids.append(sampled[fork.request_id])
                        fork.status = RequestStatus.RUNNING
                        self.running.append(fork)
                req.output_ids.append(token)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stopped, length or aborted) and return its blocks at once."""
        if req.status.finished:
            return  # an abort racing a finish: already freed
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.block_manager.free(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        # else: a fork that never started (its group was aborted before the prompt finished)
        req.status = status
