"""The specification of every kernel op, in plain torch: the paged attention of the CPU and CUDA
kernels, the KV cache write, a decoder layer's small ops (RMSNorm, residual add + RMSNorm, the
gated activation, RoPE + the KV write) and the block products. The face (ops.py) binds these
where no device kernel covers a model's shapes; tests/kernels checks every kernel against them.

Paged attention:

The KV cache of one layer is two tensors `[num_blocks, block_size, n_kv_heads, head_dim]`, in the
model's dtype or in 8 bits (kv_quant.QuantizedCache: written quantized, gathered dequantized).
A sequence's token at position p lives in slot `block_table[p // block_size] * block_size +
p % block_size` of the flattened `[num_blocks * block_size, n_kv_heads, head_dim]` view.

A step's tokens are flattened: the prefill chunks first, then one token per decoding sequence.

    tokens:   | seq 0 chunk (positions 5..9) | seq 1 chunk (0..3) | dec 2 | dec 3 |
    query_start_loc = [0, 5, 9]            (prefill part)
    seq_lens        = [10, 4] prefill, [17, 3] decode   (context length incl. the new tokens)

Attention reads everything, the new tokens included, from the cache: `write_kv` runs first.
The `plan_*` functions turn block tables and lengths into gather indices and masks once per
step; the `*_planned` functions run per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.kernels import kv_quant
from inferd.kernels.kv_quant import QuantizedCache

Cache = torch.Tensor | QuantizedCache  # one layer's K (or V): the model's dtype, or 8 bits (kv_quant)


def write_kv(
    key: torch.Tensor,  # [T, n_kv_heads, head_dim]
    value: torch.Tensor,  # [T, n_kv_heads, head_dim]
    key_cache: Cache,  # [num_blocks, block_size, n_kv_heads, head_dim]
    value_cache: Cache,  # [num_blocks, block_size, n_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Store each token's K and V in its cache slot (the `reshape_and_cache` kernel's spec); an
    8-bit cache quantizes them (kv_quant.write)."""
    if isinstance(key_cache, QuantizedCache):
        kv_quant.write(key, value, key_cache, value_cache, slot_mapping)  # type: ignore[arg-type]
        return
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


