"""Drift statistics: how today's traffic differs from the traffic the server started with.

Each finished generation request (the request file's records, request_file.py) becomes one
`Observation`. The first `baseline_requests` of them form the baseline; every later one goes
into the current window, the last `window_seconds` of them. Per feature both are histograms:

    prompt_tokens, completion_tokens   powers of two: bin "0", "1", "2" (2-3), "4" (4-7), ...
    finish_reason                      each choice's reason
    refusal                            each choice: "refusal" (a refusal phrase in its text) or "answer"
    language                           the prompt's letters by script: latin, cjk, cyrillic, arabic, other

and the population stability index compares them: PSI = Σ (p_cur − p_base) · ln(p_cur / p_base),
over the bins, each share at least EPSILON. Rule of thumb: < 0.1 steady, 0.1–0.2 moving, > 0.2 shifted.

    time ─────────────────────────────────────────────────────────────>
    [ baseline: the first N requests ] ... [b][b][b][b][b][b][b][b][b][b] now
                                           └── window: BUCKETS buckets ──┘

NOTE: the window keeps per-bin counts per time bucket and their running sum: a request adds to
one bucket, a bucket leaves the sum once when it ages out; a scrape reads the sums (O(bins)).
Everything runs on the event loop.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from inferd.api.telemetry.status_wire import DriftStatus

FEATURES = ("prompt_tokens", "completion_tokens", "finish_reason", "refusal", "language")
SCRIPTS = ("latin", "cjk", "cyrillic", "arabic", "other")
EPSILON = 1e-4  # the share an empty bin counts as
BUCKETS = 10  # time buckets per window
LANGUAGE_CHARS = 4096  # of a prompt, looked at for its script mix
_MAX_BIT = 24  # lengths from 2^23 up share the last bin

_LETTER = re.compile(r"[^\W\d_]")
_SCRIPT_RES = {
    "latin": re.compile(r"[A-Za-z\u00c0-\u024f\u1e00-\u1eff]"),
    "cjk": re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]"),
    "cyrillic": re.compile(r"[\u0400-\u052f]"),
    "arabic": re.compile(r"[\u0600-\u06ff\u0750-\u077f\u08a0-\u08ff\ufb50-\ufdff\ufe70-\ufeff]"),
}


def length_bin(n: int) -> str:
    """The power-of-two bin of a length, named by its lower bound: 0, 1, 2, 4, 8, ..."""
    bit = min(max(n, 0).bit_length(), _MAX_BIT)
    return str(1 << (bit - 1)) if bit else "0"


def script_shares(text: str) -> dict[str, float]:
    """The share of each script among the letters of (the start of) `text`; {} without letters."""
    sample = text[:LANGUAGE_CHARS]
    letters = len(_LETTER.findall(sample))
    if not letters:
        return {}
    counts = {name: len(pattern.findall(sample)) for name, pattern in _SCRIPT_RES.items()}
    counts["other"] = max(0, letters - sum(counts.values()))
    return {name: n / letters for name, n in counts.items() if n}


def psi(base: Mapping[str, float], cur: Mapping[str, float], epsilon: float = EPSILON) -> float | None:
    """The population stability index of `cur` against `base` (counts per bin); None if either is empty."""
    base_total, cur_total = sum(base.values()), sum(cur.values())
    if base_total <= 0 or cur_total <= 0:
        return None
    total = 0.0
    for key in base.keys() | cur.keys():
        p_base = max(base.get(key, 0.0) / base_total, epsilon)
        p_cur = max(cur.get(key, 0.0) / cur_total, epsilon)
        total += (p_cur - p_base) * math.log(p_cur / p_base)
    return total


class RefusalMatcher:
    """Whether a text contains one of the phrases, case-insensitively (’ read as ')."""

    def __init__(self, phrases: Iterable[str]) -> None:
        alternatives = "|".join(re.escape(p.replace("\u2019", "'")) for p in phrases if p)
        self._pattern = re.compile(alternatives, re.IGNORECASE) if alternatives else None

    def __call__(self, text: str) -> bool:
        return self._pattern is not None and self._pattern.search(text.replace("\u2019", "'")) is not None


@dataclass(frozen=True)
class Observation:
    """One finished request, as drift sees it."""

    prompt_tokens: int
    completion_tokens: int  # all its choices'
    finish_reasons: tuple[str, ...]  # one per choice
    refusals: int  # its choices with a refusal phrase
    languages: Mapping[str, float]  # script_shares of its prompt

    def histograms(self) -> dict[str, Counter[str]]:
        choices = max(1, len(self.finish_reasons))
        return {
            "prompt_tokens": Counter({length_bin(self.prompt_tokens): 1}),
            "completion_tokens": Counter({length_bin(round(self.completion_tokens / choices)): 1}),
            "finish_reason": Counter(self.finish_reasons),
            "refusal": Counter({"refusal": self.refusals, "answer": choices - self.refusals}),
            "language": Counter(self.languages),
        }

    def sums(self) -> Counter[str]:
        return Counter(requests=1, choices=max(1, len(self.finish_reasons)), refusals=self.refusals,
                       prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)


@dataclass
class _Counts:
    """Histograms per feature, and plain sums (requests, choices, tokens, refusals)."""

    features: dict[str, Counter[str]] = field(default_factory=lambda: {f: Counter() for f in FEATURES})
    sums: Counter[str] = field(default_factory=Counter)

    def add(self, other: _Counts | Observation, sign: int = 1) -> None:
        hists = other.histograms() if isinstance(other, Observation) else other.features
        sums = other.sums() if isinstance(other, Observation) else other.sums
        for feature, counts in hists.items():
            _accumulate(self.features[feature], counts, sign)
        _accumulate(self.sums, sums, sign)


def _accumulate(into: Counter[str], counts: Mapping[str, float], sign: int) -> None:
    for key, n in counts.items():
        value = into[key] + sign * n
        if abs(value) > 1e-9:
            into[key] = value
        else:
            del into[key]  # (fractional language shares do not always cancel exactly)


class DriftMonitor:
    """The baseline and the sliding window; `observe` per request, `report` per scrape."""

    def __init__(self, window_seconds: float, baseline_requests: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_seconds = window_seconds
        self.baseline_requests = baseline_requests
        self._bucket_seconds = window_seconds / BUCKETS
        self._clock = clock
        self.baseline = _Counts()
        self.window = _Counts()  # the sum of the buckets
        self._buckets: deque[tuple[int, _Counts]] = deque()  # (bucket number, counts), oldest first

    @property
    def baseline_complete(self) -> bool:
        return self.baseline.sums["requests"] >= self.baseline_requests

    def observe(self, obs: Observation) -> None:
        if not self.baseline_complete:
            self.baseline.add(obs)
            return
        number = self._expire()
        if not self._buckets or self._buckets[-1][0] != number:
            self._buckets.append((number, _Counts()))
        self._buckets[-1][1].add(obs)
        self.window.add(obs)

    def _expire(self) -> int:
        """Drop the buckets older than the window; the current bucket's number."""
        number = math.floor(self._clock() / self._bucket_seconds)
        while self._buckets and self._buckets[0][0] <= number - BUCKETS:
            self.window.add(self._buckets.popleft()[1], -1)
        return number

    def report(self) -> DriftStatus:
        self._expire()
        sums, features = self.window.sums, self.window.features
        requests, choices = sums["requests"], sums["choices"]
        psis = {f: psi(self.baseline.features[f], features[f]) for f in FEATURES}
        languages = features["language"]
        return DriftStatus(
            baseline_requests=int(self.baseline.sums["requests"]), baseline_complete=self.baseline_complete,
            window_seconds=self.window_seconds, window_requests=int(requests),
            psi={f: round(v, 6) for f, v in psis.items() if v is not None},
            mean_prompt_tokens=sums["prompt_tokens"] / requests if requests else None,
            mean_completion_tokens=sums["completion_tokens"] / choices if choices else None,
            refusal_rate=sums["refusals"] / choices if choices else None,
            languages=_shares(languages), finish_reasons=_shares(features["finish_reason"]),
        )


def _shares(counts: Mapping[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: round(v / total, 6) for k, v in sorted(counts.items())} if total > 0 else {}
