"""The serving layer's own cost: HTTP + SSE + engine loop + scheduler + detokenizer, no model.

`SyntheticZeroCostModel` stands in for the transformer: it returns precomputed logits, so
every step's model time is ~0 and what is measured is everything around it. The tokenizer is
the real SmolLM2 one, so prompts are really encoded and outputs really detokenized.

    launcher ──spawns──> server process: AsyncEngine(LLMEngine(zero-cost model)) + create_app
        │                  on 127.0.0.1:<free port>, uvloop, engine on its own thread
        └── client (this process): aiohttp, --concurrency streaming /v1/completions at once,
            counts SSE `data:` events (one per streamed chunk; the usage event is checked
            once per stream, so no JSON in the hot loop)

Streamed tokens/s = completion tokens of all streams / wall time from the first request to the
last stream's end, median of --runs runs (greedy by default, EOS ignored). The server also
reports its cost per steady-state step (schedule+update, and the whole `LLMEngine.step`) and
the CPU seconds of its event-loop thread, its engine thread and its other (torch) threads.
`--engine-only` runs the same load through `LLMEngine.step()` in-process (no HTTP, no thread):
the ceiling for the server. `--profile` prints cProfile's top functions of the engine thread
and of the event loop for the last run. `--vocab-size 1024` shrinks the model's vocabulary (the
prompt and the sampled words all have ids below 1024), which takes the sampler's [S, vocab]
work out of the picture.

    python bench/serve_overhead.py [--concurrency 256] [--max-tokens 200] [--runs 3]
    python bench/serve_overhead.py --engine-only [--profile] [--vocab-size 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from inferd.engine.builder import in_passing_thread
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.model.families.config import ModelConfig
from inferd.model.loading.loader import default_model_path
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer

MODEL_NAME = "synthetic-zero-cost"
# ordinary one-token words of the SmolLM2 vocabulary: row r of every step samples WORDS[r % 8]
WORDS = (" the", " and", " of", " to", " in", " is", " that", " for")
# 32 tokens; every id is below 1024, so --vocab-size 1024 can serve the same prompt
PROMPT = "The way we can have more of this and that: it is not for you or for them, and you can see it as it is, at all."


# ------------------------------------------------------------------------------ the model

class SyntheticZeroCostModel:
    """A zero-cost stand-in for `DecoderModel`, used only by this benchmark.

    It has the surface `LLMEngine` and `ModelRunner` use (`cfg`, `dtype`, `device`, `forward`,
    `set_attention`/`attention`)
    and a tiny config (1 layer, 1 KV head, head_dim 8), so the KV cache is negligible. `forward`
    does no arithmetic: it returns the first S rows of logits computed once at start-up, where
    row r peaks (by 30 nats, so sampling at temperature 1 picks it too) at one of a few
    ordinary word-piece tokens. The vocabulary is the real tokenizer's, so the sampler does
    its real work over [S, vocab].
    """

    def __init__(self, tokenizer: Tokenizer, max_rows: int, vocab_size: int = 0) -> None:
        vocab = vocab_size or tokenizer.vocab_size  # smaller: a cheaper sampler (diagnostic)
        self.cfg = ModelConfig(
            architecture="llama", vocab_size=vocab, hidden_size=8, intermediate_size=8, num_layers=1,
            num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=8192, tie_word_embeddings=True, name="synthetic",
        )
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        tokens = []
        for word in WORDS:
            [token] = tokenizer.encode(word)  # one ordinary token each
            tokens.append(token)
        self.tokens = tokens
        rows = torch.arange(max_rows)
        self._logits = torch.zeros(max_rows, vocab)  # [max_rows, vocab] float32
        self._logits[rows, torch.tensor(tokens)[rows % len(tokens)]] = 30.0
        self.attention: Any = None  # the engine's backend: the runner asks it for step plans

    def set_attention(self, backend: Any) -> None:
        self.attention = backend

    def set_batch_invariant(self, on: bool) -> None:
        pass  # precomputed logits: the same for any batch

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: Any,
        logits_indices: torch.Tensor,  # [S] int64
    ) -> torch.Tensor:  # [S, vocab] float32, a view: no copy, no matmul
        return self._logits[: logits_indices.shape[0]]


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    result = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        result[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return result


def build_engine(max_num_seqs: int, vocab_size: int = 0) -> LLMEngine:
    tokenizer = load_tokenizer(default_model_path())
    model = SyntheticZeroCostModel(tokenizer, max_num_seqs, vocab_size)
    assert max(tokenizer.encode(PROMPT)) < model.cfg.vocab_size, "the prompt must fit the vocabulary"
    config = EngineConfig.of(device="cpu", dtype="float32", kv_cache_memory=64 * 2**20,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=8192)
    return LLMEngine(model, tokenizer, config)  # type: ignore[arg-type]


class StepTimer:
    """Wraps one engine's schedule/update/step (on the instances) to time them per step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.records: list[tuple[int, float, float]] = []  # per step: (decodes, schedule+update s, step s)
        self.engine_tid = 0  # the native id of the thread that runs step()
        self._decodes, self._scheduler = 0, 0.0  # of the step in progress
        sched = engine.scheduler
        schedule, update, step = sched.schedule, sched.update, engine.step

        def timed_schedule() -> Any:
            t = time.perf_counter()
            out = schedule()
            self._scheduler += time.perf_counter() - t
            self._decodes = len(out.decodes)
            return out

        def timed_update(out: Any, sampled: dict[int, int]) -> None:
            t = time.perf_counter()
            update(out, sampled)
            self._scheduler += time.perf_counter() - t

        def timed_step() -> Any:
            self.engine_tid = threading.get_native_id()
            self._decodes, self._scheduler = 0, 0.0
            t = time.perf_counter()
            out = step()
            self.records.append((self._decodes, self._scheduler, time.perf_counter() - t))
            return out

        sched.schedule, sched.update, engine.step = timed_schedule, timed_update, timed_step  # type: ignore[method-assign]

    def summary(self, min_decodes: int) -> dict[str, float]:
        """Medians over the steps that decoded at least `min_decodes` sequences, then a reset."""
        keep = [r for r in self.records if r[0] >= min_decodes]
        self.records = []
        return {
            "steps": len(keep),
            "scheduler_ms": statistics.median(r[1] for r in keep) * 1e3 if keep else float("nan"),
            "step_ms": statistics.median(r[2] for r in keep) * 1e3 if keep else float("nan"),
        }


