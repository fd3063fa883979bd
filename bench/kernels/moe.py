"""Mixture of experts on this CPU (issue 40): the decode step of a MoE model against a dense one with
the same active parameters, the cost of grouping rows by expert, and the resident bytes of a
Qwen3-30B-A3B-shaped layer packed against bf16.

    .venv/bin/python bench/kernels/moe.py [--batches 1 32] [--steps 24] [--rounds 3]

Two random checkpoints written by transformers (Qwen3 and Qwen3-MoE, 8 layers, hidden 1024, 16/4
heads): the dense MLP has 1,536 intermediate rows; the mixture 64 experts of 192, 8 active per
token (8 x 192 = 1,536: the same active parameters, 8x the total). Both served by inferd's engine in
bfloat16, weights "bf16" (dense) and "int4" (packed on the block products); decode steps timed
after every prompt is prefilled (median of --rounds, the engines alternating).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.kernels import ops
from inferd.model.layers import moe, mxfp4
from inferd.model.layers.linear import BlockLinear, make_linear
from inferd.model.layers.quant import quantize_int4
from inferd.text.sampling_params import SamplingParams

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=True)


def write_models(folder: Path) -> dict[str, Path]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    models = {
        "dense": Qwen3ForCausalLM(Qwen3Config(intermediate_size=1536, **SHAPE)),
        "moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=1536, num_experts=64, num_experts_per_tok=8,
                                                  moe_intermediate_size=192, norm_topk_prob=True, **SHAPE)),
    }
    paths = {}
    for name, model in models.items():
        paths[name] = folder / name
        model.save_pretrained(paths[name])
        _write_tokenizer(paths[name], SHAPE["vocab_size"])
    return paths


def _write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over `vocab` ids: the bench feeds token ids, never text."""
    import json

    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1", "bos_token": "w2"}))


def decode_step_seconds(engine: LLMEngine, batch: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add([(7 * i + j) % 4000 + 10 for j in range(16)], params)
    while any(len(r.output_ids) == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # (prefill)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    while engine.has_work():
        engine.step()
    return elapsed


def step_table(paths: dict[str, Path], batches: list[int], steps: int, rounds: int) -> None:
    print("| batch | weights | dense step ms | MoE step ms (8x the parameters) | MoE / dense |")
    print("|---:|---|---:|---:|---:|")
    for weights in ("bf16", "int4"):
        engines = {name: LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="bfloat16", weights=weights,
                                                              kv_cache_memory=256 * 2**20, enable_prefix_caching=False))
                   for name, path in paths.items()}
        for n in batches:
            times: dict[str, list[float]] = {name: [] for name in engines}
            for engine in engines.values():
                decode_step_seconds(engine, 1, 2)  # (warm-up)
            for _ in range(rounds):
                for name, engine in engines.items():
                    times[name].append(decode_step_seconds(engine, n, steps))
            dense, sparse = (statistics.median(times[k]) * 1e3 for k in ("dense", "moe"))
            print(f"| {n} | {weights} | {dense:.1f} | {sparse:.1f} | {sparse / dense:.2f}x |", flush=True)


def grouping_overhead(batches: list[int], rounds: int) -> None:
    """The mixture's time against its expert products alone (same rows per expert): routing,
    sorting, gathering and the weighted sum are the difference."""
    spec = moe.Experts(num_experts=64, top_k=8, intermediate_size=192)
    gen = torch.Generator().manual_seed(0)
    shapes = moe.expected_tensors(spec, "m", 1024)
    w = {name: quantize_int4(0.02 * torch.randn(shape, generator=gen)) if name.rsplit(".", 1)[-1] in ("gate", "up", "down")
         else (0.02 * torch.randn(shape, generator=gen)).bfloat16() for name, shape in shapes.items()}

    shape = ops.LayerShape(1024, 192, 64, 16, 4, 1e-6, False, False, "silu", False, False)
    gated = ops.layer_ops(shape, torch.bfloat16, torch.device("cpu"), ops.TorchAttention()).gated  # (the decoder's)
    layer = moe.MixtureOfExperts(spec, w, "m", torch.bfloat16, gated)  # type: ignore[arg-type]
    print("\n| rows | mixture µs | its expert products alone µs | grouping overhead |")
    print("|---:|---:|---:|---:|")
    for n in batches:
        x = torch.randn(n, 1024, generator=gen).bfloat16()
        _, index = moe.route(layer.router(x.float()), spec)
        counts = torch.bincount(index.flatten(), minlength=64).tolist()
        rows = [x[:1].expand(c, -1).contiguous() for c in counts]

        def products() -> None:
            for expert, r in zip(layer.experts, rows):
                if r.shape[0]:
                    expert(r)

        whole, alone = _time(lambda: layer(x), rounds), _time(products, rounds)
        print(f"| {n} | {whole:.0f} | {alone:.0f} | {(whole - alone) / whole:.0%} |", flush=True)


