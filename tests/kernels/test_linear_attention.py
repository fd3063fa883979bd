"""Linear attention (Gated DeltaNet): the torch reference (inferd/kernels/linear_attention.py)
against transformers' Qwen3.5 functions, sequence by sequence; then every backend the face binds
against the reference: GQA ratios, chunk edges, state carried across steps, saves, and decode
rows that do not depend on their batch."""

from __future__ import annotations

import random

import pytest
import torch

from inferd.kernels import linear_attention as la
from inferd.kernels import ops
from inferd.kernels.linear_attention import StatePlan

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hf():  # transformers' functions (a few seconds to import)
    return pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def random_step(lens: list[int], num_decode: int, num_slots: int, fresh: list[bool] | None = None,
                num_saves: int = 0, seed: int = 0) -> StatePlan:
    """Prefill segments of `lens` then `num_decode` one-token rows, each on its own slot; saves
    into spare slots at random rows."""
    rng = random.Random(seed)
    lens = lens + [1] * num_decode
    slots = rng.sample(range(num_slots), len(lens) + num_saves)
    fresh = fresh if fresh is not None else [rng.random() < 0.4 for _ in lens]
    rows = rng.sample(range(sum(lens)), num_saves)
    return StatePlan.build(lens, slots[:len(lens)], fresh, list(zip(rows, slots[len(lens):])), num_decode, CPU)


def inputs(T: int, Hk: int, Hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, dk, generator=gen).to(dtype)
    k = torch.randn(T, Hk, dk, generator=gen).to(dtype)
    v = torch.randn(T, Hv, dv, generator=gen).to(dtype)
    g = -torch.nn.functional.softplus(torch.randn(T, Hv, generator=gen)) * 0.5  # log decays <= 0
    beta = torch.rand(T, Hv, generator=gen)
    return q, k, v, g, beta


# ------------------------------------------------------------------------------ reference vs transformers


def hf_conv(hf, x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
    """One sequence through transformers: x [n, C], history [K-1, C] or None (fresh) -> [n, C]."""
    if history is None:
        return hf.causal_conv1d_fn(x.T[None], weight, activation="silu")[0].T
    state = history.T[None].clone()  # transformers' [B, C, K-1]
    return hf.causal_conv1d_update(x.T[None], state, weight, activation="silu")[0].T


def expected_conv_history(x: torch.Tensor, history: torch.Tensor, upto: int) -> torch.Tensor:
    """The last K-1 inputs through row `upto` of x (history before it)."""
    window = torch.cat([history, x[:upto + 1]])
    return window[-history.shape[0]:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 4])
def test_conv_matches_transformers(hf, dtype: torch.dtype, K: int) -> None:
    C, S = 24, 20
    plan = random_step([1, 5, 63, 64, 65, 2], num_decode=4, num_slots=S, num_saves=5, seed=K)
    T = plan.starts[-1]
    gen = torch.Generator().manual_seed(K)
    x = torch.randn(T, C, generator=gen).to(dtype)
    weight = torch.randn(C, K, generator=gen).to(dtype)
    conv_states = torch.randn(S, K - 1, C, generator=gen).to(dtype)
    before = conv_states.clone()
    y = la.causal_conv(x, weight, conv_states, plan)
    assert y.dtype == dtype and y.shape == x.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(plan.num_seqs):
        a, b, slot = plan.starts[i], plan.starts[i + 1], plan.slot_ids[i]
        history = torch.zeros_like(before[slot]) if plan.fresh_ids[i] else before[slot]
        expected = hf_conv(hf, x[a:b], weight, None if plan.fresh_ids[i] else history)
        torch.testing.assert_close(y[a:b].float(), expected.float(), atol=tolerance, rtol=tolerance)
        assert torch.equal(conv_states[slot], expected_conv_history(x[a:b], history, b - a - 1))
        for r, d in plan.saves:
            if a <= r < b:
                assert torch.equal(conv_states[d], expected_conv_history(x[a:b], history, r - a))


