"""Linear attention (Gated DeltaNet, Qwen3.5 / Qwen3-Next): the step's state plan, and the torch
reference of its two ops, which the CPU and CUDA kernels are checked against.

A linear-attention layer keeps no per-token cache: each sequence has one fixed-size state per
layer, held in a *state slot* (engine/kv/state_slots.py): the short convolution's last K-1 inputs
and the delta rule's recurrent state. A step's tokens are segments, one per sequence (prefill
chunks first, then one-token decode rows), each reading and writing its slot:

    rows      [ seq 0: 7 prefill tokens | seq 1: 3 | seq 2 | seq 3 ]      cu_seqlens [0, 7, 10, 11, 12]
    slots     [ 4                       | 9        | 2     | 5     ]      fresh: seq 0 starts at 0
    saves     (row 3, slot 11): after row 3 (seq 0's 4th token) its state is copied into slot 11,
              a checkpoint at a block boundary for the prefix cache (the slot is otherwise unread)

A fresh sequence starts from a zero state (its slot's old contents are never read).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.kernels.tensors import device_tensor

Tensor = torch.Tensor


@dataclass
class StatePlan:
    """One step's segments over the state slots, shared by every linear-attention layer."""

    cu_seqlens: Tensor  # [N + 1] int64: sequence i's rows are [cu_seqlens[i], cu_seqlens[i + 1])
    slots: Tensor  # [N] int64: the slot each sequence reads (unless fresh) and leaves its state in
    fresh: Tensor  # [N] bool: starts from a zero state
    save_rows: Tensor  # [M] int64: after this row's token ...
    save_slots: Tensor  # [M] int64: ... the state of that row's sequence is also written here
    # the same on the host (loops over segments without reading the device)
    starts: list[int]  # [N + 1]
    slot_ids: list[int]  # [N]
    fresh_ids: list[bool]  # [N]
    saves: list[tuple[int, int]]  # [M] (row, slot), rows ascending
    num_decode: int  # the last num_decode sequences have one row each (decode rows)

    @classmethod
    def build(cls, lens: Sequence[int], slots: Sequence[int], fresh: Sequence[bool],
              saves: Sequence[tuple[int, int]], num_decode: int, device: torch.device) -> StatePlan:
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        saves = sorted(saves)
        return cls(device_tensor(starts, torch.int64, device), device_tensor(list(slots), torch.int64, device),
                   device_tensor(list(fresh), torch.bool, device),
                   device_tensor([r for r, _ in saves], torch.int64, device),
                   device_tensor([s for _, s in saves], torch.int64, device),
                   starts, list(slots), list(fresh), list(saves), num_decode)

    @property
    def num_seqs(self) -> int:
        return len(self.slot_ids)


# ------------------------------------------------------------------------------ the short convolution

# (x [B, C], weight [C, K], conv_states [S, K-1, C], slots [B] int64, fresh [B] bool) -> y [B, C]
ConvStep = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
# (q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv], states [S, Hv, dk, dv], slots, fresh) -> o [B, Hv, dv]
DeltaStep = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def causal_conv(
    x: Tensor,  # [T, C] the step's rows (model dtype)
    weight: Tensor,  # [C, K] depthwise taps
    conv_states: Tensor,  # [S, K-1, C] per slot: the last K-1 inputs, row K-2 the newest
    plan: StatePlan,
    decode_step: ConvStep | None = None,  # a kernel for the decode rows; conv_step by default
) -> Tensor:  # [T, C] in x's dtype
    """Per sequence: the depthwise causal conv over (its slot's history, or zeros if fresh) then
    its rows, then SiLU (transformers' causal_conv1d_fn / _update, activation "silu", no bias).
    Leaves each sequence's last K-1 inputs in its slot, and at each save (row r, slot d) the last
    K-1 inputs up to row r in slot d.

    NOTE: taps are summed in float32 in a fixed order (k = 0 .. K-1) and rounded to x's dtype
    before the SiLU, as transformers rounds conv1d's output: each row's result depends on its own
    window only (batch-invariant), and the kernels do the same."""
    K = weight.shape[1]
    y = torch.empty_like(x)
    for i in range(plan.num_seqs - plan.num_decode):
        # prefill: one sequence at a time
        a, b = plan.starts[i], plan.starts[i + 1]
        history = torch.zeros_like(conv_states[0]) if plan.fresh_ids[i] else conv_states[plan.slot_ids[i]]
        window = torch.cat([history, x[a:b]])  # [K-1+n, C]
        y[a:b] = _conv_silu(window[None], weight, b - a)[0]
        for r, d in plan.saves:
            if a <= r < b:
                conv_states[d] = window[r - a + 1:r - a + K]
        conv_states[plan.slot_ids[i]] = window[b - a:]
    if plan.num_decode:
        # decode: one token per sequence, all at once
        n, a = decode_rows(plan)
        y[a:] = (decode_step or conv_step)(x[a:], weight, conv_states, plan.slots[n:], plan.fresh[n:])
        copy_decode_saves(conv_states, plan)
    return y