# ------------------------------------------------------------------------------ engine only

def engine_only(args: argparse.Namespace) -> None:
    engine = build_engine(args.concurrency, args.vocab_size)
    timer = StepTimer(engine)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
    profile = cProfile.Profile() if args.profile else None
    rates = []
    for run in range(args.runs):
        for _ in range(args.concurrency):
            engine.add(prompt_ids, params)
        tokens, chars = 0, 0
        start = time.perf_counter()
        if profile and run == 0:
            profile.enable()
        while engine.has_work():
            for out in engine.step().outputs:
                tokens += len(out.new_token_ids)
                chars += len(out.text)
        if profile and run == 0:
            profile.disable()
        elapsed = time.perf_counter() - start
        assert tokens == args.concurrency * args.max_tokens, tokens
        rates.append(tokens / elapsed)
        s = timer.summary(args.concurrency)
        print(f"run {run}: {tokens / elapsed:,.0f} tok/s ({elapsed:.2f} s, {chars / tokens:.1f} chars/token), "
              f"per {args.concurrency}-seq step: LLMEngine.step {s['step_ms']:.2f} ms, "
              f"schedule+update {s['scheduler_ms']:.3f} ms", flush=True)
    print(f"engine only: median {statistics.median(rates):,.0f} tokens/s")
    if profile:
        print_profile("LLMEngine.step (run 0)", profile)


def print_profile(title: str, profile: cProfile.Profile, limit: int = 25) -> None:
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(limit)
    print(f"\n==== profile: {title} (by own time) ====")
    print("\n".join(buf.getvalue().splitlines()[4:]))


# ------------------------------------------------------------------------------ server

