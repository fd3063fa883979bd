"""Offline decode throughput: inferd's engine against transformers' `generate`, same run.

Each sequence has a 128-token prompt and generates exactly 128 tokens (EOS ignored). Output
tokens/s = batch * 128 / wall time of the whole call (prefill included, for both). Each cell
is the median of --repeats runs; the ratio is inferd / transformers.

    python bench/engine.py [--batch-sizes 1,8,32,64] [--dtype bfloat16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.model.loading.loader import default_model_path
from inferd.text.sampling_params import SamplingParams

TEXT = (
    "The history of computing is a story of ideas that moved from laboratories into everyday life. "
    "Early machines filled rooms, consumed enormous power and were programmed by rewiring panels. "
    "Stored programs, transistors and integrated circuits changed that within a few decades, and "
    "each step made machines smaller, cheaper and more capable. Operating systems, compilers and "
    "networks followed, turning isolated calculators into a connected fabric of services. "
)


def make_prompts(engine: LLMEngine, batch: int, prompt_len: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(TEXT * 20)
    # a different window of the same text per sequence, so prompts differ but have equal length
    return [ids[i * 7 : i * 7 + prompt_len] for i in range(batch)]


def bench_inferd(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    completions = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(c.token_ids) == new_tokens for c in completions)
    return len(prompts) * new_tokens / elapsed


def bench_transformers(model, prompts: list[list[int]], new_tokens: int) -> float:
    input_ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    dtype = getattr(torch, args.dtype)
    path = default_model_path()
    # offline: larger prefill chunks than the server's latency-minded default
    engine = LLMEngine.from_config(
        EngineConfig.of(dtype=args.dtype, kv_cache_memory=2 * 2**30, max_num_seqs=256, max_num_batched_tokens=2048)
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    print(f"model {path.name}, dtype {args.dtype}, {args.threads} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__} (attn: {model.config._attn_implementation})")
    print(f"prompt {args.prompt_len} + output {args.new_tokens} tokens per sequence; median of {args.repeats} runs\n")
    print("| batch | inferd tok/s | transformers tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = make_prompts(engine, batch, args.prompt_len)
        bench_inferd(engine, prompts[:1], 4)  # warm-up
        bench_transformers(model, prompts[:1], 4)
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
            ours.append(bench_inferd(engine, prompts, args.new_tokens))
            theirs.append(bench_transformers(model, prompts, args.new_tokens))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"| {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
