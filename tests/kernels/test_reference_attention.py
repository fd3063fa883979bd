"""The reference paged attention against a dense computation on random inputs."""

from __future__ import annotations

import pytest
import torch

from inferd.kernels import reference

HEAD_DIM = 32


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Textbook causal attention for one sequence. q: [Q, H, D] at positions q_start.., k/v: [L, KV, D];
    a sliding window keeps keys with q_pos - k_pos < window; a soft-cap maps s to tanh(s / c) * c."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(q.shape[0])[:, None] + q_start
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window is not None else True)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def scatter_into_cache(
    keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, n_kv: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place each sequence's K/V in randomly chosen, shuffled blocks, as the block pool would."""
    blocks_needed = [-(-k.shape[0] // block_size) for k in keys]
    num_blocks = sum(blocks_needed) + 3
    key_cache = torch.randn(num_blocks, block_size, n_kv, HEAD_DIM, generator=gen)  # garbage elsewhere
    value_cache = torch.randn(num_blocks, block_size, n_kv, HEAD_DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(keys), max(blocks_needed), dtype=torch.int64)
    for s, (k, v) in enumerate(zip(keys, values)):
        table = [order.pop() for _ in range(blocks_needed[s])]
        tables[s, : len(table)] = torch.tensor(table)
        positions = torch.arange(k.shape[0])
        slots = tables[s, positions // block_size] * block_size + positions % block_size
        reference.write_kv(k, v, key_cache, value_cache, slots)
    return key_cache, value_cache, tables


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_matches_dense(block_size: int, group: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + group)
    n_kv = 2
    lengths = [1, 7, 33, 64, 100]  # ragged, one shorter than a block, some crossing blocks
    keys = [torch.randn(n, n_kv, HEAD_DIM, generator=gen) for n in lengths]
    values = [torch.randn(n, n_kv, HEAD_DIM, generator=gen) for n in lengths]
    key_cache, value_cache, tables = scatter_into_cache(keys, values, block_size, n_kv, gen)
    query = torch.randn(len(lengths), n_kv * group, HEAD_DIM, generator=gen)
    out = reference.decode_attention(
        query, key_cache, value_cache, tables, torch.tensor(lengths), HEAD_DIM**-0.5
    )
    for s, n in enumerate(lengths):
        expected = dense_attention(query[s : s + 1], keys[s], values[s], q_start=n - 1)
        torch.testing.assert_close(out[s : s + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_chunked_prefill_matches_dense(block_size: int, group: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 7 + group)
    n_kv = 2
    # (cached prefix, chunk): a fresh prompt, chunks continuing a cached prefix, a 1-token chunk
    shapes = [(0, 20), (16, 17), (45, 5), (3, 1), (0, 64)]
    keys = [torch.randn(c + q, n_kv, HEAD_DIM, generator=gen) for c, q in shapes]
    values = [torch.randn(c + q, n_kv, HEAD_DIM, generator=gen) for c, q in shapes]
    key_cache, value_cache, tables = scatter_into_cache(keys, values, block_size, n_kv, gen)
    query_lens = torch.tensor([q for _, q in shapes])
    seq_lens = torch.tensor([c + q for c, q in shapes])
    query = torch.randn(int(query_lens.sum()), n_kv * group, HEAD_DIM, generator=gen)
    out = reference.prefill_attention(
        query, key_cache, value_cache, tables, query_lens, seq_lens, HEAD_DIM**-0.5
    )
    start = 0
    for s, (cached, q_len) in enumerate(shapes):
        expected = dense_attention(query[start : start + q_len], keys[s], values[s], q_start=cached)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=1e-5, rtol=1e-5)
        start += q_len


def test_bfloat16_close_to_dense() -> None:
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(40, 3, HEAD_DIM, generator=gen)]
    values = [torch.randn(40, 3, HEAD_DIM, generator=gen)]
    key_cache, value_cache, tables = scatter_into_cache(keys, values, 16, 3, gen)
    query = torch.randn(1, 9, HEAD_DIM, generator=gen)
    out = reference.decode_attention(
        query.bfloat16(), key_cache.bfloat16(), value_cache.bfloat16(), tables, torch.tensor([40]), HEAD_DIM**-0.5
    )
    expected = dense_attention(query, keys[0], values[0], q_start=39)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_write_kv_places_tokens_in_their_slots() -> None:
    key_cache = torch.zeros(4, 2, 1, 1)
    value_cache = torch.zeros(4, 2, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    reference.write_kv(k, -k, key_cache, value_cache, torch.tensor([5, 0, 6]))
    assert key_cache.flatten().tolist() == [2.0, 0, 0, 0, 0, 1.0, 3.0, 0]
    assert value_cache.flatten().tolist() == [-2.0, 0, 0, 0, 0, -1.0, -3.0, 0]


@pytest.mark.parametrize("window", [None, 1, 5, 16, 21])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("group", [1, 3])
def test_windowed_and_capped_prefill_and_decode_match_dense(window: int | None, softcap: float | None,
                                                            group: int) -> None:
    """Windows that cut 16-token blocks in the middle (5, 21) or match one (16), chunks that start
    past the window's edge (a cached prefix of 40), and decode rows."""
    gen = torch.Generator().manual_seed(7 * group + (window or 0))
    n_kv, block_size = 2, 16
    lengths, chunks = [9, 50, 70], [9, 10, 30]  # prefixes cached: 0, 40, 40
    keys = [torch.randn(n, n_kv, HEAD_DIM, generator=gen) for n in lengths]
    values = [torch.randn(n, n_kv, HEAD_DIM, generator=gen) for n in lengths]
    key_cache, value_cache, tables = scatter_into_cache(keys, values, block_size, n_kv, gen)
    query = torch.randn(sum(chunks), n_kv * group, HEAD_DIM, generator=gen)
    out = reference.prefill_attention(query, key_cache, value_cache, tables, torch.tensor(chunks),
                                      torch.tensor(lengths), HEAD_DIM**-0.5, window=window, softcap=softcap)
    start = 0
    for s, (n, c) in enumerate(zip(lengths, chunks)):
        expected = dense_attention(query[start : start + c], keys[s], values[s], n - c, window, softcap)
        torch.testing.assert_close(out[start : start + c], expected, atol=1e-5, rtol=1e-5)
        start += c
    decoded = reference.decode_attention(query[: len(lengths)], key_cache, value_cache, tables,
                                         torch.tensor(lengths), HEAD_DIM**-0.5, window=window, softcap=softcap)
    for s, n in enumerate(lengths):
        expected = dense_attention(query[s : s + 1], keys[s], values[s], n - 1, window, softcap)
        torch.testing.assert_close(decoded[s : s + 1], expected, atol=1e-5, rtol=1e-5)
