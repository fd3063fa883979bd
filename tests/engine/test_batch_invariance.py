"""`[model] deterministic`: each row's result the same bits whatever shares its batch, on the CPU
in bfloat16 (the default dtype), kernel by kernel and end to end.

The kernels are checked with one row fixed among batches of 1..64 rows. The products use the real
model's weights and activations it computes: with random test data oneDNN's one-row path agrees
with its many-row path, with the model's own numbers it does not (see `linear`). The full sweeps
(every batch size, a dozen fixed rows; 24 prompts end to end) are the soak tier's; the default
tier runs the same checks at the sizes where products change paths (1 row, 2, odd, a vector's
width and more, 64) and on 8 prompts.
"""

from __future__ import annotations

from typing import Any

from collections.abc import Callable, Sequence

import pytest
import torch

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.kernels import reference
from inferd.kernels.ops import CpuAttention
from inferd.model.layers.linear import Linear, SplitLinear
from inferd.text.sampling_params import SamplingParams

BATCHES = range(1, 65)
SOME_BATCHES = (1, 2, 3, 8, 17, 31, 64)  # one row, two, odd sizes, across vector widths, the most
SWEEPS = [pytest.param((BATCHES, 7), marks=pytest.mark.soak, id="every-batch"),
          pytest.param((SOME_BATCHES, 21), id="some-batches")]  # (batch sizes, every how many rows one is fixed)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.of(dtype="bfloat16", kv_cache_memory=128 * 2**20, deterministic=True,
                                              enable_prefix_caching=False))


