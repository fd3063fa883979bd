"""A local fleet: three real `inferd serve` replicas behind HAProxy (deploy/haproxy.cfg, rendered
by deploy/fleet.sh), loaded by the real `inferd bench` CLI while one replica is killed with
SIGKILL and another drained with SIGTERM.

    inferd bench ── 200 streams, 5/s, --retries 3 ──▶ haproxy ──▶ r1  SIGKILL after the 60th request
                                                     leastconn ├─▶ r2  SIGTERM after the 100th
                                                     /ready    └─▶ r3  serves to the end

(the soak tier's run; the default tier's twin is the same at 60 streams, 6/s, killing after the
18th and draining after the 30th)

What a SIGKILL can and cannot save: inferd sends a stream's headers at once, so HAProxy can retry
only what never reached the dead replica (a refused connection); a stream the dead replica held
before its first event is resent by `inferd bench --retries`, and so is a stream that had tokens
(cut mid-way: sent again from the start, the cut part not counted). So the test kills r1 while it
runs streams and queues more, and accounts for each: every request completes, 0 lost. It checks that HAProxy took the killed and the drained replica out of
the pool within its check interval (the drained one on its /ready 503, while still streaming)
and sent neither a new connection after, and that the drained replica finished every stream,
a long one through the balancer included, and exited 0. Measured numbers: docs/fleet.md.
"""

from __future__ import annotations

import concurrent.futures
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from serveproc import Server, start_server

pytestmark = pytest.mark.served  # it starts a real server

REPO = Path(__file__).resolve().parents[2]
FLEET_SH = REPO / "deploy" / "fleet.sh"
MODEL = "smollm2"
# Light on a 2-core machine: one torch thread per replica (three share the cores), no idle probe;
# no speculation (streams that copy their prompt would end before a replica holds 3 of them)
SERVE_ARGS = ("--host", "127.0.0.1", "--served-model-name", MODEL, "--dtype", "bfloat16",
              "--kv-cache-memory", "64MiB", "--probe-interval", "0", "--threads", "1", "--speculative", "off")
# NOTE: r1, the one killed, runs 2 sequences at a time, so that it holds streams of both kinds
# when it dies: running ones (with tokens: cut) and queued ones (no event yet: resent).
MAX_NUM_SEQS = {"r1": 2, "r2": 8, "r3": 8}
OUTPUT_TOKENS = 32  # long enough that a replica holds 3 streams at once on a fast CPU


@dataclass(frozen=True)
class Load:
    requests: int
    rate: float  # requests a second
    kill_at: int  # requests the balancer has received before r1 is killed
    drain_at: int  # ... and r2 drained


LOADS = [pytest.param(Load(200, 5, 60, 100), marks=pytest.mark.soak, id="200-requests"),
         pytest.param(Load(60, 6, 18, 30), id="60-requests")]
INTER, FALL = 1.0, 2  # deploy/haproxy.cfg's check timing
PINNED_TOKENS = 192  # a long stream, pinned to r2, that it finishes while draining (seconds, on a fast CPU too)
PIN_HEADER = "X-Fleet-Test-Pin"  # the test's copy of the config sends a request naming a replica there
HTTPLOG = re.compile(  # option httplog: ... backend/server Tq/Tw/Tc/Tr/Ta status bytes - - TERM ac/fc/bc/sc/retries
    r'^\S+ \[[^\]]+\] \S+ (?P<backend>[^/\s]+)/(?P<server>\S+) \S+ (?P<status>-?\d+) \d+ \S+ \S+ '
    r'(?P<term>\S{4}) \d+/\d+/\d+/\d+/(?P<redispatched>\+?)(?P<retries>\d+) \S+ "(?P<method>\S+) (?P<path>\S+)')


# ---------------------------------------------------------------------------------- HAProxy


