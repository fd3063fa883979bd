"""Hybrid linear attention (Qwen3.5, issue 41): the state pool's memory, the decode step against a
dense model of the same size, and a served agent replay that resumes from state checkpoints.

    .venv/bin/python bench/hybrid.py memory            # instant: bytes per sequence and checkpoint
    .venv/bin/python bench/hybrid.py decode            # ~3 min: engine decode steps, batch 1 and 32
    .venv/bin/python bench/hybrid.py replay            # ~3 min: two-turn agent replay, served

memory   Qwen3.5-4B's text config (hidden 2560, 32 layers of which 24 Gated DeltaNet, 16 key / 32
         value heads of 128, conv 4, float32 state; 8 full layers of 4 KV heads of 256): a state
         slot (one sequence's state, or one checkpoint) against the KV of one token, and how
         kv_cache_memory splits between slots and blocks (engine/worker/kv_cache.py).
decode   A 4-layer slice of that shape (3 linear + 1 full layer; a vocabulary of 400 so the slice
         is its layers) against a dense slice of the same widths (Qwen3: 4 full layers),
         random weights, bfloat16, our engine alone: ms per decode step at batch 1 and 32 after a
         64-token prompt, the median of 3 runs of 30 steps.
replay   `inferd serve` on a random Qwen3.5 of hidden 1024 (8 layers: 6 linear, 2 full), bfloat16:
         a vocabulary of single characters (_char_tokenizer says why). --sessions sessions one
         after the other, each a shared ~1k-token system prompt and a task, then a second turn of
         the same text plus the (64-token) answer plus a --tool-chars tool result.
         Printed per later turn: prompt tokens, cached tokens, TTFT; and the same later turn's
         TTFT on a server started with --no-prefix-caching (its cold prefill).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "model"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

QWEN35_4B = dict(  # the text config of Qwen/Qwen3.5-4B
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=2560, intermediate_size=9216,
    num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    vocab_size=248320, rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def memory() -> None:
    from inferd.engine.worker.kv_cache import bytes_per_block, state_bytes_per_slot, state_slots_for
    from inferd.model.families.registry import config_from_hf

    cfg = config_from_hf(dict(QWEN35_4B), "Qwen3.5-4B")
    dtype = torch.bfloat16
    slot = state_bytes_per_slot(cfg, dtype)
    per_token = bytes_per_block(cfg, 16, dtype) / 16
    print("Qwen3.5-4B, bfloat16 KV and conv state, float32 recurrent state")
    print(f"  state slot (one sequence, or one checkpoint): {slot / 2**20:.2f} MiB")
    print(f"  KV of one token (8 full layers): {per_token / 2**10:.1f} KiB  -> a slot = the KV of "
          f"{slot / per_token:,.0f} tokens")
    print(f"  a checkpoint at every 16-token block would cost {slot / 16 / per_token:,.0f}x the KV it sits beside;"
          f" inferd keeps: each prefill chunk's last block end, branch points, the last 2 decode block ends")
    print("  | kv_cache_memory | max_num_seqs | working slots | checkpoint slots | state MiB | KV blocks (16) | KV tokens |")
    print("  |---:|---:|---:|---:|---:|---:|---:|")
    for budget_gib, seats in ((2, 8), (2, 32), (8, 32), (64, 256)):
        budget = budget_gib * 2**30
        total, working = state_slots_for(budget, cfg, dtype, seats)
        blocks = int((budget - total * slot) // bytes_per_block(cfg, 16, dtype))
        print(f"  | {budget_gib} GiB | {seats} | {working} | {total - working - 1} | {total * slot / 2**20:,.0f} | "
              f"{blocks:,} | {blocks * 16:,} |")


def _write(folder: Path, hybrid: bool, layers: int, hidden: int, intermediate: int, vocab: int) -> Path:
    import tiny_models as tm
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=hidden // 16 if not hybrid else 256,
                  max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if hybrid:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, linear_num_key_heads=16, linear_num_value_heads=32,
                                                     linear_key_head_dim=128, linear_value_head_dim=128,
                                                     linear_conv_kernel_dim=4))
        model = tm.randomize(model, 0, std=0.02, norm_centre=0.0)
    else:
        model = tm.randomize(Qwen3ForCausalLM(Qwen3Config(**{**common, "head_dim": 256})), 0, std=0.02)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return folder


def _decode_ms(folder: Path, batch: int) -> float:
    from inferd.engine.config import EngineConfig
    from inferd.engine.llm_engine import LLMEngine
    from inferd.text.sampling_params import SamplingParams

    from inferd.settings.policy import SchedulingPolicy, ShedConfig

    # (shedding off: a batch's TTFT in a slow offline run would shed it down to 4 sequences)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(folder), dtype="bfloat16", kv_cache_memory=2 * 2**30,
                                                   max_num_seqs=max(batch, 8),
                                                   policy=SchedulingPolicy(shedding=ShedConfig(enabled=False))))
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    runs = []
    for run in range(3):
        for i in range(batch):
            engine.add([5 + (i * 7 + j + run) % 300 for j in range(64)], params)
        while engine.scheduler.waiting or any(not r.output_ids for r in engine.scheduler.running):
            engine.step()
        assert len(engine.scheduler.running) == batch
        start = time.perf_counter()
        for _ in range(30):
            engine.step()
        assert len(engine.scheduler.running) == batch
        runs.append((time.perf_counter() - start) / 30 * 1e3)
        for group in engine.group_ids():
            engine.abort(group)
    return statistics.median(runs)


def decode() -> None:
    import tiny_models as tm

    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name, hybrid in (("hybrid (3 linear + 1 full)", True), ("dense (4 full)", False)):
            folder = Path(tmp) / name.split()[0]
            folder.mkdir()
            vocab = tm.train_sentencepiece(folder)  # (a small vocabulary: the slices are their layers)
            folders[name] = _write(folder, hybrid, 4, 2560, 9216, vocab)
        print("Qwen3.5-4B-shaped 4-layer slices, bfloat16, decode step after a 64-token prompt (ms, median of 3)")
        print("| model | batch 1 | batch 32 |")
        print("|---|---:|---:|")
        results = {name: [_decode_ms(folder, b) for b in (1, 32)] for name, folder in folders.items()}
        for name, (one, many) in results.items():
            print(f"| {name} | {one:.1f} | {many:.1f} |")
        (h1, h32), (d1, d32) = results.values()
        print(f"hybrid / dense: {h1 / d1:.2f}x at batch 1, {h32 / d32:.2f}x at batch 32")


def _char_tokenizer(folder: Path) -> int:
    """A tokenizer.json whose tokens are the printable ASCII characters and newline, one each (no
    merges), and an EOS: a random model's answer then re-tokenizes into the very tokens it
    generated, as a real model's answer mostly does (a merge vocabulary would re-cut its random
    text and end every hit at the previous prompt). Returns the vocabulary size."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # (byte-level characters: printable ASCII stands for itself, space is "Ġ" and newline "Ċ")
    vocab = {c: i for i, c in enumerate([chr(b) for b in range(33, 127)] + ["Ġ", "Ċ"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return tok.get_vocab_size(with_added_tokens=True)


def replay(sessions: int, tool_chars: int) -> None:
    import openai
    from serveproc import start_server, stop_server

    system = ("You are a careful coding agent. Read the repository, plan, and call tools to edit files. "
              "Always run the tests before you answer. ") * 8
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen35"
        folder.mkdir()
        _write(folder, True, 8, 1024, 3072, _char_tokenizer(folder))
        args = ("--model", str(folder), "--dtype", "bfloat16", "--kv-cache-memory", "1GiB", "--max-model-len", "4096")

        def run(server_args: tuple[str, ...], label: str) -> list[tuple[int, int, int, float]]:
            workdir = Path(tmp) / label
            workdir.mkdir()
            server = start_server(workdir, *server_args)
            client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
            rows = []
            try:
                for k in range(sessions):
                    prompt = system + f"Task {k}: fix the failing test in module {k}. "
                    _, first_cached, answer, _ = _turn(client, prompt)
                    prompt += answer + (f" Tool result {k}: " + "the test output line says ok " * 9)[:tool_chars]
                    tokens, cached, _answer, ttft = _turn(client, prompt)
                    rows.append((first_cached, tokens, cached, ttft))
            finally:
                stop_server(server)
            return rows

        warm = run(args, "cached")
        cold = run((*args, "--no-prefix-caching"), "uncached")
    print(f"two-turn agent replay, {sessions} sessions, hidden 1024 / 8 layers (6 linear), bfloat16")
    print("| session | turn 1: cached | turn 2: prompt tokens | cached | share | TTFT (ms) | cold TTFT (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, ((first, tokens, cached, ttft), (*_, cold_ttft)) in enumerate(zip(warm, cold)):
        print(f"| {k} | {first} | {tokens} | {cached} | {cached / tokens:.0%} | {ttft * 1e3:.0f} | "
              f"{cold_ttft * 1e3:.0f} | {ttft / cold_ttft:.2f} |")


def _turn(client: object, prompt: str) -> tuple[int, int, str, float]:
    """(prompt tokens, cached tokens, answer, TTFT) of one streamed greedy completion."""
    start = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.completions.create(model="qwen35", prompt=prompt, max_tokens=64, temperature=0,  # type: ignore[attr-defined]
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and ttft is None:
            ttft = time.perf_counter() - start
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert usage is not None and ttft is not None
    details = usage.prompt_tokens_details
    return usage.prompt_tokens, (details.cached_tokens or 0) if details else 0, text, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["memory", "decode", "replay"])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--tool-chars", type=int, default=64, help="the tool result's characters (tokens)")
    args = parser.parse_args()
    if args.part == "memory":
        memory()
    elif args.part == "decode":
        decode()
    else:
        replay(args.sessions, args.tool_chars)


if __name__ == "__main__":
    main()
