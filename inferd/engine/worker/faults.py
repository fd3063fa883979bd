"""Fault injection, for tests only: off and inert unless `INFERD_FAULTS` is set (or a test sets
`LLMEngine.faults`). The engine asks it at a few fixed points; with it unset, each point is one
`is None` check.

    INFERD_FAULTS='{"forward_failures": 1}'        the next forward raises
    INFERD_FAULTS='{"oom_failures": 1}'            the next forward raises an out-of-memory error
    INFERD_FAULTS='{"oom_above_tokens": 16}'       every forward of more than 16 tokens does
    INFERD_FAULTS='{"fail_marker": "XYZZY"}'       a request whose prompt contains it fails alone
    INFERD_FAULTS='{"stall_steps": 1, "stall_seconds": 3}'   the next step sleeps 3 s first
    INFERD_FAULTS='{"corrupt_weights": true}'      the next step corrupts a weight in place
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, fields

import torch

from inferd.settings import environment

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """An exception the fault injector raised on purpose."""


class InjectedOutOfMemory(torch.OutOfMemoryError):
    """An out-of-memory error the fault injector raised on purpose (as CUDA's allocator would)."""


@dataclass
class FaultInjector:
    forward_failures: int = 0  # the next N forwards raise InjectedFault
    oom_failures: int = 0  # the next N forwards raise an out-of-memory error
    oom_above_tokens: int | None = None  # every forward of more tokens raises out-of-memory
    fail_marker: str | None = None  # requests whose prompt text contains it fail in output processing
    stall_steps: int = 0  # the next N steps sleep `stall_seconds` before their forward
    stall_seconds: float = 0.0
    corrupt_weights: bool = False  # the next step flips the sign of the final norm's weight
    doomed: set[int] = field(default_factory=set)  # groups whose prompt had the fail marker

    @classmethod
    def from_environ(cls) -> FaultInjector | None:
        spec = environment.FAULTS.get()
        if not spec:
            return None
        known = {f.name for f in fields(cls)} - {"doomed"}
        values = json.loads(spec)
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"INFERD_FAULTS: unknown faults {sorted(unknown)}; known: {sorted(known)}")
        injector = cls(**values)
        log.warning("fault injection is on (INFERD_FAULTS=%s): for tests only", spec)
        return injector

    def before_step(self, model: object) -> None:
        if self.stall_steps > 0:
            self.stall_steps -= 1
            time.sleep(self.stall_seconds)
        if self.corrupt_weights:
            self.corrupt_weights = False
            flip_final_norm(model)

    def before_forward(self, num_tokens: int) -> None:
        if self.forward_failures > 0:
            self.forward_failures -= 1
            raise InjectedFault("injected forward failure")
        if self.oom_failures > 0:
            self.oom_failures -= 1
            raise InjectedOutOfMemory("injected out of memory")
        if self.oom_above_tokens is not None and num_tokens > self.oom_above_tokens:
            raise InjectedOutOfMemory(f"injected out of memory: {num_tokens} tokens > {self.oom_above_tokens}")

    def on_add(self, group_id: int, prompt_text: str) -> None:
        if self.fail_marker is not None and self.fail_marker in prompt_text:
            self.doomed.add(group_id)

    def check_output(self, group_id: int) -> None:
        """Raise for a request marked to fail in its output processing."""
        if group_id in self.doomed:
            self.doomed.discard(group_id)
            raise InjectedFault(f"injected failure of request {group_id}")


def flip_final_norm(model: object) -> None:
    """Corrupt the model in place, reversibly (flip again to undo): every logit changes sign."""
    weight: torch.Tensor = model.norm.weight  # type: ignore[attr-defined]
    weight.neg_()
