"""The KV cache in 8 bits ([cache] kv_cache_dtype = "fp8"): the cache's tensors and block copies
(exponents travel with their codes), and the real default model served over it: sensible greedy
text, the same tokens whatever the batch, copy-on-write and swapping exact, about twice the
blocks of a bfloat16 cache in the same memory; and perplexity over 8-bit layers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_batch_invariance import tables_for  # (the bfloat16 tests' helpers, beside this file)
from test_engine import run_group
from test_engine_policy import GREEDY, PROMPTS, assert_pool_whole, run

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.engine.worker.kv_cache import KVCache, bytes_per_block, host_blocks_for, num_blocks_for
from inferd.kernels import kv_quant
from inferd.kernels.kv_quant import QuantizedCache
from inferd.kernels.ops import CpuAttention
from inferd.model.evaluate import perplexity
from inferd.model.families.config import ModelConfig
from inferd.settings.policy import SchedulingPolicy
from inferd.text.sampling_params import SamplingParams

CFG = ModelConfig(
    architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=64, tie_word_embeddings=True,
)
CPU = torch.device("cpu")
MEMORY = 96 * 2**20


# ------------------------------------------------------------------------------ the cache's tensors


def test_8bit_blocks_cost_a_byte_an_element_and_one_a_row() -> None:
    per_block = bytes_per_block(CFG, 16, torch.bfloat16, "fp8_e4m3")
    assert per_block == 2 * 2 * 16 * (2 * 16 + 2)  # K+V, layers, tokens, (kv heads x head dim + kv heads) bytes
    assert bytes_per_block(CFG, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2
    assert num_blocks_for(10 * per_block + 5, CFG, 16, torch.bfloat16, CPU, "fp8_e5m2") == 10
    assert host_blocks_for(10 * per_block + 5, CFG, 16, torch.bfloat16, "fp8_e4m3") == 10
    cache = KVCache(CFG, num_blocks=5, block_size=4, dtype=torch.bfloat16, device=CPU, kv_format="fp8_e5m2")
    assert cache.bytes_per_block == sum(t[:, :, :1].nbytes for t in cache.block_tensors)


def fill(cache: KVCache, seed: int) -> None:
    """Every layer's every slot written through the spec, rows of varied magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(cache.num_blocks * cache.block_size)
    for key_cache, value_cache in cache.layers:
        rows = [torch.randn(len(slots), 2, 16, generator=gen) * 4.0 ** torch.randint(-3, 4, (len(slots), 2, 1),
                                                                                       generator=gen)
                for _ in range(2)]
        kv_quant.write(rows[0], rows[1], key_cache, value_cache, slots)  # type: ignore[arg-type]


def values(cache: KVCache) -> torch.Tensor:  # [layers, 2, num_blocks, block_size, kv_heads, head_dim] float32
    return torch.stack([torch.stack([kv_quant.dequantize(c.data, c.exponents, torch.float32) for c in layer])
                        for layer in cache.layers])  # type: ignore[union-attr]


@pytest.mark.parametrize("fmt", list(kv_quant.FORMATS))
def test_8bit_layers_are_views_and_block_copies_carry_the_exponents(fmt: str) -> None:
    cache = KVCache(CFG, num_blocks=5, block_size=4, dtype=torch.bfloat16, device=CPU, kv_format=fmt)
    assert cache.storage.dtype == kv_quant.FORMATS[fmt][0] and cache.storage.shape == (2, 2, 5, 4, 2, 16)
    assert cache.exponents[0].dtype == torch.int8 and cache.exponents[0].shape == (2, 2, 5, 4, 2)
    assert all(not t.any() for t in cache.block_tensors)
    assert all(isinstance(c, QuantizedCache) and c.format == fmt for layer in cache.layers for c in layer)
    fill(cache, 0)
    before = values(cache)
    assert before[:, :, 1].abs().amax() > 0
    cache.copy_blocks([(1, 3), (4, 0)])
    after = values(cache)
    assert torch.equal(after[:, :, 3], before[:, :, 1]) and torch.equal(after[:, :, 0], before[:, :, 4])
    assert torch.equal(after[:, :, 1:3], before[:, :, 1:3])


def test_8bit_blocks_swap_out_and_back_with_their_exponents() -> None:
    cache = KVCache(CFG, num_blocks=6, block_size=4, dtype=torch.bfloat16, device=CPU, num_host_blocks=3,
                    kv_format="fp8_e4m3")
    assert cache.host_storages is not None and len(cache.host_storages) == 2  # codes (as bytes), exponents
    assert [h.dtype for h in cache.host_storages] == [torch.uint8, torch.int8]
    fill(cache, 1)
    blocks = values(cache)
    cache.swap_out([(1, 0), (4, 2)])
    fill(cache, 2)  # the device blocks reused
    untouched = values(cache)
    cache.swap_in([(0, 5), (2, 0)])
    after = values(cache)
    assert torch.equal(after[:, :, 5], blocks[:, :, 1]) and torch.equal(after[:, :, 0], blocks[:, :, 4])
    assert torch.equal(after[:, :, 1:5], untouched[:, :, 1:5])


# ------------------------------------------------------------------------------ the engine over it


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The default model as served (bfloat16, packed weights, batch-invariant), K/V in fp8 (e4m3).
    NOTE: a model of its own: the KV format binds the model's KV write (set_attention)."""
    return LLMEngine.from_config(EngineConfig.of(kv_cache_dtype="fp8", kv_cache_memory=MEMORY,
                                                 enable_prefix_caching=False))