def _install_haproxy() -> str | None:
    """Debian's haproxy via apt-get, when running as root where apt-get exists; the reason not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "haproxy is not installed (apt-get install haproxy needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "haproxy"]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"haproxy is not installed and {' '.join(command)} failed: {e}"
        if done.returncode != 0:
            return f"haproxy is not installed and {' '.join(command)} failed: {done.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def haproxy_bin() -> str:
    if shutil.which("haproxy") is None:
        reason = _install_haproxy()
        if reason is not None or shutil.which("haproxy") is None:
            pytest.skip(reason or "apt-get installed haproxy, but it is not on PATH")
    return str(shutil.which("haproxy"))


@dataclass
class Balancer:
    """A running HAProxy: its log lines as they came (monotonic time, line) and its stats socket."""

    proc: subprocess.Popen
    url: str
    stats_socket: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    def read_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def close(self) -> None:
        """Once it has exited: the rest of its log read, the pipe closed."""
        if self.reader is not None:
            self.reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def stat(self) -> dict[str, dict[str, str]]:
        """`show stat`: one row per proxy and server, keyed "backend/server" ("inferd/FRONTEND")."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.stats_socket))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        text = data.decode().lstrip("# ")
        return {f"{r['pxname']}/{r['svname']}": r for r in csv.DictReader(text.splitlines()) if r.get("pxname")}

    def requests(self) -> list[tuple[float, dict[str, str]]]:
        """The request lines of the log (option httplog), parsed, with when each came (its end)."""
        return [(t, m.groupdict()) for t, line in self.lines if (m := HTTPLOG.match(line))]

    def about(self, server: str, after: float) -> list[str]:
        """The log's lines naming the server after `after` (for a failure's message)."""
        return [f"{t - after:+.3f} {line}" for t, line in self.lines if t > after and server in line]

    def went_down(self, server: str, after: float) -> tuple[float, str] | None:
        """(when, why) the log first said the server is DOWN after `after`: why is the failed
        check's reason ("Layer7 wrong status": /ready answered 503; "Layer4 connection problem":
        refused; "Health analyze": a failed connection of real traffic, observe layer4)."""
        reason = ""
        for t, line in self.lines:
            if t > after and (m := re.search(rf"server replicas/{server} failed, reason: ([^,]+)", line)):
                reason = m.group(1)
            if t > after and f"Server replicas/{server} is DOWN" in line:
                return t, reason
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_balancer(haproxy: str, folder: Path, servers: list[Server]) -> Balancer:
    """HAProxy on a free port with deploy/haproxy.cfg, rendered by `deploy/fleet.sh config` for
    these replicas; returned once every server is UP and a request through it is answered."""
    bind = f"127.0.0.1:{free_port()}"
    addrs = [s.url.removeprefix("http://") for s in servers]
    config = folder / "haproxy.cfg"
    rendered = subprocess.run(["bash", str(FLEET_SH), "config", bind, *addrs], capture_output=True, text=True,
                              check=True).stdout
    # NOTE: the test's only addition, at the end of the backend: a request with PIN_HEADER goes
    # to the replica it names while that one is up (to hold a long stream on the drained one).
    pins = "".join(f"    use-server r{i} if {{ req.hdr({PIN_HEADER}) -m str r{i} }}\n" for i in range(1, len(servers) + 1))
    assert rendered.rstrip().endswith("# replicas: end")
    config.write_text(rendered + pins)
    # NOTE: a unix socket path has at most 107 bytes: the stats socket goes in a short folder
    stats_socket = Path(tempfile.mkdtemp(prefix="lb")) / "stats.sock"
    with open(folder / "haproxy.err", "w") as stderr:  # (the child keeps its own copy of the descriptor)
        proc = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=subprocess.PIPE, stderr=stderr,
                                text=True, bufsize=1, env={**os.environ, "INFERD_LB_STATS": str(stats_socket)})
    balancer = Balancer(proc, f"http://{bind}", stats_socket)
    balancer.reader = threading.Thread(target=balancer.read_log, name="haproxy-log", daemon=True)
    balancer.reader.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"haproxy exited with {proc.returncode}: {(folder / 'haproxy.err').read_text()}")
        try:
            rows = balancer.stat()
            with urllib.request.urlopen(f"{balancer.url}/ready", timeout=5) as r:
                if r.status == 200 and all(rows[f"replicas/r{i + 1}"]["status"] == "UP" for i in range(len(servers))):
                    return balancer
        except (OSError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"haproxy did not come up: {(folder / 'haproxy.err').read_text()}")


