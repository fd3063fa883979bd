"""The linear-attention CUDA kernels (inferd/kernels/cuda/csrc/linear_attention.cu), run on the CPU
through the emulation of CUDA's threads (cuda_emulator.py), against the torch reference: the conv's
row tiles and history reads, the delta rule's row groups and their fixed-order sums, saves, fresh
slots, GQA, strided rows. Shapes are small: the emulated threads take turns on one core."""

from __future__ import annotations

import sys
from pathlib import Path

import cuda_emulator
import pytest
import torch

from inferd.kernels import linear_attention as la
from inferd.kernels.cuda import launch as cuda
from inferd.kernels.linear_attention import StatePlan

pytestmark = pytest.mark.skipif(cuda_emulator.compiler() is None, reason="needs g++ to build the CPU emulation")

CPU = torch.device("cpu")
# (dtype, dk, dv, conv width): 4 row groups of 4 rows, 2 of 16, 1 of 32 (one column per thread)
CASES = [(torch.float32, 16, 32, 4), (torch.bfloat16, 32, 64, 4), (torch.float16, 32, 128, 3)]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory):
    names = [n for dt, _, _, K in CASES for n in cuda.conv_kernel_names(dt, K)]
    names += [cuda.delta_kernel_name(dt, dk, dv) for dt, dk, dv, _ in CASES]
    return cuda_emulator.build(names, tmp_path_factory.mktemp("linear_emulator"))


@pytest.fixture
def kernels(emulated, monkeypatch: pytest.MonkeyPatch):
    cuda_emulator.install(monkeypatch, emulated)
    return cuda


def step() -> StatePlan:
    """Prefill segments (one fresh, one longer than a conv tile, one shorter than the conv's
    history), then decode rows (one fresh); saves inside segments, at a segment's first row, and
    at a decode row."""
    lens = [9, 2, 13, 1, 1, 1]
    return StatePlan.build(lens, [3, 0, 5, 1, 7, 2], [True, False, False, False, True, False],
                           [(0, 8), (4, 9), (9, 10), (11, 11), (20, 12), (25, 13)], 3, CPU)


def run_conv(conv, plan, x, weight, conv_states):
    conv_states = conv_states.clone()
    return conv(x, weight, conv_states, plan), conv_states


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-dk{c[1]}-dv{c[2]}-K{c[3]}")
def test_conv_matches_the_reference(kernels, case) -> None:
    dtype, _, _, K = case
    plan = step()
    gen = torch.Generator().manual_seed(K)
    T, C, S = plan.starts[-1], 200, 14  # two channel blocks, the second ragged
    wide = torch.randn(T, C + 24, generator=gen).to(dtype)
    x = wide[:, 8:8 + C]  # strided rows, as a slice of the projection
    weight = torch.randn(C, K, generator=gen).to(dtype)
    conv_states = torch.randn(S, K - 1, C, generator=gen).to(dtype)
    expected, expected_states = run_conv(la.causal_conv, plan, x, weight, conv_states)
    got, got_states = run_conv(
        lambda *a: kernels.causal_conv(*a[:3], plan.cu_seqlens, plan.slots, plan.fresh, plan.save_rows,
                                       plan.save_slots), plan, x, weight, conv_states)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    assert torch.equal(got_states, expected_states)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-dk{c[1]}-dv{c[2]}-K{c[3]}")
def test_gated_delta_matches_the_reference(kernels, case) -> None:
    dtype, dk, dv, _ = case
    plan = step()
    gen = torch.Generator().manual_seed(dk + dv)
    T, Hk, Hv, S = plan.starts[-1], 1, 2, 14
    qkv = torch.randn(T, 2 * Hk * dk + Hv * dv, generator=gen).to(dtype)
    q = qkv[:, :Hk * dk].unflatten(1, (Hk, dk))  # strided rows
    k = qkv[:, Hk * dk:2 * Hk * dk].unflatten(1, (Hk, dk))
    v = qkv[:, 2 * Hk * dk:].unflatten(1, (Hv, dv))
    g = -torch.nn.functional.softplus(torch.randn(T, Hv, generator=gen))
    beta = torch.rand(T, Hv, generator=gen)
    states = torch.randn(S, Hv, dk, dv, generator=gen) * 0.1
    expected_states, got_states = states.clone(), states.clone()
    expected = la.gated_delta(q, k, v, g, beta, expected_states, plan)
    got = kernels.gated_delta(q, k, v, g, beta, got_states, plan.cu_seqlens, plan.slots, plan.fresh, plan.save_rows,
                              plan.save_slots)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_states, expected_states, atol=1e-5, rtol=1e-5)


