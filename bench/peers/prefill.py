"""compare.py's cold-prefill workload: time to first token of one request at a time, each server
alone, on prompts that no prefix cache can hold, and one later turn on a cached context.

    warm-up      WARMUP_TOKENS tokens, untimed
    run 1..N     fresh S           a new prompt of S tokens, for each S of --prefill-tokens
                 context C         a new prompt of C tokens, untimed: it fills the prefix cache
                 turn +A on C      the same C tokens + A new ones, timed (C, A: --turn-tokens)

Every prompt opens with a random 12-digit hex tag, so no server's prefix cache holds its first
block (nor a server's left running at --peer-url from an earlier run); the rest is the driver's
prose words drawn at random, sized with the model's tokenizer (a word with its leading space
tokenizes alone, so the counts add up). The prompt token counts reported are each server's
usage.prompt_tokens, the cached ones its usage.prompt_tokens_details.cached_tokens (llama-server:
timings.cache_n). The driver sends them all in order, `inferd bench URL --dataset FILE
--concurrency 1`: streamed /v1/completions, max_tokens 1, temperature 0, TTFT as it measures it.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.client.bench_workload import WORDS
from inferd.text.tokenizer_loader import load_tokenizer
from peers.points import Attempt, Point, cpu_line, keep_least_disturbed, run_driver, should_repeat
from peers.servers import Server
from peers.workload import MAX_OTHER_CORES, PREFILL_CONTEXT

DEFAULT_FRESH = (1500, 6000)
DEFAULT_TURN = (3400, 640)
DEFAULT_RUNS = 3
WARMUP_TOKENS = 64
MARGIN = 16  # context kept free beyond a prompt's size: a word's overshoot, a BOS, the answer token
WARMUP, CONTEXT = "warm-up", "context"  # the untimed prompts' labels


def fresh_label(tokens: int) -> str:
    return f"fresh {tokens:,}"


def turn_label(context: int, added: int) -> str:
    return f"turn +{added:,} on cached {context / 1000:.1f}k"


@dataclass(frozen=True)
class Prompt:
    label: str  # a measurement's label, or WARMUP / CONTEXT (untimed)
    run: int  # the repetition, 1..N (0: the warm-up)
    text: str
    tokens: int  # counted here, with the model's tokenizer

    @property
    def timed(self) -> bool:
        return self.label not in (WARMUP, CONTEXT)


class Prose:
    """Random words of the driver's passage, sized in tokens with the model's tokenizer."""

    def __init__(self, model: Path) -> None:
        self.tokenizer = load_tokenizer(model)
        self.counts: dict[str, int] = {}  # " word" -> its tokens

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def words(self, rng: random.Random, tokens: int) -> tuple[str, int]:
        """At least `tokens` tokens of words, each with its leading space: (text, tokens)."""
        pieces, n = [], 0
        while n < tokens:
            piece = " " + rng.choice(WORDS)
            if piece not in self.counts:
                self.counts[piece] = self.count(piece)
            pieces.append(piece)
            n += self.counts[piece]
        return "".join(pieces), n

    def prompt(self, rng: random.Random, tokens: int) -> tuple[str, int]:
        """A prompt of about `tokens` tokens whose first tokens are a random tag: (text, tokens)."""
        tag = f"{random.SystemRandom().getrandbits(48):012x}:"  # NOTE: not from `rng`: unique in every run
        head = self.count(tag)
        body, n = self.words(rng, tokens - head)
        return tag + body, head + n


def build_prompts(prose: Prose, fresh: list[int], turn: tuple[int, int], runs: int, seed: str) -> list[Prompt]:
    """The warm-up, then `runs` times the fresh prompts and the turn's context and turn, in order."""
    rng = random.Random(f"compare-prefill:{seed}")
    prompts = [Prompt(WARMUP, 0, *prose.prompt(rng, WARMUP_TOKENS))]
    context, added = turn
    for run in range(1, runs + 1):
        prompts += [Prompt(fresh_label(n), run, *prose.prompt(rng, n)) for n in fresh]
        text, tokens = prose.prompt(rng, context)
        more, extra = prose.words(rng, added)
        prompts += [Prompt(CONTEXT, run, text, tokens), Prompt(turn_label(context, added), run, text + more,
                                                                tokens + extra)]
    return prompts


