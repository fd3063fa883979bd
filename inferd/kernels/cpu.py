"""Our CPU kernels, batch-invariant by construction: paged decode attention
(csrc/cpu_attention.cpp), products over block-quantized weights on AVX-512 VNNI
(csrc/cpu_matmul.cpp; inferd.model.layers.quant packs the weights for them) and a decoder layer's
small bfloat16 ops fused (csrc/cpu_layer_ops.cpp: RMSNorm, residual add + RMSNorm, SiLU x up,
RoPE + the KV cache write).

They are compiled once per machine with the system's g++ against the installed torch (`make`
builds it: `python -m inferd.kernels.cpu`), into a cache folder keyed by the source, the torch
version and the CPU's instruction sets (-march=native: the library fits only this kind of CPU).
A server that finds no library builds it at start-up (~40 s on 2 cores); without g++ the model falls back
to the torch reference and torch's packed products, with a warning.

    INFERD_KERNEL_DIR   where the libraries are kept (default ~/.cache/inferd/kernels)
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = [_CSRC / name for name in ("cpu_attention.cpp", "cpu_matmul.cpp", "cpu_layer_ops.cpp")]
HEADERS = [_CSRC / "cpu_simd.h"]
# Reassociation (-fassociative-math and what it needs): vectorized sums, in a fixed order all the
# same (one compiled loop). NOT -ffast-math: linking with it sets flush-to-zero for the whole
# process (crtfastmath), which changes torch's arithmetic and breaks hypothesis (tests/kernels).
# -fopenmp: ATen's parallel_for is inlined OpenMP; it binds to the libgomp.so.1 that torch ships
# and has loaded already (same soname), so the kernel runs on torch's threads.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
         "-fopenmp", "-std=c++17", "-fPIC"]
HEAD_SIZE_MULTIPLE = 16  # the kernel's dot product runs 16 lanes
_loaded: bool | None = None  # None: not tried yet


class KernelBuildError(RuntimeError):
    pass


def library_path() -> Path:
    """Where this machine's build of the current source lives."""
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    key.update(" ".join(FLAGS).encode())
    key.update(torch.__version__.encode())
    key.update(platform.machine().encode())
    key.update(_cpu_flags().encode())
    folder = Path(os.environ.get("INFERD_KERNEL_DIR") or Path.home() / ".cache" / "inferd" / "kernels")
    return folder / f"inferd_cpu_{key.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(force: bool = False) -> Path:
    """Compile the kernel for this machine (no-op when the library is already there)."""
    target = library_path()
    if target.exists() and not force:
        return target
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise KernelBuildError("no C++ compiler (g++) on PATH: the CPU kernel cannot be built")
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpaths = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        # one compiler per source, side by side (the build is most of a fresh set-up's wait)
        compiles = [subprocess.Popen([compiler, *FLAGS, abi, *includes, "-c", str(source), "-o", str(obj)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for source, obj in zip(SOURCES, objects)]
        errors = [process.communicate()[1] for process in compiles]
        failures = [f"{source.name}:\n{error[-4000:]}"
                    for source, process, error in zip(SOURCES, compiles, errors) if process.returncode != 0]
        if failures:
            raise KernelBuildError("building the CPU kernels failed: " + "\n".join(failures))
        # linked beside the target and renamed into place: a concurrent start never loads half a file
        partial = Path(scratch) / target.name
        result = subprocess.run([compiler, "-shared", "-fopenmp", *map(str, objects), *libraries, *rpaths,
                                 "-lc10", "-ltorch_cpu", "-o", str(partial)], capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"linking the CPU kernels failed:\n{result.stderr[-4000:]}")
        partial.replace(target)
    return target


def available() -> bool:
    """Load the kernel, building it first if this machine has none; False (and a warning) if not."""
    global _loaded
    if _loaded is None:
        try:
            path = library_path()
            if not path.exists():
                log.info("building the CPU kernels for this machine (once; make does it ahead)")
            torch.ops.load_library(str(build()))
            _loaded = True
        except (KernelBuildError, OSError, RuntimeError) as e:
            log.warning("CPU kernels unavailable, using the torch reference and torch's products: %s", e)
            _loaded = False
    return _loaded


def supports(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    return head_dim % HEAD_SIZE_MULTIPLE == 0 and num_heads % num_kv_heads == 0


def block_matmul_available() -> bool:
    """The quantized products run here: the kernels built, and on a CPU with AVX-512 VNNI."""
    return available() and torch.ops.inferd_cpu.block_matmul_available()


def block_matmul(x: torch.Tensor,  # [M, K]
                 weight: torch.Tensor,  # uint8 [N / 16, K / 32, bytes]: quant.BlockLinear's packing
                 bits: int,  # the weights' codes: 4 or 8
                 activation_bits: int = 8) -> torch.Tensor:  # [M, N], x's dtype; 16 for 4-bit weights only
    return torch.ops.inferd_cpu.block_matmul(x, weight, bits, activation_bits)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, H] bfloat16
    return torch.ops.inferd_cpu.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (rounded to bfloat16); returns RMSNorm(x) * weight."""
    return torch.ops.inferd_cpu.add_rms_norm_(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I] bfloat16
    return torch.ops.inferd_cpu.silu_mul(gate_up)


def rope_write_kv(qkv: torch.Tensor,  # [T, (H + 2 KV) x D] bfloat16
                  cos: torch.Tensor, signed_sin: torch.Tensor,  # [T, D] bfloat16 each
                  key_cache: torch.Tensor, value_cache: torch.Tensor,  # [blocks, block_size, KV, D] bfloat16
                  slot_mapping: torch.Tensor,  # [T] int64, negative: padding
                  num_heads: int, num_kv_heads: int) -> torch.Tensor:  # q: [T, H, D]
    """q and k rotated (inferd.model.layers.rope.rotate's arithmetic), k and v written to their slots
    (inferd.kernels.reference.write_kv's), in one pass."""
    return torch.ops.inferd_cpu.rope_write_kv(qkv, cos, signed_sin, key_cache, value_cache, slot_mapping,
                                              num_heads, num_kv_heads)


def decode_attention(query: torch.Tensor,  # [N, heads, head_dim]
                     key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
                     value_cache: torch.Tensor,
                     block_tables: torch.Tensor,  # [N, width] int32
                     seq_lens: torch.Tensor,  # [N] int32
                     scale: float,
                     window: int | None = None,  # a sliding layer's: only the last `window` positions
                     softcap: float | None = None) -> torch.Tensor:  # [N, heads, head_dim]
    return torch.ops.inferd_cpu.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                                 window or 0, softcap or 0.0)


if __name__ == "__main__":
    try:
        print(build(force="--force" in sys.argv))
    except KernelBuildError as e:
        sys.exit(str(e))
