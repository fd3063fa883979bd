"""`inferd bench`'s options as one frozen config: checked once (`check`), expanded into the sweep's
points, and written into the JSON result without its secret."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


from inferd.client.bench_conversation import (
    DEFAULT_ANSWER_TOKENS, DEFAULT_SYSTEM_TOKENS, DEFAULT_TOOL_TOKENS, DEFAULT_TURNS, ConversationShape,
)
from inferd.client.bench_retry import RETRY_BASE, RetryPolicy

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DEFAULT_NUM_REQUESTS = 100
JSON_VERSION = 1
WORKLOADS = ("requests", "conversation", "agent")
CONVERSATION_KEYS = ("workload", "turns", "system_tokens", "tool_tokens", "answer_tokens")
SESSION_WORKLOADS = ("conversation", "agent")  # multi-turn: chat, closed loop, their own requests

@dataclass(frozen=True)
class Point:
    """One measured run: a closed loop at `concurrency`, or an open loop at `rate` (capped at
    `concurrency` requests in flight when that is set)."""

    label: str
    concurrency: int | None
    rate: float | None


@dataclass(frozen=True)
class BenchConfig:
    url: str
    endpoint: str = "completions"
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    concurrency: int | None = None
    rates: tuple[float, ...] = ()
    sweep: tuple[int, ...] = ()
    burstiness: float = 1.0
    duration: float | None = None
    num_requests: int | None = None
    warmup: int = 0
    input_len: int = 32
    input_dist: str = "fixed"
    output_len: int = 128
    output_dist: str = "fixed"
    spread: float = 0.5
    dataset: str | None = None
    ignore_eos: bool = False
    priority_mix: str | None = None
    seed: int = 0
    slo: str | None = None
    json_path: str | None = None
    plot_path: str | None = None
    timeout: float = 600.0
    retries: int = 0
    retry_base: float = RETRY_BASE
    workload: str = "requests"
    turns: int = DEFAULT_TURNS
    system_tokens: int = DEFAULT_SYSTEM_TOKENS
    tool_tokens: tuple[int, int] = DEFAULT_TOOL_TOKENS
    answer_tokens: tuple[int, int] = DEFAULT_ANSWER_TOKENS

    @property
    def conversation(self) -> ConversationShape | None:
        """The conversation workload's shape; None for `requests`."""
        if self.workload != "conversation":
            return None
        return ConversationShape(self.turns, self.system_tokens, self.tool_tokens, self.answer_tokens)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(self.retries, self.retry_base)

    def points(self) -> list[Point]:
        if self.rates and self.sweep:
            raise ValueError("--sweep lists concurrencies; to sweep rates give --rate a list (--rate 1,2,4)")
        if self.rates:
            return [Point(f"rate={r:g}", self.concurrency, r) for r in self.rates]
        if self.sweep:
            return [Point(f"concurrency={c}", c, None) for c in self.sweep]
        c = self.concurrency or 1
        return [Point(f"concurrency={c}", c, None)]

    def check(self) -> None:
        """ValueError naming the option for anything out of range."""
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint is one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.duration is not None and self.num_requests is not None:
            raise ValueError("give --duration or --num-requests, not both")
        if self.duration is not None and not self.duration > 0:
            raise ValueError("--duration must be > 0 seconds")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be ≥ 1")
        if any(c < 1 for c in (*self.sweep, *(() if self.concurrency is None else (self.concurrency,)))):
            raise ValueError("concurrencies must be ≥ 1")
        if any(not r > 0 for r in self.rates):
            raise ValueError("--rate must be > 0 requests/s")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if self.warmup < 0:
            raise ValueError("--warmup must be ≥ 0")
        if self.spread < 0 or (self.spread >= 1 and "uniform" in (self.input_dist, self.output_dist)):
            raise ValueError("--spread must be ≥ 0 (and < 1 with a uniform distribution)")
        self.retry.check()
        self._check_workload()

    def _check_workload(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload is one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.workload not in SESSION_WORKLOADS:
            return
        if self.rates:
            raise ValueError(f"--workload {self.workload} is a closed loop: give --concurrency or --sweep, not --rate")
        for option, value in (("--dataset", self.dataset), ("--priority-mix", self.priority_mix)):
            if value:
                raise ValueError(f"--workload {self.workload} writes its own requests: drop {option}")
        if (shape := self.conversation) is not None:
            shape.check()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("api_key")  # a secret: never written
        d["rates"], d["sweep"] = list(self.rates), list(self.sweep)
        if self.conversation is None:
            # the requests workload's JSON as it always was; the agent's shape is bench_agent's own:
            # only its name is kept
            for key in CONVERSATION_KEYS:
                if key != "workload" or self.workload == "requests":
                    d.pop(key)
        else:
            d["tool_tokens"], d["answer_tokens"] = list(self.tool_tokens), list(self.answer_tokens)
        return d


def parse_list(text: str | None, kind: type, option: str) -> tuple[Any, ...]:
    """`1,4,16` → (1, 4, 16) as `kind`; () for None or empty."""
    if not text:
        return ()
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{option} takes a comma-separated list of numbers, got {text!r}") from None
