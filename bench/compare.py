"""inferd against a peer server on the same model file, machine and workload (issue 6).

    python bench/compare.py                               # inferd, then llama-server; appends to bench/RESULTS.md
    python bench/compare.py --concurrency 1,4 --requests-per-point 4 --no-write    # a smoke run
    python bench/compare.py --peer-url http://127.0.0.1:8080 [--peer-pid PID]      # a peer already running

One server at a time, never both at once (a second busy process collapses either side's
thread pool on a small CPU):

1. inferd: `inferd serve --port 0 --dtype bfloat16 --model MODEL` with its default settings,
   from a scratch folder (no ./inferd.toml is read); the URL comes from its start-up line
   ("inferd serving NAME ... on http://HOST:PORT"), then GET /ready must answer 200.
2. the peer: llama.cpp's `llama-server -m MODEL -np 16 -c 16384 -t CORES` from the binary that
   bench/build_llama_server.sh caches (`--peer-bin`), ready once GET /health answers 200; or,
   with `--peer-url`, any OpenAI-compatible server someone already runs (nothing started).

MODEL is the default SmolLM2-135M-Instruct Q4_1 GGUF (`--model` for another). On each server,
for each concurrency C (default 1, 4, 16, 32), the driver `inferd bench` runs once, closed loop:
max(8, 3 x C) measured requests (`--requests-per-point N` to fix the count) after a warm-up,
streaming /v1/completions with prompts of 30-60 tokens and exactly 128 output tokens (EOS
ignored); BENCH_ARGS below is the workload, identical for both sides. Its JSON summary gives
output tokens/s, TTFT and TPOT percentiles with vLLM's definitions (TPOT excludes the first
token).

CPU: around each run the machine's busy time (/proc/stat) is read, less the server's CPU time
(/proc/PID/stat), the driver's (its rusage as a reaped child) and this script's: what is left
is other processes'. A run where they took more than 0.2 cores is run once more, and the less
disturbed of the two kept (both printed and recorded). With `--peer-url` and no `--peer-pid`
the peer's own CPU cannot be told apart: "other" then includes it and nothing is repeated.

Output: a table per concurrency, ratio = inferd / peer in every column (output tokens/s:
higher is better; TTFT, TPOT: lower is better), the issue's targets marked met / missed
(inferd >= 1.5x the peer's output tokens/s at 16 and 32 and >= 0.5x at 1; TTFT p99 lower at
every concurrency >= 4), and the CPU of other processes per run. It is appended as a dated
section, with this command line and both sides' JSON summaries, to bench/RESULTS.md
(`--results PATH`; `--no-write` only prints). Every request's timings stay in the driver's
JSON files under `--json-dir` (default ~/.cache/inferd/compare/DATE-TIME, outside the repo).

Time with the defaults on the 2-core machine: ~7 minutes (inferd ~4 min, its concurrency-1 point
alone ~70 s at ~18 tok/s, warm-up included; llama-server ~2.5 min), up to twice that when every
run is disturbed and repeated. The smoke run above takes ~1.5 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEER_BIN = Path(os.environ.get("INFERD_PEER_DIR", Path.home() / ".cache/inferd/llama-server")) / "bin/llama-server"
DEFAULT_RESULTS = REPO / "bench" / "RESULTS.md"
CONCURRENCIES = (1, 4, 16, 32)
OUTPUT_LEN = 128
WARMUP = 2
MAX_OTHER_CORES = 0.2  # other processes' CPU above this: the run is repeated once

# The workload, identical for both sides: `inferd bench URL` + these + the per-point flags
# (--concurrency, --num-requests, --json, --model). Streaming /v1/completions; prompts of
# 30-60 tokens of prose (uniform over [45(1 - s), 45(1 + s)] = [30, 60] with s = 0.3333),
# exactly OUTPUT_LEN output tokens (EOS ignored), a fixed seed: the same prompts on both sides.
BENCH_ARGS = (
    "--endpoint", "completions", "--input-len", "45", "--input-dist", "uniform", "--spread", "0.3333",
    "--output-len", str(OUTPUT_LEN), "--output-dist", "fixed", "--ignore-eos", "--warmup", str(WARMUP), "--seed", "0",
)
# where each compared metric is in a run's `summary` of the driver's JSON ({"runs": [{"summary":
# ...}]}), and the factor that makes it tokens/s or seconds
SUMMARY_KEYS: dict[str, tuple[tuple[str, ...], float]] = {
    "output_tok_s": (("output_throughput",), 1.0),
    "ttft_p50": (("ttft", "p50"), 1.0),
    "ttft_p99": (("ttft", "p99"), 1.0),
    "tpot_p50": (("tpot", "p50"), 1.0),
    "tpot_p99": (("tpot", "p99"), 1.0),
}
STARTUP_LINE = re.compile(r"inferd serving (\S+) .* on (http://[\w.\[\]:-]+:\d+)")


# ------------------------------------------------------------------------------ servers

@dataclass
class Server:
    side: str  # "inferd" or "peer"
    url: str
    model: str | None  # the name requests send (None: let the driver ask /v1/models)
    pid: int | None  # for CPU accounting; None: not ours and not given
    description: str


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_ready(url: str, path: str, proc: subprocess.Popen | None, log: Path | None, timeout: float) -> None:
    """Poll GET url+path until it answers 200; exit with the log's tail if the process dies first."""
    deadline = time.monotonic() + timeout
    while _get(url + path, timeout=2.0)[0] != 200:
        if proc is not None and proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            sys.exit(f"{url}{path} never answered 200 (exit code {proc.poll() if proc else None}):\n{tail}")
        time.sleep(0.2)


