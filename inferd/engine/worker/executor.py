"""Runs a scheduled step on the model runner and survives what it can.

    out of memory in a forward -> the step's chunks split in two halves, most important first,
                                  each run on its own (recursively): a smaller step, retried
                                  before anything fails; a single chunk that still does not
                                  fit fails alone ("out_of_memory")
    any other error in the forward or the sampler -> StepFailed: every request of the step
                                  fails with a retryable error, and the engine goes on

The engine also halves the scheduler's token budget after an out-of-memory step (see
LLMEngine), so the next steps are smaller from the start.
"""

from __future__ import annotations

import logging

import torch

from inferd.engine.worker.faults import FaultInjector
from inferd.engine.sched.request import Request
from inferd.engine.worker.runner import ModelRunner, StepResult
from inferd.engine.sched.plan import ScheduledChunk, SchedulerOutput
from inferd.model.sampler import SamplerOutput

log = logging.getLogger(__name__)


class StepFailed(Exception):
    """The step's forward failed; every request in it must fail (retryable)."""


class StepExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.faults: FaultInjector | None = None  # tests only
        self.out_of_memory_events = 0  # in the last run() call
        self.no_room: list[Request] = []  # in the last run(): chunks that did not fit even alone

    def run(self, plan: SchedulerOutput) -> StepResult:
        self.out_of_memory_events = 0
        self.no_room = []
        try:
            self.runner.apply_block_ops(plan)
            return self._run(plan.prefills, plan.decodes)
        except Exception as e:  # noqa: BLE001 - a failed forward fails its step, not the engine
            log.exception("the forward of a step failed; failing its %d requests", len(plan.chunks))
            raise StepFailed(f"{type(e).__name__}: {e}") from e

    def _run(self, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk]) -> StepResult:
        try:
            if self.faults is not None:
                self.faults.before_forward(sum(c.num_tokens for c in prefills + decodes))
            return self.runner.run(prefills, decodes)
        except (torch.OutOfMemoryError, MemoryError):  # a device or a host allocation failed
            self.out_of_memory_events += 1
            chunks = prefills + decodes
            if len(chunks) == 1:
                log.warning("out of memory on a single chunk of %d tokens: failing its request", chunks[0].num_tokens)
                self.no_room.append(chunks[0].request)
                return StepResult([], SamplerOutput([], None, None))
            ordered = sorted(chunks, key=lambda c: c.request.rank)  # the lowest class in the later half
            half = len(ordered) // 2
            log.warning("out of memory on a step of %d chunks: running it in two halves", len(chunks))
            return StepResult.concat([self._run(*_by_kind(ordered[:half])), self._run(*_by_kind(ordered[half:]))])


def _by_kind(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
    """(prefills, decodes), split as the scheduler splits them (ScheduledChunk.is_decode)."""
    return [c for c in chunks if not c.is_decode], [c for c in chunks if c.is_decode]