# ------------------------------------------------------------------------------ layer ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm in float32, as transformers computes each family's: Llama's x̂·w rounds x̂ to x's
    dtype first; with `offset` (Gemma's x̂·(1 + w), `weight` already 1 + w in float32) the product
    is taken in float32. The token-exact tests rely on the same arithmetic."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x * weight).to(dtype)
    return weight * x.to(dtype)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                  offset: bool = False) -> torch.Tensor:
    """x += delta in place (rounded to x's dtype); returns rms_norm(x)."""
    x.add_(delta)
    return rms_norm(x, weight, eps, offset)


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """activation(gate) x up, gate and up the two halves of one product: "silu" (Llama) or
    "gelu_tanh" (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (transformers' convention) over the first `rotary_dim` of each head.

    x * cos + cat(-x2, x1) * sin is written as x * cos + cat(x2, x1) * cat(-sin, sin): bit-identical
    and one op shorter. x: [T, heads, head_dim], cos / signed_sin: [T, rotary_dim]."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos[:, None, :] + x.roll(rotary_dim // 2, dims=-1) * signed_sin[:, None, :]
    part, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = part * cos[:, None, :] + part.roll(rotary_dim // 2, dims=-1) * signed_sin[:, None, :]
    return torch.cat((rotated, rest), dim=-1)


def rope_write_kv(qkv: torch.Tensor,  # [T, (H + 2 KV) x D]
                  cos: torch.Tensor, signed_sin: torch.Tensor,  # [T, rotary_dim] each
                  key_cache: Cache, value_cache: Cache,  # [blocks, block_size, KV, D] each
                  slot_mapping: torch.Tensor,  # [T] int64
                  num_heads: int, num_kv_heads: int,
                  write: Callable[..., None] | None = None) -> torch.Tensor:  # q: [T, H, D]
    """q and k rotated, k and v written to their slots (by `write`, write_kv's signature: a device's
    KV write; write_kv itself by default); returns q."""
    t, d = qkv.shape[0], key_cache.shape[-1]
    qk = rotate(qkv[:, : (num_heads + num_kv_heads) * d].view(t, num_heads + num_kv_heads, d), cos, signed_sin)
    v = qkv[:, (num_heads + num_kv_heads) * d:].view(t, num_kv_heads, d)
    (write or write_kv)(qk[:, num_heads:], v, key_cache, value_cache, slot_mapping)
    return qk[:, :num_heads]


# ------------------------------------------------------------------------------ paged attention

# The key/value block of torch's CPU flash attention (SDPA reduces over blocks of min(512, L)
# keys, L the group's padded context): with every context padded (masked) to a multiple of it,
# each block is a whole one, so a query row gets the same bits whatever shares its step (other
# sequences setting L, a prompt split into chunks). Measured with torch 2.13 in
# tests/engine/test_batch_invariance.py; used with [model] deterministic.
KV_BLOCK = 512


@dataclass
class AttentionPlan:
    """Gather indices and masks for a group of sequences, shared by all layers of one step."""

    num_seqs: int
    max_query_len: int
    slots: torch.Tensor  # [N, L] int64: cache slot of each context position (0 past the end)
    mask: torch.Tensor  # [N, 1, Q, L] bool: True where query q may attend to position l
    # Padding map for groups with query_len > 1: flat token -> row of the padded [N * Q] layout
    pad_index: torch.Tensor | None  # [T] int64, or None when every sequence has exactly 1 query


def plan_attention(
    block_tables: torch.Tensor,  # [N, max_blocks] int (block ids; entries past the end are ignored)
    seq_lens: torch.Tensor,  # [N] int64: context length, the new tokens included
    query_lens: torch.Tensor,  # [N] int64: new tokens per sequence (the last query_len of the context)
    block_size: int,
    *,
    max_seq_len: int | None = None,  # max(seq_lens) and max(query_lens) when the caller knows
    max_query_len: int | None = None,  # them on the host; else read (on a GPU, a host sync)
    num_query_tokens: int | None = None,  # sum(query_lens), likewise
    kv_block: int | None = None,  # pad the context to a multiple of this (KV_BLOCK: batch invariance)
    window: int | None = None,  # a sliding layer's: a query sees a key iff q_pos - k_pos < window
    bidirectional: bool = False,  # every query sees every key of its context; a window: |q_pos - k_pos| < window
) -> AttentionPlan:
    device = block_tables.device
    n = block_tables.shape[0]
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    if kv_block:
        max_len = -(-max_len // kv_block) * kv_block
    max_q = int(query_lens.max()) if max_query_len is None else max_query_len
    positions = torch.arange(max_len, device=device)  # [L]
    block_idx = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.long()[:, block_idx] * block_size + positions % block_size  # [N, L]
    valid = positions[None, :] < seq_lens[:, None]  # [N, L]
    slots = torch.where(valid, slots, 0)
    # query i of sequence s sits at position seq_len - query_len + i and sees keys up to it (causal),
    # or (bidirectional: an encoder's prompt, computed in one chunk) every key of the context;
    # padded query rows (i >= query_len) see the whole context, so no row is fully masked
    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=device)[None, :]  # [N, Q]
    if bidirectional:
        mask = valid[:, None, :].repeat(1, max_q, 1)  # [N, Q, L]
    else:
        mask = (positions[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [N, Q, L]
    if window is not None:
        padded = torch.arange(max_q, device=device)[None, :] >= query_lens[:, None]  # [N, Q]: (see above)
        # NOTE: bidirectional, the window reaches both ways (transformers' Gemma 3:
        # |q - k| < window); the keys past q are those of the same chunk
        distance = q_pos[:, :, None] - positions[None, None, :]  # [N, Q, L]
        near = (distance.abs() if bidirectional else distance) < window
        mask = mask & (near | padded[:, :, None])
    pad_index = None
    if max_q > 1:
        starts = torch.cumsum(query_lens, 0) - query_lens  # [N]
        seq_of_token = torch.repeat_interleave(torch.arange(n, device=device), query_lens, output_size=num_query_tokens)
        offset_in_seq = torch.arange(seq_of_token.shape[0], device=device) - starts[seq_of_token]
        pad_index = seq_of_token * max_q + offset_in_seq
    return AttentionPlan(n, max_q, slots, mask[:, None], pad_index)


def attention_planned(
    query: torch.Tensor,  # [T, n_heads, head_dim], T = sum of query_lens
    key_cache: Cache,  # [num_blocks, block_size, n_kv_heads, head_dim]
    value_cache: Cache,  # [num_blocks, block_size, n_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,  # scores s -> tanh(s / softcap) * softcap before the mask (Gemma 2)
    sinks: torch.Tensor | None = None,  # [n_heads] float32: a logit per head in the softmax, no value (gpt-oss)
) -> torch.Tensor:  # [T, n_heads, head_dim]
    """Each query row's softmax(scores) @ V over its plan's context. With `sinks`, head h's
    softmax has one more column, sinks[h], whose weight is dropped: out = Σ exp(s_j - m) v_j /
    (Σ exp(s_j - m) + exp(sinks[h] - m)), m = max(s, sinks[h]) (transformers' gpt-oss eager attention)."""
    _, n_heads, head_dim = query.shape
    n_kv = key_cache.shape[2]
    n, q_len = plan.num_seqs, plan.max_query_len
    if plan.pad_index is not None:
        padded = query.new_zeros(n * q_len, n_heads, head_dim)
        padded[plan.pad_index] = query
        query = padded
    ctx_len = plan.slots.shape[1]
    flat_slots = plan.slots.view(-1)
    # NOTE: index_select beats advanced indexing ~5x here; SDPA with enable_gqa reads each KV
    # head once for its query heads and beat explicit matmuls 2-8x on this CPU (bench notes).
    if isinstance(key_cache, QuantizedCache):  # 8 bits: dequantized to the query's dtype as gathered
        k = kv_quant.gather(key_cache, flat_slots, query.dtype)  # [N * L, kv, D]
        v = kv_quant.gather(value_cache, flat_slots, query.dtype)  # type: ignore[arg-type]
    else:
        k = key_cache.view(-1, n_kv, head_dim).index_select(0, flat_slots)  # [N * L, kv, D]
        v = value_cache.view(-1, n_kv, head_dim).index_select(0, flat_slots)  # [N * L, kv, D]
    k = k.view(n, ctx_len, n_kv, head_dim).transpose(1, 2)  # [N, kv, L, D]
    v = v.view(n, ctx_len, n_kv, head_dim).transpose(1, 2)  # [N, kv, L, D]
    q = query.view(n, q_len, n_heads, head_dim).transpose(1, 2)  # [N, H, Q, D]
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale, enable_gqa=True)
    elif softcap is None and q.device.type == "cpu":
        out = _flash_attention_with_sinks(q, k, v, plan.mask, scale, sinks)  # type: ignore[arg-type]
    else:  # (SDPA has no soft-cap: the scores written out, as transformers' eager attention does)
        out = _eager_attention(q, k, v, plan.mask, scale, softcap, sinks)
    out = out.transpose(1, 2).reshape(n * q_len, n_heads, head_dim)  # [N * Q, H, D]
    if plan.pad_index is not None:
        out = out[plan.pad_index]
    return out


