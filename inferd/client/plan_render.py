"""`inferd bench plan`'s output: the plan as rich tables (steps, the sweep, KEDA's trigger) or JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text


JSON_VERSION = 1
from inferd.client.plan import KEDA_QUERY, SLO_NAMES, Plan, SweepPoint, slo_text



def _n(x: float) -> str:
    return f"{x:.4g}"


def steps(plan: Plan) -> list[tuple[str, str]]:
    """The arithmetic, one (formula, why) pair per step."""
    i, c, w = plan.inputs, plan.concurrency, plan.latency
    lines = [
        (f"c  = {c}", "the highest concurrency that met the SLO"),
        (f"W  = {_n(w)} s", "mean E2E at c: Little's law relates means"),
        (f"L  = λ × W = {_n(i.qps)} × {_n(w)} = {_n(plan.in_flight)}", "requests in flight at λ"),
    ]
    load = "L"
    if i.headroom:
        load = "L'"
        lines.append((f"L' = L × {_n(1 + i.headroom / 100)} = {_n(plan.in_flight_headroom)}",
                      f"{i.headroom:g} % headroom"))
    lines.append((f"N  = ceil({load} / c) = ceil({_n(plan.in_flight_headroom)} / {c}) = "
                  f"ceil({_n(plan.in_flight_headroom / c)}) = {plan.boxes}", f"boxes at {c} in flight each"))
    lines.append((f"replicas = N + {i.spare} = {plan.boxes} + {i.spare} = {plan.replicas}",
                  f"N+{i.spare}: {'one' if i.spare == 1 else i.spare} may fail or drain"))
    return lines


def keda(plan: Plan) -> list[tuple[str, str]]:
    """The KEDA prometheus trigger: (field, value and why) pairs."""
    i, c = plan.inputs, plan.concurrency
    return [
        ("query", KEDA_QUERY),
        ("threshold", f"{plan.keda_target:.4g} per replica = c / (1 + headroom) = {c} / {_n(1 + i.headroom / 100)}"),
        ("minReplicaCount", f"{1 + i.spare}   1 + spare"),
    ]


def render(plan: Plan) -> RenderableType:
    """The sweep with each run's verdict, the arithmetic step by step, the check, the KEDA trigger."""
    i = plan.inputs
    parts: list[RenderableType] = [
        Text(f"inferd plan: {_n(i.qps)} req/s within {slo_text(i)}", style="bold"), _sweep_table(plan),
        _pairs(steps(plan)), Text(_workload(plan.chosen), style="dim"), Text(_check(plan), style="dim"),
        Text(_verify(plan), style="dim"), *_open_loop(plan),
        Text("KEDA trigger (type prometheus, metricType AverageValue): requests in flight", style="bold"),
        _pairs(keda(plan)),
    ]
    parts += [Text(f"note: {n}", style="yellow") for n in plan.notes]
    return Group(*parts)


def _sweep_table(plan: Plan) -> Table:
    stat = f"p{plan.inputs.percentile}"
    keys = [k for k in SLO_NAMES if k in plan.inputs.slo or k != "tpot"]
    several = len({p.file for p, _ in plan.points}) > 1
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="the sweep (seconds)", title_justify="left")
    for col in (*(["file"] if several else []), "concurrency", "req/s", *(f"{SLO_NAMES[k]} {stat}" for k in keys),
                "E2E mean", "SLO"):
        table.add_column(col, justify="left" if col in ("file", "SLO") else "right")
    for p, why in plan.points:
        verdict = Text("met", style="green") if why is None else Text(f"missed: {why}", style="red")
        table.add_row(*([p.file] if several else []), str(p.concurrency), f"{p.request_throughput:.3g}",
                      *(_s(p.latency[k].get(stat)) for k in keys), _s(p.latency["e2e"].get("mean")), verdict,
                      style="bold" if p is plan.chosen else "")
    return table


def _pairs(rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 3))
    grid.add_column(no_wrap=True)
    grid.add_column(style="dim")
    for left, right in rows:
        grid.add_row(left, right)
    return grid


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _workload(p: SweepPoint) -> str:
    tokens = "?" if p.mean_prompt_tokens is None else f"{p.mean_prompt_tokens:.0f}"
    out = "?" if p.mean_output_tokens is None else f"{p.mean_output_tokens:.0f}"
    return f"for requests like the measured ones: {tokens} prompt and {out} output tokens on average ({p.source})"


def _check(plan: Plan) -> str:
    """Little's law on one box: c / W should be the throughput the box measured."""
    c, w, measured = plan.concurrency, plan.latency, plan.chosen.request_throughput
    return f"check: Little's law on one box: c / W = {_n(c / w)} req/s; the box measured {_n(measured)} req/s"


def _verify(plan: Plan) -> str:
    rate = _n(plan.verify_rate)
    return (f"verify: one box at λ / N = {rate} req/s of Poisson arrivals (`inferd bench URL --rate {rate}`) should "
            "meet the SLO; a closed loop holds exactly c in flight, open arrivals fluctuate around their mean")


def _open_loop(plan: Plan) -> list[Text]:
    """One line per open-loop run: did it meet the SLO at its rate."""
    stat = f"p{plan.inputs.percentile}"
    lines = []
    for p, why in plan.open_loop:
        measured = ", ".join(f"{SLO_NAMES[k]} {stat} {_s(p.latency[k].get(stat))} s" for k in plan.inputs.slo)
        verdict = Text(f"met the SLO ({measured})", "green") if why is None else Text(f"missed: {why}", "red")
        lines.append(Text.assemble(f"open loop at {p.rate:g} req/s ({p.file}): ", verdict))
    return lines


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as plain data: the inputs, every run's verdict, the arithmetic and the KEDA trigger."""
    i = plan.inputs
    return {
        "tool": "inferd plan", "version": JSON_VERSION,
        "inputs": {"qps": i.qps, "slo": dict(i.slo), "percentile": i.percentile, "headroom_pct": i.headroom,
                   "spare": i.spare},
        "points": [{**asdict(p), "met": why is None, "missed": why} for p, why in plan.points],
        "open_loop": [{**asdict(p), "met": why is None, "missed": why} for p, why in plan.open_loop],
        "chosen": plan.chosen.source,
        "little": {"c": plan.concurrency, "W_s": plan.latency, "W_is": "mean e2e latency at c",
                   "L": plan.in_flight, "L_with_headroom": plan.in_flight_headroom, "N": plan.boxes,
                   "replicas": plan.replicas, "verify_rate": plan.verify_rate},
        "steps": [f"{formula}   ({why})" for formula, why in steps(plan)],
        "keda": {"metric": "requests in flight per replica", "query": KEDA_QUERY, "threshold": plan.keda_target,
                 "min_replica_count": 1 + i.spare},
        "notes": list(plan.notes),
    }


def print_plan(plan: Plan, as_json: bool = False, out: Console | None = None) -> None:
    """The plan on stdout: the text report, or (--json) the JSON of `to_json`."""
    if as_json:
        sys.stdout.write(json.dumps(to_json(plan), indent=1, ensure_ascii=False) + "\n")
    else:
        (out or Console()).print(render(plan))
