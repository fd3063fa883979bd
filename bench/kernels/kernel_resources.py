"""Registers, shared memory and spills of every kernel specialization CI compiles, as ptxas
reports them (`nvcc -Xptxas -v`). Needs nvcc; no GPU.

    python bench/kernels/kernel_resources.py [--arch sm_90] [--out FILE.md]

Spills or a register count that caps occupancy are what to look at before a GPU run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inferd.kernels.cuda import launch as cuda  # noqa: E402

ENTRY = re.compile(r"Compiling entry function '(\S+)' for")
USAGE = re.compile(r"Used (\d+) registers.*?(\d+) bytes smem")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def report(arch: str) -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc is not on PATH")
    rows: list[str] = []
    for file, names in cuda.covering_specializations().items():
        with tempfile.TemporaryDirectory() as tmp:
            unit = Path(tmp) / "unit.cu"
            # taking each specialization's address instantiates it for the device
            refs = ", ".join(f"(void*)&{name}" for name in names)
            unit.write_text(f'#include "{file}"\nvoid* inferd_refs[] = {{{refs}}};\n')
            proc = subprocess.run(
                [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", f"-I{cuda.CSRC}", str(unit),
                 "-o", str(Path(tmp) / "unit.cubin")],
                capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr)
        lowered = {_mangled_key(n): n for n in names}
        current = None
        spills = (0, 0)
        for line in proc.stderr.splitlines():
            if m := ENTRY.search(line):
                current = m.group(1)
            elif m := SPILLS.search(line):
                spills = (int(m.group(1)), int(m.group(2)))
            elif (m := USAGE.search(line)) and current:
                name = lowered.get(_demangled_key(current), current)
                rows.append(f"| `{name}` | {m.group(1)} | {m.group(2)} | {spills[0]} / {spills[1]} |")
                current = None
    header = [f"ptxas resource usage, {arch} (nvcc -Xptxas -v):", "",
              "| kernel | registers | static smem (bytes) | spill stores / loads (bytes) |",
              "| --- | ---: | ---: | ---: |"]
    return "\n".join(header + sorted(rows)) + "\n"


def _mangled_key(name: str) -> str:
    """'paged_decode<__half, 128, 16, 4>' -> ('paged_decode', '__half', '128', '16', '4') as text."""
    return re.sub(r"[^A-Za-z0-9_]+", " ", name).strip()


def _demangled_key(mangled: str) -> str:
    # _Z12paged_decodeI6__halfLi128ELi16ELi4EEv... -> 'paged_decode __half 128 16 4'
    m = re.match(r"_Z\d+(\w+?)I(.*?)EEv", mangled)
    if not m:
        return mangled
    name, args = m.group(1), m.group(2)
    types = {"f": "float", "6__half": "__half", "13__nv_bfloat16": "__nv_bfloat16"}
    parts = []
    for token in re.findall(r"Li(\d+)|(13__nv_bfloat16|6__half|f)", args):
        parts.append(token[0] or types[token[1]])
    return " ".join([name, *parts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = report(args.arch)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
