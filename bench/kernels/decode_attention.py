"""The CPU decode-attention kernel's sweep: batch 1-64 x context 64-8k, time per call and the
bandwidth it achieves on the K/V bytes it must read, against two peers in the same run:

- `before`: the kernel as it was at --baseline (default 34526bb, before issue 30), built from
  that commit's source under another op namespace, so both load into this one process;
- `torch`: the pure-torch reference (inferd.kernels.reference: gathers the context, then SDPA),
  what a torch-only server does; only where the gathered context stays small (it is slow).

Shapes are the default model's layer (9 query heads, 3 KV heads, head size 64, bfloat16, blocks
of 16), each sequence's blocks scattered over the pool as the block manager leaves them.

    .venv/bin/python bench/kernels/decode_attention.py [--batches 1,4,16,32,64] [--contexts 64,256,1024,2048,4096,8192]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from inferd.kernels import cpu, reference
from inferd.kernels.cpu.build import FLAGS

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


# Where the kernel's source lived: the CPU device room (its registration in bindings.cpp), or before
# it, inferd/kernels/csrc/ (its TORCH_LIBRARY inside the file)
_ROOM, _FLAT = "inferd/kernels/cpu/csrc", "inferd/kernels/csrc"
_REGISTER = """
#include <torch/library.h>
TORCH_LIBRARY(inferd_cpu_before, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(inferd_cpu::decode_attention));
}
"""


def _git_show(root: Path, commit: str, path: str) -> str | None:
    shown = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{path}"], capture_output=True, text=True,
                           check=False)
    return shown.stdout if shown.returncode == 0 else None


def build_baseline(commit: str) -> bool:
    """The kernel at `commit`, registered as torch.ops.inferd_cpu_before; False if it cannot be built."""
    root = Path(__file__).resolve().parents[2]
    folder = Path(tempfile.mkdtemp(prefix="inferd-attn-before-"))
    source = _git_show(root, commit, f"{_ROOM}/cpu_attention.cpp")
    if source is not None:  # the room's layout: the headers beside it, the op registered here
        for header in ("cpu_simd.h", "cpu_ops.h"):
            (folder / header).write_text(_git_show(root, commit, f"{_ROOM}/{header}") or "")
        source += _REGISTER
    else:
        source = _git_show(root, commit, f"{_FLAT}/cpu_attention.cpp")
        if source is None:
            print(f"(no baseline: no cpu_attention.cpp at {commit})")
            return False
        for header in ("cpu_simd.h",):
            (folder / header).write_text(_git_show(root, commit, f"{_FLAT}/{header}") or "")
        source = source.replace("TORCH_LIBRARY(inferd_cpu,", "TORCH_LIBRARY(inferd_cpu_before,")
    from torch.utils import cpp_extension

    path = folder / "before.cpp"
    path.write_text(source)
    lib = folder / "before.so"
    command = ["g++", *FLAGS, "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *[f"-I{p}" for p in cpp_extension.include_paths()], str(path),
               *[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu", "-o", str(lib)]
    subprocess.run(command, check=True)
    torch.ops.load_library(str(lib))
    return True


def timed(fn, budget: float = 0.3) -> float:
    """Median seconds per call over ~`budget` seconds (after one warm-up call)."""
    fn()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--contexts", default="64,256,1024,2048,4096,8192")
    parser.add_argument("--baseline", default="34526bb")
    parser.add_argument("--torch-limit", type=int, default=64 * 1024, help="largest batch x context for the torch peer")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    assert cpu.available()
    before = build_baseline(args.baseline)
    torch.manual_seed(0)
    num_blocks = max(batches) * -(-max(contexts) // BLOCK) + 1
    key_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    print(f"threads {torch.get_num_threads()}, pid {os.getpid()}; times are medians per call (one layer)")
    print("| batch | context | µs / call | GB/s of K/V | before µs | speed-up | torch µs | vs torch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for context in contexts:
        width = -(-context // BLOCK)
        for batch in batches:
            tables = torch.randperm(num_blocks - 1)[: batch * width].reshape(batch, width).int()
            lens = torch.full((batch,), context, dtype=torch.int32)
            query = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16)
            ours = timed(lambda: cpu.decode_attention(query, key_cache, value_cache, tables, lens, 0.125))
            gbps = batch * context * KV_HEADS * DIM * 2 * 2 / ours / 1e9
            row = f"| {batch} | {context} | {ours * 1e6:,.0f} | {gbps:.1f} |"
            if before:
                old = timed(lambda: torch.ops.inferd_cpu_before.decode_attention(
                    query, key_cache, value_cache, tables, lens, 0.125, 0, 0.0))
                row += f" {old * 1e6:,.0f} | {old / ours:.2f}x |"
            else:
                row += " - | - |"
            if batch * context <= args.torch_limit:
                tables64, lens64 = tables.long(), lens.long()
                peer = timed(lambda: reference.decode_attention(query, key_cache, value_cache, tables64, lens64, 0.125))
                row += f" {peer * 1e6:,.0f} | {peer / ours:.1f}x |"
            else:
                row += " - | - |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