class Commands:
    """The server process's stdin commands: `stats`, `profile`, `report`; anything else ends it.
    Called on the event loop's thread."""

    def __init__(self, llm: LLMEngine, timer: StepTimer, concurrency: int, done: asyncio.Event) -> None:
        self.llm, self.timer, self.concurrency, self.done = llm, timer, concurrency, done
        self.cpu_before = thread_cpu_seconds()
        self.profiles: dict[str, cProfile.Profile] = {}

    def __call__(self, line: str) -> None:
        if line == "stats":
            print("STATS " + json.dumps(self.stats()), flush=True)
        elif line == "profile":  # profile the next run: the loop thread and the engine thread
            start_profiles(self.llm, self.profiles)
            print("OK", flush=True)
        elif line == "report":
            for name, p in self.profiles.items():
                p.disable()
                print_profile(name, p)
            self.profiles.clear()
            print("OK", flush=True)
        else:
            self.done.set()

    def stats(self) -> dict[str, Any]:
        """The step timer's summary, and CPU seconds since the last `stats`: the loop thread, the
        engine thread, the rest."""
        now, before = thread_cpu_seconds(), self.cpu_before
        delta = {tid: t - before.get(tid, 0.0) for tid, t in now.items()}
        self.cpu_before = now
        stats = self.timer.summary(self.concurrency)
        stats["cpu_loop"] = delta.pop(threading.get_native_id(), 0.0)
        stats["cpu_engine"] = delta.pop(self.timer.engine_tid, 0.0)
        stats["cpu_other"] = sum(delta.values())
        return stats


def serve(args: argparse.Namespace) -> None:
    """The server process: prints `PORT <n>`, then answers `stats` / `profile` lines on stdin."""
    import uvloop
    from aiohttp import web

    from inferd.api.app import create_app
    from inferd.api.routing.registry import single_model
    from inferd.settings.config import load_settings
    from inferd.engine.async_engine import AsyncEngine

    torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    llm = in_passing_thread(build_engine, args.concurrency, args.vocab_size)  # (as `inferd serve` does)
    timer = StepTimer(llm)
    engine = AsyncEngine(llm)
    settings = load_settings(None, {
        "scheduler": {"max_num_seqs": args.concurrency},
        "limits": {"max_tokens_limit": max(4096, args.max_tokens)},
        "model": {"name": MODEL_NAME},
    }, environ={})
    app = create_app(single_model(engine, settings), settings)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        loop = asyncio.get_running_loop()
        print(f"PORT {runner.addresses[0][1]}", flush=True)
        done = asyncio.Event()

        command = Commands(llm, timer, args.concurrency, done)

        def read_stdin() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(command, line.strip())
            loop.call_soon_threadsafe(done.set)

        threading.Thread(target=read_stdin, daemon=True).start()
        await done.wait()
        await runner.cleanup()

    uvloop.run(main())


def start_profiles(llm: LLMEngine, profiles: dict[str, cProfile.Profile]) -> None:
    """cProfile sees one thread: one profiler here (the loop), one inside the engine's step."""
    loop_profile, engine_profile = cProfile.Profile(), cProfile.Profile()
    profiles["event loop thread (HTTP, SSE, streams)"] = loop_profile
    profiles["engine thread (LLMEngine.step)"] = engine_profile
    step = llm.step

    def profiled_step() -> Any:
        engine_profile.enable()
        try:
            return step()
        finally:
            engine_profile.disable()

    llm.step = profiled_step  # type: ignore[method-assign]
    loop_profile.enable()


# ------------------------------------------------------------------------------ client

async def one_stream(session: Any, url: str, body: bytes) -> tuple[int, int]:
    """(data events, completion tokens from the usage event) of one streamed completion.

    NOTE: the hot loop only counts b"data:" in raw chunks (the 4 bytes carried over cannot
    hold a whole match, so none is counted twice); the usage event is parsed once at the end.
    """
    count, tail, last = 0, b"", b""
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for chunk in resp.content.iter_any():
            count += (tail + chunk).count(b"data:")
            tail = chunk[-4:]
            last = (last + chunk)[-4096:]
    data = [line for line in last.split(b"\n") if line.startswith(b"data:")]
    assert data[-1] == b"data: [DONE]", data[-1:]
    usage = json.loads(data[-2][5:])["usage"]
    return count - 2, usage["completion_tokens"]  # less the usage event and [DONE]


