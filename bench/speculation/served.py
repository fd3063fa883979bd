"""Speculative decoding (issue 42): its acceptance measurements, each a ratio of two sides measured one
after the other in this run, nothing else running.

    .venv/bin/python bench/speculation/served.py                           # all three; appends to bench/RESULTS.md
    .venv/bin/python bench/speculation/served.py --only copy,compare       # a subset (of copy, compare, agent)
    .venv/bin/python bench/speculation/served.py --quick --peer none --no-write    # a smoke run

Each part starts `inferd serve --port 0 --dtype bfloat16 --model MODEL` (compare.py's bench/peers:
a scratch folder, default settings) afresh twice: with `--off-args` (`--speculative off`), then
with `--on-args` (`--speculative METHOD`, `--method` auto).
(a) copy, concurrency 1: POST /v1/completions, greedy, max_tokens 256, prompt "Passage: P\\nThe same
    passage again: P\\nAnd once more, word for word:", P 90 words of bench_workload's prose
    (`--passages` x `--repeats`, after a warm-up), each timed end to end: output tok/s on / off
    (target >= 2x); then 16 passages at once, greedy: how many texts on equal their text off.
(b) compare: compare.py's requests workload (its driver and REQUESTS_ARGS) at concurrency 32:
    output tok/s on / off (target >= 0.95x).
(c) agent: `inferd bench --workload agent` (AGENT_ARGS: 6 turns to ~6k tokens, two copy turns, EOS
    ignored) at `--sessions` 1 and 8, 6 x max(2, C) requests; then each peer of `--peer` without
    and with its speculation (`--peer-modes`), in its own environment: llama-server `-np C -c
    8192xC -t CORES` (prompt cache on, its default), then + LLAMA_SPEC (`--llama-spec`); vLLM's CPU
    build as compare.py starts it + VLLM_CACHE, then + `--speculative-config VLLM_SPEC`. Output
    tok/s of inferd on / the best peer configuration (targets >= 1.5x at 1, >= 2x at 8); TTFT of
    first, later and copy turns; cached prompt tokens; acceptance (inferd's usage extension and
    llama-server's timings through the driver, vLLM's /metrics). A peer that will not start is
    reported and skipped.
CPU: other processes' CPU is counted around each run as compare.py does; a run they took over 0.2
cores of is run once more, the less disturbed kept. Logs, JSON: ~/.cache/inferd/speculative/DATE-TIME.
Time (estimated from compare.py's conversation runs, not yet measured whole): (a) and (b) ~5 min;
(c) inferd ~10 min, llama-server ~25 min a configuration (~12 out tok/s at 8 sessions), vLLM ~8.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: compare.py, peers/, speculation/

from compare import default_model, parse_concurrency  # noqa: E402
from embeddings import measured  # noqa: E402
from peers.points import Point, cpu_line, run_point  # noqa: E402
from peers.report import machine, rounded  # noqa: E402
from peers.servers import (Server, VllmInstall, check_llama, find_vllm, inferd_server, llama_args,  # noqa: E402
                           llama_server, vllm_args, vllm_server)
from speculation.copying import copies, copy_rate, first_difference, spec_counters  # noqa: E402
from peers.workload import DEFAULT_PEER_BIN, DEFAULT_RESULTS, MAX_OTHER_CORES, VLLM_MIN_SEQS  # noqa: E402

PARTS = ("copy", "compare", "agent")
PEER_NAMES = ("llama", "vllm")
COPY_MAX_TOKENS, STREAMS = 256, 16
COMPARE_CONCURRENCY = 32
LLAMA_SPEC = "--spec-type ngram-mod"
VLLM_SPEC = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
VLLM_CACHE = ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len", "8192")
TARGETS = {"copy": 2.0, "compare": 0.95, "agent": {1: 1.5, 8: 2.0}}


# ------------------------------------------------------------------------------ (a) copy

def copy_side(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    """The timed copies one at a time (after one warm-up), then `--streams` at once (their texts)."""
    asyncio.run(copies(server, 1, args.copy_max_tokens))  # the warm-up
    timed = measured(f"{server.side} copy", server,
                     lambda attempt: copies(server, args.passages, args.copy_max_tokens, args.repeats),
                     lambda r: f"{copy_rate(r):.1f} out tok/s over {len(r)} requests")
    streams = asyncio.run(copies(server, args.streams, args.copy_max_tokens, at_once=True))
    return {"timed": timed, "streams": [r["text"] for r in streams]}


# ------------------------------------------------------------------------------ (b), (c): the driver

def driver_point(args: argparse.Namespace, server: Server, workload: str, c: int, n: int | None,
                 json_dir: Path) -> Point:
    """One `inferd bench` point (compare.py's driver), with /metrics' speculation counters around it."""
    point_args = argparse.Namespace(**{**vars(args), "workload": workload, "requests_per_point": n, "turns": None})
    before = spec_counters(server)
    point = run_point(point_args, server, c, json_dir)
    after = spec_counters(server)
    if before is not None and after is not None:
        point.best.summary["metrics_speculation"] = {"drafted_tokens": after[0] - before[0],
                                                     "accepted_tokens": after[1] - before[1]}
    return point


def acceptance(summary: dict[str, Any]) -> str:
    """accepted / drafted from the driver's records (usage or timings), else from /metrics."""
    spec = summary.get("speculation") or summary.get("metrics_speculation")
    if not spec or not spec.get("drafted_tokens"):
        return "-"
    return f"{spec['accepted_tokens'] / spec['drafted_tokens']:.0%} of {spec['drafted_tokens']:,.0f}"


def request_drafts(point: Point) -> dict[str, int]:
    """Drafted / accepted tokens summed over the driver's records of the kept attempt."""
    requests = json.loads(Path(point.best.json_path).read_text())["runs"][0]["requests"]
    return {k: sum(r.get(k) or 0 for r in requests) for k in ("drafted_tokens", "accepted_tokens")}


# ------------------------------------------------------------------------------ sides

@dataclass
class Config:
    """One server configuration of one side: how to start it, and its points."""

    name: str  # the side's name in tables and file names
    start: Any  # () -> a context manager of a Server
    copy: dict[str, Any] | None = None
    compare: Point | None = None
    agent: dict[int, Point] = field(default_factory=dict)
    failed: str | None = None  # a peer configuration that would not start: why
    description: str = ""  # the server's, once started
    model: str | None = None  # the name it serves


def inferd_configs(args: argparse.Namespace, tmp: Path, logs: Path, part: str) -> list[Config]:
    """inferd off, then on: a fresh server for each (no prefix cache carried from another part)."""
    out = []
    for name, extra in ((f"inferd-{args.off_name}", args.off_args), (f"inferd-{args.method}", args.on_args)):
        folder = logs / f"{part}-{name}"
        folder.mkdir(exist_ok=True)
        cmd = [*shlex.split(args.inferd_args), *shlex.split(extra)]
        out.append(Config(name, lambda f=folder, c=cmd: inferd_server(tmp, f, args.model, c)))
    return out


def peer_configs(args: argparse.Namespace, tmp: Path, logs: Path, vllm: VllmInstall | None,
                 served: str | None) -> list[Config]:
    sessions, out = max(args.sessions), []
    for peer in args.peer:
        for mode in args.peer_modes:
            folder = logs / f"agent-{peer}-{mode}"
            folder.mkdir(exist_ok=True)
            if peer == "llama":
                extra = llama_args(args.peer_threads, "agent", sessions)
                extra += shlex.split(args.llama_spec) if mode == "spec" else []
                name = "llama-server" + ("+" + args.llama_spec.split()[-1] if mode == "spec" else "")
                out.append(Config(name, lambda f=folder, e=extra: llama_server(
                    tmp, f, args.peer_bin, args.model, e, args.peer_start_timeout)))
            else:
                assert vllm is not None
                extra = [*vllm_args(served or Path(vllm.model_dir).name, max(VLLM_MIN_SEQS, sessions)), *VLLM_CACHE]
                extra += ["--speculative-config", args.vllm_spec] if mode == "spec" else []
                name = "vllm" + ("+ngram" if mode == "spec" else "")
                out.append(Config(name, lambda f=folder, e=extra: vllm_server(
                    tmp, f, vllm, e, args.peer_threads, args.peer_start_timeout)))
    return out


def run_config(args: argparse.Namespace, config: Config, part: str, json_dir: Path, peer: bool = False) -> None:
    """Start the configuration's server and run `part` on it; a peer that will not start is recorded."""
    try:
        with config.start() as started:
            server = dataclasses.replace(started, side=config.name)  # (the driver's files are named by it)
            print(f"{config.name}: {server.description} at {server.url}, model {server.model}", flush=True)
            config.description, config.model = server.description, server.model
            if part == "copy":
                config.copy = copy_side(args, server)
            elif part == "compare":
                n = args.compare_requests
                config.compare = driver_point(args, server, "requests", COMPARE_CONCURRENCY, n, json_dir)
            else:
                for c in args.sessions:
                    n = args.agent_requests or 6 * max(2, c)
                    config.agent[c] = driver_point(args, server, "agent", c, n, json_dir)
    except SystemExit as e:  # (peers.servers exits when a server dies or never answers)
        if not peer:
            raise
        config.failed = str(e.code)[-1500:]
        print(f"  {config.name} failed: {config.failed[-500:]}", flush=True)


# ------------------------------------------------------------------------------ report

def verdict(value: float, target: float) -> str:
    return f"**{value:.2f}x** (target >= {target:g}x: **{'met' if value >= target else 'missed'}**)"


def disturbed(cpu: dict[str, Any]) -> str:
    return " (disturbed)" if not cpu["other_includes_server"] and cpu["other_cores"] > MAX_OTHER_CORES else ""


def copy_text(args: argparse.Namespace, off: Config, on: Config) -> str:
    rows = ["| side | requests | output tokens | seconds | out tok/s | accepted / drafted |", "|---|" + "---:|" * 5]
    for config in (off, on):
        assert config.copy is not None
        m = config.copy["timed"]
        runs, drafted = m.result, sum(r["drafted"] for r in m.result)
        spec = f"{sum(r['accepted'] for r in runs):,} / {drafted:,}" if drafted else "-"
        rows.append(f"| {config.name}{disturbed(m.attempts[m.kept][1])} | {len(runs)} | "
                    f"{sum(r['tokens'] for r in runs):,} | {sum(r['seconds'] for r in runs):.2f} | "
                    f"{copy_rate(runs):.1f} | {spec} |")
    assert off.copy is not None and on.copy is not None
    ratio = copy_rate(on.copy["timed"].result) / copy_rate(off.copy["timed"].result)
    alone = sum(a["text"] == b["text"] for a, b in zip(off.copy["timed"].result, on.copy["timed"].result))
    streams = list(zip(off.copy["streams"], on.copy["streams"]))
    differ = [f"stream {i}: character {first_difference(a, b)}" for i, (a, b) in enumerate(streams) if a != b]
    return "\n".join([
        f"{args.passages} passages x {args.repeats} requests, one at a time (after one warm-up), greedy, max_tokens "
        f"{args.copy_max_tokens}; each timed end to end.", "", *rows, "",
        f"Output tok/s {on.name} / {off.name}: {verdict(ratio, TARGETS['copy'])}.",
        f"Greedy texts equal, {on.name} against {off.name}: one at a time **{alone} of "
        f"{len(off.copy['timed'].result)}**; {len(streams)} streams at once "
        f"**{len(streams) - len(differ)} of {len(streams)}**"
        + (f" (first differences: {', '.join(differ)})" if differ else "") + "."])


def compare_text(off: Config, on: Config) -> str:
    rows = ["| side | requests | out tok/s | TTFT p50 s | TTFT p99 s | TPOT p50 ms | accepted / drafted |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for config in (off, on):
        p = config.compare
        assert p is not None
        m, drafts = p.best.metrics, request_drafts(p)
        spec = f"{drafts['accepted_tokens']:,} / {drafts['drafted_tokens']:,}" if drafts["drafted_tokens"] else "-"
        rows.append(f"| {config.name}{disturbed(p.best.cpu)} | {p.best.summary.get('completed')} | "
                    f"{m['output_tok_s']:.1f} | {m['ttft_p50']:.3f} | {m['ttft_p99']:.3f} | "
                    f"{m['tpot_p50'] * 1e3:.1f} | {spec} |")
    assert off.compare is not None and on.compare is not None
    ratio = on.compare.best.metrics["output_tok_s"] / off.compare.best.metrics["output_tok_s"]
    return "\n".join([f"compare.py's requests workload at concurrency {COMPARE_CONCURRENCY}.", "", *rows, "",
                      f"Output tok/s {on.name} / {off.name}: {verdict(ratio, TARGETS['compare'])}."])


def agent_row(config: Config, c: int) -> str:
    if config.failed is not None:
        return f"| {c} | {config.name} | did not start | | | | | | |"
    p = config.agent[c]
    s, m = p.best.summary, p.best.metrics
    cached = s.get("cached_tokens") or {}
    ttft = [(s.get(k) or {}).get(q) for k, q in (("ttft_first_turn", "p50"), ("ttft_later_turns", "p99"),
                                                 ("ttft_copy_turns", "p50"))]
    cells = [str(c), f"{config.name}{disturbed(p.best.cpu)}", f"{m['output_tok_s']:.1f}",
             *("-" if t is None else f"{t:.2f}" for t in ttft),
             "-" if cached.get("fraction") is None else f"{cached['fraction']:.0%}", acceptance(s),
             str(s.get("failed") or 0)]
    return "| " + " | ".join(cells) + " |"


def agent_text(args: argparse.Namespace, inferd: list[Config], peers: list[Config]) -> str:
    rows = ["| sessions | side | out tok/s | TTFT first p50 s | later p99 s | copy p50 s | cached | accepted "
            "| failed |", "|---:|---|" + "---:|" * 7]
    rows += [agent_row(config, c) for c in args.sessions for config in [*inferd, *peers]]
    lines = ["", *rows, ""]
    on = inferd[1]
    for c in args.sessions:
        ran = [p for p in peers if p.failed is None and c in p.agent]
        if not ran:
            lines.append(f"- {c} session(s): no peer ran")
            continue
        best = max(ran, key=lambda p: p.agent[c].best.metrics["output_tok_s"])
        rate = best.agent[c].best.metrics["output_tok_s"]
        goal = TARGETS["agent"].get(c)  # type: ignore[union-attr]
        ratio = on.agent[c].best.metrics["output_tok_s"] / rate
        lines.append(f"- {c} session(s): the best peer configuration is {best.name} ({rate:.1f} out tok/s); "
                     f"{on.name} / it: " + (verdict(ratio, goal) if goal else f"**{ratio:.2f}x**")
                     + f"; {inferd[0].name} / it: {inferd[0].agent[c].best.metrics['output_tok_s'] / rate:.2f}x")
    return "\n".join(lines)


def report(args: argparse.Namespace, results: dict[str, list[Config]], started: dt.datetime, seconds: float) -> str:
    command = shlex.join([".venv/bin/python", "bench/speculation/served.py", *sys.argv[1:]])
    configs = [c for part in results.values() for c in part]
    servers = "\n".join(dict.fromkeys(f"- {c.name}: {c.failed and 'did not start' or c.description}." for c in configs))
    parts = []
    if "copy" in results:
        parts.append(f"### (a) Copy-heavy completions, concurrency 1\n\n{copy_text(args, *results['copy'])}")
    if "compare" in results:
        parts.append(f"### (b) Short requests, concurrency {COMPARE_CONCURRENCY}\n\n"
                     + compare_text(*results["compare"]))
    if "agent" in results:
        parts.append("### (c) Agent sessions against the peers\n\n`inferd bench --workload agent` (EOS ignored), "
                     f"{args.agent_requests or '6 x max(2, C)'} requests at C sessions; TTFT in seconds; cached: "
                     "the prefix cache's share of prompt tokens; accepted: of the drafted tokens.\n"
                     + agent_text(args, results["agent"][:2], results["agent"][2:]))
    cpu = [f"- {c.name} copy: {cpu_line(c.copy['timed'].attempts[c.copy['timed'].kept][1])}" for c in configs if c.copy]
    cpu += [f"- {p.side} c={p.concurrency}: {cpu_line(p.best.cpu)}" for c in configs
            for p in ([c.compare] if c.compare else []) + list(c.agent.values())]
    summaries = [f' "{p.side} {p.concurrency}": {json.dumps(rounded(p.best.summary))}' for c in configs
                 for p in ([c.compare] if c.compare else []) + list(c.agent.values())]
    failures = "".join(f"\n{c.name} did not start:\n```\n{c.failed}\n```\n" for c in configs if c.failed)
    sections = "\n\n".join(parts)
    details = "" if not summaries else ("\n<details><summary>The driver's JSON summaries (times in s)</summary>\n\n"
                                        "```json\n{\n" + ",\n".join(summaries) + "\n}\n```\n</details>\n")
    return f"""
## Speculative decoding (issue 42), {started:%Y-%m-%d}

`{command}` ({started:%Y-%m-%d %H:%M}, {seconds / 60:.1f} min)

Machine: {machine()}. Model file: `{args.model}`. One server at a time, a fresh one for each part:
{servers}

{sections}
{failures}
CPU per run (other processes over {MAX_OTHER_CORES} cores: run once more, the less disturbed kept):
{chr(10).join(cpu)}

Logs and the driver's JSON files: `{args.logs}` (not in the repo).
{details}"""


# ------------------------------------------------------------------------------ main

def parse_list(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip() and v.strip() != "none"]
        if any(v not in choices for v in values) or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"a comma-separated list of distinct values out of {', '.join(choices)}")
        return values
    return parse


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=parse_list(PARTS), default=list(PARTS), help="the parts: copy,compare,agent (all)")
    p.add_argument("--method", default="auto", help="the method measured against off (default: auto)")
    p.add_argument("--on-args", help="inferd serve's arguments for the method (default: --speculative METHOD)")
    p.add_argument("--off-args", default="--speculative off", help="...and without it (default: %(default)s)")
    p.add_argument("--inferd-args", default="", help="more `inferd serve` arguments for both sides")
    p.add_argument("--quick", action="store_true", help="a smoke run: few requests, one session count")
    p.add_argument("--passages", type=int, default=4, help="copy: passages timed (default: 4)")
    p.add_argument("--repeats", type=int, default=3, help="copy: requests per passage (default: 3)")
    p.add_argument("--copy-max-tokens", type=int, default=COPY_MAX_TOKENS, help="copy: max_tokens (default: 256)")
    p.add_argument("--compare-requests", type=int, help="compare: measured requests (default: max(8, 3 x 32))")
    p.add_argument("--sessions", type=parse_concurrency, default=[1, 8], help="agent: sessions at once (1,8)")
    p.add_argument("--agent-requests", type=int, help="agent: requests per point (default: 6 x max(2, sessions))")
    p.add_argument("--peer", type=parse_list(PEER_NAMES), default=list(PEER_NAMES), help="agent: llama,vllm or none")
    p.add_argument("--peer-modes", type=parse_list(("plain", "spec")), default=["plain", "spec"],
                   help="agent: each peer without (plain) and with (spec) its speculation (default: both)")
    p.add_argument("--llama-spec", default=LLAMA_SPEC, help="llama-server's speculation flags (%(default)s)")
    p.add_argument("--vllm-spec", default=VLLM_SPEC, help="vLLM's --speculative-config (%(default)s)")
    p.add_argument("--peer-bin", type=Path, default=DEFAULT_PEER_BIN, help="llama-server (default: %(default)s)")
    p.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1, help="peers' threads (every core)")
    p.add_argument("--model", type=Path, help="the GGUF every side serves (default: the embedded SmolLM2)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="(default: %(default)s)")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    args = p.parse_args()
    args.streams, args.peer_start_timeout, args.point_timeout = STREAMS, 600.0, 3600.0
    args.on_args = f"--speculative {args.method}" if args.on_args is None else args.on_args
    args.off_name = "off" if "off" in args.off_args or not args.off_args.strip() else "base"
    if args.quick:
        args.passages, args.repeats, args.streams, args.copy_max_tokens = 2, 1, 4, 64
        args.compare_requests, args.sessions, args.agent_requests = args.compare_requests or 16, [1], 4
    args.model = (args.model or default_model()).resolve()
    args.driver = [sys.executable, "-m", "inferd.cli", "bench"]
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # (a KeyboardInterrupt: the servers are stopped)
    args = parse_args()
    agent = "agent" in args.only
    vllm = find_vllm(args.model) if agent and "vllm" in args.peer else None
    if agent and "llama" in args.peer:
        check_llama(args.peer_bin)
    started, t0 = dt.datetime.now(), time.perf_counter()
    args.logs = Path.home() / ".cache/inferd/speculative" / f"{started:%Y%m%d-%H%M%S}"
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}; parts {args.only}; {args.off_args!r} against {args.on_args!r}; logs in {args.logs}",
          flush=True)
    results: dict[str, list[Config]] = {}
    with tempfile.TemporaryDirectory(prefix="inferd-speculative-") as tmp:
        for part in args.only:
            configs = inferd_configs(args, Path(tmp), args.logs, part)
            for config in configs:
                run_config(args, config, part, args.logs)
            if part == "agent":
                peers = peer_configs(args, Path(tmp), args.logs, vllm, configs[0].model)
                for config in peers:
                    run_config(args, config, part, args.logs, peer=True)
                configs += peers
            results[part] = configs
    section = report(args, results, started, time.perf_counter() - t0)
    print(section)
    if not args.no_write:
        with open(args.results, "a") as f:
            f.write(section)
        print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