# ------------------------------------------------------------------------------ one side


def measure(prompts: list[Prompt], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per timed label, over the runs: TTFT, the server's prompt and cached tokens, the size sent."""
    by_index = {r.get("index"): r for r in records}
    out: dict[str, dict[str, Any]] = {}
    for i, prompt in enumerate(prompts):
        if not prompt.timed:
            continue
        r = by_index.get(i) or {"error_type": "missing"}
        m = out.setdefault(prompt.label, {"ttft": [], "prompt_tokens": [], "cached_tokens": [], "sized": [],
                                          "failed": 0})
        m["sized"].append(prompt.tokens)
        if r.get("error_type") or r.get("ttft") is None:
            m["failed"] += 1
            continue
        m["ttft"].append(r["ttft"])
        m["prompt_tokens"].append(r.get("prompt_tokens"))
        m["cached_tokens"].append(r.get("cached_tokens"))
    return out


def metrics(measured: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`LABEL median` and `LABEL min` TTFT in seconds, for each label with a completed request."""
    out = {}
    for label, m in measured.items():
        if m["ttft"]:
            out[f"{label} median"], out[f"{label} min"] = statistics.median(m["ttft"]), min(m["ttft"])
    return out


def driver_command(args: argparse.Namespace, server: Server, dataset: Path, count: int, json_path: Path) -> list[str]:
    cmd = [*args.driver, server.url, "--concurrency", "1", "--num-requests", str(count), "--dataset", str(dataset),
           "--endpoint", "completions", "--output-len", "1", "--seed", "0", "--json", str(json_path)]
    return cmd + (["--model", server.model] if server.model else [])


def run_attempt(args: argparse.Namespace, server: Server, json_dir: Path, prompts: list[Prompt], stem: str) -> Attempt:
    """One driver run over `prompts`: its summary (with the measurements under "prefill"), its CPU."""
    dataset, json_path = json_dir / f"{stem}.jsonl", json_dir / f"{stem}.json"
    dataset.write_text("".join(json.dumps({"prompt": p.text, "max_tokens": 1}) + "\n" for p in prompts))
    cmd = driver_command(args, server, dataset, len(prompts), json_path)
    summary, cpu = run_driver(cmd, json_dir / f"{stem}.log", args.point_timeout, server)
    records = json.loads(json_path.read_text())["runs"][0].get("requests", [])
    measured = measure(prompts, records)
    if summary.get("failed"):
        print(f"  WARNING: {summary['failed']} of {summary.get('requests')} requests failed: "
              f"{summary.get('errors')} ({json_dir / stem}.log)", flush=True)
    found = metrics(measured)
    shown = ", ".join(f"{label} {found[f'{label} median']:.3f} s ({tokens_text(m)} tok)"
                      for label, m in measured.items() if f"{label} median" in found)
    print(f"  {server.side} prefill, median of {args.prefill_runs}: {shown}; {cpu_line(cpu)}", flush=True)
    return Attempt(str(json_path), cpu, summary | {"prefill": measured}, found)


def run_prefill_side(args: argparse.Namespace, server: Server, json_dir: Path, *, prose: Prose,
                     first: list[Prompt]) -> list[Point]:
    """The side's one point (concurrency 1): `first` (the prompts every side gets), and once more
    on new prompts when other processes took the CPU, the less disturbed kept."""
    print(f"{server.side}: {server.description} at {server.url}, model {server.model}", flush=True)
    point = Point(server.side, 1, len(first))
    for attempt in (1, 2):
        prompts = first if attempt == 1 else build_prompts(prose, args.prefill_tokens, args.turn_tokens,
                                                           args.prefill_runs, f"{server.side}-repeat")
        stem = f"{server.side}-prefill" + ("" if attempt == 1 else "-repeat")
        point.attempts.append(run_attempt(args, server, json_dir, prompts, stem))
        if not should_repeat(point.attempts[-1].cpu, attempt, ", on new prompts"):
            break
    keep_least_disturbed(point)
    return [point]


def prefill_runner(args: argparse.Namespace) -> Callable[[argparse.Namespace, Server, Path], list[Point]]:
    """run_side's twin for the prefill workload: the same first prompts on every side."""
    prose = Prose(args.model)
    first = build_prompts(prose, args.prefill_tokens, args.turn_tokens, args.prefill_runs, "0")
    return functools.partial(run_prefill_side, prose=prose, first=first)


# ------------------------------------------------------------------------------ arguments and report


def check_sizes(fresh: list[int], turn: tuple[int, int]) -> str | None:
    """Why the sizes do not fit the servers' context, or None."""
    longest = max(*fresh, sum(turn))
    if longest + MARGIN > PREFILL_CONTEXT:
        return f"the longest prompt ({longest:,} tokens) + {MARGIN} must fit the context ({PREFILL_CONTEXT:,})"
    if min(*fresh, *turn) < 16:
        return "every size must be at least 16 tokens"
    return None


def tokens_text(m: dict[str, Any]) -> str:
    """The server's prompt token count (the median over the runs), and its cached tokens when any."""
    counted = [n for n in m["prompt_tokens"] if n is not None]
    if not counted:
        return f"~{statistics.median(m['sized']):,.0f} (not reported)"
    cached = [n for n in m["cached_tokens"] if n]
    text = f"{statistics.median(counted):,.0f}"
    return text + (f", {statistics.median(cached):,.0f} cached" if cached else "")


def disturbed(point: Point) -> bool:
    cpu = point.best.cpu
    return not cpu["other_includes_server"] and cpu["other_cores"] > MAX_OTHER_CORES


def prefill_table(inferd: Point, peer: Point, name: str) -> str:
    """Markdown: per measurement, prompt tokens, each side's TTFT (median, min) and the ratio."""
    head = ["measurement", "prompt tokens inferd", f"prompt tokens {name}", "TTFT inferd s", f"TTFT {name} s",
            "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    a, b = inferd.best, peer.best
    note = " (disturbed)" if disturbed(inferd) or disturbed(peer) else ""
    for label, m in a.summary["prefill"].items():
        n = b.summary["prefill"].get(label)
        if n is None:
            continue
        failed = m["failed"] + n["failed"]
        cells = [f"{label}{note}{f' ({failed} failed)' if failed else ''}", tokens_text(m), tokens_text(n)]
        for x in (a.metrics, b.metrics):
            cells.append(f"{x[label + ' median']:.3f} (min {x[label + ' min']:.3f})" if label + " median" in x else "-")
        x, y = a.metrics.get(label + " median"), b.metrics.get(label + " median")
        cells.append(f"{x / y:.2f}x" if x is not None and y else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(inferd: Point, peer: Point, name: str) -> str:
    """One line per measurement: inferd's median TTFT at or below the peer's, or not."""
    lines = []
    for label in inferd.best.summary["prefill"]:
        x, y = inferd.best.metrics.get(label + " median"), peer.best.metrics.get(label + " median")
        if x is None or y is None:
            lines.append(f"- n/a: {label}: not measured on both sides")
            continue
        mark = "**at or below**" if x <= y else "**above**"
        lines.append(f"- {mark} {name}'s: {label}: median TTFT {x:.3f} s vs {y:.3f} s ({x / y:.2f}x)")
    return "\n".join(lines)


def prefill_section(inferd: list[Point], peer: list[Point], name: str) -> str:
    return f"""### inferd / {name}

{prefill_table(inferd[0], peer[0], name)}

inferd's TTFT against {name}'s (median over the runs):
{verdicts(inferd[0], peer[0], name)}
"""


def workload_text(args: argparse.Namespace) -> str:
    cmd = ["inferd", "bench", "URL", "--concurrency", "1", "--num-requests", "N", "--dataset", "FILE",
           "--endpoint", "completions", "--output-len", "1", "--seed", "0"]
    context, added = args.turn_tokens
    sizes = ", ".join(f"{n:,}" for n in args.prefill_tokens)
    return (f"`{' '.join(cmd)}`: one streamed completion at a time, max_tokens 1; a {WARMUP_TOKENS}-token warm-up, "
            f"then {args.prefill_runs} run(s) of: fresh prompts of {sizes} tokens, a {context:,}-token context (untimed: "
            f"it fills the prefix cache) and that context + {added:,} new tokens (timed); every prompt new, opening "
            f"with a random tag; TTFT median and min over the runs (llama-server: one slot of {PREFILL_CONTEXT} "
            f"tokens; vLLM: --max-model-len {PREFILL_CONTEXT} --enable-prompt-tokens-details)")
