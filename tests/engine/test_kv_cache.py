"""KV cache sizing and the block copies behind copy-on-write."""

from __future__ import annotations

import torch

from inferd.engine.kv_cache import KVCache, available_memory, bytes_per_block, num_blocks_for
from inferd.model.config import ModelConfig

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
