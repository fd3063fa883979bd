"""Code shape: no module over 450 lines, no function or method over 60 lines.

Small modules and short functions are what keep inferd readable (nano-vllm's largest file is ~260
lines; vLLM's 100 KB scheduler is the warning). A justified exception goes in EXCEPTIONS with its
reason; an exception that no longer matches an offender must be removed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "inferd"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60

# A module's repo-relative path ("inferd/engine/sched/scheduler.py") or a function's qualified name
# ("inferd.engine.sched.scheduler.Scheduler.schedule") -> why it may be longer than the limit.
EXCEPTIONS: dict[str, str] = {}


def _modules() -> Iterator[tuple[str, Path]]:
    """Each module as (repo-relative path, file)."""
    for path in sorted(PACKAGE.rglob("*.py")):
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
    offenders = _long_modules() | _long_functions()
    stale = sorted(set(EXCEPTIONS) - set(offenders))
    assert not stale, f"EXCEPTIONS that are within the limits now (remove them): {stale}"
