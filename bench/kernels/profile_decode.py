"""Where a decode step goes: the default model in bfloat16, BATCH requests decoding together,
the engine alone (no HTTP). Prints the step time, the part inside model.forward, and
torch.profiler's table of the ops over 20 steps.

    .venv/bin/python bench/kernels/profile_decode.py [--batch 32] [--context 100] [--rows 12]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.text.sampling_params import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--context", type=int, default=0, help="prompt tokens before decoding (0: a short prompt)")
parser.add_argument("--rows", type=int, default=12, help="rows of the profiler's table")
args = parser.parse_args()
eng = LLMEngine.from_config(EngineConfig.of(dtype="bfloat16", kv_cache_memory=max(64, args.batch * (args.context + 400) // 8) * 2**20,
                                         max_num_seqs=max(16, args.batch)))
p = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
words = ("the sea was calm and the ship sailed on " * (1 + args.context // 9)).split()[: args.context]
for i in range(args.batch):
    eng.add(f"Tell me a long story about the sea, number {i}. " + " ".join(words), p)
while any(len(s.output_ids) == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
    eng.step()
for _ in range(10):
    eng.step()
running = len(eng.scheduler.running)
fwd = eng.model.forward
t_fwd = []


def timed(*a, **k):
    t = time.perf_counter(); r = fwd(*a, **k); t_fwd.append(time.perf_counter() - t); return r


eng.model.forward = timed
t0 = time.perf_counter(); n = 50
for _ in range(n):
    eng.step()
step = (time.perf_counter() - t0) / n
print(f"batch {running}: step {step*1e3:.1f} ms ({running / step:.0f} tokens/s), model.forward "
      f"{sum(t_fwd)/len(t_fwd)*1e3:.1f} ms, rest {(step - sum(t_fwd)/len(t_fwd))*1e3:.1f} ms")
eng.model.forward = fwd
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        eng.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