@pytest.fixture(scope="module")
def activations(engine: LLMEngine) -> dict[str, tuple[Linear, torch.Tensor]]:
    """(product, its input rows) for the middle layer's products and the head, recorded while the
    model prefills real prompts (inputs with the model's own magnitudes and structure)."""
    model = engine.model
    layer = model.layers[len(model.layers) // 2]
    seen: dict[str, tuple[Linear, torch.Tensor]] = {}

    def recorder(name: str, op: Linear) -> Callable[..., torch.Tensor]:
        def record(x: torch.Tensor, num_prefill_rows: int = 0) -> torch.Tensor:
            if x.shape[0] > len(seen.get(name, (None, ()))[1]):
                seen[name] = (op, x.clone())
            return op(x, num_prefill_rows)
        return record

    names = ("qkv", "o", "gate_up", "down")
    for name in names:
        setattr(owner(layer, name), name, recorder(name, getattr(owner(layer, name), name)))
    try:
        text = "The quick brown fox jumps over the lazy dog. " * 10
        engine.generate([text, text[:-3]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    finally:
        for name in names:
            setattr(owner(layer, name), name, seen[name][0])
    # the head sees only the rows it samples: give it the layer's normed hidden states instead
    seen["lm_head"] = (model.lm_head, seen["gate_up"][1])
    return seen


@pytest.mark.parametrize("sweep", SWEEPS)
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down", "lm_head"])
@pytest.mark.parametrize("rows", ["prefill", "decode"])
def test_each_product_gives_a_row_the_same_bits_at_batch_sizes_1_to_64(
        activations: dict[str, tuple[Linear, torch.Tensor]], name: str, rows: str,
        sweep: tuple[Sequence[int], int]) -> None:
    """A layer's product on packed weights: decode rows through the packed kernel, prefill rows
    through the dense copy (linear.SplitLinear); the head is dense for both."""
    op, inputs = activations[name]
    if name != "lm_head":
        assert isinstance(op, SplitLinear), type(op)  # the default weights of the default model
    assert inputs.shape[0] > 64, inputs.shape

    def run(x: torch.Tensor) -> torch.Tensor:
        return op(x, x.shape[0] if rows == "prefill" else 0)

    batches, every = sweep
    # several fixed rows: whether a row's bits move depends on its values
    for k in range(0, inputs.shape[0], every if name != "lm_head" else 30):
        fixed, others = inputs[k:k + 1], torch.cat([inputs[:k], inputs[k + 1:]])
        alone = run(fixed)[0]
        for n in batches:
            at = n // 2  # (the fixed row in the middle: neither first nor last)
            batch = torch.cat([others[:at], fixed, others[at:n - 1]])
            assert torch.equal(run(batch)[at], alone), (name, k, n)


def cache(num_blocks: int = 400, block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    shape = (num_blocks, block_size, 3, 64)
    return torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)


def attend(key_cache: torch.Tensor, value_cache: torch.Tensor, lens: list[int], query_lens: list[int],
           queries: torch.Tensor, tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    plan = reference.plan_attention(torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lens),
                                    torch.tensor(query_lens), 16, kv_block=reference.KV_BLOCK)
    return reference.attention_planned(queries, key_cache, value_cache, plan, 0.125)


def tables_for(lens: list[int], fixed: int, fixed_table: list[int]) -> list[list[int]]:
    tables, next_block = [], 0
    for i, n in enumerate(lens):
        blocks = -(-n // 16)
        tables.append(fixed_table if i == fixed else [(next_block + b) % 200 for b in range(blocks)])
        next_block += blocks
    return tables


def test_decode_attention_gives_a_row_the_same_bits_beside_any_contexts(engine: LLMEngine) -> None:
    """Our CPU kernel (the default decode attention): no padding needed."""
    assert isinstance(engine.model.attention, CpuAttention)
    key_cache, value_cache = cache()
    backend = CpuAttention()

    def decode(queries: torch.Tensor, lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        width = max(map(len, tables))
        plan = backend.plan_decode([t + [0] * (width - len(t)) for t in tables], lens, 16, torch.device("cpu"))
        return backend.decode(queries, key_cache, value_cache, plan, 0.125)

    query, own = torch.randn(1, 9, 64, dtype=torch.bfloat16), [300 + b for b in range(3)]  # 37 keys
    alone = decode(query, [37], [own])[0]
    generator = torch.Generator().manual_seed(1)
    for n in BATCHES:
        lens = torch.randint(1, 700, (n,), generator=generator).tolist()
        at = n // 2
        lens[at] = 37
        queries = torch.randn(n, 9, 64, dtype=torch.bfloat16)
        queries[at] = query[0]
        out = decode(queries, lens, tables_for(lens, at, own))
        assert torch.equal(out[at], alone), n


def test_prefill_attention_gives_the_same_bits_beside_other_prompts_and_in_chunks(engine: LLMEngine) -> None:
    key_cache, value_cache = cache()
    own = [300 + b for b in range(4)]  # a 60-token prompt
    prompt = torch.randn(60, 9, 64, dtype=torch.bfloat16)
    alone = attend(key_cache, value_cache, [60], [60], prompt, [own])
    for others in ([5], [100], [200, 3], [600, 40, 7]):  # longer and shorter prompts beside it
        lens = [60, *others]
        queries = torch.cat([prompt, torch.randn(sum(others), 9, 64, dtype=torch.bfloat16)])
        out = attend(key_cache, value_cache, lens, lens, queries, tables_for(lens, 0, own))
        assert torch.equal(out[:60], alone), others
    first = attend(key_cache, value_cache, [25], [25], prompt[:25], [own])  # split in two chunks
    second = attend(key_cache, value_cache, [60], [35], prompt[25:], [own])
    assert torch.equal(torch.cat([first, second]), alone)


@pytest.mark.parametrize("count", [pytest.param(24, marks=pytest.mark.soak), 4])
def test_greedy_tokens_alone_equal_those_among_others(engine: LLMEngine, count: int) -> None:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly vexing brains".split()
    prompts = [f"Story {i}: " + " ".join(words[(i + j) % len(words)] for j in range(5 + (i * 37) % 120))
               for i in range(count)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = [c.token_ids for c in engine.generate(prompts, params)]
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def owner(layer: Any, name: str) -> Any:
    """Where a decoder layer keeps the product `name`: its MLP's gate_up and down, its own qkv and o."""
    return layer.mlp if name in ("gate_up", "down") else layer