def conv_step(x: Tensor, weight: Tensor, conv_states: Tensor, slots: Tensor, fresh: Tensor) -> Tensor:
    """One token for each of B sequences (the CPU kernel's spec): x [B, C] -> y [B, C]; the slots'
    histories gathered (zeros where fresh), shifted by the new input and scattered back."""
    history = torch.where(fresh[:, None, None], 0, conv_states[slots])  # [B, K-1, C]
    window = torch.cat([history, x[:, None]], dim=1)  # [B, K, C]
    conv_states.index_copy_(0, slots, window[:, 1:])
    return _conv_silu(window, weight, 1)[:, 0]


def _conv_silu(window: Tensor, weight: Tensor, n: int) -> Tensor:
    """window [B, K-1+n, C] -> [B, n, C]: the conv's last n outputs, then SiLU."""
    K = weight.shape[1]
    w = weight.float()  # [C, K]
    acc = window[:, 0:n].float() * w[:, 0]
    for k in range(1, K):
        acc += window[:, k:k + n].float() * w[:, k]
    return F.silu(acc.to(window.dtype).float()).to(window.dtype)


def decode_rows(plan: StatePlan) -> tuple[int, int]:
    """(the first decode sequence, its row)."""
    n = plan.num_seqs - plan.num_decode
    return n, plan.starts[n]


def copy_decode_saves(state: Tensor, plan: StatePlan) -> None:
    """Saves at decode rows: the row's slot already holds the state after it; copy it over."""
    n, a = decode_rows(plan)
    for r, d in plan.saves:
        if r >= a:
            state[d] = state[plan.slot_ids[n + r - a]]


# ------------------------------------------------------------------------------ the gated delta rule

CHUNK = 64  # the chunked rule's block of tokens (transformers' and FLA's)


def gated_delta(
    q: Tensor,  # [T, Hk, dk]
    k: Tensor,  # [T, Hk, dk]
    v: Tensor,  # [T, Hv, dv]
    g: Tensor,  # [T, Hv] float32: log decay (<= 0)
    beta: Tensor,  # [T, Hv] float32: write strength
    states: Tensor,  # [S, Hv, dk, dv] float32 per slot (out = q @ S)
    plan: StatePlan,
    decode_step: DeltaStep | None = None,  # a kernel for the decode rows; delta_step by default
) -> Tensor:  # [T, Hv, dv] in v's dtype
    """transformers' gated delta rule (use_qk_l2norm_in_kernel=True), value heads grouped over
    key heads as repeat_interleave does. Each sequence starts from its slot's state (zeros if
    fresh) and leaves its final state there; a save (row r, slot d) copies the state right after
    row r into slot d. Prefill segments run the chunked rule, cut at the save rows (matmuls over
    chunks of 64 tokens); decode rows one recurrence step for all of them at once.

    NOTE: save slots are spare slots no sequence of the step reads, so each sequence may write
    its slot and saves as soon as it is done."""
    o = torch.empty_like(v)
    first_decode, decode_row = decode_rows(plan)
    if first_decode:
        # prefill: q, k normed and v in float32 once, then one sequence at a time, chunked
        q32, k32 = prepare_qk(q[:decode_row], k[:decode_row], v.shape[1])  # [rows, Hv, dk]
        v32 = v[:decode_row].float()
    for i in range(first_decode):
        a, b = plan.starts[i], plan.starts[i + 1]
        slot = plan.slot_ids[i]
        state = states.new_zeros(states.shape[1:]) if plan.fresh_ids[i] else states[slot]
        for lo, hi, save_slot in _sub_segments(a, b, plan.saves):
            out, state = chunked_delta(q32[lo:hi], k32[lo:hi], v32[lo:hi], g[lo:hi], beta[lo:hi], state)
            o[lo:hi] = out.to(o.dtype)
            if save_slot is not None:
                states[save_slot] = state
        states[slot] = state
    if plan.num_decode:
        # decode: one recurrence step for every decode row at once
        rows, seqs = slice(decode_row, None), slice(first_decode, None)
        o[rows] = (decode_step or delta_step)(q[rows], k[rows], v[rows], g[rows], beta[rows], states,
                                               plan.slots[seqs], plan.fresh[seqs])
        copy_decode_saves(states, plan)
    return o


def delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor, slots: Tensor,
               fresh: Tensor) -> Tensor:
    """One token for each of B sequences (the CPU kernel's spec): the slots' states gathered
    (zeros where fresh), one step of torch_recurrent_gated_delta_rule, scattered back."""
    q32, k32 = prepare_qk(q, k, v.shape[1])  # [B, Hv, dk]
    state = torch.where(fresh[:, None, None, None], 0, states[slots])  # [B, Hv, dk, dv]
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k32[..., None]).sum(-2)  # [B, Hv, dv]
    delta = (v.float() - kv_mem) * beta[..., None]
    state = state + k32[..., None] * delta[..., None, :]
    states.index_copy_(0, slots, state)
    return (state * q32[..., None]).sum(-2).to(v.dtype)


def prepare_qk(q: Tensor, k: Tensor, num_v_heads: int) -> tuple[Tensor, Tensor]:
    """[T, Hk, dk] -> [T, Hv, dk] float32: l2-normed (eps 1e-6), q scaled by dk**-0.5, each key
    head repeated for its Hv/Hk consecutive value heads."""
    def l2norm(x: Tensor) -> Tensor:
        x = x.float()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    group = num_v_heads // q.shape[1]
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k


def _sub_segments(a: int, b: int, saves: list[tuple[int, int]]) -> list[tuple[int, int, int | None]]:
    """Rows [a, b) cut after each save row in them: (lo, hi, the slot to save into after hi - 1)."""
    parts: list[tuple[int, int, int | None]] = []
    lo = a
    for r, d in saves:
        if a <= r < b:
            parts.append((lo, r + 1, d))  # empty for a second save at the same row
            lo = r + 1
    if lo < b:
        parts.append((lo, b, None))
    return parts


def chunked_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  state: Tensor) -> tuple[Tensor, Tensor]:
    """One segment: q, k [n, Hv, dk], v [n, Hv, dv], g, beta [n, Hv], state [Hv, dk, dv] (all
    float32, q and k as prepare_qk leaves them) -> (out [n, Hv, dv], the final state), as
    torch_chunk_gated_delta_rule computes it: chunks of 64 tokens, zero-padded."""
    n = q.shape[0]
    if n == 0:
        return v.new_empty(v.shape), state
    pad = (-n) % CHUNK
    # [Hv, chunks, CHUNK, d]
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, CHUNK)) for x in (q, k, v))
    beta, g = (F.pad(x.transpose(0, 1), (0, pad)).unflatten(1, (-1, CHUNK)) for x in (beta, g))
    k_beta = k * beta[..., None]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(-1)  # [Hv, chunks, CHUNK]: log decay from the chunk's start
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # the UT transform's (unit lower triangular)
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, chunks, 1, 1]
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        v_new = new_values[:, c] - k_cumdecay[:, c] @ state
        out[:, c] = q[:, c] @ state + intra[:, c] @ v_new
        state = state * chunk_decay[:, c] + k[:, c].transpose(-1, -2) @ v_new
    return out.flatten(1, 2)[:, :n].transpose(0, 1), state