def hf_delta(hf, q, k, v, g, beta, state: torch.Tensor | None, chunked: bool):
    """One sequence through transformers: [n, ...] -> (out [n, Hv, dv], final state)."""
    rule = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    out, final = rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                      initial_state=None if state is None else state[None],
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_matches_transformers(hf, group: int, dtype: torch.dtype) -> None:
    Hk, dk, dv, S = 2, 16, 8, 24
    Hv = Hk * group
    plan = random_step([1, 5, 63, 64, 65, 130], num_decode=3, num_slots=S, num_saves=5, seed=group)
    T = plan.starts[-1]
    q, k, v, g, beta = inputs(T, Hk, Hv, dk, dv, dtype, seed=group)
    states = torch.randn(S, Hv, dk, dv) * 0.1
    before = states.clone()
    o = la.gated_delta(q, k, v, g, beta, states, plan)
    assert o.dtype == dtype and o.shape == v.shape
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    n_prefill = plan.num_seqs - plan.num_decode
    for i in range(plan.num_seqs):
        a, b, slot = plan.starts[i], plan.starts[i + 1], plan.slot_ids[i]
        initial = None if plan.fresh_ids[i] else before[slot]
        rows = slice(a, b)
        out, final = hf_delta(hf, q[rows], k[rows], v[rows], g[rows], beta[rows], initial, chunked=i < n_prefill)
        torch.testing.assert_close(o[rows].float(), out.float(), atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(states[slot], final, atol=2e-5, rtol=2e-5)
        for r, d in plan.saves:
            if a <= r < b:
                rows = slice(a, r + 1)
                _, saved = hf_delta(hf, q[rows], k[rows], v[rows], g[rows], beta[rows], initial, chunked=True)
                torch.testing.assert_close(states[d], saved, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------ backends vs the reference


def backends() -> list[ops.LinearAttentionOps]:
    bound = ops.linear_attention_ops(CPU, torch.bfloat16, key_head_dim=16, value_head_dim=16)
    assert bound.backend == "cpu", "the CPU kernels did not build (make builds them: python -m inferd.kernels.cpu)"
    return [bound, ops.reference_linear_attention()]


@pytest.fixture(params=["cpu", "reference"])
def backend(request) -> ops.LinearAttentionOps:
    return next(b for b in backends() if b.backend == request.param)


def layer(T: int, Hk: int, Hv: int, dk: int, dv: int, K: int, S: int, dtype: torch.dtype, seed: int = 0):
    """A layer's inputs: conv input, taps, q, k, v, g, beta, and the slots' two states."""
    gen = torch.Generator().manual_seed(seed + 1)
    C = 2 * Hk * dk + Hv * dv
    x = torch.randn(T, C, generator=gen).to(dtype)
    weight = (torch.randn(C, K, generator=gen) * 0.5).to(dtype)
    conv_states = torch.randn(S, K - 1, C, generator=gen).to(dtype)
    states = torch.randn(S, Hv, dk, dv, generator=gen) * 0.1
    return (x, weight, conv_states, *inputs(T, Hk, Hv, dk, dv, dtype, seed), states)


def run(backend: ops.LinearAttentionOps, plan: StatePlan, x, weight, conv_states, q, k, v, g, beta, states):
    """Both ops on copies of the states: (y, o, conv_states, states)."""
    conv_states, states = conv_states.clone(), states.clone()
    y = backend.conv(x, weight, conv_states, plan)
    o = backend.delta(q, k, v, g, beta, states, plan)
    return y, o, conv_states, states


def close(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hk,group,dk,dv,K", [(2, 1, 16, 16, 4), (2, 2, 32, 16, 4), (1, 4, 16, 48, 3),
                                              (4, 2, 64, 64, 2)])
def test_the_backend_matches_the_reference(dtype: torch.dtype, Hk: int, group: int, dk: int, dv: int,
                                           K: int) -> None:
    [cpu_ops, reference] = backends()
    S = 40
    plan = random_step([1, 5, 63, 64, 65, 130], num_decode=9, num_slots=S, num_saves=6, seed=dk + group)
    args = layer(plan.starts[-1], Hk, Hk * group, dk, dv, K, S, dtype, seed=dv)
    got, expected = run(cpu_ops, plan, *args), run(reference, plan, *args)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **close(dtype))


