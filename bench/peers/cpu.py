"""CPU accounting around each run: the machine's busy time less the server's, the driver's and this
script's, so a run disturbed by other processes is seen (and repeated)."""

from __future__ import annotations

import contextlib
import os
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