class StatsPoller:
    """Samples `show stat` every 0.1 s in a thread: (monotonic time, rows) for what happened when."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer
        self.samples: list[tuple[float, dict[str, dict[str, str]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="haproxy-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), self.balancer.stat()))
            except OSError:
                pass
            self._stop.wait(0.1)

    def latest(self) -> dict[str, dict[str, str]]:
        return self.samples[-1][1] if self.samples else {}

    def wait_for(self, condition: Callable[[dict[str, dict[str, str]]], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.latest()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; last stats: {self.latest()}")
            time.sleep(0.05)

    def first_down(self, key: str, after: float) -> tuple[float, int] | None:
        """(when, its stot then) of the first sample after `after` where `key` is DOWN."""
        for t, rows in self.samples:
            if t > after and rows.get(key, {}).get("status", "").startswith("DOWN"):
                return t, int(rows[key]["stot"])
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ------------------------------------------------------------------------------------ fleet


@dataclass
class Fleet:
    replicas: list[Server]
    balancer: Balancer
    stats: StatsPoller


@pytest.fixture
def fleet(haproxy_bin: str, tmp_path: Path) -> Iterator[Fleet]:
    started: list[Server] = []
    balancer: Balancer | None = None
    stats: StatsPoller | None = None
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = []
            for name, seqs in MAX_NUM_SEQS.items():
                (tmp_path / name).mkdir()
                futures.append(pool.submit(start_server, tmp_path / name, *SERVE_ARGS, "--max-num-seqs", str(seqs)))
            for future in futures:  # (every start is awaited, so a failed one leaves none behind)
                try:
                    started.append(future.result())
                except AssertionError:
                    pass
        assert len(started) == 3, "a replica did not start"
        balancer = start_balancer(haproxy_bin, tmp_path, started)
        stats = StatsPoller(balancer)
        yield Fleet(started, balancer, stats)
    finally:
        if stats is not None:
            stats.stop()
        for proc in [s.proc for s in started] + ([balancer.proc] if balancer else []):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        if balancer is not None:  # (its log kept beside the replicas' for a failed run)
            balancer.close()
            (tmp_path / "haproxy.log").write_text("".join(f"{t:.3f} {line}\n" for t, line in balancer.lines))
            shutil.rmtree(balancer.stats_socket.parent, ignore_errors=True)


# ------------------------------------------------------------------------------------- test


def start_bench(url: str, folder: Path, load: Load) -> subprocess.Popen:
    """The real `inferd bench` CLI: short streams at a steady rate, resending what is safe to send
    again (exponential backoff with full jitter from 1 s, honouring Retry-After)."""
    with open(folder / "bench.out", "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "inferd.cli", "bench", "run", url, "--model", MODEL, "--rate", str(load.rate),
             "--num-requests", str(load.requests), "--input-len", "16", "--output-len", str(OUTPUT_TOKENS), "--ignore-eos",
             "--retries", "3", "--seed", "0", "--json", str(folder / "bench.json")],
            stdout=out, stderr=subprocess.STDOUT, cwd=folder)


def received(rows: dict[str, dict[str, str]]) -> int:
    """HTTP requests the balancer's frontend has received."""
    return int(rows.get("inferd/FRONTEND", {}).get("req_tot") or 0)


def wait_for_streams(balancer: Balancer, server: str, n: int, timeout: float) -> None:
    """Until HAProxy has at least n requests in progress on the server (a fresh `show stat`)."""
    deadline = time.monotonic() + timeout
    while int(balancer.stat()[f"replicas/{server}"]["scur"]) < n:
        assert time.monotonic() < deadline, f"{server} never had {n} requests in progress"
        time.sleep(0.01)


