"""`inferd generate` as a user runs it: a real subprocess on the default model."""

from __future__ import annotations

import subprocess
import sys

from inferd.engine.config import EngineConfig
from inferd.engine.llm_engine import LLMEngine
from inferd.text.sampling_params import SamplingParams


def run_inferd(*args: str, cwd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferd.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_generate_prints_the_greedy_completion(tmp_path, served_weights: tuple) -> None:
    prompt = "The three primary colors are"
    proc = run_inferd("generate", prompt, "--temperature", "0", "--max-tokens", "12", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    engine = LLMEngine(*served_weights, EngineConfig.of(kv_cache_memory=16 * 2**20))
    [expected] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    assert proc.stdout == expected.text + "\n"
    assert "tokens in" in proc.stderr and "model loaded in" in proc.stderr


def test_generate_chat_with_seed_is_reproducible(tmp_path) -> None:
    args = ("generate", "Name a fruit.", "--chat", "--seed", "5", "--max-tokens", "10", "--temperature", "1.0")
    first = run_inferd(*args, cwd=str(tmp_path))
    second = run_inferd(*args, cwd=str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()


def test_invalid_flag_value_is_one_line_error(tmp_path) -> None:
    proc = run_inferd("generate", "hi", "--dtype", "fp8", cwd=str(tmp_path))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "model.dtype" in proc.stderr
