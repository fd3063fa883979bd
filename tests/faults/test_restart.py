"""Crash recovery: `kill -9` of a real `inferd serve` subprocess while it streams, under a tiny
supervisor that restarts it the way systemd's Restart=always does, on the same address.

    supervisor thread:  start_server ──▶ proc.wait() ──▶ (exit -9) ──▶ start_server ──▶ proc.wait() ──▶ (SIGTERM: 0)
    test:               reference ─ 4 streams ─ kill -9 ─ streams cut ─ /ready 200 ─ same answer ─ stop

NOTE: the restarted server binds the port the killed one held while its connections to the
clients may still sit in TIME_WAIT; aiohttp's TCPSite leaves reuse_address to asyncio, whose
create_server sets SO_REUSEADDR on POSIX, so the bind succeeds. A failed start is recorded, and
the test asserts there was none.

The soak tier runs it on the default model; the default tier's twin on a tiny random Llama
folder (the same kill, restart and answers, without two GGUF loads of seconds each on two cores).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
import tiny_models  # (tests/model's builders of tiny checkpoints)
from serveproc import Server, start_server, stop_server  # noqa: E402  (tests/e2e's real-subprocess helpers)

pytestmark = pytest.mark.served  # it starts a real server

MODEL = "smollm2"
# Light on a 2-core machine; batch-invariant (the default), so a greedy answer is token-exact from
# one process to the next; no idle probe, so no probe run shares a batch with the test's requests.
SERVE_ARGS = ("--host", "127.0.0.1", "--served-model-name", MODEL,
              "--kv-cache-memory", "32MiB", "--max-num-seqs", "8", "--probe-interval", "0")
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
LONG_STREAM = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 200, "temperature": 0,
               "ignore_eos": True, "stream": True}
# the tiny model's streams are longer: a few ms a step, they still run when the kill comes
TINY_LONG_TOKENS = 1500
RESTART_SECONDS = 0.1  # systemd's default RestartSec
START_LIMIT = 3  # failed starts in a row before the supervisor gives up (systemd's StartLimitBurst)


class Supervisor:
    """Keeps one `inferd serve` running on a fixed port: starts it, and starts it again when it
    exits, until stopped. Each start has its own working folder (and so its own serve.log)."""

    def __init__(self, workdir: Path, port: int, args: tuple[str, ...]) -> None:
        self.workdir = workdir
        self.port = port
        self.args = args
        self.servers: list[Server] = []  # every start that became ready, in order
        self.exits: list[int] = []  # their exit codes, in order (-9: killed by SIGKILL)
        self.failed_starts: list[str] = []
        self._stopping = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set() and len(self.failed_starts) < START_LIMIT:
            folder = self.workdir / f"start-{len(self.servers) + len(self.failed_starts) + 1}"
            folder.mkdir()
            try:  # (a later --port overrides start_server's "--port 0")
                server = start_server(folder, "--port", str(self.port), *self.args)
            except AssertionError as e:  # it exited, or never got ready
                self.failed_starts.append(str(e))
                time.sleep(RESTART_SECONDS)
                continue
            with self._changed:
                self.servers.append(server)
                self._changed.notify_all()
            if self._stopping.is_set():  # stopped while it was starting: close() ends it
                return
            self.exits.append(server.proc.wait())
            time.sleep(RESTART_SECONDS)

    def wait_for_start(self, n: int, timeout: float) -> Server:
        """The n-th start (1-based), once it is ready."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self.servers) >= n or not self._thread.is_alive(), timeout):
                raise AssertionError(f"start {n} not ready within {timeout} s; failed starts: {self.failed_starts}")
            if len(self.servers) < n:
                raise AssertionError(f"the supervisor gave up; failed starts: {self.failed_starts}")
            return self.servers[n - 1]

    def stop(self) -> None:
        """What `systemctl stop` does: no more restarts, SIGTERM, and exit 0 asserted."""
        self._stopping.set()
        stop_server(self.servers[-1])
        self._thread.join(timeout=10)

    def close(self) -> None:
        """Leave no process behind, whatever state the test left things in."""
        self._stopping.set()
        for server in self.servers:
            if server.proc.poll() is None:
                server.proc.kill()
        if self._thread.is_alive():  # (a start in progress ends within start_server's own deadline)
            self._thread.join(timeout=150)
        for server in self.servers:
            if server.proc.poll() is None:
                server.proc.kill()
            server.proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = tiny_models.train_sentencepiece(folder)
    # seed 3: its greedy answer to GREEDY's prompt is 16 varied tokens (seed 1's is an EOS at once)
    tiny_models.tiny_llama(vocab, seed=3, max_position_embeddings=2048).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(params=[pytest.param("gguf", marks=pytest.mark.soak), "tiny"])
