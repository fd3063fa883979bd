"""Embeddings (issue 45): short documents embedded per second, inferd against llama-server, and
chat TTFT beside a flood of embedding requests.

    .venv/bin/python bench/embeddings.py                          # ~5 min; appends to bench/RESULTS.md
    .venv/bin/python bench/embeddings.py --docs 128 --no-write    # a smoke run
    .venv/bin/python bench/embeddings.py --sides llama --no-write # llama-server alone

One server at a time, never two at once (compare.py's bench/peers starts each from a scratch
folder, so no ./inferd.toml is read, and stops it with its process group), MODEL the default
SmolLM2-135M-Instruct Q4_1 GGUF (`--model`): 1. inferd: `inferd serve --port 0 --dtype bfloat16
--model MODEL`, default settings (a generation model's embeddings: mean-pooled, normalized, in the
pooling class, by default "batch"); 2. llama-server: `llama-server -m MODEL` + LLAMA_ARGS
(`--llama-args`), from bench/build_llama_server.sh's build for this CPU (`--peer-bin`).

Documents: word salad from a fixed word list (overload.py's TEXT), 10-60 tokens each (uniform,
the model's tokenizer, special tokens aside), seeded: every side gets the same ones; each
measured run has its own, so no prefix cache serves one run from another.
1. Throughput: per concurrency C (`--concurrency`, 1,4), `--docs` documents (512) to POST
   /v1/embeddings in requests of `--batch` (32, "float"), C clients in a closed loop; docs/s =
   documents / wall time. The warm-up before: the agreement set (128 documents in 4 requests, one
   of them again as base64, which must decode to the same floats), whose vectors are compared
   across the servers (cosine per document, mean and min; each side's norms).
2. Chat TTFT beside an embedding flood (inferd only): CHATS streamed chats one at a time (short
   prompts, max_tokens 16, greedy; TTFT = the first event with content), alone, then (other
   prompts) beside FLOOD_CLIENTS clients looping on requests of FLOOD_BATCH documents, each made
   unique by a number in front. Chats in "interactive" (the default class), embeddings in
   "batch": p50 / p95 TTFT of both, loaded p95 / alone p95 (target: <= 2x), the flood's docs/s.

CPU: a run where other processes (the machine's busy time less the server's and this script's)
took over 0.2 cores is run once more with new documents, the less disturbed kept, both recorded.
Logs in ~/.cache/inferd/embeddings/DATE-TIME; the dated section (`--results PATH`, `--no-write`
only prints) carries this command line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import functools
import json
import math
import os
import random
import shlex
import signal
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from compare import default_model, parse_concurrency  # (bench/ is this script's folder)
from overload import TEXT, percentile
from peers.cpu import CpuSnapshot, cpu_usage
from peers.points import cpu_line
from peers.report import machine
from peers.servers import Server, check_llama, inferd_server, llama_server
from peers.workload import DEFAULT_PEER_BIN, DEFAULT_RESULTS, MAX_OTHER_CORES

DOC_TOKENS = (10, 60)  # each document's length in tokens, uniform
SEED = 0
AGREEMENT_DOCS = 128  # the warm-up, whose vectors are compared across the servers
CHATS, CHAT_WARMUP, CHAT_MAX_TOKENS = 20, 2, 16
FLOOD_CLIENTS = 4
FLOOD_BATCH = 32
FLOOD_RAMP_S = 3.0  # the flood runs this long before the first chat
REQUEST_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 600.0
# NOTE: -kvu: with -np N and no -kvu (a KV stream per slot) a document's vector depends on the others in its
# ubatch (cosine to itself alone down to 0.74); its default (4 slots) also unifies. 16 slots (each input takes
# one; the default -ub 512 covers any document) were the fastest of those tried: within 15% of each other.
LLAMA_ARGS = "--embeddings --pooling mean -np 16 -c 16384 -kvu -t {threads}"
WORDS = sorted({w.strip(".,").lower() for w in TEXT.split()})  # the documents' (and chat prompts') words


# ------------------------------------------------------------------------------ documents

@functools.lru_cache(maxsize=1)
def tokenizer(model: Path) -> Any:
    from inferd.text.tokenizer_loader import load_tokenizer

    return load_tokenizer(model)


@functools.lru_cache(maxsize=16)
def documents(model: Path, n: int, seed: int) -> tuple[str, ...]:
    """`n` documents of DOC_TOKENS tokens (uniform), the same for a given seed."""
    tok, rng = tokenizer(model), random.Random(seed)
    docs = []
    for _ in range(n):
        target, text = rng.randint(*DOC_TOKENS), ""
        while len(tok.encode(text + ".", add_special_tokens=False)) < target:
            text = f"{text} {rng.choice(WORDS)}" if text else rng.choice(WORDS).capitalize()
        while len(tok.encode(text + ".", add_special_tokens=False)) > DOC_TOKENS[1]:  # (the last word overshot)
            text = text.rsplit(" ", 1)[0]
        docs.append(text + ".")
    return tuple(docs)


# ------------------------------------------------------------------------------ clients

class BenchError(Exception):
    pass


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


def vector(value: list[float] | str) -> list[float]:
    """An embedding as floats: a list, or base64 of little-endian float32 (OpenAI's encoding)."""
    if isinstance(value, str):
        raw = base64.b64decode(value)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return [float(v) for v in value]


async def embed(s: aiohttp.ClientSession, server: Server, docs: list[str] | tuple[str, ...],
                encoding: str = "float") -> list[list[float]]:
    """The vectors of `docs`, in order, from the server's POST /v1/embeddings."""
    body: dict[str, Any] = {"input": list(docs), "encoding_format": encoding}
    if server.model:
        body["model"] = server.model
    async with s.post(f"{server.url}/v1/embeddings", json=body) as resp:
        if resp.status != 200:
            raise BenchError(f"{server.side} /v1/embeddings: HTTP {resp.status}: {(await resp.text())[:500]}")
        data = sorted((await resp.json())["data"], key=lambda d: d["index"])
    if len(data) != len(docs):
        raise BenchError(f"{server.side} /v1/embeddings: {len(data)} vectors for {len(docs)} inputs")
    return [vector(d["embedding"]) for d in data]


async def embed_all(server: Server, docs: tuple[str, ...], batch: int, concurrency: int) -> tuple[float, list]:
    """(wall seconds, vectors in order): `docs` in requests of `batch`, `concurrency` clients."""
    chunks = [docs[i:i + batch] for i in range(0, len(docs), batch)]
    out: list[list[list[float]]] = [[] for _ in chunks]
    queue = iter(range(len(chunks)))  # shared: each client takes the next chunk

    async with session() as s:
        async def client() -> None:
            for i in queue:
                out[i] = await embed(s, server, chunks[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
    return seconds, [v for chunk in out for v in chunk]


async def chat_ttft(s: aiohttp.ClientSession, server: Server, prompt: str) -> float:
    """Seconds from the send to the first streamed event with content (or a finish reason)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": CHAT_MAX_TOKENS, "temperature": 0,
            "stream": True, **({"model": server.model} if server.model else {})}
    t0, ttft = time.perf_counter(), None
    async with s.post(f"{server.url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise BenchError(f"chat: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for line in resp.content:
            if ttft is not None or not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content") or choices[0].get("finish_reason"):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise BenchError("chat: a stream without content")
    return ttft


def chat_prompts(phase: str) -> list[str]:
    return [f"({phase} {i}) Write one short sentence about {WORDS[i * 7 % len(WORDS)]}." for i in range(CHATS)]


@dataclass
class Flood:
    docs: tuple[str, ...]
    requests: int = 0
    embedded: int = 0
    refused: int = 0  # 429 / 503: the batch class shed
    errors: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, s: aiohttp.ClientSession, server: Server, k: int) -> None:
        n = 0
        while not self.stop.is_set():
            first = (k * 7919 + n * FLOOD_BATCH) % len(self.docs)
            docs = [f"{k}-{n}-{j}: {self.docs[(first + j) % len(self.docs)]}" for j in range(FLOOD_BATCH)]
            n += 1
            try:
                await embed(s, server, docs)
                self.requests, self.embedded = self.requests + 1, self.embedded + len(docs)
            except BenchError as e:  # a refusal (429 / 503: the class shed) is counted, anything else kept
                shed = " 429" in str(e) or " 503" in str(e)
                self.refused, self.errors = self.refused + shed, self.errors + ([] if shed else [str(e)[:200]])
                await asyncio.sleep(0.5)


async def chats(server: Server, prompts: list[str], flood: Flood | None) -> dict[str, Any]:
    """TTFTs of `prompts` one at a time, beside `flood` when given (started FLOOD_RAMP_S before)."""
    async with session() as s:
        tasks = [asyncio.create_task(flood.client(s, server, k)) for k in range(FLOOD_CLIENTS)] if flood else []
        await asyncio.sleep(FLOOD_RAMP_S if flood else 0.0)
        before = (flood.embedded, flood.refused) if flood else (0, 0)
        t0 = time.perf_counter()
        try:
            ttfts = [await chat_ttft(s, server, p) for p in prompts]
        finally:
            seconds = time.perf_counter() - t0
            if flood:
                flood.stop.set()
        await asyncio.gather(*tasks)
    flooded = {"flood_docs_s": (flood.embedded - before[0]) / seconds, "flood_refused": flood.refused - before[1],
               "flood_requests": flood.requests, "flood_errors": flood.errors[:3]} if flood else {}
    return {"ttfts": ttfts, "seconds": seconds, **flooded}


# ------------------------------------------------------------------------------ runs

@dataclass
class Run:
    """One measurement: each attempt's (result, CPU as peers/cpu.py counts it), and the one kept."""

    label: str
    attempts: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    kept: int = 0

    @property
    def result(self) -> Any:
        return self.attempts[self.kept][0]


def measured(label: str, server: Server, start: Callable[[int], Awaitable[Any]], show: Callable[[Any], str]) -> Run:
    """`start(attempt)` under the CPU check: repeated once when disturbed, the less disturbed kept."""
    run = Run(label)
    for attempt in (1, 2):
        before = CpuSnapshot.take(server.pid)
        try:
            result = asyncio.run(asyncio.wait_for(start(attempt), RUN_TIMEOUT_S))
        except (TimeoutError, BenchError, aiohttp.ClientError) as e:
            sys.exit(f"{label}: {type(e).__name__}: {e}")
        cpu = cpu_usage(before, CpuSnapshot.take(server.pid))
        run.attempts.append((result, cpu))
        print(f"  {label}: {show(result)}; {cpu_line(cpu)}", flush=True)
        if cpu["other_cores"] <= MAX_OTHER_CORES:
            break
        if attempt == 1:
            print(f"  disturbed: other processes took {cpu['other_cores']:.2f} cores (> {MAX_OTHER_CORES}): "
                  "running it once more", flush=True)
    run.kept = min(range(len(run.attempts)), key=lambda i: run.attempts[i][1]["other_cores"])
    return run


def warm_up(server: Server, docs: tuple[str, ...], batch: int) -> dict[str, Any]:
    """The agreement set's vectors (4 requests at concurrency 1), and whether base64 matches float."""
    async def go() -> dict[str, Any]:
        _, vectors = await embed_all(server, docs, batch, 1)
        async with session() as s:
            b64 = await embed(s, server, docs[:batch], "base64")
        diff = max(abs(x - y) for a, b in zip(vectors, b64) for x, y in zip(a, b))
        return {"vectors": vectors, "base64_max_diff": diff}

    try:
        return asyncio.run(asyncio.wait_for(go(), RUN_TIMEOUT_S))
    except (TimeoutError, BenchError, aiohttp.ClientError, KeyError, ValueError) as e:
        sys.exit(f"{server.side}: the warm-up failed: {type(e).__name__}: {e}")


def throughput(args: argparse.Namespace, server: Server) -> list[Run]:
    """docs/s per concurrency; each attempt its own documents (seeded by concurrency and attempt)."""
    runs = []
    for c in args.concurrency:
        def start(attempt: int, c: int = c) -> Awaitable[tuple[float, list]]:
            return embed_all(server, documents(args.model, args.docs, SEED + 100 * c + attempt), args.batch, c)

        runs.append(measured(f"{server.side} c={c}", server, start,
                             lambda r: f"{args.docs / r[0]:.1f} docs/s ({r[0]:.2f} s)"))
    return runs


def flood_runs(args: argparse.Namespace, server: Server) -> tuple[Run, Run]:
    """Chat TTFTs alone, then beside the embedding flood."""
    asyncio.run(chats(server, [f"Say hello {i}." for i in range(CHAT_WARMUP)], None))

    def show(r: dict[str, Any]) -> str:
        flood = f", flood {r['flood_docs_s']:.1f} docs/s, {r['flood_refused']} refused" if "flood_docs_s" in r else ""
        return f"TTFT p50 {statistics.median(r['ttfts']):.3f} s p95 {percentile(r['ttfts'], 0.95):.3f} s{flood}"

    alone = measured("chats alone", server, lambda a: chats(server, chat_prompts(f"alone{a}"), None), show)
    pool = documents(args.model, 256, SEED + 7)
    loaded = measured("chats + flood", server, lambda a: chats(server, chat_prompts(f"flood{a}"), Flood(pool)), show)
    return alone, loaded


@dataclass
class SideResult:
    server: Server
    agreement: dict[str, Any]
    points: list[Run]
    chats: tuple[Run, Run] | None = None


def run_side(args: argparse.Namespace, server: Server) -> SideResult:
    print(f"{server.side}: {server.description} at {server.url}, model {server.model}", flush=True)
    agreement = warm_up(server, documents(args.model, AGREEMENT_DOCS, SEED), args.batch)
    points = throughput(args, server)
    return SideResult(server, agreement, points, flood_runs(args, server) if server.side == "inferd" else None)


# ------------------------------------------------------------------------------ report

def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def agreement_text(a: SideResult, b: SideResult) -> str:
    va, vb = a.agreement["vectors"], b.agreement["vectors"]
    if {len(v) for v in va} != {len(v) for v in vb}:
        return f"- the vectors' sizes differ: {len(va[0])} against {len(vb[0])}: no comparison"
    cos = [sum(x * y for x, y in zip(u, w)) / (norm(u) * norm(w)) for u, w in zip(va, vb)]
    mean = statistics.fmean(cos)
    lines = [f"- cosine similarity of the same document's vectors, {len(cos)} documents of {len(va[0])} dimensions: "
             + f"mean **{mean:.5f}**, min {min(cos):.5f} ({'above' if mean > 0.99 else 'BELOW'} 0.99)"]
    for side in (a, b):
        dev = max(abs(norm(v) - 1) for v in side.agreement["vectors"])
        state = "normalized" if dev < 1e-3 else "NOT normalized; the cosine divides by the norms anyway"
        lines.append(f"- {side.server.side}: max ||v| - 1| {dev:.1e} ({state}); base64 against float: max "
                     f"|difference| {side.agreement['base64_max_diff']:.1e}")
    return "\n".join(lines)


def disturbed(run: Run) -> str:
    return " (disturbed)" if run.attempts[run.kept][1]["other_cores"] > MAX_OTHER_CORES else ""


def throughput_table(args: argparse.Namespace, sides: list[SideResult]) -> str:
    rates = [[args.docs / run.result[0] for run in side.points] for side in sides]
    head = [f"{side.server.side} docs/s" for side in sides] + (["inferd / llama-server"] if len(sides) == 2 else [])
    lines = ["| concurrency | " + " | ".join(head) + " |", "|---:" * (len(head) + 1) + "|"]
    for i, c in enumerate(args.concurrency):
        cells = [str(c)] + [f"{r[i]:.1f}{disturbed(side.points[i])}" for side, r in zip(sides, rates)]
        cells += [f"**{rates[0][i] / rates[1][i]:.2f}x**"] if len(sides) == 2 else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chats_text(alone: Run, loaded: Run) -> str:
    x, y = alone.result, loaded.result
    rows = [f"| {name}{disturbed(run)} | {statistics.median(r['ttfts']):.3f} | {percentile(r['ttfts'], 0.95):.3f} | "
            f"{max(r['ttfts']):.3f} |" for name, run, r in (("alone", alone, x), ("beside the flood", loaded, y))]
    ratio, errors = percentile(y["ttfts"], 0.95) / percentile(x["ttfts"], 0.95), y["flood_errors"]
    verdict = (f"Loaded p95 / alone p95: **{ratio:.2f}x** (target <= 2x: **{'met' if ratio <= 2 else 'missed'}**). "
               f"The flood meanwhile: {y['flood_docs_s']:.1f} docs/s, {y['flood_refused']} requests refused "
               f"(429/503: the batch class shed), other errors: {errors or 'none'}.")
    return "\n".join(["| chats | TTFT p50 s | TTFT p95 s | max s |", "|---|---:|---:|---:|", *rows, "", verdict])


def report(args: argparse.Namespace, sides: list[SideResult], started: dt.datetime, seconds: float) -> str:
    command = shlex.join([".venv/bin/python", "bench/embeddings.py", *sys.argv[1:]])
    docs = documents(args.model, args.docs, SEED + 100 * args.concurrency[0] + 1)
    counts = [len(tokenizer(args.model).encode(d, add_special_tokens=False)) for d in docs]
    servers = "\n".join(f"- {s.server.side}: {s.server.description}." for s in sides)
    a, b = sides[0], (sides[1] if len(sides) > 1 else None)
    chats = chats_text(*a.chats) if a.chats else "(inferd not run)"
    cpu = "\n".join(f"- {run.label} attempt {i + 1}{' (kept)' if len(run.attempts) > 1 and i == run.kept else ''}: "
                    f"{cpu_line(c)}" for s in sides for run in s.points + list(s.chats or ())
                    for i, (_, c) in enumerate(run.attempts))
    return f"""
## Embeddings (issue 45), {started:%Y-%m-%d}

`{command}` ({started:%Y-%m-%d %H:%M}, {seconds / 60:.1f} min)

Machine: {machine()}. Model file: `{args.model}`. One server at a time, in this order:
{servers}

**Short documents embedded per second.** {args.docs} documents per run, {min(counts)}-{max(counts)} tokens
(median {statistics.median(counts):g}), word salad from a fixed word list, seeded; POST /v1/embeddings with
{args.batch} documents a request (float), C clients in a closed loop; after a warm-up of {AGREEMENT_DOCS}
documents (the agreement set below).

{throughput_table(args, sides)}

Agreement of the two servers' vectors (the warm-up's {AGREEMENT_DOCS} documents):
{agreement_text(a, b) if b else '(one side only)'}

**Chat TTFT beside an embedding flood** (inferd only): {CHATS} streamed chat completions one at a time
(max_tokens {CHAT_MAX_TOKENS}, greedy, default class "interactive"), alone, then beside {FLOOD_CLIENTS} clients
sending {FLOOD_BATCH} documents a request in a loop (the pooling class, "batch"), started {FLOOD_RAMP_S:g} s before.

{chats}

CPU per run (other processes over {MAX_OTHER_CORES} cores: run once more with new documents, the less
disturbed kept):
{cpu}
"""


# ------------------------------------------------------------------------------ main

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=512, help="documents per throughput run (default: 512)")
    p.add_argument("--batch", type=int, default=32, help="documents per request (default: 32)")
    p.add_argument("--concurrency", type=parse_concurrency, default=[1, 4], help="comma-separated (default: 1,4)")
    p.add_argument("--sides", choices=("both", "inferd", "llama"), default="both", help="the servers (default: both)")
    p.add_argument("--model", type=Path, help="the GGUF both serve (default: the embedded SmolLM2)")
    p.add_argument("--peer-bin", type=Path, default=DEFAULT_PEER_BIN, help="llama-server (default: %(default)s)")
    p.add_argument("--llama-args", default=LLAMA_ARGS.format(threads=os.cpu_count() or 1), help="(%(default)s)")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="(default: %(default)s)")
    args = p.parse_args()
    args.model = args.model or default_model()
    return args


def main() -> None:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # (a KeyboardInterrupt: the servers are stopped)
    args = parse_args()
    if args.sides != "inferd":
        check_llama(args.peer_bin)
    started, t0 = dt.datetime.now(), time.perf_counter()
    logs = Path.home() / ".cache/inferd/embeddings" / f"{started:%Y%m%d-%H%M%S}"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}; {args.docs} docs in requests of {args.batch}, concurrency {args.concurrency}; "
          f"logs in {logs}", flush=True)
    sides = []
    with tempfile.TemporaryDirectory(prefix="inferd-embeddings-") as tmp:
        if args.sides != "llama":
            with inferd_server(Path(tmp), logs, args.model, []) as server:
                sides.append(run_side(args, server))
        if args.sides != "inferd":
            with llama_server(Path(tmp), logs, args.peer_bin, args.model, shlex.split(args.llama_args), 120) as server:
                sides.append(run_side(args, server))
    section = report(args, sides, started, time.perf_counter() - t0)
    print(section)
    if not args.no_write:
        with open(args.results, "a") as f:
            f.write(section)
        print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
