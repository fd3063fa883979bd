"""The servers compare.py measures, one at a time: inferd, llama-server, vLLM's CPU build, or one
already running; each started, waited for, and stopped with its whole process group."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from inferd.api.startup import StartupLine

from peers.workload import LLAMA_CONTEXT_PER_SESSION, PEERS, PREFILL_CONTEXT, PREPARE_VLLM, VLLM_KVCACHE_GIB

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
    if workload == "prefill":  # one request at a time: one slot with the model's whole context
        return ["-np", "1", "-c", str(PREFILL_CONTEXT), "-t", str(threads)]
    if workload in ("conversation", "agent"):  # a slot per session, each with the model's whole context
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


def llama_system_info(binary: Path, model: Path, logs: Path, timeout: float = 60.0) -> str | None:
    """llama-server's `system_info:` line (the SIMD features it was built with), from a short start
    at log verbosity 4, which prints it (this build's default verbosity does not); stopped as soon as
    the line is there. None when it never came. Never run beside a measured server."""
    if not os.access(binary, os.X_OK):
        return None
    log = logs / "llama-server-system-info.log"
    cmd = [str(binary), "-m", str(model), "-lv", "4", "-c", "256", "-t", "1", "--host", "127.0.0.1",
           "--port", str(free_port())]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while (line := system_info_line(log)) is None and proc.poll() is None and time.monotonic() < deadline:
            if "listening on" in log.read_text(errors="replace"):
                break
            time.sleep(0.1)
        return line or system_info_line(log)
    finally:
        stop(proc)


def system_info_line(log: Path) -> str | None:
    """The `system_info:` line of a llama-server log (from the key on), None when there is none."""
    if not log.is_file():
        return None
    for line in log.read_text(errors="replace").splitlines():
        if "system_info:" in line:
            return line[line.index("system_info:"):].strip()
    return None


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


def vllm_args(served_name: str, max_seqs: int, workload: str = "requests") -> list[str]:
    args = ["--dtype", "bfloat16", "--served-model-name", served_name, "--max-num-seqs", str(max_seqs)]
    if workload == "prefill":  # the model's whole context, and the cached prompt tokens in usage (reported)
        args += ["--max-model-len", str(PREFILL_CONTEXT), "--enable-prompt-tokens-details"]
    return args


def vllm_env(install: VllmInstall, threads: int, tmp: Path) -> dict[str, str]:
    """The environment `vllm serve` runs in: loopback only, no usage reports, its CPU settings."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    # NOTE: not ONEDNN_MAX_CPU_ISA either: importing inferd sets it in this process (AVX-512 BF16, for
    # batch invariance), and vLLM capped by it runs its bf16 products without AMX (FACTS.md)
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD", "ONEDNN_MAX_CPU_ISA")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
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
