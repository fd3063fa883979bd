"""Runs inferd's CUDA kernel sources on the CPU, for machines without a GPU (tests only).

The sources in inferd/kernels/cuda/csrc are compiled by g++ against `emu/` (cuda_fp16.h, cuda_bf16.h,
cuda_fp8.h and cuda_emu.h, a model of CUDA's threads: one fiber per CUDA thread, barriers for
__syncthreads and for warp shuffles, float arithmetic flushing subnormals as CuPy's -ftz=true
makes it) into a shared library. `install(monkeypatch)` then makes
`inferd.kernels.cuda.launch` launch through it instead of CuPy, so its host code (argument packing,
grids, partition layout, workspace) runs unchanged and the kernels' code runs for real, on CPU
tensors. What it cannot show: speed, and anything about the GPU's memory model beyond the
barriers the kernels use.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

from inferd.kernels.cuda import launch as cuda

EMU = Path(__file__).parent / "emu"


def compiler() -> str | None:
    return shutil.which("g++")


def build(names: list[str], cache_dir: Path) -> ctypes.CDLL:
    """A library that can launch each kernel specialization in `names` (CuPy name expressions)."""
    driver = [*(f'#include "{source}"' for source in cuda.SOURCES), "#include <string.h>", "#include <utility>",
              "",
              "template <typename... A, size_t... I>",
              "void run(void (*k)(A...), dim3 g, dim3 b, void** p, std::index_sequence<I...>) {",
              "    emu::launch(g, b, k, *static_cast<A*>(p[I])...);",
              "}",
              "template <typename... A> void run(void (*k)(A...), dim3 g, dim3 b, void** p) {",
              "    run(k, g, b, p, std::index_sequence_for<A...>{});",
              "}",
              'extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, void** params) {',
              "    const dim3 g{gx, gy, gz}, b{bx, 1, 1};"]
    for name in names:
        driver.append(f'    if (!strcmp(name, "{name}")) {{ run(&{name}, g, b, params); return 0; }}')
    driver += ["    return 1;", "}"]
    source = "\n".join(driver) + "\n"
    inputs = source + "".join((d / f).read_text() for d in (EMU, cuda.CSRC) for f in sorted(p.name for p in d.iterdir())
                              if f.endswith((".h", ".cuh", ".cu")))
    key = hashlib.sha256(inputs.encode()).hexdigest()[:16]
    library = cache_dir / f"kernels-{key}.so"
    if not library.exists():
        unit = cache_dir / f"driver-{key}.cpp"
        unit.write_text(source)
        subprocess.run(
            [compiler() or "g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-x", "c++",
             "-include", str(EMU / "cuda_emu.h"), f"-I{EMU}", f"-I{cuda.CSRC}", str(unit), "-o", str(library)],
            check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(library))


_CTYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}


class EmulatedKernel:
    def __init__(self, library: ctypes.CDLL, name: str) -> None:
        self.library = library
        self.name = name

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:
        values = [_CTYPES[type(a)](a) for a in args]  # kept alive through the call
        params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        gx, gy, gz = (*grid, 1, 1)[:3]
        if self.library.emu_launch(self.name.encode(), gx, gy, gz, block[0], params):
            raise KeyError(f"{self.name} is not in the emulated library")


def install(monkeypatch, library: ctypes.CDLL, num_sms: int = 132) -> None:
    """Make inferd.kernels.cuda launch on the CPU emulation (an H200's SM count by default)."""
    monkeypatch.setattr(cuda, "_kernel", lambda file, name, device_index: EmulatedKernel(library, name))
    monkeypatch.setattr(cuda, "_launch", lambda kernel, device, grid, args: kernel(grid, (cuda.THREADS,), args))
    monkeypatch.setattr(cuda, "num_sms", lambda device_index: num_sms)
