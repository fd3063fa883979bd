"""The linear-attention CUDA kernels (inferd/kernels/cuda/csrc/linear_attention.cu) on a GPU, through
the face, against the torch reference: Qwen3.5's layer shape and smaller ones, chunk edges, saves,
fresh slots, strided rows, decode rows that do not depend on their batch, and no host sync.
Skipped with a reason where there is no CUDA device or no CuPy."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from inferd.kernels import linear_attention as la
from inferd.kernels import ops
from inferd.kernels.linear_attention import StatePlan


def cuda_ready() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and CuPy")]

DEVICE = torch.device("cuda")
# the kernel's recurrent rule against the reference's chunked one (float32 both), then the rounding
TOLERANCE = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def layer(lens: list[int], num_decode: int, Hk: int, Hv: int, dk: int, dv: int, K: int, dtype: torch.dtype,
          seed: int = 0):
    """A plan (every 3rd prefill sequence fresh, saves in the middle of segments and at a decode
    row) and a layer's inputs, q/k/v as strided views of one projection."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    lens = lens + [1] * num_decode
    N, T = len(lens), sum(lens)
    slots = torch.randperm(2 * N + 8).tolist()
    starts = [sum(lens[:i]) for i in range(N)]
    saves = [(starts[i] + lens[i] // 2, slots[N + i]) for i in range(N) if lens[i] > 2]
    saves.append((T - 1, slots[-1]))
    plan = StatePlan.build(lens, slots[:N], [i % 3 == 0 for i in range(N)], saves, num_decode, DEVICE)
    S = len(slots)
    C = 2 * Hk * dk + Hv * dv
    x = torch.randn(T, C + 16, device=DEVICE, generator=gen).to(dtype)[:, 16:]
    weight = (torch.randn(C, K, device=DEVICE, generator=gen) * 0.5).to(dtype)
    conv_states = torch.randn(S, K - 1, C, device=DEVICE, generator=gen).to(dtype)
    qkv = torch.randn(T, C, device=DEVICE, generator=gen).to(dtype)
    q = qkv[:, :Hk * dk].unflatten(1, (Hk, dk))
    k = qkv[:, Hk * dk:2 * Hk * dk].unflatten(1, (Hk, dk))
    v = qkv[:, 2 * Hk * dk:].unflatten(1, (Hv, dv))
    g = -torch.nn.functional.softplus(torch.randn(T, Hv, device=DEVICE, generator=gen))
    beta = torch.rand(T, Hv, device=DEVICE, generator=gen)
    states = torch.randn(S, Hv, dk, dv, device=DEVICE, generator=gen) * 0.1
    return plan, (x, weight, conv_states), (q, k, v, g, beta, states)


def run(bound: ops.LinearAttentionOps, plan, conv_args, delta_args):
    x, weight, conv_states = conv_args
    *qkvgb, states = delta_args
    conv_states, states = conv_states.clone(), states.clone()
    return bound.conv(x, weight, conv_states, plan), bound.delta(*qkvgb, states, plan), conv_states, states


# Qwen3.5's layer in every dtype, then other head sizes, GQA ratios and conv widths in bfloat16
# (each case compiles its own specializations: a few seconds)
CASES = [(dt, 16, 32, 128, 128, 4) for dt in (torch.bfloat16, torch.float16, torch.float32)] + [
    (torch.bfloat16, 4, 4, 64, 64, 4), (torch.bfloat16, 2, 8, 128, 64, 3), (torch.bfloat16, 2, 4, 64, 32, 2)]


@pytest.mark.parametrize("dtype,Hk,Hv,dk,dv,K", CASES, ids=lambda c: str(c).removeprefix("torch."))
def test_the_kernels_match_the_reference(dtype, Hk, Hv, dk, dv, K) -> None:
    bound = ops.linear_attention_ops(DEVICE, dtype, key_head_dim=dk, value_head_dim=dv, conv_size=K)
    assert bound.backend == "cuda"
    plan, conv_args, delta_args = layer([1, 5, 63, 64, 65, 130, 700], 32, Hk, Hv, dk, dv, K, dtype, seed=dk + Hv)
    got = run(bound, plan, conv_args, delta_args)
    expected = run(ops.reference_linear_attention(), plan, conv_args, delta_args)
    tol = TOLERANCE[dtype]
    y, o, conv_states, states = got
    torch.testing.assert_close(y.float(), expected[0].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(o.float(), expected[1].float(), atol=tol, rtol=tol)
    assert torch.equal(conv_states, expected[2])
    torch.testing.assert_close(states, expected[3], atol=2e-4, rtol=2e-4)


def test_decode_rows_do_not_depend_on_their_batch() -> None:
    bound = ops.linear_attention_ops(DEVICE, torch.bfloat16)
    plan, conv_args, delta_args = layer([100], 48, 16, 32, 128, 128, 4, torch.bfloat16)
    y, o, conv_states, states = run(bound, plan, conv_args, delta_args)
    x, weight, cs = conv_args
    q, k, v, g, beta, st = delta_args
    for i in (1, 20, 48):  # sequence i: decode row 99 + i
        row, slot = plan.starts[i], plan.slot_ids[i]
        alone = StatePlan.build([1], [slot], [plan.fresh_ids[i]], [], 1, DEVICE)
        rows = slice(row, row + 1)
        y1, o1, cs1, st1 = run(bound, alone, (x[rows], weight, cs), (q[rows], k[rows], v[rows], g[rows], beta[rows], st))
        assert torch.equal(y1[0], y[row]) and torch.equal(o1[0], o[row])
        assert torch.equal(cs1[slot], conv_states[slot]) and torch.equal(st1[slot], states[slot])


def test_a_step_launches_without_a_host_sync() -> None:
    bound = ops.linear_attention_ops(DEVICE, torch.bfloat16)
    plan, conv_args, delta_args = layer([70], 8, 16, 32, 128, 128, 4, torch.bfloat16)
    run(bound, plan, conv_args, delta_args)  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, weight, conv_states = conv_args
        *qkvgb, states = delta_args
        bound.conv(x, weight, conv_states, plan)
        bound.delta(*qkvgb, states, plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_long_prefill_split_in_two_steps_equals_one() -> None:
    """The state carried across steps, on the kernels alone."""
    bound = ops.linear_attention_ops(DEVICE, torch.float32)
    _, conv_args, delta_args = layer([300], 0, 4, 8, 128, 128, 4, torch.float32)
    whole = StatePlan.build([300], [0], [True], [], 0, DEVICE)
    y, o, cs, st = run(bound, whole, conv_args, delta_args)
    x, weight, conv_states = conv_args
    q, k, v, g, beta, states = delta_args
    conv_states, states = conv_states.clone(), states.clone()
    parts = []
    for a, b in ((0, 129), (129, 300)):
        part = StatePlan.build([b - a], [0], [a == 0], [], 0, DEVICE)
        rows = slice(a, b)
        parts.append((bound.conv(x[rows], weight, conv_states, part),
                      bound.delta(q[rows], k[rows], v[rows], g[rows], beta[rows], states, part)))
    assert torch.equal(torch.cat([p[0] for p in parts]), y)
    assert torch.equal(torch.cat([p[1] for p in parts]), o)  # the same recurrence, token by token
    assert torch.equal(conv_states[0], cs[0]) and torch.equal(states[0], st[0])


def test_the_reference_itself_runs_on_the_gpu() -> None:
    plan, conv_args, delta_args = layer([5, 64], 4, 2, 4, 32, 32, 4, torch.float32)
    y, o, _, _ = run(ops.reference_linear_attention(), plan, conv_args, delta_args)
    assert y.device.type == "cuda" and o.device.type == "cuda" and torch.isfinite(o).all()
    assert la.CHUNK == 64
