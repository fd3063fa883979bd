"""Where a batch-1 decode step goes: the default model in bfloat16, one request, the engine
alone (no HTTP). Prints the step time, the part inside model.forward, and torch.profiler's
table of the ops over 20 steps.

    .venv/bin/python bench/profile_decode.py
"""
import time, torch
from torch.profiler import profile, ProfilerActivity
from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.model.sampling_params import SamplingParams
eng = LLMEngine.from_config(EngineConfig(dtype="bfloat16", kv_cache_memory=64 * 2**20))
p = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
eng.add("Tell me a long story about the sea.", p)
for _ in range(20): eng.step()
# wall time per step, and the part inside model.forward
fwd = eng.model.forward
t_fwd = []
def timed(*a, **k):
    t = time.perf_counter(); r = fwd(*a, **k); t_fwd.append(time.perf_counter() - t); return r
eng.model.forward = timed
t0 = time.perf_counter(); n = 50
for _ in range(n): eng.step()
step = (time.perf_counter() - t0) / n
print(f"step {step*1e3:.1f} ms, model.forward {sum(t_fwd)/len(t_fwd)*1e3:.1f} ms, rest {(step - sum(t_fwd)/len(t_fwd))*1e3:.1f} ms")
eng.model.forward = fwd
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20): eng.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
