"""KV cache sizing, the block copies behind copy-on-write, and swapping blocks to host memory."""

from __future__ import annotations

import pytest
import torch

from inferd.engine.worker.kv_cache import KVCache, available_memory, bytes_per_block, host_blocks_for, num_blocks_for
from inferd.model.families.config import ModelConfig

CFG = ModelConfig(
    architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=64, tie_word_embeddings=True,
)
CPU = torch.device("cpu")


def test_pool_size_from_bytes_and_from_a_fraction() -> None:
    per_block = bytes_per_block(CFG, 16, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 2 * 4 * 2  # K+V, layers, tokens, kv heads, head dim, bytes
    assert num_blocks_for(10 * per_block + 5, CFG, 16, torch.bfloat16, CPU) == 10
    fraction = num_blocks_for(0.01, CFG, 16, torch.bfloat16, CPU)
    assert abs(fraction - 0.01 * available_memory(CPU) / per_block) <= 0.002 * available_memory(CPU) / per_block


def test_cache_starts_zeroed_and_copies_blocks_in_every_layer() -> None:
    cache = KVCache(CFG, num_blocks=5, block_size=4, dtype=torch.float32, device=CPU)
    assert cache.storage.shape == (2, 2, 5, 4, 2, 4)
    assert not cache.storage.any()
    for key_cache, value_cache in cache.layers:
        key_cache[1].fill_(1.0)
        value_cache[1].fill_(2.0)
    cache.copy_blocks([(1, 3)])
    for key_cache, value_cache in cache.layers:
        assert torch.equal(key_cache[3], key_cache[1]) and torch.equal(value_cache[3], value_cache[1])
        assert not key_cache[2].any()


def test_host_blocks_from_swap_space() -> None:
    per_block = bytes_per_block(CFG, 4, torch.float16)
    assert host_blocks_for(10 * per_block + 5, CFG, 4, torch.float16) == 10
    assert host_blocks_for(0, CFG, 4, torch.float16) == 0
    with pytest.raises(ValueError):
        host_blocks_for(-1, CFG, 4, torch.float16)


def test_no_host_storage_without_host_blocks() -> None:
    cache = KVCache(CFG, num_blocks=2, block_size=4, dtype=torch.float32, device=CPU)
    assert cache.host_storage is None
    cache.swap_out([])
    cache.swap_in([])
    with pytest.raises(ValueError, match="swap space"):
        cache.swap_out([(0, 0)])


def check_swap_round_trip(device: torch.device, dtype: torch.dtype) -> None:
    cache = KVCache(CFG, num_blocks=6, block_size=4, dtype=dtype, device=device, num_host_blocks=3)
    host = cache.host_storage
    assert host is not None and host.device.type == "cpu" and host.dtype == dtype
    assert host.shape == (2, 2, 3, 4, 2, 4) and not host.any()
    assert host.is_pinned() == (device.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen).to(dtype))
    block_1, block_4 = cache.storage[:, :, 1].to(CPU, copy=True), cache.storage[:, :, 4].to(CPU, copy=True)

    cache.swap_out([(1, 0), (4, 2)])  # device 1 -> host 0, device 4 -> host 2
    assert torch.equal(host[:, :, 0], block_1) and torch.equal(host[:, :, 2], block_4)
    assert not host[:, :, 1].any()

    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen).to(dtype))  # blocks reused
    untouched = cache.storage.to(CPU, copy=True)
    cache.swap_in([(0, 5), (2, 0)])  # host 0 -> device 5, host 2 -> device 0
    after = cache.storage.to(CPU, copy=True)
    assert torch.equal(after[:, :, 5], block_1) and torch.equal(after[:, :, 0], block_4)
    assert torch.equal(after[:, :, 1:5], untouched[:, :, 1:5])
    for i, (key_cache, value_cache) in enumerate(cache.layers):  # the per-layer views see it
        assert torch.equal(key_cache[5].cpu(), block_1[i, 0]) and torch.equal(value_cache[0].cpu(), block_4[i, 1])


def test_swap_round_trip_on_cpu() -> None:
    check_swap_round_trip(CPU, torch.float32)
    check_swap_round_trip(CPU, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_swap_round_trip_on_cuda_uses_pinned_host_memory() -> None:
    check_swap_round_trip(torch.device("cuda"), torch.float16)
