"""The CUDA kernels, run on the CPU through an emulation of CUDA's threads (cuda_emulator.py),
against the torch reference, on every machine.

Their source is compiled by g++ and launched through `inferd.kernels.cuda.launch`'s own host code, so
indexing, partitioning, the online softmax, the warp and CTA reductions and the split-context
reduce step are checked where CI runs (it has no GPU), and so is the 8-bit KV cache (kv_quant.py): its
write bit for bit, its decode against the reference on the dequantized cache, with CuPy's
flush-to-zero arithmetic emulated; tests/kernels/test_cuda_kernels.py covers the same and more on a
real device. Shapes are small: the emulated CUDA threads take turns on one core.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import cuda_emulator
from inferd.kernels import kv_quant, reference
from inferd.kernels.cuda import launch as cuda

pytestmark = pytest.mark.skipif(cuda_emulator.compiler() is None, reason="needs g++ to build the CPU emulation")

# (dtype, head size, block size, GQA group): together they take every path through the kernels:
# 16-byte K rows per lane group of 8, 16 and 32 lanes and of 2 vectors per lane (float32, 256),
# V rows combined by shuffles (fewer than 32 lanes per row) and across warps (32 and 64)
CASES = [
    (torch.float32, 64, 16, 3),
    (torch.float16, 64, 32, 3),
    (torch.bfloat16, 128, 16, 4),
    (torch.float32, 128, 32, 1),
    (torch.bfloat16, 256, 16, 2),
    (torch.float32, 256, 16, 1),
]
# 8-bit caches (dtype, head size, block size, group, format): both formats, every query dtype, the
# three lane layouts of 8-code loads (8, 16 and 32 lanes per row)
CASES_8BIT = [
    (torch.bfloat16, 64, 16, 3, "fp8_e4m3"),
    (torch.float32, 128, 32, 2, "fp8_e5m2"),
    (torch.float16, 256, 16, 1, "fp8_e4m3"),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # as test_cuda_kernels
GARBAGE = 30.0  # unowned cache slots: a kernel that reads one gets a visibly wrong answer


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory):
    names = [cuda.cache_kernel_name(dt) for dt in cuda.DTYPES]
    names += [cuda.decode_kernel_name(*case) for case in CASES]
    names += sorted({cuda.reduce_kernel_name(dt, hd) for dt, hd, _, _ in CASES})
    names += [cuda.cache_kernel_name(dt, f) for dt in cuda.DTYPES for f in ("fp8_e4m3", "fp8_e5m2")]
    names += [cuda.decode_kernel_name(*case) for case in CASES_8BIT]
    names += sorted({cuda.reduce_kernel_name(dt, hd) for dt, hd, *_ in CASES_8BIT} - set(names))
    return cuda_emulator.build(names, tmp_path_factory.mktemp("cuda_emulator"))


@pytest.fixture
def kernels(emulated, monkeypatch: pytest.MonkeyPatch):
    cuda_emulator.install(monkeypatch, emulated)
    return cuda


def paged(lengths: list[int], block_size: int, n_kv: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """K/V caches with each sequence in shuffled blocks and garbage everywhere else, and block
    tables ([N, widest + 2] int32) whose unused columns point at random blocks."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.randint(0, num_blocks, (len(lengths), max(needed) + 2), generator=gen, dtype=torch.int32)
    shape = (num_blocks, block_size, n_kv, head_dim)
    key_cache, value_cache = (GARBAGE * torch.randn(shape, generator=gen) for _ in range(2))
    for s, n in enumerate(lengths):
        tables[s, : needed[s]] = torch.tensor([order.pop() for _ in range(needed[s])], dtype=torch.int32)
        positions = torch.arange(n)
        slots = tables[s, positions // block_size].long() * block_size + positions % block_size
        reference.write_kv(torch.randn(n, n_kv, head_dim, generator=gen), torch.randn(n, n_kv, head_dim, generator=gen),
                           key_cache, value_cache, slots)
    return key_cache.to(dtype), value_cache.to(dtype), tables


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-b{c[2]}-g{c[3]}")
def test_decode_single_pass_and_split_match_the_reference(kernels, case) -> None:
    dtype, head_dim, block_size, group = case
    gen = torch.Generator().manual_seed(head_dim + block_size + group)
    n_kv = 2 if head_dim < 256 else 1
    lengths = [1, block_size + 1, 0, 2 * block_size - 1, 520]  # a padding row; tiles past 4 blocks
    key_cache, value_cache, tables = paged(lengths, block_size, n_kv, head_dim, dtype, gen)
    query = torch.randn(len(lengths), n_kv * group, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    live = seq_lens > 0
    expected = reference.decode_attention(query[live].float(), key_cache.float(), value_cache.float(),
                                          tables[live].long(), seq_lens[live].long(), head_dim**-0.5)
    tol = TOLERANCE[dtype]
    for num_partitions in (1, 3):  # 3: partitions of 256 tokens, the last one ragged
        out = kernels.decode_attention(query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5,
                                       num_partitions=num_partitions)
        torch.testing.assert_close(out[live].float(), expected, atol=tol, rtol=tol)
        assert torch.equal(out[~live], torch.zeros_like(out[~live]))


@pytest.mark.parametrize("case, window, softcap", [(CASES[0], 5, None), (CASES[1], 40, 3.0), (CASES[2], 300, None),
                                                   (CASES[0], None, 2.0)], ids=["w5", "w40-cap", "w300", "cap"])
def test_windowed_and_capped_decode_matches_the_reference(kernels, case, window: int | None,
                                                          softcap: float | None) -> None:
    """Windows that cut blocks in the middle (5, 40), leave whole 256-token partitions before them
    (300 of 520), or no window with a soft-cap; single pass and split."""
    dtype, head_dim, block_size, group = case
    gen = torch.Generator().manual_seed(head_dim + (window or 0))
    lengths = [1, block_size + 3, 0, 45, 520]
    key_cache, value_cache, tables = paged(lengths, block_size, 2, head_dim, dtype, gen)
    query = torch.randn(len(lengths), 2 * group, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    live = seq_lens > 0
    expected = reference.decode_attention(query[live].float(), key_cache.float(), value_cache.float(),
                                          tables[live].long(), seq_lens[live].long(), head_dim**-0.5, window, softcap)
    for num_partitions in (1, 3):
        out = kernels.decode_attention(query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5,
                                       num_partitions=num_partitions, window=window, softcap=softcap)
        torch.testing.assert_close(out[live].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_split_workspace_can_be_larger_than_the_batch(kernels) -> None:
    dtype, head_dim, block_size, group = CASES[0]
    gen = torch.Generator().manual_seed(5)
    lengths = [300, 7]
    key_cache, value_cache, tables = paged(lengths, block_size, 2, head_dim, dtype, gen)
    query = torch.randn(2, 2 * group, head_dim, generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    workspace = cuda.DecodeWorkspace(8, 2 * group, head_dim, max_partitions=4, device="cpu")
    out = torch.full_like(query, float("nan"))
    result = kernels.decode_attention(query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5,
                                      max_seq_len=512, num_partitions=2, out=out, workspace=workspace)
    assert result.data_ptr() == out.data_ptr()
    expected = reference.decode_attention(query, key_cache, value_cache, tables.long(), seq_lens.long(), head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", cuda.DTYPES, ids=str)
def test_reshape_and_cache_is_bit_exact(kernels, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    n_q, n_kv, head_dim, block_size, num_blocks, num_tokens = 6, 2, 64, 16, 8, 40
    qkv = torch.randn(num_tokens, n_q + 2 * n_kv, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, n_q : n_q + n_kv], qkv[:, n_q + n_kv :]  # strided rows, as the model's
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding rows: skipped
    shape = (num_blocks, block_size, n_kv, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    reference.write_kv(key[keep], value[keep], expected_k, expected_v, slots[keep])
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


# ------------------------------------------------------------------------------ 8-bit caches


def fp8_values(fmt: str) -> torch.Tensor:  # [n] float32
    """Every positive finite value of the format and every midpoint between neighbours (the
    ties that round to the even code), in float32: exact in bfloat16 and float16 too."""
    dtype, _ = kv_quant.FORMATS[fmt]
    top = 0x7E if fmt == "fp8_e4m3" else 0x7B  # the largest finite code
    values = torch.arange(top + 1, dtype=torch.uint8).view(dtype).float()
    return torch.cat((values, (values[1:] + values[:-1]) / 2))


def kv_rows(num_tokens: int, n_kv: int, head_dim: int, dtype: torch.dtype, fmt: str, gen: torch.Generator):
    """K and V [T, n_kv, D] whose (token, head) rows take every path of the exponent and the
    rounding: random rows at magnitudes 2**-40 .. 2**40 (2**-14 .. 2**8 in float16), zero rows,
    bfloat16/float32 rows of subnormal floats, and rows holding every code and tie of the format
    after its largest value (exponent 0), with random signs."""
    x = torch.randn(2, num_tokens, n_kv, head_dim, generator=gen)
    low, high = (-14, 8) if dtype == torch.float16 else (-40, 40)
    x = x * torch.exp2(torch.randint(low, high + 1, (2, num_tokens, n_kv, 1), generator=gen).float())
    rows = x.view(-1, head_dim)  # [2 T n_kv, D]
    rows[3::11] = 0.0
    if dtype != torch.float16:
        subnormal = rows[5::13]
        subnormal.copy_(torch.randn(subnormal.shape, generator=gen) * 2.0**-135)
    ties = fp8_values(fmt)
    ties = torch.cat((ties, ties.new_zeros(-len(ties) % (head_dim - 1)))).view(-1, head_dim - 1)
    top = ties.max()
    ties = torch.cat((torch.full((len(ties), 1), top), ties), 1)
    ties *= torch.where(torch.rand(ties.shape, generator=gen) < 0.5, -1.0, 1.0)
    rows[1 : 1 + 2 * len(ties) : 2] = ties
    return x[0].to(dtype), x[1].to(dtype)


def empty_8bit_cache(shape: tuple[int, ...], fmt: str, gen: torch.Generator) -> kv_quant.QuantizedCache:
    """Random bytes in every code and exponent: a slot the kernel skips keeps them."""
    data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(kv_quant.FORMATS[fmt][0])
    return kv_quant.QuantizedCache(data, torch.randint(-127, 128, shape[:3], generator=gen, dtype=torch.int8))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", cuda.DTYPES, ids=str)
def test_8bit_reshape_and_cache_equals_kv_quant_write(kernels, dtype: torch.dtype, fmt: str) -> None:
    """Codes and exponents bit for bit; strided K/V rows, skipped slots."""
    gen = torch.Generator().manual_seed(3)
    n_kv, head_dim, block_size, num_blocks, num_tokens = 2, 64, 16, 6, 40
    key, value = kv_rows(num_tokens, n_kv, head_dim, dtype, fmt, gen)
    key, value = (torch.cat((key, value, key), 1)[:, i * n_kv : (i + 1) * n_kv] for i in (0, 1))  # strided rows
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[7::9] = -1
    shape = (num_blocks, block_size, n_kv, head_dim)
    key_cache, value_cache = empty_8bit_cache(shape, fmt, gen), empty_8bit_cache(shape, fmt, gen)
    expected = [kv_quant.QuantizedCache(c.data.clone(), c.exponents.clone()) for c in (key_cache, value_cache)]
    keep = slots >= 0
    kv_quant.write(key[keep], value[keep], *expected, slots[keep])
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    for got, want in zip((key_cache, value_cache), expected):
        assert torch.equal(got.exponents, want.exponents)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))


def quantized_paged(lengths: list[int], block_size: int, n_kv: int, head_dim: int, fmt: str, gen: torch.Generator,
                    exponents: tuple[int, int] = (-100, 100)):
    """paged()'s caches in 8 bits, and what they hold dequantized (float32): the reference's input.
    The V row of sequence 0's first position holds distinct finite codes of both signs (all of
    them where the row is long enough: subnormal, the largest) and exponents in `exponents`."""
    key_cache, value_cache, tables = paged(lengths, block_size, n_kv, head_dim, torch.float32, gen)
    caches = [kv_quant.QuantizedCache(*kv_quant.quantize(c, fmt)) for c in (key_cache, value_cache)]
    top = 0x7E if fmt == "fp8_e4m3" else 0x7B  # the largest finite code
    finite = torch.cat((torch.arange(top + 1), torch.arange(top + 1) | 0x80))
    codes = finite[torch.randperm(len(finite), generator=gen)].repeat(n_kv * head_dim // len(finite) + 1)
    codes = codes[: n_kv * head_dim].to(torch.uint8)
    slot = divmod(int(tables[0, 0]) * block_size, block_size)
    caches[1].data.view(torch.uint8)[slot] = codes.view(n_kv, head_dim)
    caches[1].exponents[slot] = torch.randint(exponents[0], exponents[1] + 1, (n_kv,), generator=gen,
                                              dtype=torch.int8)
    plain = [kv_quant.dequantize(c.data, c.exponents, torch.float32) for c in caches]
    return caches, plain, tables


@pytest.mark.parametrize("case", CASES_8BIT, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-b{c[2]}-g{c[3]}-{c[4]}")
def test_8bit_decode_single_pass_and_split_match_the_reference(kernels, case) -> None:
    """The decode kernel on an 8-bit cache against the reference on the dequantized cache:
    one pass and three partitions, a padding row; the first case with a window, a soft-cap and sinks.
    Sequence 0 (one token) attends to one V row: its output is that row's value, exactly."""
    dtype, head_dim, block_size, group, fmt = case
    gen = torch.Generator().manual_seed(head_dim + group)
    n_kv = 2 if head_dim < 256 else 1
    lengths = [1, block_size + 1, 0, 2 * block_size - 1, 520]
    # (exponents that keep the planted V row in float16's range: -8 .. 0)
    planted = (-8, 0) if dtype == torch.float16 else (-100, 100)
    (key_cache, value_cache), (key_plain, value_plain), tables = quantized_paged(lengths, block_size, n_kv, head_dim,
                                                                                 fmt, gen, planted)
    query = torch.randn(len(lengths), n_kv * group, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    live = seq_lens > 0
    extras = [dict()]
    if case == CASES_8BIT[0]:
        extras.append(dict(window=40, softcap=3.0, sinks=torch.randn(n_kv * group, generator=gen) + 1.0))
    for extra in extras:
        expected = reference.decode_attention(query[live].float(), key_plain, value_plain, tables[live].long(),
                                              seq_lens[live].long(), head_dim**-0.5, **extra)
        for num_partitions in (1, 3):
            out = kernels.decode_attention(query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5,
                                           num_partitions=num_partitions, **extra)
            torch.testing.assert_close(out[live].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
            assert torch.equal(out[~live], torch.zeros_like(out[~live]))
            if not extra:
                row = value_plain.view(-1, n_kv, head_dim)[int(tables[0, 0]) * block_size]  # [n_kv, D]
                assert torch.equal(out[0].view(n_kv, group, head_dim), row[:, None].expand(-1, group, -1).to(dtype))


def test_8bit_caches_are_checked(kernels) -> None:
    gen = torch.Generator().manual_seed(4)
    shape = (4, 16, 2, 64)
    e4m3, e5m2 = empty_8bit_cache(shape, "fp8_e4m3", gen), empty_8bit_cache(shape, "fp8_e5m2", gen)
    key = torch.randn(3, 2, 64, generator=gen)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="one format"):
        kernels.reshape_and_cache(key, key, e4m3, e5m2, slots)
    with pytest.raises(ValueError, match="one format"):
        kernels.reshape_and_cache(key, key, e4m3, torch.zeros(shape), slots)
    strided = kv_quant.QuantizedCache(e4m3.data, e4m3.exponents.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="exponents"):
        kernels.reshape_and_cache(key, key, e4m3, strided, slots)


# Gemma 2 (the default tier's) takes every path the Llama case does, and the window and soft-cap too;
# gpt-oss adds attention sinks (in the split kernel's reduce too) and the experts, Gemma 4 KV-shared layers
@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.soak), "gemma2", "gpt_oss", "gemma4"])
def test_a_model_on_the_cuda_backend_matches_transformers(kernels, tmp_path, family: str) -> None:
    """The CUDA attention backend end to end (strided K/V into reshape_and_cache, int32 decode
    plans, the split kernel for a context past 512 tokens), inside the engine on the CPU: greedy
    tokens equal transformers' in float32, as with the reference backend. Gemma 2: a sliding layer
    (window 40) and a full one, both soft-capped."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    import tiny_models as tm

    from inferd.engine.config import EngineConfig
    from inferd.engine.llm_engine import LLMEngine
    from inferd.kernels.ops import CudaAttention
    from inferd.text.sampling_params import SamplingParams

    vocab_size = tm.train_sentencepiece(tmp_path)
    # head size 64, 3 query heads per KV head: the decode specialization CASES[0] compiles
    shape = dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=256,
                 max_position_embeddings=1024)
    if family == "llama":
        model = tm.tiny_llama(vocab_size, **shape)
    elif family in ("gpt_oss", "gemma4"):
        model = _newer_family(family, vocab_size, shape)
    else:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        torch.manual_seed(0)
        model = tm.randomize(Gemma2ForCausalLM(Gemma2Config(
            vocab_size=vocab_size, num_hidden_layers=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=40,
            attn_logit_softcapping=5.0, tie_word_embeddings=False, **shape)), 0, norm_centre=0.0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(tmp_path), dtype="float32", kv_cache_memory=16 * 2**20,
                                                block_size=16, max_num_seqs=8, speculative="suffix"))
    cfg = engine.model.cfg
    engine.model.set_attention(CudaAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 8, engine.max_model_len,
                                             torch.device("cpu")))
    prompts = [engine.tokenizer.encode(p) for p in tm.PROMPTS[:3]]
    if family in ("llama", "gemma2"):  # (sinks in the split kernel: tests/kernels/test_sinks.py)
        prompts.append(engine.tokenizer.encode(" ".join(tm.PROMPTS) * 30)[:530])  # the split kernel's range
    with tm.torch_threads(1):
        expected = tm.greedy_reference(model, prompts, 8)
    # speculation: each decode verifies the reference's next tokens with the last one wrong (several
    # rows of a sequence through the decode kernel, accepted and rejected drafts)
    answers = {tuple(p): e for p, e in zip(prompts, expected)}

    def drafts(req, room: int, cold: float) -> list[int]:
        right = answers[tuple(req.prompt_ids)][len(req.output_ids):][:room]
        return right[:-1] + [(right[-1] + 1) % cfg.vocab_size] if right else []

    engine.speculator._propose = drafts
    completions = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [c.token_ids for c in completions] == expected
    assert engine.speculator.accepted_tokens > 0 and engine.speculator.accepted_tokens < engine.speculator.drafted_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks


def _newer_family(family: str, vocab_size: int, shape: dict[str, int]) -> torch.nn.Module:
    """gpt-oss (sinks, a window of 40 and a full layer, 4 experts) or Gemma 4 (two of four layers
    reading earlier layers' caches), in the shape the compiled decode specialization takes."""
    import tiny_models as tm
    import transformers as t

    torch.manual_seed(0)
    if family == "gpt_oss":
        model = t.GptOssForCausalLM(t.GptOssConfig(
            vocab_size=vocab_size, num_hidden_layers=2, head_dim=64, sliding_window=40, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], **shape))
        model = tm.randomize(model, 0)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.mul_(10).add_(1.0)  # (sinks that matter)
        return model
    sliding, full = "sliding_attention", "full_attention"
    return tm.randomize(t.Gemma4ForCausalLM(t.Gemma4TextConfig(
        vocab_size=vocab_size, num_hidden_layers=4, head_dim=64, global_head_dim=64, num_global_key_value_heads=1,
        sliding_window=40, layer_types=[sliding, full, sliding, full], num_kv_shared_layers=2,
        hidden_size_per_layer_input=0, tie_word_embeddings=False, **shape)), 0)
