"""compare.py's report: a table per peer with inferd / peer ratios, the targets met or missed, the
instruction sets each server multiplies on, the CPU of other processes, and the dated section
appended to bench/RESULTS.md."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from peers import prefill
from peers.cpu import cpu_flags, inferd_isa, llama_isa, machine_isa, vllm_isa
from peers.points import Point, cpu_line
from peers.servers import Server, llama_system_info, system_info_line
from peers.workload import MAX_OTHER_CORES, TARGETS, Targets, bench_args

COLUMNS = (("output_tok_s", "out tok/s", 1.0, 1), ("ttft_p50", "TTFT p50 s", 1.0, 3),
           ("ttft_p99", "TTFT p99 s", 1.0, 3), ("tpot_p50", "TPOT p50 ms", 1e3, 1), ("tpot_p99", "TPOT p99 ms", 1e3, 1))
LATER_COLUMN = ("ttft_later_p99", "later-turn TTFT p99 s", 1.0, 3)  # where the driver reports it


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


@dataclass
class Side:
    """One server's run: the peer it is (None for inferd), the server and its points."""

    peer: str | None  # a key of PEERS
    server: Server
    points: list[Point]


def columns(*sides: list[Point]) -> tuple[tuple[str, str, float, int], ...]:
    """COLUMNS, and the later-turn TTFT p99 where every point of the sides has one."""
    later = all("ttft_later_p99" in p.best.metrics for points in sides for p in points)
    return COLUMNS + ((LATER_COLUMN,) if later else ())


