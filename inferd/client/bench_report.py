"""`inferd bench`'s reports, pure functions of a result dict (the JSON a run writes):

    render_run(run)           one run's summary: throughputs, latency percentiles, classes, errors, retries
    render_sweep(result)      one row per sweep point (--workload conversation: TTFT of first and later turns)
    render_compare(a, b)      two results side by side with B/A ratios
    make_figure(result)       latency CDFs (TTFT, TPOT, e2e), and throughput vs latency for a sweep
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from inferd.client.bench_metrics import RequestRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
TURN_LATENCIES = (("ttft_first_turn", "TTFT turn 1"), ("ttft_later_turns", "TTFT turns 2+"))  # conversations
STAT_COLUMNS = ("mean", "p50", "p90", "p95", "p99")
MISSING = "-"
SINGLE_SIZE = (15.0, 4.5)  # inches, at DPI: one row of three CDF panels
SWEEP_SIZE = (12.0, 9.0)  # two rows: three CDFs and throughput vs latency
DPI = 100


def load_result(path: Path | str) -> dict[str, Any]:
    """A JSON that `inferd bench --json` wrote; ValueError with one line otherwise."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(result, dict) or not isinstance(result.get("runs"), list) or not result["runs"]:
        raise ValueError(f"{path} is not an `inferd bench --json` result (no runs)")
    return result


# ---------------------------------------------------------------------------------- numbers


def ms(x: float | None) -> str:
    return MISSING if x is None else f"{x * 1000:.1f}"


def num(x: float | None, digits: int = 2) -> str:
    return MISSING if x is None else f"{x:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else b / a


def _counts(d: dict[str, Any] | None) -> str:
    items = [f"{k} {v}" for k, v in (d or {}).items() if v]
    return ", ".join(items) if items else "0"


# ---------------------------------------------------------------------------------- one run


def render_run(run: dict[str, Any], title: str | None = None) -> RenderableType:
    s = run["summary"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="dim")
    head.add_column()
    head.add_row("requests", f"{s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s")
    head.add_row("throughput", f"{num(s['request_throughput'])} req/s   input {num(s['input_throughput'], 1)} tok/s"
                 f"   output {num(s['output_throughput'], 1)} tok/s   (tokens: {s['token_source'] or MISSING})")
    if s.get("slo"):
        slo = ", ".join(f"{k} ≤ {v:g} s" for k, v in s["slo"].items())
        head.add_row("goodput", f"{num(s['goodput'])} req/s ({s['good_requests']} of {s['requests']} within {slo})")
    if "conversations" in s:
        head.add_row("conversations", _conversations(s))
    latency = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    latency.add_column("latency (ms)")
    for col in STAT_COLUMNS:
        latency.add_column(col, justify="right")
    for key, name in (*LATENCIES, *(TURN_LATENCIES if "conversations" in s else ())):
        latency.add_row(name, *(ms(s[key][c]) for c in STAT_COLUMNS))
    parts: list[RenderableType] = [Text(title or run.get("label", "run"), style="bold"), head]
    if s["completed"]:
        parts.append(latency)
    if s.get("classes"):
        parts.append(_classes(s))
    errors = s["errors"]
    if errors["total"]:
        by_status = ", ".join(f"{'no response' if k == MISSING else 'HTTP ' + k}: {v}"
                              for k, v in errors["by_status"].items())
        line = Text.assemble(("errors  ", "dim"), (f"{_counts(errors['by_type'])}", "red"), f"  ({by_status})")
        parts.append(line)
        for kind, message in errors["examples"].items():
            parts.append(Text(f"  {kind}: {message}", style="dim"))
    retries = s.get("retries")
    if retries and retries["total"]:
        parts.append(_retries(retries))
    counters = run.get("server_counters")
    if counters is not None:
        hits, queries = counters.get("prefix_cache_hits", 0), counters.get("prefix_cache_queries", 0)
        parts.append(Text.assemble(
            ("inferd  ", "dim"), f"preemptions {_counts(counters.get('preemptions'))}   ",
            f"rejections {_counts(counters.get('rejections'))}   timeouts {_counts(counters.get('timeouts'))}   ",
            f"prefix-cache hits {hits} / {queries} prompt tokens",
        ))
    return Group(*parts)