def _flash_attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                                sinks: torch.Tensor) -> torch.Tensor:
    """Sinks without writing the scores out: torch's CPU flash attention also returns each row's
    log-sum-exp, and the sink only rescales the row, by Z / (Z + e^sink) = sigmoid(lse - sink)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=additive,
                                                                         scale=scale)[:2]
    share = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # [N, H, Q]
    return (out.float() * share[..., None]).to(q.dtype)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [N, H, Q, D], k / v [N, kv, L, D], mask [N, 1, Q, L], sinks [H] -> [N, H, Q, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [N, H, Q, L]
    if softcap is not None:  # (the real scores only: never the sink)
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # the sink as one more column of the softmax, then dropped (its weight has no value)
        n, h, q_len, _ = scores.shape
        column = sinks.float().view(1, h, 1, 1).expand(n, h, q_len, 1)  # [N, H, Q, 1]
        weights = torch.softmax(torch.cat((scores.float(), column), dim=-1), dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(weights, v)


def decode_attention(
    query: torch.Tensor,  # [N, n_heads, head_dim]: one query per sequence
    key_cache: Cache,
    value_cache: Cache,
    block_tables: torch.Tensor,  # [N, max_blocks]
    seq_lens: torch.Tensor,  # [N]
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [n_heads] float32
) -> torch.Tensor:  # [N, n_heads, head_dim]
    plan = plan_attention(block_tables, seq_lens, torch.ones_like(seq_lens), key_cache.shape[1], window=window)
    return attention_planned(query, key_cache, value_cache, plan, scale, softcap, sinks)


def prefill_attention(
    query: torch.Tensor,  # [T, n_heads, head_dim]: each sequence's chunk, concatenated
    key_cache: Cache,
    value_cache: Cache,
    block_tables: torch.Tensor,  # [N, max_blocks]
    query_lens: torch.Tensor,  # [N]: the chunk lengths
    seq_lens: torch.Tensor,  # [N]: cached prefix + chunk
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [n_heads] float32
) -> torch.Tensor:  # [T, n_heads, head_dim]
    plan = plan_attention(block_tables, seq_lens, query_lens, key_cache.shape[1], window=window)
    return attention_planned(query, key_cache, value_cache, plan, scale, softcap, sinks)


# ------------------------------------------------------------------------------ block products


def quantize_rows(x: torch.Tensor, bits: int = 8, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations as the block products take them: per row and block of `block` inputs, codes
    round(x * L / max |x|) and the scale max |x| / L, L = 127 (8 bits) or 32639 (16). Returns
    codes [M, K] (float64) and scales [M, K / block] (float64)."""
    levels = 127.0 if bits == 8 else 32639.0  # 16 bits: 127 x 256 + 127, so a code splits into two signed bytes
    m, k = x.shape
    blocks = x.float().view(m, k // block, block)
    top = blocks.abs().amax(-1)  # float32, as the kernel computes it
    # NOTE: a tensor over a tensor: `L / top` is top.reciprocal() * L in torch, an ulp off
    # the kernel's correctly rounded quotient a quarter of the time (and then codes at a half step flip)
    inverse = torch.where(top > 0, torch.full_like(top, levels) / top, torch.zeros_like(top))
    codes = torch.round(blocks * inverse[..., None])  # round half to even, as nearbyint
    return codes.view(m, k).double(), (top / levels).double()


def block_matmul(x: torch.Tensor,  # [M, K]
                 codes: torch.Tensor,  # [N, K] integer codes
                 scale: torch.Tensor,  # [N, K / 32]
                 minimum: torch.Tensor | None,  # [N, K / 32] (int4) or None (int8)
                 activation_bits: int = 8) -> torch.Tensor:
    """The specification of inferd_cpu::block_matmul (csrc/cpu_matmul.cpp), in float64: each
    block of 32 inputs an exact integer dot product of weight codes and the row's 8- (or 16-)
    bit codes, times both scales, plus (int4) the block's minimum times the sum of its inputs."""
    m, k = x.shape
    n, blocks = codes.shape[0], k // 32
    qx, dx = quantize_rows(x, activation_bits)
    dots = torch.einsum("mbi,nbi->mnb", qx.view(m, blocks, 32), codes.double().view(n, blocks, 32))  # [M, N, B]
    out = (dots * scale.double()[None] * dx[:, None]).sum(-1)
    if minimum is not None:
        sums = x.float().view(m, blocks, 32).sum(-1).double()  # [M, B]
        out = out + sums @ minimum.double().t()
    return out