def test_an_fp8_engine_holds_about_twice_the_tokens(engine: LLMEngine) -> None:
    assert engine.kv_cache.kv_format == "fp8_e4m3" and isinstance(engine.model.attention, CpuAttention)
    bf16_blocks = num_blocks_for(MEMORY, engine.model.cfg, 16, torch.bfloat16, CPU)
    assert engine.block_manager.pool.num_blocks == engine.limits.num_kv_blocks
    assert engine.block_manager.pool.num_blocks >= 1.9 * bf16_blocks


def test_an_fp8_engine_generates_sensible_greedy_text(engine: LLMEngine) -> None:
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name the capital city of France."}])
    ids = engine.tokenizer.encode(chat, add_special_tokens=False)
    [c] = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0))
    assert "Paris" in c.text
    assert_pool_whole(engine)


def test_fp8_decode_gives_a_row_the_same_bits_beside_any_contexts(engine: LLMEngine) -> None:
    """The engine's backend (our CPU kernel) over an 8-bit cache of the model's K/V shape."""
    backend = engine.model.attention
    cache = KVCache(engine.model.cfg, num_blocks=200, block_size=16, dtype=torch.bfloat16, device=CPU,
                    kv_format="fp8_e4m3")
    key_cache, value_cache = cache.layers[0]
    slots = torch.arange(200 * 16)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(len(slots), 3, 64, generator=gen).bfloat16() for _ in range(2)]
    backend.write_kv(rows[0], rows[1], key_cache, value_cache, slots)

    def decode(queries: torch.Tensor, lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        width = max(map(len, tables))
        plan = backend.plan_decode([t + [0] * (width - len(t)) for t in tables], lens, 16, CPU)
        return backend.decode(queries, key_cache, value_cache, plan, 0.125)

    query, own = torch.randn(1, 9, 64, generator=gen).bfloat16(), [150 + b for b in range(3)]  # 37 keys
    alone = decode(query, [37], [own])[0]
    for n in (2, 3, 17, 64):
        lens = torch.randint(1, 700, (n,), generator=gen).tolist()
        at = n // 2
        lens[at] = 37
        queries = torch.randn(n, 9, 64, generator=gen).bfloat16()
        queries[at] = query[0]
        out = decode(queries, lens, tables_for(lens, at, own))
        assert torch.equal(out[at], alone), n


def test_fp8_greedy_tokens_alone_equal_those_among_others(engine: LLMEngine) -> None:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly vexing brains".split()
    prompts = [f"Story {i}: " + " ".join(words[(i + j) % len(words)] for j in range(5 + (i * 37) % 60))
               for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    together = [c.token_ids for c in engine.generate(prompts, params)]
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone
    assert_pool_whole(engine)


def test_fp8_copy_on_write_gives_n_choices_the_tokens_of_one(engine: LLMEngine) -> None:
    prompt_ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    assert len(prompt_ids) % 16  # a partial last block, shared by the forks, then copied
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [alone] = engine.generate([prompt_ids], greedy)
    copies: list[tuple[int, int]] = []
    real = engine.kv_cache.copy_blocks
    engine.kv_cache.copy_blocks = lambda pairs: (copies.extend(pairs), real(pairs))[1]  # type: ignore[method-assign]
    try:
        tokens = run_group(engine, prompt_ids, greedy, 3)
    finally:
        engine.kv_cache.copy_blocks = real  # type: ignore[method-assign]
    assert copies and all(t == alone.token_ids for t in tokens.values())
    assert_pool_whole(engine)


def test_fp8_swapping_under_memory_pressure_keeps_the_greedy_text(engine: LLMEngine) -> None:
    greedy = replace(GREEDY, max_tokens=12)
    expected = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
    per_block = engine.kv_cache.bytes_per_block * 4 // 16  # (blocks of 4)
    tight = LLMEngine(engine.model, engine.tokenizer, EngineConfig.of(
        kv_cache_dtype="fp8", block_size=4, kv_cache_memory=14 * per_block, swap_space=64 * per_block,
        enable_prefix_caching=False, policy=SchedulingPolicy(preemption_mode="swap")))
    assert tight.block_manager.pool.num_blocks == 14 and tight.kv_cache.host_storages is not None
    ids = [tight.add(p, greedy, priority=("interactive", "batch")[i % 2]) for i, p in enumerate(PROMPTS)]
    results = run(tight, ids)
    assert [results[i][0] for i in ids] == expected
    assert tight.scheduler.preemptions["swap"] > 0, tight.scheduler.preemptions
    assert_pool_whole(tight)


def test_perplexity_over_8bit_layers_is_close_to_bfloat16s(engine: LLMEngine) -> None:
    """evaluate.perplexity writes and reads 8-bit layers through the reference, whatever backend
    the model has, and gives that backend back."""
    model, backend = engine.model, engine.model.attention
    text = " ".join(f"Rule {i}: be kind to the number {i * 7 % 13}, and to its neighbours." for i in range(20))
    ids = engine.tokenizer.encode(text)[:257]
    results = {}
    for fmt in (None, "fp8_e4m3"):
        cache = KVCache(model.cfg, 20, 16, torch.bfloat16, CPU, kv_format=fmt)
        results[fmt] = perplexity(model, cache.layers, 16, ids, window=128)
        assert model.attention is backend
    assert 1 < results[None] < 100 and abs(results["fp8_e4m3"] / results[None] - 1) < 0.05, results