async def client_run(port: int, args: argparse.Namespace, concurrency: int) -> tuple[float, int, int, float]:
    """(tokens/s, data events, completion tokens, seconds) of `concurrency` concurrent streams."""
    import aiohttp

    body = json.dumps({
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()
    url = f"http://127.0.0.1:{port}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, url, body) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    events = sum(e for e, _ in results)
    tokens = sum(u for _, u in results)
    return tokens / elapsed, events, tokens, elapsed


def launch(args: argparse.Namespace) -> None:
    import uvloop  # noqa: PLC0415 - the client runs on uvloop, as the server does
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--concurrency", str(args.concurrency),
           "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
           "--vocab-size", str(args.vocab_size), "--switch-interval", str(args.switch_interval)]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        port = int(expect(server, "PORT"))
        uvloop.run(client_run(port, args, 8))  # warm-up: connections, first-request paths
        ask(server, "stats")
        rates = []
        for run in range(args.runs):
            if args.profile and run == args.runs - 1:
                ask(server, "profile", "OK")
            cpu = time.process_time()
            rate, events, tokens, elapsed = uvloop.run(client_run(port, args, args.concurrency))
            cpu_client = time.process_time() - cpu
            stats = json.loads(ask(server, "stats"))
            expected = args.concurrency * args.max_tokens
            assert tokens == expected, f"{tokens} completion tokens, expected {expected}"
            rates.append(rate)
            print(f"run {run}: {rate:,.0f} streamed tokens/s ({tokens} tokens in {events} data events, "
                  f"{elapsed:.2f} s); server, per {args.concurrency}-seq step ({stats['steps']} steps): "
                  f"LLMEngine.step {stats['step_ms']:.2f} ms, schedule+update {stats['scheduler_ms']:.3f} ms",
                  flush=True)
            print(f"       CPU s: server event loop {stats['cpu_loop']:.2f}, engine thread {stats['cpu_engine']:.2f}, "
                  f"other server threads {stats['cpu_other']:.2f}, client {cpu_client:.2f}", flush=True)
        print(f"\nserved: median {statistics.median(rates):,.0f} streamed tokens/s "
              f"({args.concurrency} streams x {args.max_tokens} tokens, median of {args.runs})")
        if args.profile:
            server.stdin.write("report\n")  # type: ignore[union-attr]
            server.stdin.flush()  # type: ignore[union-attr]
            for line in server.stdout:  # type: ignore[union-attr]
                if line.strip() == "OK":
                    break
                print(line, end="")
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=30)


def expect(server: subprocess.Popen, tag: str) -> str:
    for line in server.stdout:  # type: ignore[union-attr]
        if line.startswith(tag):
            return line[len(tag):].strip()
        print(line, end="", file=sys.stderr)
    raise RuntimeError(f"the server exited before printing {tag}")


def ask(server: subprocess.Popen, command: str, reply: str = "STATS") -> str:
    server.stdin.write(command + "\n")  # type: ignore[union-attr]
    server.stdin.flush()  # type: ignore[union-attr]
    return expect(server, reply)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=256, help="concurrent streams (= max_num_seqs)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="the server's torch threads")
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="the synthetic model's vocabulary; 0: the tokenizer's (a smaller one isolates the sampler)")
    parser.add_argument("--switch-interval", type=float, default=0.0,
                        help="the server's sys.setswitchinterval (GIL hand-over); 0: Python's 5 ms")
    parser.add_argument("--engine-only", action="store_true", help="LLMEngine.step in-process, no HTTP")
    parser.add_argument("--profile", action="store_true", help="cProfile the last run")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args()
    run: Callable[[argparse.Namespace], None] = serve if args.serve else engine_only if args.engine_only else launch
    run(args)


if __name__ == "__main__":
    main()