def ratio_table(inferd: list[Point], peer: list[Point], peer_name: str) -> str:
    """Markdown: per concurrency and metric, inferd, the peer and inferd / peer."""
    cols = columns(inferd, peer)
    head = ["conc."] + [f"{label} {who}" if who else "ratio" for _, label, _, _ in cols
                        for who in ("inferd", peer_name, "")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    peers = {p.concurrency: p for p in peer}
    for p in inferd:
        q = peers.get(p.concurrency)
        if q is None:
            continue
        a, b = p.best.metrics, q.best.metrics
        disturbed = any(not x.best.cpu["other_includes_server"] and x.best.cpu["other_cores"] > MAX_OTHER_CORES
                        for x in (p, q))
        failed = sum(x.best.summary.get("failed") or 0 for x in (p, q))
        cells = [f"{p.concurrency}{' (disturbed)' if disturbed else ''}{f' ({failed} failed)' if failed else ''}"]
        for key, _, scale, digits in cols:
            cells += [f"{a[key] * scale:.{digits}f}", f"{b[key] * scale:.{digits}f}", fmt_ratio(ratio(a[key], b[key]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(inferd: list[Point], peer: list[Point], goal: Targets, name: str) -> list[tuple[str, bool | None]]:
    """Issue 30's targets against one peer: (what, met); met None where it could not be judged."""
    a = {p.concurrency: p.best.metrics for p in inferd}
    b = {p.concurrency: p.best.metrics for p in peer}
    out: list[tuple[str, bool | None]] = []
    for c, least in sorted(goal.throughput.items()):
        what = f"output tok/s at concurrency {c} >= {least:g}x {name}'s"
        if c in a and c in b:
            r = ratio(a[c]["output_tok_s"], b[c]["output_tok_s"])
            out.append((f"{what}: {fmt_ratio(r)}", r is not None and r >= least))
        else:
            out.append((f"{what}: not run", None))
    metric = {key: label for key, label, _, _ in (*COLUMNS, LATER_COLUMN)}[goal.ttft_key].removesuffix(" s")
    judged = [c for c in sorted(set(a) & set(b)) if c >= goal.ttft_from]
    for c in judged:
        x, y = a[c].get(goal.ttft_key), b[c].get(goal.ttft_key)
        if x is None or y is None:
            out.append((f"{metric} at concurrency {c} at or below {name}'s: not reported by the driver", None))
        else:
            out.append((f"{metric} at concurrency {c} at or below {name}'s: {x:.3f} s vs {y:.3f} s "
                        f"({fmt_ratio(ratio(x, y))})", x <= y))
    if not judged:
        out.append((f"{metric} at or below {name}'s at every concurrency >= {goal.ttft_from}: not run", None))
    return out


def peer_section(args: argparse.Namespace, inferd: Side, peer: Side) -> str:
    """The table and targets against one peer."""
    name = peer.server.side
    goal = TARGETS.get((peer.peer or "", args.workload))
    checks = targets_text(targets(inferd.points, peer.points, goal, name)) if goal else \
        f"- none set for {name} on the {args.workload} workload"
    return f"""### inferd / {name}

{ratio_table(inferd.points, peer.points, name)}

Targets (issue 30):
{checks}
"""


def targets_text(checks: list[tuple[str, bool | None]]) -> str:
    mark = {True: "**met**", False: "**missed**", None: "n/a"}
    return "\n".join(f"- {mark[met]}: {what}" for what, met in checks)


def cpu_text(points: list[Point]) -> str:
    lines = []
    for p in points:
        for i, att in enumerate(p.attempts):
            note = (" (repeated: disturbed)" if i == 0 and len(p.attempts) > 1 else "") + \
                   (" (kept)" if len(p.attempts) > 1 and i == p.kept else "")
            lines.append(f"- {p.side} c={p.concurrency} attempt {i + 1}{note}: {cpu_line(att.cpu)}")
    return "\n".join(lines)


def machine() -> str:
    name = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores, {name}, Python {sys.version.split()[0]}"


def rounded(value: Any) -> Any:
    """`value` with every float to 5 significant digits (for the compact summaries)."""
    if isinstance(value, float):
        return float(f"{value:.5g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def read_log(path: Path) -> str | None:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return None


def side_isa(args: argparse.Namespace, side: Side, json_dir: Path, flags: set[str]) -> str:
    """What one server multiplies on: from the CPU and inferd's settings, or from the peer's log."""
    if side.peer is None:
        return inferd_isa(flags, read_log(json_dir / "inferd.log") or "")
    if args.peer_url:
        return "not known (a server not started here: its log is not ours)"
    if side.peer == "vllm":
        return vllm_isa(read_log(json_dir / "vllm.log"), flags)
    # NOTE: this llama-server logs system_info only at verbosity 4: a short second start prints it
    info = system_info_line(json_dir / "llama-server.log") or llama_system_info(args.peer_bin, args.model, json_dir)
    return llama_isa(info)


def isa_text(args: argparse.Namespace, sides: list[Side], json_dir: Path) -> str:
    """One line for the CPU, and one per server (read after every server has stopped)."""
    flags = cpu_flags()
    lines = [f"- this CPU: {machine_isa(flags)}"]
    lines += [f"- {side.server.side}: {side_isa(args, side, json_dir, flags)}" for side in sides]
    return "\n".join(lines)


def workload_text(args: argparse.Namespace) -> str:
    if args.workload == "prefill":
        return prefill.workload_text(args)
    count = ["--num-requests", "N"] if args.workload == "requests" or args.requests_per_point else []
    cmd = shlex.join(["inferd", "bench", "URL", "--concurrency", "C", *count, *bench_args(args)])
    if args.workload == "requests":
        n = "max(8, 3 x C)" if not args.requests_per_point else args.requests_per_point
        return f"`{cmd}`, with N = {n} measured requests per concurrency C (closed loop, streaming completions)"
    n = f", N = {args.requests_per_point}" if args.requests_per_point else " (the driver's default count)"
    return f"`{cmd}`, C conversations at once{n} (closed loop, streaming chat completions)"


def report(args: argparse.Namespace, inferd: Side, peers: list[Side], json_dir: Path, started: dt.datetime,
           seconds: float) -> str:
    """The dated RESULTS.md section."""
    command = shlex.join([".venv/bin/python", "bench/compare.py", *sys.argv[1:]])
    points = inferd.points + [p for side in peers for p in side.points]
    summaries = "{\n" + ",\n".join(f' "{p.side} c{p.concurrency}": {json.dumps(rounded(p.best.summary))}'
                                     for p in points) + "\n}"
    servers = "\n".join(f"- {side.server.side}: {side.server.description}." for side in [inferd, *peers])
    if args.workload == "prefill":
        tables = "\n".join(prefill.prefill_section(inferd.points, side.points, side.server.side) for side in peers)
        ratios = "Ratio = inferd / peer TTFT, of the medians (lower is better)."
    else:
        tables = "\n".join(peer_section(args, inferd, side) for side in peers)
        ratios = "Ratio = inferd / peer (output tok/s: higher is better; TTFT, TPOT: lower is better)."
    isa = isa_text(args, [inferd, *peers], json_dir)
    names = ", ".join(side.server.side for side in peers)
    return f"""
## inferd vs {names}, side by side, {args.workload} workload (issues 6, 30)

`{command}` ({started:%Y-%m-%d %H:%M}, {seconds / 60:.1f} min)

Machine: {machine()}. Model file: `{args.model}`. One server at a time, in this order:
{servers}
- workload, the same for all: {workload_text(args)}.

Instruction sets each server multiplies on:
{isa}

{ratios}

{tables}
CPU per run (other processes over {MAX_OTHER_CORES} cores: run repeated once, the less disturbed kept):
{cpu_text(points)}

Every request's timings: the driver's JSON files in `{json_dir}` (not in the repo).

<details><summary>The driver's JSON summaries (one line per side and concurrency; times in s)</summary>

```json
{summaries}
```
</details>
"""
