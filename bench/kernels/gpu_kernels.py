"""Decode attention's achieved memory bandwidth on the GPU, against the device's copy bandwidth.

    PYTHONPATH=. python3 bench/kernels/gpu_kernels.py [--out FILE.md]

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head size 128, bfloat16, block size 16)
at batch 1, 16, 64 x context 1k, 4k, 16k, for the single-pass kernel and the split (flash-decoding)
one; torch's reference at a few small shapes as a peer. Bandwidth counts the K and V bytes a decode
must read (batch x context x n_kv x head_dim x 2 x itemsize) over the median kernel time; the copy
bandwidth (bytes read + bytes written) is measured in the same run.

Timing: each trial enqueues N launches behind a GPU sleep long enough to cover the host's launch
cost, so the events time back-to-back kernels, not Python. Each launch reads its own layer's cache
(at least 256 MiB in all, beyond the L2), as in a forward pass where every layer has its own.

Exit status: 0 measured; 1 an error (a kernel failed, CuPy missing on a CUDA machine);
2 skipped: no CUDA device.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch

N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16  # Llama-3-8B
BATCHES = (1, 16, 64)
CONTEXTS = (1024, 4096, 16384)
REFERENCE_SHAPES = ((1, 1024), (1, 4096), (16, 1024), (16, 4096))
MIN_POOL_BYTES = 256 * 2**20  # caches of all layers together: well past the H200's 50 MB L2
TRIALS = 10
TRIAL_MS = 5.0  # GPU time of one trial's launches
MAX_LAUNCHES = 200  # per trial: stays inside the launch queue behind the sleep


def median_ms(run: Callable[[], None], trials: int, per_trial: int, sleep_cycles: int = 0) -> float:
    """Median over `trials` of the event-timed GPU time of `per_trial` calls of `run`, per call."""
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)  # the GPU waits while the host enqueues the launches
        start.record()
        for _ in range(per_trial):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / per_trial)
    return statistics.median(times)


def sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def copy_bandwidth() -> tuple[float, int]:
    """Device-to-device copy bandwidth in GB/s (read + written bytes), and the buffer size used."""
    free, _ = torch.cuda.mem_get_info()
    n_bytes = min(2 * 2**30, free // 4)
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = median_ms(lambda: dst.copy_(src), trials=20, per_trial=1)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n_bytes / ms / 1e6, n_bytes


class Shape:
    """A batch of `batch` sequences of `context` tokens over `layers` per-layer caches."""

    def __init__(self, batch: int, context: int) -> None:
        self.batch, self.context = batch, context
        blocks_per_seq = -(-context // BLOCK_SIZE)
        self.num_blocks = batch * blocks_per_seq
        self.kv_bytes = batch * context * N_KV * HEAD_DIM * 2 * DTYPE.itemsize  # what a decode reads
        layer_bytes = 2 * self.num_blocks * BLOCK_SIZE * N_KV * HEAD_DIM * DTYPE.itemsize
        self.layers = max(1, math.ceil(MIN_POOL_BYTES / layer_bytes))
        self.pool_bytes = self.layers * layer_bytes

    def allocate(self) -> None:
        shape = (self.layers, self.num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM)
        self.key_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_()  # [L, blocks, bs, kv, D]
        self.value_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_()
        # a random permutation of the pool: each sequence's blocks scattered, as after some uptime
        perm = torch.randperm(self.num_blocks, device="cuda", dtype=torch.int64)
        self.block_tables = perm.to(torch.int32).view(self.batch, -1).contiguous()  # [B, blocks_per_seq]
        self.seq_lens = torch.full((self.batch,), self.context, dtype=torch.int32, device="cuda")  # [B]
        self.query = torch.randn(self.batch, N_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")  # [B, H, D]
        self.out = torch.empty_like(self.query)

    def free(self) -> None:
        del self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.query, self.out
        torch.cuda.empty_cache()


def time_kernel(shape: Shape, launch: Callable[[int], None], cycles_per_ms: float) -> float:
    """Median µs of one launch; launch(i) runs on layer i's cache."""
    for i in range(3):  # warm-up: compiles and loads the kernel
        launch(i % shape.layers)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(10):
        launch(i % shape.layers)
    host_ms = (time.perf_counter() - t0) * 1e3 / 10  # enqueue cost, or the GPU time if it blocks
    torch.cuda.synchronize()
    estimate = median_ms(lambda: launch(0), trials=3, per_trial=1)
    per_trial = max(5, min(MAX_LAUNCHES, math.ceil(TRIAL_MS / max(estimate, 1e-3))))
    counter = iter(range(10**9))
    sleep = int(cycles_per_ms * (1.5 * host_ms * per_trial + 1.0))
    ms = median_ms(lambda: launch(next(counter) % shape.layers), TRIALS, per_trial, sleep_cycles=sleep)
    return ms * 1e3


