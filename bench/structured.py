"""Structured outputs on the CPU (issue 15): what a grammar costs a decode step.

    .venv/bin/python bench/structured.py             # ~3.5 min on the 2-core machine
    .venv/bin/python bench/structured.py --quick     # a smoke run, ~30 s

One engine (the default model, the serving default dtype), one process, three measurements:

1. Decode throughput, constrained against unconstrained, at batch 1 and 32: the same prompts
   and seeds, temperature 1, exactly --new-tokens tokens per request. The constrained rows
   follow ARRAY_SCHEMA, which cannot close within the budget (minItems 1000), so they never end
   early; the unconstrained rows ignore EOS. A run whose requests did not all produce exactly
   --new-tokens tokens makes the script fail. Decode tokens/s = tokens sampled in steps without
   prefill / those steps' wall time (the whole batch); each cell the median of --repeats runs,
   interleaved (free, grammar, free, grammar, ... with the order swapped every repetition).
   The step's split, ms per decode step: model.forward, the sampler (and apply_token_mask
   inside it), the wait for the masks after the forward, `accept` over the rows, and the rest
   (scheduler, inputs, detokenizer); "fill" is the time in fill_masks, on the worker thread
   while the forward runs (or on the engine thread before it, in measurement 3).
2. Mask time per token: one constrained request's tokens replayed through a fresh matcher,
   `GrammarConstraint.fill_mask` timed before each `accept`; and the batched `fill_masks`
   (llguidance's executor, 2 threads, as MaskFiller) over the 32 rows of a batch-32 run. Both
   back to back, so warmer than inside the engine, where one fill comes every ~130 ms.
3. The overlap: the batch-32 constrained run with the masks filled on the engine thread before
   the forward (MaskFiller.start replaced here, in this script only) against the default, which
   fills them on a worker thread while the forward runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
import torch

import inferd.engine.structured.masks as masks_mod
import inferd.model.sampler as sampler_mod
from inferd.engine.config import EngineConfig
from inferd.engine.structured.grammar import GrammarCompiler, GrammarConstraint, json_schema_grammar
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.structured.masks import MaskFiller, fill_masks
from inferd.settings.policy import SchedulingPolicy, ShedConfig
from inferd.engine.protocol import EngineRequest
from inferd.text.sampling_params import SamplingParams

from peers.cpu import machine_busy_seconds  # (bench/ is this script's folder)

# An array of people that cannot close within any budget here: a constrained row never stops.
ARRAY_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 1000,
    "items": {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
              "required": ["name", "age", "tags"]},
}
GOAL = 0.9  # constrained / unconstrained decode tokens/s
MAX_OTHER_CORES = 0.2  # other processes' CPU above this during a repetition: it is done again


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


class OtherCpu:
    """Other processes' CPU (cores) over an interval: the machine's busy time less our own."""

    def __init__(self) -> None:
        self.t, self.busy, self.me = time.perf_counter(), machine_busy_seconds(), own_cpu_seconds()

    def cores(self) -> float:
        wall = time.perf_counter() - self.t
        return max(0.0, (machine_busy_seconds() - self.busy) - (own_cpu_seconds() - self.me)) / wall


def wait_for_quiet(limit: float) -> float:
    """Wait (up to `limit` s) until other processes use under 0.1 cores for 2 s; what they used last."""
    deadline = time.perf_counter() + limit
    while True:
        probe = OtherCpu()
        time.sleep(2.0)
        other = probe.cores()
        if other < 0.1 or time.perf_counter() > deadline:
            return other


# ------------------------------------------------------------------------------ step timing

@dataclass
class StepTimes:
    """Seconds per decode-only step, by part (from the timers Probe installs)."""

    step: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    sampler: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)  # apply_token_mask, inside the sampler
    accept: list[float] = field(default_factory=list)  # GrammarConstraint.accept, every row
    mask_wait: list[float] = field(default_factory=list)  # engine thread, in pending.result()
    fill: list[float] = field(default_factory=list)  # worker thread (or engine thread: sync mode)
    tokens: int = 0  # tokens sampled in these steps


class Probe:
    """Wraps the engine's forward, sampler, apply_token_mask, mask start/wait, fill_masks and
    accept with timers; `cur` collects one step's parts, kept when the step had no prefill."""

    def __init__(self, engine: LLMEngine) -> None:
        self.cur: dict[str, float] = {}
        runner = engine.runner
        forward, sampler, start = runner.model.forward, runner.sampler, runner.masks.start
        self.sync = False

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.cur[name] = self.cur.get(name, 0.0) + time.perf_counter() - t
            return wrapper

        runner.model.forward = timed("forward", forward)
        runner.sampler = timed("sampler", sampler)
        masks_mod.fill_masks = timed("fill", fill_masks)  # MaskFiller.start looks it up per call
        sampler_mod.apply_token_mask = timed("apply", sampler_mod.apply_token_mask)  # so does Sampler
        GrammarConstraint.accept = timed("accept", GrammarConstraint.accept)  # type: ignore[method-assign]

        def start_wrapped(constraints: Any) -> Any:
            pending = self._start_sync(runner.masks, constraints) if self.sync else start(constraints)
            return None if pending is None else _TimedFuture(pending, self.cur)

        runner.masks.start = start_wrapped

    @staticmethod
    def _start_sync(filler: MaskFiller, constraints: Any) -> Future | None:
        """MaskFiller.start without the worker thread: the masks are filled here, on the engine
        thread, before the forward; a completed future is returned."""
        rows = [(i, c) for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        if filler._executor is None:
            filler._executor = llguidance.LLExecutor(num_threads=2)
        masks = np.full((len(constraints), filler.words), -1, dtype=np.int32)  # [B, W]
        done: Future = Future()
        done.set_result((masks, masks_mod.fill_masks(rows, masks, filler._executor)))
        return done


class _TimedFuture:
    def __init__(self, inner: Future, cur: dict[str, float]) -> None:
        self.inner, self.cur = inner, cur

    def result(self) -> Any:
        t = time.perf_counter()
        try:
            return self.inner.result()
        finally:
            self.cur["mask_wait"] = self.cur.get("mask_wait", 0.0) + time.perf_counter() - t


# ------------------------------------------------------------------------------ runs

@dataclass
class RunResult:
    times: StepTimes
    tokens: dict[int, list[int]]  # group -> its generated ids

    @property
    def decode_tps(self) -> float:
        return self.times.tokens / sum(self.times.step)

    def ms(self, part: str) -> float:
        """Mean ms per decode step of one part."""
        values = getattr(self.times, part)
        return 1e3 * sum(values) / len(self.times.step) if values else 0.0


class Bench:
    def __init__(self, engine: LLMEngine, compiler: GrammarCompiler, grammar: str, prompts: list[list[int]],
                 new_tokens: int, seed: int) -> None:
        self.engine, self.compiler, self.grammar = engine, compiler, grammar
        self.prompts, self.new_tokens, self.seed = prompts, new_tokens, seed
        self.probe = Probe(engine)
        self.group_ids = itertools.count(1)

    def run(self, batch: int, constrained: bool, sync: bool = False) -> RunResult:
        engine, probe = self.engine, self.probe
        probe.sync = sync
        groups = []
        for i in range(batch):
            group = next(self.group_ids)
            params = SamplingParams(max_tokens=self.new_tokens, temperature=1.0, seed=self.seed + i,
                                    ignore_eos=not constrained)
            constraint = self.compiler.compile(self.grammar) if constrained else None
            engine.add_request(EngineRequest(group, self.prompts[i], params, "interactive", constraint=constraint))
            groups.append(group)
        times = StepTimes()
        tokens: dict[int, list[int]] = {g: [] for g in groups}
        finish: dict[int, str | None] = {}
        while engine.has_work():
            probe.cur = {}
            t = time.perf_counter()
            step = engine.step()
            elapsed = time.perf_counter() - t
            new = 0
            for out in step.outputs:
                tokens[out.group_id] += out.new_token_ids
                new += len(out.new_token_ids)
                if out.finished:
                    finish[out.group_id] = out.finish_reason
            if step.prefill_tokens == 0 and new:  # decode-only steps
                times.step.append(elapsed)
                times.tokens += new
                for part in ("forward", "sampler", "apply", "accept", "mask_wait", "fill"):
                    if part in probe.cur:
                        getattr(times, part).append(probe.cur[part])
        probe.sync = False
        short = {g: (len(t), finish.get(g)) for g, t in tokens.items() if len(t) != self.new_tokens}
        if short:
            side = "constrained" if constrained else "unconstrained"
            sys.exit(f"UNFAIR: {len(short)} of {batch} {side} requests did not produce exactly {self.new_tokens} "
                     f"tokens (group: (tokens, finish reason)) {short}; the comparison would not be like for like")
        return RunResult(times, tokens)


def mask_timings(compiler: GrammarCompiler, grammar: str, sequences: list[list[int]], vocab_size: int,
                 repeats: int) -> dict[str, float]:
    """fill_mask per token for one sequence (µs, every step of `repeats` replays pooled) and
    fill_masks over all sequences as one batch per step (µs per step, median)."""
    words = (vocab_size + 31) // 32
    single: list[float] = []
    mask = np.zeros(words, dtype=np.int32)  # [W]
    for _ in range(repeats):
        constraint = compiler.compile(grammar)
        for token in sequences[0]:
            t = time.perf_counter()
            constraint.fill_mask(mask)
            single.append(time.perf_counter() - t)
            assert mask[token // 32] >> (token % 32) & 1, "the replayed token is not allowed by its own mask"
            constraint.accept(token)
    executor = llguidance.LLExecutor(num_threads=2)
    batched: list[float] = []
    masks = np.zeros((len(sequences), words), dtype=np.int32)  # [B, W]
    for _ in range(repeats):
        constraints = [compiler.compile(grammar) for _ in sequences]
        rows = list(enumerate(constraints))
        for step in range(len(sequences[0])):
            t = time.perf_counter()
            failed = fill_masks(rows, masks, executor)
            batched.append(time.perf_counter() - t)
            assert not failed, failed
            for c, seq in zip(constraints, sequences):
                c.accept(seq[step])
    single_us = sorted(1e6 * s for s in single)
    return {
        "single_median": statistics.median(single_us),
        "single_mean": statistics.fmean(single_us),
        "single_p99": single_us[min(len(single_us) - 1, int(0.99 * len(single_us)))],
        "batch_median": 1e6 * statistics.median(batched),
        "rows": len(sequences),
    }


# ------------------------------------------------------------------------------ main

def machine() -> str:
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
            f"llguidance {getattr(llguidance, '__version__', '?')}, Python {platform.python_version()}; "
            f"load average at start {load[0]:.2f}")


def make_prompts(engine: LLMEngine, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        text = f"List people number {i + 1} to {i + 1000} as a JSON array of objects with name, age and tags."
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out.append(engine.tokenizer.encode(rendered, add_special_tokens=False))
    return out


Kind = tuple[int, bool, bool]  # (batch, constrained, masks before the forward)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions per cell")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-wait", type=float, default=60.0,
                        help="before each repetition, wait up to this many seconds for a quiet machine")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, 2 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.repeats, args.idle_wait = 16, 2, 5.0
    return args


def repetitions(bench: Bench, kinds: list[Kind], args: argparse.Namespace) -> dict[Kind, list[RunResult]]:
    """Every kind's runs, interleaved, the order swapped every repetition so a drift hits every side
    alike."""
    # NOTE: a repetition during which other processes took over MAX_OTHER_CORES is done again
    # (at most --repeats extra times); the medians are over the undisturbed ones if there are enough
    clean: dict[Kind, list[RunResult]] = {k: [] for k in kinds}
    every: dict[Kind, list[RunResult]] = {k: [] for k in kinds}
    attempts = 0
    while len(clean[kinds[0]]) < args.repeats and attempts < 2 * args.repeats:
        before = wait_for_quiet(args.idle_wait)
        other = OtherCpu()
        rep: dict[Kind, RunResult] = {}
        for kind in kinds if attempts % 2 == 0 else kinds[::-1]:
            rep[kind] = bench.run(*kind)
        cores = other.cores()
        attempts += 1
        for kind, r in rep.items():
            every[kind].append(r)
            if cores <= MAX_OTHER_CORES:
                clean[kind].append(r)
        shown = ", ".join(f"{b}{'g' if c else 'u'}{'s' if sync else ''} {r.decode_tps:.1f}"
                          for (b, c, sync), r in rep.items())
        print(f"repetition {attempts}: decode tok/s {shown}; other processes {cores:.2f} cores "
              f"({before:.2f} just before){' DISTURBED, not counted' if cores > MAX_OTHER_CORES else ''}")
        sys.stdout.flush()
    if len(clean[kinds[0]]) >= min(3, args.repeats):
        return clean
    print(f"WARNING: only {len(clean[kinds[0]])} undisturbed repetitions: medians over all {attempts}")
    return every


def step_table(results: dict[Kind, list[RunResult]], kinds: list[Kind], big: int) -> dict[str, float]:
    """The medians' table; returns grammar / unconstrained decode tok/s per batch (overlapped)."""

    def median(kind: Kind, what: Callable[[RunResult], float]) -> float:
        return statistics.median(what(r) for r in results[kind])

    print(f"\nmedians of {len(results[kinds[0]])} repetitions; ms per decode-only step:")
    print("\n| batch | side | decode tok/s | ratio | ms/step | forward | sampler | of which mask apply | "
          "mask wait | accept | rest | fill |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    labels = {(False, False): "unconstrained", (True, False): "grammar (overlapped)",
              (True, True): "grammar, masks before forward"}
    ratios: dict[str, float] = {}
    for kind in kinds:
        b, c, sync = kind
        tps = median(kind, lambda r: r.decode_tps)
        ratio = tps / median((b, False, False), lambda r: r.decode_tps)
        if c and not sync:
            ratios[f"batch {b}"] = ratio
        step, fwd, smp, apply, accept, wait, fill = (
            median(kind, lambda r, p=p: r.ms(p)) for p in ("step", "forward", "sampler", "apply", "accept", "mask_wait", "fill"))
        rest = step - fwd - smp - wait - accept - (fill if sync else 0.0)
        fill_col = (f"{fill:.2f}" + (" (engine thread)" if sync else " (worker)")) if c else "-"
        print(f"| {b} | {labels[(c, sync)]} | {tps:.1f} | {ratio:.3f} | {step:.1f} | {fwd:.1f} | {smp:.2f} | "
              f"{apply:.2f} | {wait:.2f} | {accept:.2f} | {rest:.2f} | {fill_col} |")
    if (big, True, True) in results:
        overlap = median((big, True, False), lambda r: r.decode_tps) / median((big, True, True), lambda r: r.decode_tps)
        print(f"\noverlap: batch {big} grammar decode tok/s, overlapped / masks-before-forward = {overlap:.3f}")
    return ratios


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    big = max(batches)
    wall = time.perf_counter()

    # dtype: the serving default; no load shedding (its TTFT watch only logs here, but noisily)
    config = EngineConfig.of(kv_cache_memory=512 * 2**20, max_num_seqs=max(64, big),
                          policy=SchedulingPolicy(shedding=ShedConfig(enabled=False)))
    engine = LLMEngine.from_config(config)
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size)
    grammar = json_schema_grammar(ARRAY_SCHEMA)
    prompts = make_prompts(engine, big)
    bench = Bench(engine, compiler, grammar, prompts, args.new_tokens, args.seed)
    print(f"machine: {machine()}")
    print(f"model: the default GGUF, dtype {engine.limits.dtype}, vocab {engine.model_config.vocab_size}; "
          f"{args.new_tokens} tokens per request, temperature 1, seeds {args.seed}..; "
          f"median of {args.repeats} interleaved repetitions\n")
    sys.stdout.flush()

    # NOTE: one warm-up of each kind first (the first steps of a shape are slow; llguidance
    # builds its executor; the prefix cache fills with the prompts, alike for both sides)
    for b in batches:
        bench.run(b, False), bench.run(b, True)

    # 1 + 3: interleaved repetitions, then their medians
    kinds = [(b, c, False) for b in batches for c in (False, True)] + [(big, True, True)]
    results = repetitions(bench, kinds, args)
    ratios = step_table(results, kinds, big)

    # 2: replay the tokens of the last batch run through fresh matchers
    last = results[(big, True, False)][-1].tokens
    sequences = [last[g] for g in sorted(last)]
    m = mask_timings(compiler, grammar, sequences, engine.model_config.vocab_size, repeats=3)
    print(f"\nfill_mask, one row: median {m['single_median']:.1f} µs, p99 {m['single_p99']:.1f} µs, "
          f"mean {m['single_mean']:.1f} µs per token "
          f"({len(sequences[0])} tokens x 3 replays)")
    print(f"fill_masks, {m['rows']} rows: median {m['batch_median']:.1f} µs per step, "
          f"{m['batch_median'] / m['rows']:.2f} µs per row")
    print(f"sample output of a constrained row: {engine.tokenizer.decode(sequences[0])!r}")

    for b in batches:
        r = ratios[f"batch {b}"]
        print(f"goal: grammar / unconstrained at batch {b} >= {GOAL}: {r:.3f} {'met' if r >= GOAL else 'MISSED'}")
    print(f"\ntotal {time.perf_counter() - wall:.0f} s; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
