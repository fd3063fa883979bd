"""One point of a side: the driver `inferd bench` at one concurrency, its summary read back, repeated
once when other processes took the CPU."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from peers.cpu import CpuSnapshot, cpu_usage
from peers.servers import Server
from peers.workload import MAX_OTHER_CORES, OPTIONAL_KEYS, REPO, SUMMARY_KEYS, bench_args

def requests_for(workload: str, concurrency: int, fixed: int | None) -> int | None:
    """Measured requests per point; None: the driver's default (the conversation workload's)."""
    return fixed or (max(8, 3 * concurrency) if workload == "requests" else None)


def driver_command(driver: list[str], server: Server, concurrency: int, num_requests: int | None,
                   workload: tuple[str, ...], json_path: Path) -> list[str]:
    count = ["--num-requests", str(num_requests)] if num_requests else []
    cmd = [*driver, server.url, "--concurrency", str(concurrency), *count, *workload, "--json", str(json_path)]
    return cmd + (["--model", server.model] if server.model else [])


def check_driver(driver: list[str], workload: str) -> None:
    """Exit early when the driver lacks the workload asked for (before any server starts)."""
    if workload == "requests":
        return
    # `inferd bench` is a command group whose default command (`run`) carries the options
    helps = [subprocess.run([*driver, *sub, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO,
                            env=os.environ | {"COLUMNS": "200", "NO_COLOR": "1"}).stdout for sub in (["run"], [])]
    option = "--dataset" if workload == "prefill" else "--workload"  # prefill: its prompts are a dataset
    if not any(option in text for text in helps):
        sys.exit(f"the driver ({shlex.join(driver)}) has no {option} option: the {workload} workload needs an "
                 "`inferd bench` that has it")


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
    for name, (path, scale) in OPTIONAL_KEYS.items():
        value = summary
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, (int, float)):
            out[name] = float(value) * scale
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
    num_requests: int | None  # None: the driver's default
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
    point = Point(server.side, concurrency, requests_for(args.workload, concurrency, args.requests_per_point))
    for attempt in (1, 2):
        stem = f"{server.side}-{args.workload}-c{concurrency}" + ("" if attempt == 1 else "-repeat")
        json_path = json_dir / f"{stem}.json"
        cmd = driver_command(args.driver, server, concurrency, point.num_requests, bench_args(args), json_path)
        summary, cpu = run_driver(cmd, json_dir / f"{stem}.log", args.point_timeout, server)
        try:
            point.attempts.append(Attempt(str(json_path), cpu, summary, extract(summary)))
        except KeyError as e:
            sys.exit(f"{json_path}: {e.args[0]}")
        m = point.attempts[-1].metrics
        if summary.get("failed"):
            print(f"  WARNING: {summary['failed']} of {summary.get('requests')} requests failed: "
                  f"{summary.get('errors')} ({json_dir / stem}.log)", flush=True)
        later = f", later-turn TTFT p99 {m['ttft_later_p99']:.3f} s" if "ttft_later_p99" in m else ""
        print(f"  {server.side} c={concurrency} n={point.num_requests or summary.get('requests')}: "
              f"{m['output_tok_s']:.1f} out tok/s, TTFT p50 {m['ttft_p50']:.3f} s p99 {m['ttft_p99']:.3f} s{later}, "
              f"TPOT p50 {m['tpot_p50'] * 1e3:.1f} ms; " + cpu_line(cpu), flush=True)
        if not should_repeat(cpu, attempt):
            break
    keep_least_disturbed(point)
    return point


def should_repeat(cpu: dict[str, Any], attempt: int, again: str = "") -> bool:
    """Whether other processes took more than MAX_OTHER_CORES during an attempt (the first one
    says it is run once more, `again` naming how)."""
    if cpu["other_includes_server"] or cpu["other_cores"] <= MAX_OTHER_CORES:
        return False
    if attempt == 1:
        print(f"  disturbed: other processes took {cpu['other_cores']:.2f} cores (> {MAX_OTHER_CORES}): "
              f"running it once more{again}", flush=True)
    return True


def keep_least_disturbed(point: Point) -> None:
    point.kept = min(range(len(point.attempts)), key=lambda i: point.attempts[i].cpu["other_cores"])
    if len(point.attempts) > 1:
        print(f"  kept attempt {point.kept + 1} (other processes {point.best.cpu['other_cores']:.2f} cores)", flush=True)


def cpu_line(cpu: dict[str, Any]) -> str:
    server = "n/a" if cpu["server_cpu_s"] is None else f"{cpu['server_cpu_s']:.1f} s"
    other = "other processes" + (" (server included)" if cpu["other_includes_server"] else "")
    return (f"CPU over {cpu['wall_s']:.0f} s: server {server}, driver {cpu['driver_cpu_s']:.1f} s, "
            f"{other} {cpu['other_cpu_s']:.1f} s = {cpu['other_cores']:.2f} of {cpu['cores']} cores")


def run_side(args: argparse.Namespace, server: Server, json_dir: Path) -> list[Point]:
    print(f"{server.side}: {server.description} at {server.url}, model {server.model}", flush=True)
    return [run_point(args, server, c, json_dir) for c in args.concurrency]
