"""Output processing on the CPU: what the streaming output filter and segmentation cost a token,
and what sentence segmentation does to the time to the first text.

    .venv/bin/python bench/output_filter.py            # the per-token costs, ~20 s
    .venv/bin/python bench/output_filter.py --ttft     # and the TTFT of segments, ~2 min more

1. Per token, in process: the token stream is overload.py's TEXT (original English prose)
   repeated --repeat times, tokenized by the default model's tokenizer and fed one token at a
   time through `OutputProcessor.on_token` as the engine does (detokenizer, stop checks, hooks).
   Rows: no hook (the baseline), and the hooks one at a time, µs per token added to the
   baseline; plus the hook alone (its `__call__` over the same text deltas). The blocklist:
   10,000 terms, 2,000 real words (the tokenizer's whole-word tokens of 5+ letters, 20 of them
   words of TEXT, so masks happen) and random lower-case words of 4-12 letters for the rest; the
   regex row adds 3 patterns (bounded widths: a phone number, a card number, `\\bharbour\\b`).
   Each row is the median of --trials passes.
2. --ttft: `inferd serve` (the default model and settings) in a subprocess; greedy streamed
   /v1/completions of --max-tokens tokens, token mode and "segment": "sentence" alternating;
   client-side time from sending the request to the first event with text, medians over
   --requests requests per mode (3 prompts in turn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from overload import TEXT, inferd_serve  # (bench/ is this script's folder)

from inferd.engine.output.blocklist import Blocklist, OutputFilter
from inferd.engine.output.processor import OutputHook, OutputProcessor
from inferd.engine.sched.request import Request
from inferd.engine.output.segmenter import SentenceHook
from inferd.model.loading.loader import default_model_path
from inferd.model.sampler import SamplerOutput
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer

TERMS = 10_000
REGEXES = (r"\+?\d{3}[ -]\d{3}[ -]\d{4}", r"\d{4}[ -]?\d{4}[ -]?\d{4}[ -]?\d{4}", r"\bharbour\b")


def blocklist_terms(tokenizer: Tokenizer, rng: random.Random, hits: int = 20) -> tuple[str, ...]:
    """TERMS terms: `hits` words of TEXT, real words (whole-word tokens) up to 2,000, random words."""
    vocab = {tokenizer.decode([i]) for i in range(tokenizer.vocab_size)}
    real = sorted(w.strip().lower() for w in vocab if w.startswith(" ") and w.strip().isalpha() and len(w.strip()) >= 5)
    in_text = sorted({w for w in TEXT.lower().replace(",", " ").replace(".", " ").split() if len(w) >= 5})
    words = rng.sample(in_text, hits) + [w for w in rng.sample(real, 2_500) if w not in TEXT.lower()][:2_000 - hits]
    terms = set(words)
    while len(terms) < TERMS:
        terms.add("".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 12))))
    return tuple(sorted(terms))


def run_processor(tokenizer: Tokenizer, tokens: list[int], hooks: Callable[[], list[OutputHook]]) -> tuple[float, str]:
    """Seconds for every token through a fresh processor and choice, and the text it released."""
    processor = OutputProcessor(tokenizer)
    seq = Request(0, [1], SamplingParams(max_tokens=len(tokens) + 1), 1 << 20)
    processor.add(seq, hooks())
    sampled, texts = SamplerOutput([0], None, None), []
    start = time.perf_counter()
    for token in tokens:
        seq.output_ids.append(token)
        out, _ = processor.on_token(seq, token, sampled, 0)
        texts.append(out.text)
    texts.append(processor.flush(0))
    return time.perf_counter() - start, "".join(texts)


def run_hooks(deltas: list[str], hooks: list[OutputHook]) -> float:
    """Seconds for the hooks alone (chained, as the processor calls them) over the text deltas."""
    start = time.perf_counter()
    for delta in deltas:
        for hook in hooks:
            delta, _ = hook(delta, False)
    for hook in hooks:
        hook("", True)
    return time.perf_counter() - start


def per_token(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(default_model_path())
    tokens = tokenizer.encode(" ".join([TEXT] * args.repeat), add_special_tokens=False)
    _, plain = run_processor(tokenizer, tokens, list)
    rng = random.Random(0)
    terms = blocklist_terms(tokenizer, rng)
    never = OutputFilter(Blocklist(blocklist_terms(tokenizer, rng, hits=0), (), "stop"))
    regexes = OutputFilter(Blocklist(terms, REGEXES))
    start = time.perf_counter()
    masking = OutputFilter(Blocklist(terms, ()))
    build = time.perf_counter() - start
    rows: dict[str, Callable[[], list[OutputHook]]] = {
        "no hook (baseline)": list,
        f"filter, {TERMS:,} terms, mask": lambda: [masking.hook()],
        f"filter, {TERMS:,} terms, stop (none in the text)": lambda: [never.hook()],
        f"filter, {TERMS:,} terms + 3 regexes": lambda: [regexes.hook()],
        "segment: sentence": lambda: [SentenceHook()],
        f"filter ({TERMS:,} terms) + sentence": lambda: [masking.hook(), SentenceHook()],
    }
    # the text deltas the hooks see: the detokenizer's, token by token
    deltas = []
    processor = OutputProcessor(tokenizer)
    seq = Request(0, [1], SamplingParams(max_tokens=len(tokens) + 1), 1 << 20)
    processor.add(seq)
    for token in tokens:
        seq.output_ids.append(token)
        deltas.append(processor.on_token(seq, token, SamplerOutput([0], None, None), 0)[0].text)
    print(f"{len(tokens)} tokens ({len(TEXT) * args.repeat:,} characters); automaton of {TERMS:,} terms built "
          f"in {build * 1e3:.0f} ms; median of {args.trials} passes\n")
    print(f"| {'hooks':<46} | on_token µs/token | added µs/token | hook alone µs/token | masked chars |")
    print(f"|{'-' * 48}|------------------:|---------------:|--------------------:|-------------:|")
    base = None
    for name, hooks in rows.items():
        seconds = statistics.median(run_processor(tokenizer, tokens, hooks)[0] for _ in range(args.trials))
        text = run_processor(tokenizer, tokens, hooks)[1]
        alone = statistics.median(run_hooks(deltas, hooks()) for _ in range(args.trials))
        us = seconds / len(tokens) * 1e6
        base = us if base is None else base
        assert len(text) == len(plain) or "stop" in name, name  # masks keep the length
        print(f"| {name:<46} | {us:17.2f} | {us - base:14.2f} | {alone / len(tokens) * 1e6:19.2f} | "
              f"{text.count('*') - plain.count('*'):12d} |")


async def first_text(session: object, url: str, model: str, prompt: str, max_tokens: int, segment: str) -> tuple[float, int]:
    """Seconds to the first event with text, and how many events carried text."""
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "segment": segment}
    start, first, events = time.perf_counter(), None, 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            if json.loads(line[6:])["choices"][0]["text"]:
                events += 1
                first = first or time.perf_counter() - start
    assert first is not None
    return first, events


async def ttft(args: argparse.Namespace) -> None:
    import aiohttp

    prompts = ["The Mona Lisa was painted by", "Tyrannosaurus rex was", "The harbour town woke slowly in winter."]
    with tempfile.TemporaryDirectory() as tmp, inferd_serve(Path(tmp), "segments", "") as (_, model, url):
        results: dict[str, list[tuple[float, int]]] = {"token": [], "sentence": []}
        async with aiohttp.ClientSession() as session:
            await first_text(session, url, model, prompts[0], 4, "token")  # warm-up
            for i in range(args.requests):
                for segment in ("token", "sentence") if i % 2 == 0 else ("sentence", "token"):
                    results[segment].append(await first_text(session, url, model, prompts[i % len(prompts)],
                                                             args.max_tokens, segment))
    print(f"\nTTFT, client side, greedy /v1/completions of {args.max_tokens} tokens, median of {args.requests}:")
    for segment, runs in results.items():
        print(f"  {segment:<8} first text after {statistics.median(r[0] for r in runs) * 1e3:7.1f} ms, "
              f"{statistics.median(r[1] for r in runs):.0f} events with text per request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="copies of TEXT in the token stream")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--ttft", action="store_true", help="also the TTFT of sentence segments, over HTTP")
    parser.add_argument("--requests", type=int, default=6, help="--ttft: requests per mode")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    per_token(args)
    if args.ttft:
        asyncio.run(ttft(args))


if __name__ == "__main__":
    main()
