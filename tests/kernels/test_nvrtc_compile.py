"""Every CUDA kernel source compiles for Ampere (sm_80) and Hopper (sm_90) through NVRTC, the
compiler CuPy uses at run time, on any machine: the nvidia-cuda-nvrtc and nvidia-cuda-runtime
wheels bring the compiler and the fp16/bf16/fp8 headers, no GPU needed. NVRTC is stricter than
nvcc (no implicit host headers), so this is the check that a kernel will build where it runs.

The specializations are launch.covering_specializations(): every code path, the 8-bit KV cache's
included (kv_quant.py: the write's conversion from cuda_fp8.h, the decode's exact widening). The
default tier compiles every specialization to PTX for the virtual compute_80 (the front end,
where NVRTC's strictness bites, in a fifth of the time); the soak tier builds the machine code
(CUBIN) for both real architectures, which adds register allocation and ptxas' own checks.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util

import pytest
import torch

from inferd.kernels.cuda import launch as cuda


def nvrtc_or_skip():
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("needs CuPy (the dev extra installs cupy-cuda13x)")
    from cupy.cuda import nvrtc

    try:
        nvrtc.getVersion()
    except Exception as e:  # the library itself is missing
        pytest.skip(f"NVRTC is not loadable: {e}")
    return nvrtc


TARGETS = [pytest.param(("sm_80", "sm_90"), marks=pytest.mark.soak, id="cubin"), pytest.param(("compute_80",), id="ptx")]


@pytest.mark.parametrize("archs", TARGETS)
@pytest.mark.parametrize("file", cuda.SOURCES)
def test_every_kernel_compiles_with_nvrtc(file: str, archs: tuple[str, ...]) -> None:
    """For each architecture at once (NVRTC runs without the GIL: the compiles share the cores)."""
    nvrtc = nvrtc_or_skip()
    names = cuda.covering_specializations()[file]

    def compile_for(arch: str) -> str | None:
        """None, or why the file does not build for `arch`."""
        program = nvrtc.createProgram(cuda.source(file), file, [], [])
        try:
            for name in names:
                nvrtc.addNameExpression(program, name)
            try:
                nvrtc.compileProgram(program, [*cuda.compile_options(), f"--gpu-architecture={arch}"])
            except nvrtc.NVRTCError:
                return f"{file} does not compile for {arch}:\n{nvrtc.getProgramLog(program)}"
            log = nvrtc.getProgramLog(program).strip()
            assert "warning" not in log.lower(), (arch, log)
            code = nvrtc.getPTX(program) if arch.startswith("compute_") else nvrtc.getCUBIN(program)
            assert len(code) > 0, arch
            for name in names:  # each specialization was instantiated, under its own mangled name
                assert nvrtc.getLoweredName(program, name).startswith("_Z"), (arch, name)
            return None
        finally:
            nvrtc.destroyProgram(program)

    with concurrent.futures.ThreadPoolExecutor(len(archs)) as pool:
        failures = [f for f in pool.map(compile_for, archs) if f is not None]
    if failures:
        pytest.fail("\n".join(failures))


def test_the_8bit_cache_variants_are_covered() -> None:
    """Both 8-bit formats, for the write (every dtype) and for decode, are among what compiles."""
    names = cuda.covering_specializations()
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        assert {cuda.cache_kernel_name(dt, fmt) for dt in cuda.DTYPES} <= set(names["reshape_and_cache.cu"])
        assert {cuda.decode_kernel_name(dt, 128, 16, 4, fmt) for dt in cuda.DTYPES} <= set(names["paged_attention.cu"])
    assert cuda.decode_kernel_name(torch.bfloat16, 64, 16, 3) == "paged_decode<__nv_bfloat16, 64, 16, 3, 0>"


def test_a_broken_kernel_fails_to_compile() -> None:
    """The check can fail: NVRTC has no host headers, so INFINITY (from math.h) is undefined."""
    nvrtc = nvrtc_or_skip()
    broken = '#include "common.cuh"\n__global__ void k(float* x) { x[0] = INFINITY; }\n'
    program = nvrtc.createProgram(broken, "broken.cu", [], [])
    try:
        with pytest.raises(nvrtc.NVRTCError):
            nvrtc.compileProgram(program, [*cuda.compile_options(), "--gpu-architecture=sm_90"])
        assert "INFINITY" in nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
