"""`inferd plan`: how many boxes carry a target load, from one box's measured concurrency sweep.

    bench --json files ─load_points()─> SweepPoint per run: closed loop (a concurrency) or open loop (a rate)
                       ─make_plan()───> Plan: from the closed loops, the chosen concurrency, the arithmetic,
                                        replicas, KEDA target; each open loop checked against the SLO
                       ─render() / to_json()   (plan_render.py)

The arithmetic (Little's law, L = λW: requests in flight = arrival rate × mean time in system):

    c   the highest measured concurrency whose percentiles met every SLO, with no failed request
    W   the mean e2e latency measured at c
    L   = λ × W                   requests in flight across the fleet at the target rate λ
    L'  = L × (1 + headroom/100)  the same for a rate that much higher (spikes, forecast error)
    N   = ceil(L' / c)            boxes, each holding at most c requests in flight
    replicas = N + spare          N+1: one box may fail or be drained for a rollout

NOTE: W is the mean, not the p50 or p99. Little's law relates averages: with right-skewed
latencies the p50 undercounts the requests in flight and the p99 overcounts them. The
percentiles pick c (the SLO is a statement about them); the mean converts the rate into load.

The KEDA target is in requests in flight per replica (inferd_requests_running +
inferd_requests_waiting), c / (1 + headroom/100): the HPA behind KEDA asks for
ceil(total in flight / target) replicas, which at λ is ceil(λW(1 + h)/c) = N, the plan's own
formula. The metric is proportional to load, so it scales in as well as out; queued tokens are
~0 while a box keeps up and only say that it no longer does (docs/scaling.md).

A closed loop holds exactly c in flight; Poisson arrivals fluctuate around their mean, so the plan
says to check one box at λ / N in an open loop (`inferd bench --rate`), and judges such runs when
they are among the files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from inferd.client.bench_metrics import PERCENTILES, parse_slo
from inferd.client.bench_report import load_result

JSON_VERSION = 1
# all pods together, averaged over 2 minutes like deploy/k8s's triggers (add their namespace and job labels)
KEDA_QUERY = "sum(avg_over_time(inferd_requests_running[2m])) + sum(avg_over_time(inferd_requests_waiting[2m]))"
SLO_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "E2E"}

__all__ = ["Plan", "PlanError", "PlanInput", "SweepPoint", "load_points", "make_plan", "plan_files"]


class PlanError(Exception):
    """Inputs a plan cannot be made from; the message is one clear line."""


@dataclass(frozen=True)
class PlanInput:
    qps: float  # the target arrival rate λ, requests/s
    slo: dict[str, float]  # seconds, keys ttft, tpot, e2e (at least one)
    percentile: int = 99  # which measured percentile must meet the SLO
    headroom: float = 0.0  # percent more load than qps to plan for
    spare: int = 1  # boxes beyond N (N+1)

    def check(self) -> None:
        if not self.qps > 0:
            raise PlanError(f"--qps must be > 0 requests/s, got {self.qps:g}")
        if not self.slo:
            raise PlanError("give a latency SLO, e.g. --slo ttft=1 or --slo ttft=1,e2e=10 (seconds)")
        if self.percentile not in PERCENTILES:
            raise PlanError(f"--percentile is one of {', '.join(map(str, PERCENTILES))}, got {self.percentile}")
        if not 0 <= self.headroom < 1000:
            raise PlanError(f"--headroom is a percentage in [0, 1000), got {self.headroom:g}")
        if self.spare < 0:
            raise PlanError(f"--spare must be ≥ 0, got {self.spare}")


@dataclass(frozen=True)
class SweepPoint:
    """One run of `inferd bench` and what it measured: a closed loop of `concurrency` requests in
    flight (a point of the sweep), or an open loop of `rate` requests/s (a check of a plan)."""

    file: str  # the file's name
    label: str  # the run's label in it, "concurrency=16"
    concurrency: int | None
    completed: int
    failed: int
    request_throughput: float  # completed requests/s
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    latency: dict[str, dict[str, float | None]]  # ttft, tpot, e2e -> mean, p50, ..., p99, max (seconds)
    rate: float | None = None  # open loop: the arrival rate, requests/s

    def miss(self, slo: dict[str, float], percentile: int) -> str | None:
        """Why this run missed the SLO, or None when it met it."""
        if self.failed:
            return f"{self.failed} of {self.completed + self.failed} requests failed"
        if not self.completed:
            return "no request completed"
        stat = f"p{percentile}"
        for key, limit in slo.items():
            value = self.latency[key].get(stat)
            if value is None:
                return f"no {SLO_NAMES[key]} measured"
            if value > limit:
                return f"{SLO_NAMES[key]} {stat} {value:.3g} s > {limit:g} s"
        return None

    @property
    def source(self) -> str:
        return f"{self.file}: {self.label}"


@dataclass(frozen=True)
class Plan:
    inputs: PlanInput
    points: list[tuple[SweepPoint, str | None]]  # closed-loop runs by concurrency, with why each missed (None: met)
    chosen: SweepPoint
    in_flight: float  # L = λW
    in_flight_headroom: float  # L' = L × (1 + h)
    boxes: int  # N = ceil(L' / c)
    replicas: int  # N + spare
    keda_target: float  # in-flight requests per replica
    open_loop: list[tuple[SweepPoint, str | None]] = field(default_factory=list)  # --rate runs, the same verdicts
    notes: list[str] = field(default_factory=list)

    @property
    def concurrency(self) -> int:
        """c: the chosen per-box concurrency."""
        assert self.chosen.concurrency is not None
        return self.chosen.concurrency

    @property
    def verify_rate(self) -> float:
        """λ / N: what each box gets with the spares down, to check on one box in an open loop."""
        return self.inputs.qps / self.boxes

    @property
    def latency(self) -> float:
        """W: the mean e2e latency at the chosen concurrency."""
        value = self.chosen.latency["e2e"]["mean"]
        assert value is not None
        return value


# ------------------------------------------------------------------------------------ loading


def load_points(paths: Sequence[Path | str]) -> list[SweepPoint]:
    """Every run of `inferd bench --json` files; PlanError for a file that is missing, empty, not
    JSON or not a bench result, or files of different models."""
    if not paths:
        raise PlanError("give one or more `inferd bench --json` files of one box")
    points: list[SweepPoint] = []
    models: dict[str, str] = {}
    for path in paths:
        result = _load(Path(path))
        models.setdefault(str((result.get("server") or {}).get("model")), Path(path).name)
        points += [_point(run, Path(path).name) for run in result["runs"]]
    if len(models) > 1:
        raise PlanError(f"the files measure different models ({', '.join(sorted(models))}): plan one box at a time")
    return points


def _load(path: Path) -> dict[str, Any]:
    if path.is_file() and path.stat().st_size == 0:
        raise PlanError(f"{path} is empty")
    try:
        result = load_result(path)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if result.get("tool") != "inferd bench":
        raise PlanError(f"{path} is not an `inferd bench --json` result (its \"tool\" is {result.get('tool')!r})")
    for run in result["runs"]:
        summary = run.get("summary") if isinstance(run, dict) else None
        if not isinstance(summary, dict) or not all(isinstance(summary.get(k), dict) for k in ("ttft", "e2e")):
            raise PlanError(f"{path} is not an `inferd bench --json` result (a run without latency summaries)")
    return result


def _point(run: dict[str, Any], file: str) -> SweepPoint:
    s = run["summary"]
    done = s.get("completed") or 0
    closed = run.get("rate") is None and isinstance(run.get("concurrency"), int)
    return SweepPoint(
        file=file, label=str(run.get("label", f"concurrency={run.get('concurrency')}")),
        concurrency=run.get("concurrency") if closed else None, rate=None if closed else run.get("rate"),
        completed=done, failed=s.get("failed") or 0, request_throughput=s.get("request_throughput") or 0.0,
        mean_prompt_tokens=s["input_tokens"] / done if done and s.get("input_tokens") else None,
        mean_output_tokens=s["output_tokens"] / done if done and s.get("output_tokens") else None,
        latency={key: dict(s.get(key) or {}) for key in SLO_NAMES},
    )


# ------------------------------------------------------------------------------------ planning


def make_plan(points: Sequence[SweepPoint], inputs: PlanInput) -> Plan:
    """The plan (see the module docstring) from the closed-loop runs; each open-loop run is checked
    against the SLO too. PlanError when there are no closed-loop runs or none met the SLO."""
    inputs.check()
    closed = sorted((p for p in points if p.concurrency is not None), key=lambda p: p.concurrency or 0)
    if not closed:
        raise PlanError(f"no closed-loop runs in {', '.join(sorted({p.file for p in points}))}: "
                        "measure with `inferd bench URL --sweep 1,4,16 --json FILE`")
    verdicts = [(p, p.miss(inputs.slo, inputs.percentile)) for p in closed]
    met = [p for p, why in verdicts if why is None]
    if not met:
        raise PlanError(f"no run met the SLO ({slo_text(inputs)}); lowest concurrency "
                        f"{verdicts[0][0].concurrency}: {verdicts[0][1]}. Measure lower concurrencies, "
                        "or serve on a faster box or a smaller model")
    # NOTE: of equal concurrencies (several files), the slowest: the plan should not rest on luck
    best = max(met, key=lambda p: (p.concurrency or 0, p.latency["e2e"]["mean"] or 0.0))
    c, w = best.concurrency, best.latency["e2e"]["mean"]
    assert c is not None and w is not None  # a closed loop that met the SLO completed requests
    factor = 1 + inputs.headroom / 100
    in_flight = inputs.qps * w
    boxes = _ceil(in_flight * factor / c)
    open_loop = [(p, p.miss(inputs.slo, inputs.percentile)) for p in points if p.concurrency is None]
    notes = _warnings(verdicts, c)
    # NOTE: 1 % over λ / N still counts: a rate typed with two decimals (2.22 for 20 / 9)
    if any(why is not None and (p.rate or 0) <= inputs.qps / boxes * 1.01 for p, why in open_loop):
        notes.append("an open loop at λ / N or less missed the SLO: Poisson arrivals need more margin than the "
                     "closed loop showed; add --headroom, or plan with a tighter SLO")
    return Plan(
        inputs=inputs, points=verdicts, chosen=best, in_flight=in_flight, in_flight_headroom=in_flight * factor,
        boxes=boxes, replicas=boxes + inputs.spare, keda_target=c / factor, open_loop=open_loop, notes=notes,
    )


def _ceil(x: float) -> int:
    # NOTE: rounded first, so that float noise (2.0000000000000004) does not cost a box
    return max(1, math.ceil(round(x, 9)))


def _warnings(verdicts: list[tuple[SweepPoint, str | None]], c: int) -> list[str]:
    """Notes on the sweep around the chosen concurrency c."""
    notes = []
    measured = [(p.concurrency or 0, why) for p, why in verdicts]  # closed loops: never 0
    below = sorted({k for k, why in measured if why is not None and k <= c})
    if below:
        notes.append(f"concurrency {', '.join(map(str, below))} missed the SLO though {c} met it: "
                     "the percentiles are noisy, rerun with more requests per point")
    if c == max(k for k, _ in measured):
        notes.append(f"the highest concurrency measured ({c}) met the SLO: a box may hold more; "
                     "sweep higher to find its limit (fewer boxes)")
    return notes


def slo_text(inputs: PlanInput) -> str:
    return ", ".join(f"{SLO_NAMES[k]} p{inputs.percentile} ≤ {v:g} s" for k, v in inputs.slo.items())


def plan_files(paths: Sequence[Path | str], qps: float, slo: str | None, percentile: int = 99,
               headroom: float = 0.0, spare: int = 1) -> Plan:
    """load_points + make_plan, for the CLI; PlanError with one line for any bad input."""
    try:
        inputs = PlanInput(qps=qps, slo=parse_slo(slo), percentile=percentile, headroom=headroom, spare=spare)
    except ValueError as e:
        raise PlanError(str(e)) from None
    inputs.check()  # before the files: a bad option is named even when a file is bad too
    return make_plan(load_points(paths), inputs)