def _time(fn: object, rounds: int) -> float:
    samples = []
    for _ in range(rounds * 5):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def mxfp4_products(batches: list[int], rounds: int) -> None:
    """gpt-oss-20b expert products (2,880 -> 2,880) three ways: MXFP4 converted at load to 8-bit
    blocks on the block products (what inferd does), MXFP4 read as stored (dequantized at each call,
    then a bf16 product: no kernel of ours reads e2m1 directly), and dense bf16. Eight experts in
    turn, so that the weights come from memory, not the cache, as a model's do."""
    gen = torch.Generator().manual_seed(0)
    n = k = 2880
    stored = [(torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8),
               torch.randint(118, 124, (n, k // 32), generator=gen, dtype=torch.uint8)) for _ in range(8)]
    converted = [make_linear(mxfp4.to_q8_blocks(b, s), None, torch.bfloat16) for b, s in stored]  # type: ignore[arg-type]
    dense = [mxfp4.dequantize(b, s, torch.bfloat16) for b, s in stored]
    stored_bytes = stored[0][0].nbytes + stored[0][1].nbytes
    converted_bytes = getattr(converted[0], "weight", dense[0]).nbytes
    turn = iter(range(10**9))

    def each(fn: object) -> object:
        return lambda: fn(next(turn) % 8)  # type: ignore[operator]

    print(f"\n| rows | MXFP4 as 8-bit blocks µs ({converted_bytes / n / k:.2f} B/weight) | MXFP4 as stored, "
          f"dequantized per call µs ({stored_bytes / n / k:.2f} B/weight) | bf16 µs (2 B/weight) |")
    print("|---:|---:|---:|---:|")
    for m in batches:
        x = torch.randn(m, k, generator=gen).bfloat16()
        a = _time(each(lambda i: converted[i](x)), rounds)
        b = _time(each(lambda i: torch.nn.functional.linear(x, mxfp4.dequantize(*stored[i], torch.bfloat16))), rounds)
        c = _time(each(lambda i: torch.nn.functional.linear(x, dense[i])), rounds)
        print(f"| {m} | {a:.0f} | {b:.0f} | {c:.0f} |", flush=True)


def resident_bytes() -> None:
    """A Qwen3-30B-A3B layer (hidden 2048, 128 experts of 768, 32/4 heads of 128): one expert packed
    for real, times 128, plus the attention and the router."""
    hidden, inter, experts = 2048, 768, 128
    gen = torch.Generator().manual_seed(0)
    mats = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    packed = 0
    for shape in mats.values():
        op = make_linear(quantize_int4(0.02 * torch.randn(shape, generator=gen)), None, torch.bfloat16)
        packed += op.weight.nbytes if isinstance(op, BlockLinear) else sum(
            t.nbytes for t in vars(op).values() if isinstance(t, torch.Tensor))
    expert_bf16 = sum(a * b for a, b in mats.values()) * 2
    attention = (hidden * (32 * 128 + 2 * 4 * 128) + 32 * 128 * hidden) * 2  # (bf16 in both)
    router = experts * hidden * 2
    dense_layer = experts * expert_bf16 + attention + router
    packed_layer = experts * packed + attention + router
    print(f"\nQwen3-30B-A3B-shaped layer: bf16 {dense_layer / 2**20:.0f} MiB, experts packed (int4 on the block "
          f"products) {packed_layer / 2**20:.0f} MiB: {packed_layer / dense_layer:.2f}x "
          f"(48 layers: {48 * dense_layer / 2**30:.1f} GiB against {48 * packed_layer / 2**30:.1f} GiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as folder:
        step_table(write_models(Path(folder)), args.batches, args.steps, args.rounds)
    grouping_overhead(args.batches, args.rounds)
    mxfp4_products(args.batches, args.rounds)
    resident_bytes()


if __name__ == "__main__":
    main()