def test_a_decode_row_does_not_depend_on_its_batch(kernels) -> None:
    _, dk, dv, K = CASES[0]
    gen = torch.Generator().manual_seed(3)
    B, Hk, Hv, S, C = 5, 1, 2, 6, 64
    q, k = torch.randn(B, Hk, dk, generator=gen), torch.randn(B, Hk, dk, generator=gen)
    v, x = torch.randn(B, Hv, dv, generator=gen), torch.randn(B, C, generator=gen)
    g, beta = -torch.rand(B, Hv, generator=gen), torch.rand(B, Hv, generator=gen)
    states, conv_states = torch.randn(S, Hv, dk, dv, generator=gen), torch.randn(S, K - 1, C, generator=gen)
    weight = torch.randn(C, K, generator=gen)

    def decode(rows: slice, slots: list[int]):
        plan = StatePlan.build([1] * len(slots), slots, [False] * len(slots), [], len(slots), CPU)
        s, cs = states.clone(), conv_states.clone()
        tensors = (plan.cu_seqlens, plan.slots, plan.fresh, plan.save_rows, plan.save_slots)
        o = kernels.gated_delta(q[rows], k[rows], v[rows], g[rows], beta[rows], s, *tensors)
        y = kernels.causal_conv(x[rows], weight, cs, *tensors)
        return o, y, s, cs

    o, y, s, cs = decode(slice(0, B), list(range(B)))
    o3, y3, s3, cs3 = decode(slice(3, 4), [3])
    assert torch.equal(o[3], o3[0]) and torch.equal(y[3], y3[0])
    assert torch.equal(s[3], s3[3]) and torch.equal(cs[3], cs3[3])


def test_a_hybrid_model_on_the_cuda_kernels_matches_transformers(kernels, tmp_path) -> None:
    """The CUDA linear-attention kernels inside the engine on the CPU (a tiny Qwen3.5 whose linear
    layers take CASES[0]'s shapes): prefill segments with checkpoint saves, decode rows, a second
    turn resumed from a checkpoint; greedy tokens equal transformers' in float32."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    import tiny_models as tm
    from test_gated_deltanet import qwen3_5, randomized

    from inferd.engine.config import EngineConfig
    from inferd.engine.llm_engine import LLMEngine
    from inferd.kernels.ops import cuda_linear_attention
    from inferd.text.sampling_params import SamplingParams

    vocab_size = tm.train_sentencepiece(tmp_path)
    torch.manual_seed(0)
    model = randomized(qwen3_5(vocab_size, linear_key_head_dim=16, linear_value_head_dim=32))
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(tmp_path), dtype="float32", kv_cache_memory=16 * 2**20,
                                                   block_size=16, max_num_batched_tokens=24))
    mixers = [layer.mixer for layer in engine.model.layers if hasattr(layer, "mixer")]
    for mixer in mixers:
        mixer.ops = cuda_linear_attention()
    # (few steps: an emulated launch takes ~70 ms)
    first = engine.tokenizer.encode(tm.PROMPTS[0])
    second = first + [7, 8, 9] * 10  # resumes from the first prompt's checkpoint
    with tm.torch_threads(1):
        expected = tm.greedy_reference(model, [first, second], 4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert engine.generate([first], params)[0].token_ids == expected[0]
    hits = engine.block_manager.state.stats.checkpoint_hits
    assert engine.generate([second], params)[0].token_ids == expected[1]
    assert engine.block_manager.state.stats.checkpoint_hits > hits and mixers[0].ops.backend == "cuda"