class PinnedStream:
    """One long stream through the balancer, pinned to a replica (PIN_HEADER), read in a thread:
    it keeps that replica's drain going longer than the balancer's checks take to see it."""

    def __init__(self, url: str, server: str, max_tokens: int) -> None:
        self.tokens = 0
        self.done = False  # its [DONE] came
        self.ended_at: float | None = None
        self.producing = threading.Event()
        body = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        self._request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                               headers={"Content-Type": "application/json", PIN_HEADER: server})
        self._thread = threading.Thread(target=self._read, name="pinned-stream", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self._request, timeout=60) as response:
                for line in response:
                    if line.startswith(b"data: [DONE]"):
                        self.done = True
                    elif line.startswith(b"data: {") and "choices" in json.loads(line[6:]):
                        self.tokens += 1
                        self.producing.set()
        except OSError:
            pass
        finally:
            self.ended_at = time.monotonic()
            self.producing.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclass
class Incidents:
    killed_at: float
    drained_at: float
    drain_exit: int
    exited_at: float
    pinned: PinnedStream


def kill_and_drain(fleet: Fleet, load: Load) -> Incidents:
    """SIGKILL r1 once the balancer has received `kill_at` requests and r1 holds more streams than
    it runs (some queued); SIGTERM r2 after `drain_at`, while it has streams from the balancer in
    flight, one of them long."""
    r1, r2, _ = fleet.replicas
    fleet.stats.wait_for(lambda rows: received(rows) >= load.kill_at, timeout=90)
    wait_for_streams(fleet.balancer, "r1", MAX_NUM_SEQS["r1"] + 1, timeout=30)
    os.kill(r1.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    fleet.stats.wait_for(lambda rows: received(rows) >= load.drain_at, timeout=90)
    pinned = PinnedStream(fleet.balancer.url, "r2", PINNED_TOKENS)
    assert pinned.producing.wait(timeout=30) and pinned.tokens, "the long stream to r2 never started"
    wait_for_streams(fleet.balancer, "r2", 3, timeout=30)  # the long one and two of bench's
    r2.proc.send_signal(signal.SIGTERM)
    drained_at = time.monotonic()
    drain_exit = r2.proc.wait(timeout=45)
    exited_at = time.monotonic()
    pinned.join(timeout=10)
    return Incidents(killed_at, drained_at, drain_exit, exited_at, pinned)


def left_the_pool(fleet: Fleet, server: str, at: float) -> tuple[float, str, int, int]:
    """(seconds from `at` until HAProxy logged the server DOWN, why, its sessions then, its
    sessions at the end): equal counts mean no new connection went to it after."""
    down = fleet.balancer.went_down(server, at)
    assert down is not None, f"HAProxy never took {server} out of the pool"
    sampled = fleet.stats.first_down(f"replicas/{server}", at)
    assert sampled is not None
    return down[0] - at, down[1], sampled[1], int(fleet.stats.latest()[f"replicas/{server}"]["stot"])


def drained_requests(log: str) -> tuple[int, list[dict[str, str]]]:
    """(requests in flight when the drain began, the fields of each API request that ended after)."""
    match = re.search(r"SIGTERM: draining (\d+) requests in flight", log)
    assert match is not None, log
    lines = log[match.start():].splitlines()
    return int(match.group(1)), [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines
                                 if "request path=/v1/completions" in line]


@pytest.mark.parametrize("load", LOADS)
def test_a_fleet_behind_haproxy_loses_no_request_to_a_kill_and_drains_cleanly(
        fleet: Fleet, tmp_path: Path, load: Load) -> None:
    began = time.monotonic()
    bench = start_bench(fleet.balancer.url, tmp_path, load)
    try:
        incidents = kill_and_drain(fleet, load)
        assert bench.wait(timeout=150) == 0, (tmp_path / "bench.out").read_text()
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    bench_seconds = time.monotonic() - began
    time.sleep(0.5)  # one more stats sample after the last request
    run = json.loads((tmp_path / "bench.json").read_text())["runs"][0]
    summary, records = run["summary"], run["requests"]
    lines = [(t, r) for t, r in fleet.balancer.requests() if r["path"] == "/v1/completions"]
    log = [r for _, r in lines]
    rows = fleet.stats.latest()
    r1_down, r1_why, r1_sessions_then, r1_sessions = left_the_pool(fleet, "r1", incidents.killed_at)
    r2_down, r2_why, r2_sessions_then, r2_sessions = left_the_pool(fleet, "r2", incidents.drained_at)
    in_flight, drained = drained_requests(fleet.replicas[1].log.read_text())
    finished = [e for e in drained if e["status"] == "200" and e.get("finish") == "length"]
    refused = [e for e in drained if e["status"] == "503" and e["completion_tokens"] == "0"]  # at the door
    # On the killed replica, HAProxy saw every request in progress end mid-response (SD): one
    # with tokens was cut (bench resends it from the start), one without is resent by bench too.
    failed = [r for r in records if r["error_type"] is not None]
    cut = [r for r in records if "cut" in r["retry_causes"]]
    resent = [r for r in records if "connection" in r["retry_causes"]]
    severed = [r for r in log if r["server"] == "r1" and r["term"].startswith("SD")]
    pinned = incidents.pinned
    measured = {
        "completed": summary["completed"], "cut_and_resent": len(cut), "resent_before_first_event": len(resent),
        "bench_retries": summary["retries"]["by_cause"], "severed_on_r1": len(severed),
        "haproxy_retries": int(rows["replicas/BACKEND"]["wretr"]),
        "haproxy_redispatches": int(rows["replicas/BACKEND"]["wredis"]),
        "r1_down_after_s": round(r1_down, 3), "r1_down_why": r1_why,
        "r2_down_after_s": round(r2_down, 3), "r2_down_why": r2_why,
        "drained_in_flight": in_flight, "refused_while_draining": len(refused),
        "r2_streams_ended_after_down": sum(r["server"] == "r2" and t > incidents.drained_at + r2_down
                                           for t, r in lines),
        "drain_s": round(incidents.exited_at - incidents.drained_at, 2), "pinned_tokens": pinned.tokens,
        "bench_s": round(bench_seconds, 1), "sessions": {k: int(rows[f"replicas/{k}"]["stot"]) for k in MAX_NUM_SEQS},
    }
    print("fleet measured:", json.dumps(measured))

    # Every request completed, 0 lost: the ones the kill hit were resent (cut ones from the start).
    assert summary["requests"] == summary["completed"] == load.requests and not failed, measured
    assert summary["errors"]["by_type"] == {}, measured
    assert len(cut) <= MAX_NUM_SEQS["r1"], measured
    assert len(severed) == len(cut) + len(resent), measured
    assert cut or resent, measured  # the kill hit requests in flight
    assert summary["retries"]["exhausted"] == 0 and summary["retries"]["by_cause"]["503"] == 0, measured
    assert all(r["status"] == "200" for r in log)  # no 503 (draining) reached a client: HAProxy retried it

    # The balancer stopped sending to each within its check interval, and never sent again; the
    # drained one left on its /ready 503, while still finishing its streams.
    assert r1_down <= INTER * FALL and r2_down <= INTER * FALL, measured
    assert r1_sessions_then == r1_sessions and r2_sessions_then == r2_sessions, measured
    assert r2_why == "Layer7 wrong status" and incidents.drained_at + r2_down < incidents.exited_at, (
        measured, fleet.balancer.about("r2", incidents.drained_at))

    # The drained replica finished every stream it had (none cut) and exited 0.
    assert incidents.drain_exit == 0 and in_flight >= 2, measured
    assert pinned.done and pinned.tokens == PINNED_TOKENS and pinned.ended_at > incidents.drained_at + r2_down
    log_text = fleet.replicas[1].log.read_text()
    assert "drain: every request finished" in log_text and "did not finish" not in log_text
    assert len(finished) == in_flight and len(finished) + len(refused) == len(drained), drained
    assert all(r["term"] == "----" for r in log if r["server"] == "r2")