def fmt_row(batch: int, context: int, variant: str, us: float | None, gbps: float | None, pct: float | None) -> str:
    if us is None:
        return f"| {batch} | {context} | {variant} | | | |"
    return f"| {batch} | {context} | {variant} | {us:.1f} | {gbps:.0f} | {pct:.0f}% |"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}%"


def prefill_section(say: Callable[[str], None], scale: float) -> bool:
    """The prefill choice: gathering the paged context and calling SDPA (what inferd does)
    against SDPA alone on the same context already contiguous, i.e. what the gather and the
    paging cost. True if a shape failed."""
    import torch.nn.functional as F

    from inferd.kernels import reference

    say("Prefill chunks of 512 tokens: gather + SDPA (`reference.prefill_attention`, the CUDA path's) against SDPA alone on the same,"
        " already contiguous context (the paging's cost)")
    say()
    say("| sequences | cached prefix | gather + SDPA µs | SDPA alone µs | ratio |")
    say("|---|---|---|---|---|")
    chunk, failed = 512, False
    for batch in (1, 4):
        for cached in (0, 1536, 3584):
            context = cached + chunk
            shape = Shape(batch, context)
            shape.layers = 1
            shape.allocate()
            try:
                query = torch.randn(batch * chunk, N_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")  # [T, H, D]
                query_lens = torch.full((batch,), chunk, dtype=torch.int64, device="cuda")
                seq_lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
                kc, vc = shape.key_cache[0], shape.value_cache[0]

                def paged() -> None:
                    reference.prefill_attention(query, kc, vc, shape.block_tables.long(), query_lens, seq_lens, scale)

                slots = (shape.block_tables.long()[:, :, None] * BLOCK_SIZE
                         + torch.arange(BLOCK_SIZE, device="cuda")).view(batch, -1)[:, :context]  # [B, L]
                k = kc.view(-1, N_KV, HEAD_DIM)[slots].transpose(1, 2).contiguous()  # [B, kv, L, D]
                v = vc.view(-1, N_KV, HEAD_DIM)[slots].transpose(1, 2).contiguous()
                q = query.view(batch, chunk, N_HEADS, HEAD_DIM).transpose(1, 2)  # [B, H, Q, D]
                q_pos = cached + torch.arange(chunk, device="cuda")
                mask = torch.arange(context, device="cuda")[None, :] <= q_pos[:, None]  # [Q, L]

                def contiguous() -> None:
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

                paged_ms = median_ms(paged, trials=5, per_trial=10)
                alone_ms = median_ms(contiguous, trials=5, per_trial=10)
                say(f"| {batch} | {cached} | {paged_ms * 1e3:.0f} | {alone_ms * 1e3:.0f} | {paged_ms / alone_ms:.2f} |")
            except Exception as e:
                failed = True
                say(f"| {batch} | {cached} | error: {type(e).__name__}: {e} | | |")
            shape.free()
    return failed


def kernel_table(say: Callable[[str], None], copy_gbps: float, num_sms: int, scale: float
                 ) -> tuple[dict[tuple[str, int, int], float], bool]:
    """Each kernel variant's time and bandwidth per shape: (% of copy bandwidth by (variant, batch,
    context), whether a shape failed)."""
    from inferd.kernels.cuda import launch as cuda

    cycles_per_ms = sleep_cycles_per_ms()
    say()
    say("| batch | context | variant | time µs | GB/s | % of copy |")
    say("|---|---|---|---|---|---|")
    pct: dict[tuple[str, int, int], float] = {}
    failed = False
    for batch in BATCHES:
        for context in CONTEXTS:
            shape = Shape(batch, context)
            free, _ = torch.cuda.mem_get_info()
            if shape.pool_bytes > 0.6 * free:
                say(f"| {batch} | {context} | skipped: too large ({shape.pool_bytes / 2**30:.1f} GiB) | | | |")
                continue
            shape.allocate()
            splits = cuda.choose_num_partitions(batch, N_KV, context, num_sms)
            for variant, num_partitions in (("single-pass", 1), (f"split P={splits}", splits)):
                workspace = None  # the single-pass kernel needs no scratch
                if num_partitions > 1:
                    workspace = cuda.DecodeWorkspace(batch, N_HEADS, HEAD_DIM, num_partitions, device="cuda")

                def launch(layer: int, p: int = num_partitions, ws: cuda.DecodeWorkspace | None = workspace) -> None:
                    cuda.decode_attention(
                        shape.query, shape.key_cache[layer], shape.value_cache[layer], shape.block_tables,
                        shape.seq_lens, scale, max_seq_len=shape.context, out=shape.out, num_partitions=p,
                        workspace=ws,
                    )

                try:
                    us = time_kernel(shape, launch, cycles_per_ms)
                except Exception as e:  # report and go on: one failing shape should not hide the rest
                    failed = True
                    say(f"| {batch} | {context} | {variant} | error: {type(e).__name__}: {e} | | |")
                    continue
                gbps = shape.kv_bytes / us / 1e3
                pct[(variant.split()[0], batch, context)] = 100 * gbps / copy_gbps
                say(fmt_row(batch, context, variant, us, gbps, 100 * gbps / copy_gbps))
            shape.free()
    return pct, failed


def reference_section(say: Callable[[str], None], copy_gbps: float, scale: float) -> bool:
    """The peer: torch's reference decode at a few shapes. True if one failed."""
    from inferd.kernels import reference

    say("Peer: torch's reference.decode_attention (gathers the context, then SDPA; includes its host syncs)")
    say()
    failed = False
    for batch, context in REFERENCE_SHAPES:
        shape = Shape(batch, context)
        shape.layers = 1  # slow enough that L2 reuse does not matter
        shape.allocate()
        try:
            ms = median_ms(
                lambda: reference.decode_attention(
                    shape.query, shape.key_cache[0], shape.value_cache[0], shape.block_tables, shape.seq_lens, scale
                ),
                trials=3,
                per_trial=5,
            )
            gbps = shape.kv_bytes / ms / 1e6
            say(
                f"torch reference at batch {batch} × {context // 1024}k: {ms * 1e3:.0f} µs, {gbps:.0f} GB/s"
                f" ({percent(100 * gbps / copy_gbps)} of copy bandwidth)"
            )
        except Exception as e:
            failed = True
            say(f"torch reference at batch {batch} × {context // 1024}k: error: {type(e).__name__}: {e}")
        shape.free()
    return failed


def linear_attention_section(say: Callable[[str], None], copy_gbps: float) -> bool:
    """Gated DeltaNet (Qwen3.5-4B's layer: 16 key heads, 32 value heads, heads of 128, conv width 4,
    bfloat16): our two kernels (conv + delta rule) against the torch reference, decode at batch 1
    and 32 and one prefill of 2048 tokens. Decode's bandwidth counts the states read and written.
    True if a shape failed."""
    from inferd.kernels import ops
    from inferd.kernels.linear_attention import StatePlan

    Hk, Hv, dk, dv, K, dtype = 16, 32, 128, 128, 4, torch.bfloat16
    C = 2 * Hk * dk + Hv * dv
    kernels, reference = ops.linear_attention_ops(torch.device("cuda"), dtype), ops.reference_linear_attention()
    say(f"Linear attention (Gated DeltaNet, Hk={Hk}, Hv={Hv}, dk=dv={dk}, conv {K}, bfloat16): conv + delta rule, "
        f"our kernels ({kernels.backend}) against the torch reference")
    say()
    say("| step | kernels µs | reference µs | speed-up | state GB/s (% of copy) |")
    say("|---|---|---|---|---|")
    failed = False
    for label, lens, num_decode in (("decode × 1", [], 1), ("decode × 32", [], 32), ("prefill 1 × 2048", [2048], 0)):
        try:
            lens = lens + [1] * num_decode
            n, T = len(lens), sum(lens)
            plan = StatePlan.build(lens, list(range(n)), [num_decode == 0] * n, [], num_decode, torch.device("cuda"))
            x = torch.randn(T, C, device="cuda", dtype=dtype)
            weight = torch.randn(C, K, device="cuda", dtype=dtype)
            conv_states = torch.randn(n, K - 1, C, device="cuda", dtype=dtype)
            q, k = (torch.randn(T, Hk, dk, device="cuda", dtype=dtype) for _ in range(2))
            v = torch.randn(T, Hv, dv, device="cuda", dtype=dtype)
            g = -torch.rand(T, Hv, device="cuda")
            beta = torch.rand(T, Hv, device="cuda")
            states = torch.randn(n, Hv, dk, dv, device="cuda") * 0.1

            def step(bound: ops.LinearAttentionOps) -> Callable[[], None]:
                return lambda: (bound.conv(x, weight, conv_states, plan), bound.delta(q, k, v, g, beta, states, plan))

            ours = median_ms(step(kernels), trials=5, per_trial=20) * 1e3
            theirs = median_ms(step(reference), trials=3, per_trial=3) * 1e3
            state_gbps = 2 * n * Hv * dk * dv * 4 / ours / 1e3
            bandwidth = f"{state_gbps:.0f} ({100 * state_gbps / copy_gbps:.0f}%)" if num_decode else ""
            say(f"| {label} | {ours:.1f} | {theirs:.0f} | {theirs / ours:.1f}x | {bandwidth} |")
        except Exception as e:
            failed = True
            say(f"| {label} | error: {type(e).__name__}: {e} | | | |")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernels: skipped: no CUDA device")
        return 2
    try:
        import cupy
    except ImportError as e:
        print(f"gpu_kernels: error: CUDA is there but CuPy is not importable ({e})")
        return 1
    from inferd.kernels.cuda import launch as cuda

    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    props = torch.cuda.get_device_properties(0)
    say("# Decode attention kernels: achieved bandwidth")
    say()
    say(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    say(f"- GPU: {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)")
    python = sys.version.split()[0]
    say(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, CuPy {cupy.__version__}, Python {python}")
    say(
        f"- shape: {N_HEADS} query heads, {N_KV} KV heads, head size {HEAD_DIM}, {str(DTYPE).removeprefix('torch.')},"
        f" block size {BLOCK_SIZE}; the split variant's partitions: at least {cuda.MIN_PARTITION_SIZE} tokens"
    )
    copy_gbps, copy_bytes = copy_bandwidth()
    say(f"- copy bandwidth: {copy_gbps:.0f} GB/s (torch copy_ of {copy_bytes / 2**30:.1f} GiB, read + written)")
    scale = HEAD_DIM**-0.5
    pct, failed = kernel_table(say, copy_gbps, props.multi_processor_count, scale)
    say()
    say(f"single-pass at batch 64 × 4k: {percent(pct.get(('single-pass', 64, 4096)))} of copy bandwidth "
        "(target ≥ 70%)")
    say(f"split at batch 1 × 16k: {percent(pct.get(('split', 1, 16384)))} (target ≥ 50%)")
    say()
    failed |= reference_section(say, copy_gbps, scale)
    say()
    failed |= prefill_section(say, scale)
    say()
    failed |= linear_attention_section(say, copy_gbps)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