def served_model(url: str) -> str | None:
    status, body = _get(url + "/v1/models")
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        return json.loads(body)["data"][0]["id"] if status == 200 else None
    return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def inferd_server(tmp: Path, model: Path, extra: list[str]) -> Iterator[Server]:
    """`inferd serve` on a free port with its default settings (bfloat16), from a scratch folder."""
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--port", "0", "--dtype", "bfloat16", "--model", str(model),
           *extra]
    log = tmp / "inferd.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, cwd=tmp, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (match := STARTUP_LINE.search(log.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"inferd serve did not start (exit code {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        wait_ready(match.group(2), "/ready", proc, log, 120)
        yield Server("inferd", match.group(2), match.group(1), proc.pid,
                     f"`inferd serve --dtype bfloat16{''.join(' ' + a for a in extra)}` (default settings)")
    finally:
        stop(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_version(binary: Path) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        for line in (out.stdout + out.stderr).splitlines():
            if line.startswith("version:"):
                return line.removeprefix("version:").strip()
    return "unknown version"


def peer_args(threads: int) -> list[str]:
    return ["-np", "16", "-c", "16384", "-t", str(threads)]


@contextlib.contextmanager
def llama_server(tmp: Path, binary: Path, model: Path, threads: int) -> Iterator[Server]:
    """llama.cpp's llama-server on a free local port, ready once GET /health answers 200."""
    if not os.access(binary, os.X_OK):
        sys.exit(f"no llama-server at {binary}: run bench/build_llama_server.sh (or give --peer-bin / --peer-url)")
    port, args = free_port(), peer_args(threads)
    cmd = [str(binary), "-m", str(model), *args, "--host", "127.0.0.1", "--port", str(port)]
    log = tmp / "llama-server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, "/health", proc, log, 180)
        yield Server("peer", url, served_model(url), proc.pid,
                     f"llama.cpp `llama-server` {peer_version(binary)} (`{' '.join(args)}`)")
    finally:
        stop(proc)


@contextlib.contextmanager
def external_server(url: str, pid: int | None) -> Iterator[Server]:
    url = url.rstrip("/")
    if _get(url + "/v1/models")[0] == 0:
        sys.exit(f"--peer-url {url}: no answer on /v1/models")
    yield Server("peer", url, served_model(url), pid, f"the server at {url} (not started by this script)")


# ------------------------------------------------------------------------------ CPU accounting

def proc_cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process, all its threads (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def reaped_children_seconds() -> float:
    """CPU seconds of this process's children that have been waited for (the driver, once it exits)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    busy: float
    server: float | None
    driver: float
    me: float

    @classmethod
    def take(cls, server_pid: int | None) -> CpuSnapshot:
        server = None
        if server_pid is not None:
            with contextlib.suppress(OSError):
                server = proc_cpu_seconds(server_pid)
        return cls(time.perf_counter(), machine_busy_seconds(), server, reaped_children_seconds(),
                   proc_cpu_seconds("self"))


def cpu_usage(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, Any]:
    """Seconds of CPU over the interval: the server's, the driver's, this script's, everyone else's."""
    wall = after.wall - before.wall
    server = after.server - before.server if after.server is not None and before.server is not None else None
    driver, me = after.driver - before.driver, after.me - before.me
    other = max(0.0, (after.busy - before.busy) - (server or 0.0) - driver - me)
    return {"wall_s": wall, "server_cpu_s": server, "driver_cpu_s": driver, "script_cpu_s": me,
            "other_cpu_s": other, "other_cores": other / wall if wall > 0 else 0.0,
            "other_includes_server": server is None, "cores": os.cpu_count() or 1}


# ------------------------------------------------------------------------------ one point

def requests_for(concurrency: int, fixed: int | None) -> int:
    return fixed or max(8, 3 * concurrency)


def driver_command(driver: list[str], server: Server, concurrency: int, num_requests: int, json_path: Path) -> list[str]:
    cmd = [*driver, server.url, "--concurrency", str(concurrency), "--num-requests", str(num_requests), *BENCH_ARGS,
           "--json", str(json_path)]
    return cmd + (["--model", server.model] if server.model else [])


def extract(summary: dict[str, Any]) -> dict[str, float]:
    """The compared metrics, in tokens/s and seconds, from the driver's JSON summary."""
    out, missing = {}, []
    for name, (path, scale) in SUMMARY_KEYS.items():
        value: Any = summary
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)):
            out[name] = float(value) * scale
        else:
            missing.append(".".join(path))
    if missing:
        raise KeyError(f"the driver's summary lacks {missing} (it has {sorted(summary)}): adjust SUMMARY_KEYS")
    return out


@dataclass
class Attempt:
    json_path: str
    cpu: dict[str, Any]
    summary: dict[str, Any]
    metrics: dict[str, float]


@dataclass
class Point:
    side: str
    concurrency: int
    num_requests: int
    attempts: list[Attempt] = field(default_factory=list)
    kept: int = 0  # index into attempts

    @property
    def best(self) -> Attempt:
        return self.attempts[self.kept]


def run_driver(cmd: list[str], log: Path, timeout: float, server: Server) -> tuple[dict[str, Any], dict[str, Any]]:
    """One driver run: (its JSON summary, the CPU usage over it)."""
    json_path = Path(cmd[cmd.index("--json") + 1])
    before = CpuSnapshot.take(server.pid)
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    cpu = cpu_usage(before, CpuSnapshot.take(server.pid))
    if rc != 0 or not json_path.is_file():
        tail = log.read_text(errors="replace")[-3000:]
        sys.exit(f"the driver {'timed out' if rc is None else f'exited with {rc}'} ({log}):\n{tail}")
    result = json.loads(json_path.read_text())
    if result.get("fatal") or len(result.get("runs", ())) != 1:
        sys.exit(f"the driver's run failed ({json_path}): {result.get('fatal') or 'expected one run'}")
    return result["runs"][0]["summary"], cpu


def run_point(args: argparse.Namespace, server: Server, concurrency: int, json_dir: Path) -> Point:
    point = Point(server.side, concurrency, requests_for(concurrency, args.requests_per_point))
    for attempt in (1, 2):
        stem = f"{server.side}-c{concurrency}" + ("" if attempt == 1 else "-repeat")
        json_path = json_dir / f"{stem}.json"
        cmd = driver_command(args.driver, server, concurrency, point.num_requests, json_path)
        summary, cpu = run_driver(cmd, json_dir / f"{stem}.log", args.point_timeout, server)
        point.attempts.append(Attempt(str(json_path), cpu, summary, extract(summary)))
        m = point.attempts[-1].metrics
        if summary.get("failed"):
            print(f"  WARNING: {summary['failed']} of {summary.get('requests')} requests failed: "
                  f"{summary.get('errors')} ({json_dir / stem}.log)", flush=True)
        print(f"  {server.side} c={concurrency} n={point.num_requests}: {m['output_tok_s']:.1f} out tok/s, "
              f"TTFT p50 {m['ttft_p50']:.3f} s p99 {m['ttft_p99']:.3f} s, TPOT p50 {m['tpot_p50'] * 1e3:.1f} ms; "
              + cpu_line(cpu), flush=True)
        if cpu["other_includes_server"] or cpu["other_cores"] <= MAX_OTHER_CORES:
            break
        if attempt == 1:
            print(f"  disturbed: other processes took {cpu['other_cores']:.2f} cores (> {MAX_OTHER_CORES}): "
                  "running it once more", flush=True)
    point.kept = min(range(len(point.attempts)), key=lambda i: point.attempts[i].cpu["other_cores"])
    if len(point.attempts) > 1:
        print(f"  kept attempt {point.kept + 1} (other processes {point.best.cpu['other_cores']:.2f} cores)", flush=True)
    return point


def cpu_line(cpu: dict[str, Any]) -> str:
    server = "n/a" if cpu["server_cpu_s"] is None else f"{cpu['server_cpu_s']:.1f} s"
    other = "other processes" + (" (server included)" if cpu["other_includes_server"] else "")
    return (f"CPU over {cpu['wall_s']:.0f} s: server {server}, driver {cpu['driver_cpu_s']:.1f} s, "
            f"{other} {cpu['other_cpu_s']:.1f} s = {cpu['other_cores']:.2f} of {cpu['cores']} cores")


def run_side(args: argparse.Namespace, server: Server, json_dir: Path) -> list[Point]:
    print(f"{server.side}: {server.description} at {server.url}, model {server.model}", flush=True)
    return [run_point(args, server, c, json_dir) for c in args.concurrency]


# ------------------------------------------------------------------------------ the report

COLUMNS = (("output_tok_s", "out tok/s", 1.0, 1), ("ttft_p50", "TTFT p50 s", 1.0, 3),
           ("ttft_p99", "TTFT p99 s", 1.0, 3), ("tpot_p50", "TPOT p50 ms", 1e3, 1), ("tpot_p99", "TPOT p99 ms", 1e3, 1))


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def ratio_table(inferd: list[Point], peer: list[Point], peer_name: str) -> str:
    """Markdown: per concurrency and metric, inferd, the peer and inferd / peer."""
    head = ["conc."] + [f"{label} {who}" if who else "ratio" for _, label, _, _ in COLUMNS
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
        for key, _, scale, digits in COLUMNS:
            cells += [f"{a[key] * scale:.{digits}f}", f"{b[key] * scale:.{digits}f}", fmt_ratio(ratio(a[key], b[key]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(inferd: list[Point], peer: list[Point]) -> list[tuple[str, bool | None]]:
    """The issue's targets: (what, met); met None where the concurrency was not run."""
    a = {p.concurrency: p.best.metrics for p in inferd}
    b = {p.concurrency: p.best.metrics for p in peer}
    out: list[tuple[str, bool | None]] = []

    def throughput(c: int, least: float) -> None:
        if c in a and c in b:
            r = ratio(a[c]["output_tok_s"], b[c]["output_tok_s"])
            out.append((f"output tok/s at concurrency {c} >= {least:g}x the peer's: {fmt_ratio(r)}",
                        r is not None and r >= least))
        else:
            out.append((f"output tok/s at concurrency {c} >= {least:g}x the peer's: not run", None))

    throughput(16, 1.5)
    throughput(32, 1.5)
    throughput(1, 0.5)
    for c in sorted(set(a) & set(b)):
        if c >= 4:
            x, y = a[c]["ttft_p99"], b[c]["ttft_p99"]
            out.append((f"TTFT p99 at concurrency {c} lower than the peer's: {x:.3f} s vs {y:.3f} s "
                        f"({fmt_ratio(ratio(x, y))})", x < y))
    if not any(c >= 4 for c in set(a) & set(b)):
        out.append(("TTFT p99 lower at every concurrency >= 4: not run", None))
    return out


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


def report(args: argparse.Namespace, inferd: Server, peer: Server, ip: list[Point], pp: list[Point],
           json_dir: Path, started: dt.datetime, seconds: float) -> str:
    """The dated RESULTS.md section."""
    command = shlex.join([".venv/bin/python", "bench/compare.py", *sys.argv[1:]])
    summaries = "{\n" + ",\n".join(f' "{p.side} c{p.concurrency}": {json.dumps(rounded(p.best.summary))}'
                                     for p in ip + pp) + "\n}"
    workload = shlex.join(["inferd", "bench", "URL", "--concurrency", "C", "--num-requests", "N", *BENCH_ARGS])
    return f"""
## inferd vs a peer server, side by side (issue 6)

`{command}` ({started:%Y-%m-%d %H:%M}, {seconds / 60:.1f} min)

Machine: {machine()}. Model file: `{args.model}`. One server at a time.
- inferd: {inferd.description}.
- peer: {peer.description}.
- workload, the same for both: `{workload}`, with N = {"max(8, 3 x C)" if not args.requests_per_point
                                                      else args.requests_per_point}
  measured requests per concurrency C (closed loop, streaming completions).

Ratio = inferd / peer (output tok/s: higher is better; TTFT, TPOT: lower is better).

{ratio_table(ip, pp, "peer")}

Targets (issue 6):
{targets_text(targets(ip, pp))}

CPU per run (other processes over {MAX_OTHER_CORES} cores: run repeated once, the less disturbed kept):
{cpu_text(ip + pp)}

Every request's timings: the driver's JSON files in `{json_dir}` (not in the repo).

<details><summary>The driver's JSON summaries (one line per side and concurrency; times in s)</summary>

```json
{summaries}
```
</details>
"""


# ------------------------------------------------------------------------------ main

def parse_concurrency(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def default_model() -> Path:
    from inferd.model.loader import default_model_path

    return Path(default_model_path())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=parse_concurrency, default=list(CONCURRENCIES),
                        help="comma-separated (default: 1,4,16,32)")
    parser.add_argument("--requests-per-point", type=int, help="measured requests per concurrency "
                        "(default: max(8, 3 x concurrency))")
    parser.add_argument("--model", type=Path, help="the GGUF both serve (default: the embedded SmolLM2)")
    parser.add_argument("--peer-bin", type=Path, default=DEFAULT_PEER_BIN,
                        help=f"llama-server binary (default: {DEFAULT_PEER_BIN}, from bench/build_llama_server.sh)")
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server -t (default: every core, as inferd uses)")
    parser.add_argument("--peer-url", help="compare against this running server instead of starting llama-server")
    parser.add_argument("--peer-pid", type=int, help="with --peer-url: its process id, for the CPU accounting")
    parser.add_argument("--inferd-args", default="", help="extra `inferd serve` arguments (default: none)")
    parser.add_argument("--driver", type=shlex.split, default=[sys.executable, "-m", "inferd.cli", "bench"],
                        help="the load generator command (default: this Python's `-m inferd.cli bench`)")
    parser.add_argument("--point-timeout", type=float, default=1800.0, help="seconds one driver run may take")
    parser.add_argument("--json-dir", type=Path, help="where the driver's JSON files and logs go "
                        "(default: ~/.cache/inferd/compare/DATE-TIME)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="the Markdown file to append to")
    parser.add_argument("--no-write", action="store_true", help="print the section only; write no RESULTS file")
    args = parser.parse_args()
    args.model = (args.model or default_model()).resolve()
    started, t0 = dt.datetime.now(), time.perf_counter()
    json_dir = args.json_dir or Path.home() / ".cache/inferd/compare" / f"{started:%Y%m%d-%H%M%S}"
    json_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}; concurrency {args.concurrency}; driver JSON and logs in {json_dir}", flush=True)

    with tempfile.TemporaryDirectory(prefix="inferd-compare-") as tmp:
        with inferd_server(Path(tmp), args.model, shlex.split(args.inferd_args)) as server:
            inferd_srv, inferd_points = server, run_side(args, server, json_dir)
        peer_cm = external_server(args.peer_url, args.peer_pid) if args.peer_url else \
            llama_server(Path(tmp), args.peer_bin, args.model, args.peer_threads)
        with peer_cm as server:
            peer_srv, peer_points = server, run_side(args, server, json_dir)

    section = report(args, inferd_srv, peer_srv, inferd_points, peer_points, json_dir, started,
                     time.perf_counter() - t0)
    print(section)
    if not args.no_write:
        with open(args.results, "a") as f:
            f.write(section)
        print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
