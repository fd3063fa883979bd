"""`inferd bench`'s metrics: one record per request, and pure functions over records.

The definitions are vLLM `bench serve`'s (vllm/benchmarks/serve.py), so numbers compare:

    send ──────── first token ──── token ── token ─── … ── last token ─── [DONE]
    |<─── TTFT ───>|<─ ITL ─>|<─ ITL ─>|            |<─ITL─>|
    |<──────────────────────────── e2e ───────────────────────>|
                   TPOT = (e2e − TTFT) / (output tokens − 1)

- TTFT: the request sent → the first chunk that carries a token.
- A retried request (--retries) counts from its first attempt's send: its TTFT and e2e include
  the failed attempts and the backoff between them, which is what its user waits.
- ITL: the gaps between consecutive token-bearing chunks, pooled over all requests (a chunk that
  carries several tokens is one gap, as in vLLM).
- TPOT: per request with more than one output token, (e2e − TTFT) / (output tokens − 1): the
  first token excluded.
- e2e: the request sent → its last token-bearing chunk, so TTFT + sum(ITL) = e2e.
- Throughputs: completed requests, and their prompt and output tokens, per second of the run.
- Goodput: completed requests that meet every given SLO, per second of the run; a request with one
  output token has TPOT 0 for the SLO (vLLM).
- Percentiles: linear interpolation between the closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SLO_KEYS = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 95, 99)
RETRY_CAUSES = ("connection", "429", "503", "cut")
# no answer at all, or the connection lost before the response's first SSE event
CONNECTION_ERRORS = frozenset({"connection_error", "connection_reset", "server_disconnected"})


@dataclass
class RequestRecord:
    """One request's outcome, all times in seconds. Written by the HTTP side, read here."""

    index: int
    priority: str | None = None  # the class sent in the request's `priority` field, if any
    send_time: float = 0.0  # since the run's start
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None  # send → last token-bearing chunk
    elapsed: float = 0.0  # send → the response read to its end, or the failure
    prompt_tokens: int | None = None  # the server's usage; None when it sent none
    output_tokens: int = 0
    token_source: str | None = None  # "usage" (the server's count) or "chunks" (counted here)
    chunks: int = 0  # token-bearing chunks seen
    status: int | None = None  # the HTTP status; None when no response came
    error_type: str | None = None
    error: str | None = None
    attempts: int = 1  # sends of this request: 1 + its retries
    retry_causes: list[str] = field(default_factory=list)  # each retried attempt's cause (RETRY_CAUSES)
    retry_wait: float = 0.0  # seconds slept between attempts (inside ttft, e2e and elapsed)
    retry_after: str | None = None  # the last answer's Retry-After header, as sent
    turn: int | None = None  # --workload conversation: the turn (1: the first) of its conversation
    conversation: int | None = None  # --workload conversation: the conversation's index
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None when not sent
    drafted_tokens: int | None = None  # speculative decoding's, where the server reports them (else None)
    accepted_tokens: int | None = None
    text: str = field(default="", repr=False)  # the answer's text as streamed (not written to JSON)

    @property
    def ok(self) -> bool:
        return self.error_type is None

    @property
    def tpot(self) -> float | None:
        """(e2e − TTFT) / (output tokens − 1); None unless it completed with two tokens or more."""
        if not self.ok or self.output_tokens < 2 or self.e2e is None or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def fail(self, error_type: str, message: str) -> None:
        if self.error_type is None:  # the first failure is the one that counts
            self.error_type, self.error = error_type, message

    def to_json(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "index": self.index, "priority": self.priority, "send_time": r(self.send_time), "ttft": r(self.ttft),
            "itl": [round(x, 6) for x in self.itl], "e2e": r(self.e2e), "elapsed": r(self.elapsed),
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "token_source": self.token_source, "chunks": self.chunks, "status": self.status,
            "error_type": self.error_type, "error": self.error,
            "attempts": self.attempts, "retry_causes": list(self.retry_causes), "retry_wait": r(self.retry_wait),
        } | ({} if self.turn is None else {"turn": self.turn, "conversation": self.conversation}) | {
            key: value for key in ("cached_tokens", "drafted_tokens", "accepted_tokens")
            if (value := getattr(self, key)) is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# ------------------------------------------------------------------------------------ stats


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linearly interpolated like numpy's default; None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile must be in [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 and max of `values` (all None when there are none)."""
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    out["max"] = max(values) if values else None
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=0.5,tpot=0.1` (seconds; keys ttft, tpot, e2e) → {"ttft": 0.5, "tpot": 0.1}."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo takes KEY=SECONDS pairs with KEY in {', '.join(SLO_KEYS)}, got {part.strip()!r}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo {key}: {value.strip()!r} is not a number of seconds") from None
        if not slo[key] > 0:
            raise ValueError(f"--slo {key} must be > 0 seconds, got {value.strip()}")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Completed and within every given SLO (TPOT counts as 0 for a one-token request, as vLLM)."""
    if not record.ok or record.ttft is None or record.e2e is None:
        return False
    measured = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2e": record.e2e}
    return all(measured[key] <= limit for key, limit in slo.items())


def goodput(records: Iterable[RequestRecord], slo: dict[str, float], duration: float) -> float:
    """Requests per second that completed within every SLO."""
    return sum(meets_slo(r, slo) for r in records) / duration if duration > 0 else 0.0


def run_duration(records: Sequence[RequestRecord]) -> float:
    """The span from the first send to the last end, for records without a measured run time."""
    if not records:
        return 0.0
    return max(r.send_time + r.elapsed for r in records) - min(r.send_time for r in records)


def errors(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Failed requests counted by type and by HTTP status ("-": no response), one message per type."""
    failed = [r for r in records if not r.ok]
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(str(r.error_type), r.error or "")
    return {
        "total": len(failed),
        "by_type": dict(Counter(str(r.error_type) for r in failed).most_common()),
        "by_status": dict(Counter("-" if r.status is None else str(r.status) for r in failed).most_common()),
        "examples": examples,
    }


def retry_cause(record: RequestRecord) -> str | None:
    """Why this failed attempt may be sent again ("connection", "429", "503", "cut"), or None.

    NOTE: a stream cut mid-way ("cut": its replica died) is sent again from the start, and the
    cut attempt's tokens are dropped with its record: only the last attempt's tokens and text
    are counted, so none is counted twice (the server did generate them twice)."""
    if record.ok:
        return None
    if record.error_type in CONNECTION_ERRORS:
        return "connection"
    if record.error_type == "incomplete_stream":
        return "cut"
    if record.status in (429, 503):
        return str(record.status)
    return None


def retries(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Retries (extra attempts) in total and by cause; requests retried, those that then
    succeeded, and those that failed after their last retry for a cause still retryable."""
    records = list(records)
    retried = [r for r in records if r.attempts > 1]
    exhausted = [r for r in retried if retry_cause(r) is not None]
    causes = Counter(c for r in records for c in r.retry_causes)
    gave_up = Counter(retry_cause(r) for r in exhausted)
    return {
        "total": sum(r.attempts - 1 for r in records),
        "by_cause": {c: causes[c] for c in RETRY_CAUSES},
        "requests_retried": len(retried),
        "succeeded_after_retry": sum(r.ok for r in retried),
        "exhausted": len(exhausted),
        "exhausted_by_cause": {c: gave_up[c] for c in RETRY_CAUSES},
        "wait_s": sum(r.retry_wait for r in records),
    }


def token_source(records: Iterable[RequestRecord]) -> str | None:
    sources = {r.token_source for r in records if r.ok}
    if not sources:
        return None
    return sources.pop() if len(sources) == 1 else "mixed"


def summarize(
    records: Sequence[RequestRecord], slo: dict[str, float] | None = None, duration: float | None = None,
    *, by_class: bool = True,
) -> dict[str, Any]:
    """The run's metrics (see the module docstring); `duration` defaults to the records' span.

    With `by_class`, requests that named a priority class also get a summary per class (over the
    same duration), under "classes".
    """
    if duration is None:
        duration = run_duration(records)
    done = [r for r in records if r.ok]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "request_throughput": per_s(len(done)),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "token_source": token_source(records),
        "ttft": stats([r.ttft for r in done if r.ttft is not None]),
        "tpot": stats([t for r in done if (t := r.tpot) is not None]),
        "itl": stats([x for r in done for x in r.itl]),
        "e2e": stats([r.e2e for r in done if r.e2e is not None]),
        "slo": dict(slo) if slo else None,
        "goodput": goodput(records, slo, duration) if slo else None,
        "good_requests": sum(meets_slo(r, slo) for r in records) if slo else None,
        "errors": errors(records),
        "retries": retries(records),
    }
    if by_class:
        classes = sorted({r.priority for r in records if r.priority is not None})
        if classes:
            summary["classes"] = {
                name: summarize([r for r in records if r.priority == name], slo, duration, by_class=False)
                for name in classes
            }
    return summary