def served_model(request: pytest.FixtureRequest) -> tuple[tuple[str, ...], int]:
    """(the serve flags that choose the model, the tokens a long stream asks for)."""
    if request.param == "gguf":
        return (), LONG_STREAM["max_tokens"]
    return ("--model", str(request.getfixturevalue("tiny_llama"))), TINY_LONG_TOKENS


@pytest.fixture
def supervisor(tmp_path: Path, served_model: tuple[tuple[str, ...], int]) -> Iterator[Supervisor]:
    supervised = Supervisor(tmp_path, free_port(), (*SERVE_ARGS, *served_model[0]))
    yield supervised
    supervised.close()


async def greedy_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.post(f"{url}/v1/completions", json=GREEDY) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["text"]


async def long_stream(session: aiohttp.ClientSession, url: str, producing: asyncio.Event, tokens: int) -> str:
    """How a long stream ended: "finished" (it got its [DONE]), "closed" (the connection ended
    without it), or the name of the client error that cut it."""
    try:
        async with session.post(f"{url}/v1/completions", json={**LONG_STREAM, "max_tokens": tokens}) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: {"):
                    producing.set()
                elif line.startswith(b"data: [DONE]"):
                    return "finished"
    except aiohttp.ClientError as e:
        return type(e).__name__
    return "closed"


async def kill_mid_stream_then_ask_again(supervisor: Supervisor, long_tokens: int
                                         ) -> tuple[str, list[str], float, Server, int, str]:
    """(the reference answer, how each stream ended, seconds from the kill until the last stream
    ended, the restarted server, its /ready status, its answer to the same greedy request)."""
    first = supervisor.wait_for_start(1, timeout=120)
    # force_close: no keep-alive connection to the killed process is reused afterwards
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        reference = await greedy_text(session, first.url)
        producing = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.ensure_future(long_stream(session, first.url, e, long_tokens)) for e in producing]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in producing)), timeout=30)
        os.kill(first.proc.pid, signal.SIGKILL)  # kill -9, from outside the supervisor
        killed_at = time.monotonic()
        try:
            endings = await asyncio.wait_for(asyncio.gather(*streams), timeout=5)
        except TimeoutError:
            pytest.fail("a stream still hung 5 s after the server was killed")
        cut_after = time.monotonic() - killed_at
        second = await asyncio.to_thread(supervisor.wait_for_start, 2, 60)
        async with session.get(f"{second.url}/ready") as r:
            ready = r.status
        return reference, endings, cut_after, second, ready, await greedy_text(session, second.url)


def test_a_server_killed_with_sigkill_is_restarted_and_serves_the_same_answers_once_ready(
        supervisor: Supervisor, served_model: tuple[tuple[str, ...], int]) -> None:
    supervisor.start()
    reference, endings, cut_after, second, ready, answer = asyncio.run(
        kill_mid_stream_then_ask_again(supervisor, long_tokens=served_model[1]))
    first = supervisor.servers[0]

    assert "finished" not in endings, endings  # every stream was cut, none ran to its end
    assert cut_after < 5
    assert supervisor.exits == [-signal.SIGKILL]
    assert supervisor.failed_starts == []  # the port could be bound again at once
    assert second.proc.pid != first.proc.pid
    assert first.url == second.url == f"http://127.0.0.1:{supervisor.port}"  # the same address came back
    assert ready == 200  # the restarted server's start-up inference probe passed
    assert answer == reference and reference.strip()
    supervisor.stop()  # SIGTERM: exit 0
    assert len(supervisor.servers) == 2 and supervisor.exits == [-signal.SIGKILL, 0]