@pytest.mark.parametrize("split", [[1, 1, 1], [5, 60, 7], [64, 1, 1, 66], [3, 127]])
def test_a_sequence_split_over_steps_equals_one_step(backend, split: list[int]) -> None:
    """The conv's and the rule's state carried across steps: chunks of one sequence, each step
    reading the slot the last one left (one-token chunks as decode rows), give the outputs and
    final state of the whole sequence in one step."""
    T, slot, S = sum(split), 3, 5
    x, weight, conv_states, q, k, v, g, beta, states = layer(T, 2, 4, 16, 16, 4, S, torch.float32)
    whole = StatePlan.build([T], [slot], [True], [], 0, CPU)
    y, o, conv_whole, states_whole = run(backend, whole, x, weight, conv_states, q, k, v, g, beta, states)
    conv_states, states = conv_states.clone(), states.clone()
    ys, os_ = [], []
    a = 0
    for n in split:
        plan = StatePlan.build([n], [slot], [a == 0], [], int(n == 1), CPU)
        rows = slice(a, a + n)
        ys.append(backend.conv(x[rows], weight, conv_states, plan))
        os_.append(backend.delta(q[rows], k[rows], v[rows], g[rows], beta[rows], states, plan))
        a += n
    torch.testing.assert_close(torch.cat(ys), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(os_), o, atol=1e-5, rtol=1e-5)
    assert torch.equal(conv_states[slot], conv_whole[slot])
    torch.testing.assert_close(states[slot], states_whole[slot], atol=1e-5, rtol=1e-5)


def test_a_save_holds_the_state_of_a_run_that_stops_at_its_row(backend) -> None:
    lens, S = [70, 9, 1, 1], 12
    plan = StatePlan.build(lens, [0, 1, 2, 3], [True, False, False, False],
                           [(0, 4), (63, 5), (64, 6), (69, 7), (72, 8), (79, 9), (80, 10)], 2, CPU)
    args = layer(sum(lens), 2, 2, 16, 16, 4, S, torch.float32)
    x, weight, conv_states, q, k, v, g, beta, states = args
    _, _, conv_after, states_after = run(backend, plan, *args)
    for r, d in plan.saves:
        i = next(i for i in range(plan.num_seqs) if plan.starts[i] <= r < plan.starts[i + 1])
        a = plan.starts[i]
        stop = StatePlan.build([r + 1 - a], [plan.slot_ids[i]], [plan.fresh_ids[i]], [], int(r + 1 - a == 1 and i >= 2),
                               CPU)
        rows = slice(a, r + 1)
        _, _, conv_stop, states_stop = run(backend, stop, x[rows], weight, conv_states, q[rows], k[rows], v[rows],
                                           g[rows], beta[rows], states)
        assert torch.equal(conv_after[d], conv_stop[plan.slot_ids[i]]), (r, d)
        torch.testing.assert_close(states_after[d], states_stop[plan.slot_ids[i]], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_do_not_depend_on_their_batch(backend, dtype: torch.dtype) -> None:
    """A decode row alone, and in a batch of 32 behind a prefill segment: bit for bit the same."""
    S, B = 40, 32
    args = layer(B + 20, 2, 4, 32, 32, 4, S, dtype)
    x, weight, conv_states, q, k, v, g, beta, states = args
    batch = StatePlan.build([20] + [1] * B, list(range(B + 1)), [True] + [False] * B, [], B, CPU)
    y, o, conv_after, states_after = run(backend, batch, *args)
    for j in (0, 7, B - 1):
        row, slot = 20 + j, 1 + j
        alone = StatePlan.build([1], [slot], [False], [], 1, CPU)
        rows = slice(row, row + 1)
        y1, o1, conv1, states1 = run(backend, alone, x[rows], weight, conv_states, q[rows], k[rows], v[rows], g[rows],
                                     beta[rows], states)
        assert torch.equal(y1[0], y[row]) and torch.equal(o1[0], o[row])
        assert torch.equal(conv1[slot], conv_after[slot]) and torch.equal(states1[slot], states_after[slot])


def test_a_fresh_decode_row_ignores_its_slot(backend) -> None:
    args = list(layer(3, 1, 2, 16, 16, 4, 4, torch.float32))
    plan = StatePlan.build([1, 1, 1], [0, 1, 2], [True, False, True], [], 3, CPU)
    y, o, conv_after, states_after = run(backend, plan, *args)
    args[2][[0, 2]] = float("nan")  # conv_states
    args[-1][[0, 2]] = float("nan")  # states
    y2, o2, conv2, states2 = run(backend, plan, *args)
    assert torch.equal(y, y2) and torch.equal(o, o2)
    assert torch.equal(conv_after[:3], conv2[:3]) and torch.equal(states_after[:3], states2[:3])
