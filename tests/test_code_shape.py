"""Code shape: no module over 450 lines, no function or method over 60 lines (inferd/ and bench/),
no C++/CUDA kernel function over 150 lines, no folder with more than 16 modules.

Small modules and short functions are what keep inferd readable (nano-vllm's largest file is ~260
lines; vLLM's 100 KB scheduler is the warning). A justified exception goes in EXCEPTIONS with its
reason; an exception that no longer matches an offender must be removed.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = (REPO / "inferd", REPO / "bench")  # the package, and the benchmarks that measure it
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_KERNEL_FUNCTION_LINES = 150
MAX_FOLDER_MODULES = 16
KERNEL_SOURCES = ("*.cpp", "*.cu", "*.cuh", "*.h")

# A module's repo-relative path ("inferd/engine/sched/scheduler.py"), a function's qualified name
# ("inferd.engine.sched.scheduler.Scheduler.schedule"), a kernel function as "FILE:NAME" or a
# folder's path -> why it may be longer than the limit.
EXCEPTIONS: dict[str, str] = {
    "inferd/kernels/cuda/csrc/paged_attention.cu:paged_decode": (
        "one CUDA kernel whose three phases (q.k, online softmax, p.v) share its shared-memory tiles and "
        "register arrays (q, acc); split into __device__ functions they would pass register arrays by "
        "reference, and the kernel has yet to run on a GPU to show the split costs nothing (the CPU "
        "emulation checks its arithmetic, not its registers): split it with the first device run"),
}


def _modules() -> Iterator[tuple[str, Path]]:
    """Each module as (repo-relative path, file)."""
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), path


def _dotted(relpath: str) -> str:
    return relpath.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _functions(tree: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
    """Each function and method, nested ones included, as (qualified name, lines from def to end)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}.{node.name}"
            assert node.end_lineno is not None
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name)
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}.{node.name}")
        else:
            # NOTE: functions defined under if/try/with blocks still count.
            yield from _functions(node, prefix)


def _long_modules() -> dict[str, int]:
    sizes = {rel: len(path.read_text().splitlines()) for rel, path in _modules()}
    return {rel: n for rel, n in sizes.items() if n > MAX_MODULE_LINES}


def _long_functions() -> dict[str, int]:
    long: dict[str, int] = {}
    for rel, path in _modules():
        tree = ast.parse(path.read_text(), filename=rel)
        long |= {name: n for name, n in _functions(tree, _dotted(rel)) if n > MAX_FUNCTION_LINES}
    return long


def _report(offenders: dict[str, int], limit: int, what: str) -> str:
    lines = [f"{len(offenders)} {what} over {limit} lines (split them, or add to EXCEPTIONS with a reason):"]
    lines += [f"  {n:5d}  {name}" for name, n in sorted(offenders.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def test_no_module_over_the_limit() -> None:
    offenders = {k: n for k, n in _long_modules().items() if k not in EXCEPTIONS}
    if offenders:
        pytest.fail(_report(offenders, MAX_MODULE_LINES, "modules"), pytrace=False)


def test_no_function_over_the_limit() -> None:
    offenders = {k: n for k, n in _long_functions().items() if k not in EXCEPTIONS}
    if offenders:
        pytest.fail(_report(offenders, MAX_FUNCTION_LINES, "functions/methods"), pytrace=False)


def test_every_exception_is_still_needed() -> None:
    offenders = _long_modules() | _long_functions() | _kernel_functions() | _folder_sizes()
    stale = sorted(set(EXCEPTIONS) - set(offenders))
    assert not stale, f"EXCEPTIONS that are within the limits now (remove them): {stale}"


def _kernel_functions() -> dict[str, int]:
    """Each C++/CUDA function in inferd/ as "FILE:NAME" -> lines from its signature to its closing
    brace (a function's body closes with a `}` at the start of a line, as the sources are written)."""
    sizes: dict[str, int] = {}
    for pattern in KERNEL_SOURCES:
        for path in sorted((REPO / "inferd").rglob(pattern)):
            lines = path.read_text().splitlines()
            start: int | None = None
            for i, line in enumerate(lines):
                if start is None and re.match(r"[A-Za-z_]", line) and "(" in line and not line.rstrip().endswith(";") \
                        and not line.startswith(("namespace", "template", "struct", "class", "using")):
                    start = i
                elif start is not None and line.startswith("}"):
                    signature = re.sub(r"__launch_bounds__\([^)]*\)", "", lines[start])
                    name = re.search(r"(\w+)\s*\(", signature)
                    key = f"{path.relative_to(REPO).as_posix()}:{name.group(1) if name else start + 1}"
                    sizes[key] = max(sizes.get(key, 0), i - start + 1)
                    start = None
    return sizes


def _folder_sizes() -> dict[str, int]:
    """Modules (.py files) directly in each folder of inferd/, bench/ and tests/."""
    sizes = {}
    for root in (*ROOTS, REPO / "tests"):
        for folder in [root, *sorted(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            sizes[folder.relative_to(REPO).as_posix()] = len(list(folder.glob("*.py")))
    return sizes


def test_no_kernel_function_over_the_limit() -> None:
    sizes = _kernel_functions()
    assert sizes, "no kernel function found: the scan is broken"
    offenders = {k: n for k, n in sizes.items() if n > MAX_KERNEL_FUNCTION_LINES and k not in EXCEPTIONS}
    if offenders:
        pytest.fail(_report(offenders, MAX_KERNEL_FUNCTION_LINES, "kernel functions"), pytrace=False)
    stale = [k for k in EXCEPTIONS if ":" in k and sizes.get(k, 0) <= MAX_KERNEL_FUNCTION_LINES]
    assert not stale, f"kernel EXCEPTIONS within the limit now (remove them): {stale}"


def test_no_folder_over_the_limit() -> None:
    offenders = {k: n for k, n in _folder_sizes().items() if n > MAX_FOLDER_MODULES and k not in EXCEPTIONS}
    if offenders:
        pytest.fail(_report(offenders, MAX_FOLDER_MODULES, "folders (modules in them)"), pytrace=False)
