"""Building the CPU kernels: once per machine, with the system's g++ against the installed torch,
into a cache folder keyed by the sources, the flags, the torch version and the CPU's instruction
sets (-march=native: the library fits only this kind of CPU). `make` builds ahead
(`python -m inferd.kernels.cpu`); a server that finds no library builds it at start-up (~40 s on
2 cores).

    INFERD_KERNEL_DIR   where the libraries are kept (default ~/.cache/inferd/kernels)
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from inferd.settings import environment

CSRC = Path(__file__).parent / "csrc"
# the kernels, then bindings.cpp (their registration as torch ops), compiled side by side and linked
SOURCES = [CSRC / name for name in ("cpu_attention.cpp", "cpu_prefill_attention.cpp", "cpu_matmul.cpp",
                                    "cpu_matmul_tiles.cpp", "cpu_layer_ops.cpp", "cpu_linear_attention.cpp",
                                    "bindings.cpp")]
HEADERS = [CSRC / "cpu_simd.h", CSRC / "cpu_kv8.h", CSRC / "cpu_blocks.h", CSRC / "cpu_ops.h"]
# Reassociation (-fassociative-math and what it needs): vectorized sums, in a fixed order all the
# same (one compiled loop). NOT -ffast-math: linking with it sets flush-to-zero for the whole
# process (crtfastmath), which changes torch's arithmetic and breaks hypothesis (tests/kernels).
# -fopenmp: ATen's parallel_for is inlined OpenMP; it binds to the libgomp.so.1 that torch ships
# and has loaded already (same soname), so the kernel runs on torch's threads.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
         "-fopenmp", "-std=c++17", "-fPIC"]


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
    return environment.kernel_dir() / f"inferd_cpu_{key.hexdigest()[:16]}.so"


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
    compiler = shutil.which(environment.CXX.get() or "g++")
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
