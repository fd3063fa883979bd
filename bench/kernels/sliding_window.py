"""Sliding-window KV memory and prefix reuse on a Gemma-3-shaped model (issue 28).

Tiny random weights (float32), the shape that matters: 12 layers, 5 sliding : 1 full, a window
of 1024, 8k context, blocks of 16. Prints

  (a) KV blocks held per sequence at the end of an 8k-token chat, in layer-blocks (one block of
      one layer: the unit both layouts share), against full attention's (every layer keeps every
      block); the target is <= 0.35x;
  (b) the TTFT of a second chat turn that extends the first (its prefix served from the cache)
      against the cold prefill of the same context in a fresh engine; the target is <= 0.25x.

    PYTHONPATH=. .venv/bin/python bench/kernels/sliding_window.py [--context 8192] [--turn 256]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from inferd.engine.config import EngineConfig
from inferd.engine.kv.groups import KVLayout
from inferd.engine.llm_engine import LLMEngine
from inferd.model.families.config import ModelConfig
from inferd.model.decoder import DecoderModel
from inferd.text.sampling_params import SamplingParams
from inferd.text.tokenizer import Tokenizer

BLOCK_SIZE, WINDOW, LAYERS, VOCAB = 16, 1024, 12, 512


def gemma3_shaped(context: int) -> DecoderModel:
    """A random Gemma-3-shaped decoder: layers 5 and 11 full, the rest sliding."""
    layer_types = tuple("full" if i % 6 == 5 else "sliding" for i in range(LAYERS))
    cfg = ModelConfig(
        architecture="gemma3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=LAYERS,
        num_heads=4, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=context + 1024, tie_word_embeddings=True, qk_norm=True, norm_offset=1.0,
        sandwich_norms=True, activation="gelu_tanh", embed_scale=128**0.5, sliding_window=WINDOW,
        layer_types=layer_types, local_rope_theta=1e4, name="gemma3-shaped")
    gen = torch.Generator().manual_seed(0)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    weights = {"embed": torch.randn(VOCAB, h, generator=gen) * 0.2, "norm": torch.zeros(h)}
    for n in range(LAYERS):
        shapes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i)}
        weights |= {f"layers.{n}.{name}": torch.randn(*shape, generator=gen) * 0.05 for name, shape in shapes.items()}
        for norm, size in (("attn_norm", h), ("mlp_norm", h), ("post_attn_norm", h), ("post_mlp_norm", h),
                           ("q_norm", cfg.head_dim), ("k_norm", cfg.head_dim)):
            weights[f"layers.{n}.{norm}"] = torch.zeros(size)
    return DecoderModel(cfg, weights, torch.float32)


class _Pieces:
    """A tokenizer of one piece per id: the engine detokenizes, the bench feeds ids."""

    normalizes = False

    def encode(self, text: str) -> list[int]:
        return [int(t[1:]) for t in text.split()]

    def decode(self, ids: Any) -> str:
        return "".join(f" t{i}" for i in ids)


def engine_for(model: DecoderModel, context: int) -> LLMEngine:
    tokenizer = Tokenizer(_Pieces(), [f"t{i}" for i in range(VOCAB)], vocab_size=VOCAB, bos_token_id=None,
                          eos_token_ids=frozenset(), eos_token_id=None, pad_token_id=None, add_bos=False,
                          add_eos=False, special_ids=frozenset(), chat_template=None, byte_level=False)
    config = EngineConfig.of(dtype="float32", block_size=BLOCK_SIZE, max_model_len=context + 1024,
                          max_num_batched_tokens=2048, kv_cache_memory=512 * 2**20)
    return LLMEngine(model, tokenizer, config)


def time_to_first_token(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds from submitting `prompt` to its first token, and the whole greedy completion."""
    start = time.perf_counter()
    engine.add(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    ttft, tokens = None, []
    while engine.has_work():
        for out in engine.step().outputs:
            tokens += out.new_token_ids
            if ttft is None and tokens:
                ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192, help="tokens of the second turn's prompt")
    parser.add_argument("--turn", type=int, default=256, help="new tokens of the second turn (answer + question)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    model = gemma3_shaped(args.context)
    answer = 64
    first = [rng.randrange(VOCAB) for _ in range(args.context - args.turn)]
    layout = KVLayout.for_layers([WINDOW if model.cfg.is_sliding(i) else None for i in range(LAYERS)])

    engine = engine_for(model, args.context)
    bm = engine.block_manager
    held: list[int] = []
    free = bm.free

    def watched(seq_id: int) -> None:  # what the sequence holds when its turn ends
        held[:] = [len(t) - s for t, s in zip(bm.block_tables(seq_id), bm._starts[seq_id])]
        free(seq_id)

    bm.free = watched  # type: ignore[method-assign]
    ttft_first, reply = time_to_first_token(engine, first, answer)
    tokens = len(first) + answer
    layer_blocks = sum(n * len(g.layers) for n, g in zip(held, layout.groups))
    full_attention = -(-tokens // BLOCK_SIZE) * LAYERS
    print(f"model: {LAYERS} layers (5 sliding : 1 full), window {WINDOW}, block size {BLOCK_SIZE}; "
          f"{len(layout.groups)} KV groups of {layout.group_size} layers")
    print(f"(a) first turn, {tokens} tokens: blocks held per group {held} ({sum(held)} blocks of "
          f"{layout.group_size} layers) = {layer_blocks} layer-blocks; full attention {full_attention} "
          f"({full_attention // LAYERS} blocks of {LAYERS} layers): ratio {layer_blocks / full_attention:.3f} "
          f"(target <= 0.35)")
    assert bm.num_used_blocks == 0, "blocks left held after the turn"

    second = first + reply + [rng.randrange(VOCAB) for _ in range(args.turn - answer)]
    hits = bm.prefix_hits
    ttft_hit, hit_reply = time_to_first_token(engine, second, 1)
    hit_tokens = bm.prefix_hits - hits
    cold_engine = engine_for(model, args.context)
    ttft_cold, cold_reply = time_to_first_token(cold_engine, second, 1)
    assert hit_reply == cold_reply, "the prefix hit changed the answer"
    print(f"(b) second turn, {len(second)} prompt tokens: prefix hit {hit_tokens} tokens; TTFT {ttft_hit * 1e3:.0f} ms "
          f"against a cold prefill of the same context {ttft_cold * 1e3:.0f} ms: ratio {ttft_hit / ttft_cold:.3f} "
          f"(target <= 0.25); first turn's cold TTFT {ttft_first * 1e3:.0f} ms")
    for e in (engine, cold_engine):
        e.block_manager.check_invariants()
        assert e.block_manager.num_used_blocks == 0


if __name__ == "__main__":
    main()