def _conversations(s: dict[str, Any]) -> str:
    """`12 started, 9 finished (7 turns each); 12 first turns, 80 later turns of 4,012 prompt tokens on average`"""
    c = s["conversations"]
    prompts = s["prompt_tokens_later_turns_mean"]
    return (f"{c['started']} started, {c['finished']} finished ({c['turns']} turns each); {c['first_turns']} "
            f"first turns, {c['later_turns']} later turns of {num(prompts, 0)} prompt tokens on average")


def _retries(r: dict[str, Any]) -> Text:
    """`retries  5 (connection 2, 429 1, 503 2) for 3 requests: 2 then completed, 1 gave up (503 1); ...`"""
    gave_up = f", {r['exhausted']} gave up ({_counts(r['exhausted_by_cause'])})" if r["exhausted"] else ""
    return Text.assemble(
        ("retries  ", "dim"), f"{r['total']} ({_counts(r['by_cause'])}) for {r['requests_retried']} requests: "
        f"{r['succeeded_after_retry']} then completed{gave_up}; {r['wait_s']:.2f} s of backoff, "
        "counted in their TTFT and e2e",
    )


def _classes(s: dict[str, Any]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("class", no_wrap=True)
    for col in ("done", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "errors"):
        table.add_column(col, justify="right")
    if s.get("slo"):
        table.add_column("goodput", justify="right")
    for name, c in s["classes"].items():
        row = [name, str(c["completed"]), num(c["output_throughput"], 1), ms(c["ttft"]["p50"]), ms(c["ttft"]["p99"]),
               ms(c["tpot"]["p50"]), ms(c["tpot"]["p99"]), str(c["errors"]["total"])]
        if s.get("slo"):
            row.append(num(c["goodput"]))
        table.add_row(*row)
    return table


def render_sweep(result: dict[str, Any]) -> Table:
    if all("conversations" in run["summary"] for run in result["runs"]):
        return _conversation_sweep(result)
    table = Table(title="sweep (latencies in ms)", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("point", no_wrap=True)
    for col in ("req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "errors"):
        table.add_column(col, justify="right")
    for run in result["runs"]:
        s = run["summary"]
        table.add_row(run["label"], num(s["request_throughput"]), num(s["output_throughput"], 1),
                      ms(s["ttft"]["p50"]), ms(s["ttft"]["p99"]), ms(s["tpot"]["p50"]), ms(s["tpot"]["p99"]),
                      ms(s["e2e"]["p50"]), str(s["errors"]["total"]))
    return table


def _conversation_sweep(result: dict[str, Any]) -> Table:
    """Per point: output tok/s over all conversations, TTFT p50/p90/p99 of first turns and of later
    turns, TPOT p50/p99."""
    table = Table(title="sweep, conversations (latencies in ms)", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("point", no_wrap=True)
    columns = ["out tok/s", *(f"{name} {q}" for name in ("TTFT1", "TTFT2+") for q in ("p50", "p90", "p99")),
               "TPOT p50", "TPOT p99", "errors"]
    for col in columns:
        table.add_column(col, justify="right")
    for run in result["runs"]:
        s = run["summary"]
        ttfts = [ms(s[key][q]) for key, _ in TURN_LATENCIES for q in ("p50", "p90", "p99")]
        table.add_row(run["label"], num(s["output_throughput"], 1), *ttfts, ms(s["tpot"]["p50"]),
                      ms(s["tpot"]["p99"]), str(s["errors"]["total"]))
    return table


# ---------------------------------------------------------------------------------- compare

COMPARED = (  # (row name, path into the summary, unit: "/s" higher is better, "ms" lower is better)
    ("request throughput (req/s)", ("request_throughput",), "/s"),
    ("output throughput (tok/s)", ("output_throughput",), "/s"),
    ("input throughput (tok/s)", ("input_throughput",), "/s"),
    *((f"{name} {stat} (ms)", (key, stat), "ms") for key, name in LATENCIES for stat in ("mean", "p50", "p99")),
    ("goodput (req/s)", ("goodput",), "/s"),
    ("errors", ("errors", "total"), "n"),
    ("retries", ("retries", "total"), "n"),
)


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) else None


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None, float | None]]:
    """(metric, A, B, B/A) for two run summaries; latencies in seconds."""
    rows = []
    for name, path, _ in COMPARED:
        va, vb = _get(a, path), _get(b, path)
        rows.append((name, va, vb, ratio(va, vb)))
    return rows


def render_compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> RenderableType:
    """Each pair of runs (by position) side by side; B/A green where B is better, red where worse."""
    parts: list[RenderableType] = []
    for side, name in zip((a, b), names):
        server = side.get("server") or {}
        parts.append(Text.assemble((f"{name}: ", "bold"), f"{server.get('url', MISSING)}  model {server.get('model', MISSING)}"))
    if len(a["runs"]) != len(b["runs"]):
        parts.append(Text(f"note: {len(a['runs'])} runs in {names[0]}, {len(b['runs'])} in {names[1]}: "
                          "comparing the first ones pairwise", style="yellow"))
    for run_a, run_b in zip(a["runs"], b["runs"]):
        label = run_a["label"] if run_a["label"] == run_b["label"] else f"{run_a['label']} vs {run_b['label']}"
        table = Table(title=label, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        table.add_column("metric", no_wrap=True)
        for col in (*names, f"{names[1]}/{names[0]}"):
            table.add_column(col, justify="right")
        for (name, va, vb, r), (_, _, unit) in zip(compare_rows(run_a["summary"], run_b["summary"]), COMPARED):
            fmt = ms if unit == "ms" else (lambda x: MISSING if x is None else f"{x:g}") if unit == "n" else num
            better = None if r is None or r == 1 or unit == "n" else (r > 1) == (unit == "/s")
            style = "" if better is None else "green" if better else "red"
            table.add_row(name, fmt(va), fmt(vb), Text(MISSING if r is None else f"{r:.2f}×", style=style))
        parts.append(table)
    return Group(*parts)


# ---------------------------------------------------------------------------------- plot


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def make_figure(result: dict[str, Any]) -> Figure:
    """Latency CDFs (TTFT, TPOT, e2e; one line per run) and, for a sweep (more than one run),
    output throughput against TTFT and e2e latency. Agg backend; nothing is shown."""
    from matplotlib.figure import Figure  # a Figure without pyplot: no global state, no GUI

    runs = result["runs"]
    sweep = len(runs) > 1
    fig = Figure(figsize=SWEEP_SIZE if sweep else SINGLE_SIZE, dpi=DPI)
    grid = fig.add_gridspec(2 if sweep else 1, 3)
    for col, (key, name) in enumerate((("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E latency"))):
        ax = fig.add_subplot(grid[0, col])
        for run in runs:
            values = [_request_value(r, key) for r in run["requests"]]
            xs, ys = _cdf([v * 1000 for v in values if v is not None])
            if xs:
                ax.step(xs, ys, where="post", label=run["label"])
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(runs) > 1 and ax.has_data():
            ax.legend(fontsize="small")
    if sweep:
        ax = fig.add_subplot(grid[1, :])
        tput = [run["summary"]["output_throughput"] for run in runs]
        for key, stat, style in (("ttft", "p50", "o-"), ("ttft", "p99", "o--"), ("e2e", "p50", "s-"), ("e2e", "p99", "s--")):
            points = [(t, run["summary"][key][stat] * 1000) for t, run in zip(tput, runs)
                      if run["summary"][key][stat] is not None]
            if points:
                ax.plot(*zip(*points), style, label=f"{key.upper()} {stat}")
        for t, run in zip(tput, runs):
            ax.annotate(run["label"], (t, 0), textcoords="offset points", xytext=(0, 4), fontsize="small",
                        xycoords=("data", "axes fraction"), ha="center")
        ax.set_title("throughput vs latency")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("latency (ms)")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.suptitle(f"inferd bench: {(result.get('server') or {}).get('url', '')}  {(result.get('server') or {}).get('model', '')}")
    fig.tight_layout()
    return fig


def _request_value(r: dict[str, Any], key: str) -> float | None:
    record = RequestRecord.from_json(r)
    return None if not record.ok else record.tpot if key == "tpot" else getattr(record, key)


def write_plot(result: dict[str, Any], path: Path | str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    make_figure(result).savefig(path, dpi=DPI, format="png")
