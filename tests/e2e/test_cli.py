"""`inferd generate` as a user runs it: a real subprocess on the default model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

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


CHAT_SEED = ("generate", "Name a fruit.", "--chat", "--seed", "5", "--max-tokens", "10", "--temperature", "1.0")


@pytest.mark.soak  # two processes; the default tier's twin below runs one, against this process
def test_generate_chat_with_seed_is_reproducible(tmp_path) -> None:
    first = run_inferd(*CHAT_SEED, cwd=str(tmp_path))
    second = run_inferd(*CHAT_SEED, cwd=str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()


def test_generate_chat_with_seed_prints_what_the_seed_samples_in_any_process(tmp_path, served_weights: tuple) -> None:
    """The same sampled tokens from another process: `inferd generate` once, and this process's
    engine on the same chat-templated prompt, seed and temperature (--seed and --chat reach the
    engine, and nothing process-local such as the global RNG decides the tokens)."""
    proc = run_inferd(*CHAT_SEED, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    engine = LLMEngine(*served_weights, EngineConfig.of(kv_cache_memory=16 * 2**20))
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    with torch.random.fork_rng():  # (a global RNG that decided the tokens would differ from the subprocess's)
        torch.manual_seed(1234)
        [expected] = engine.generate([ids], SamplingParams(max_tokens=10, temperature=1.0, seed=5))
    assert proc.stdout == expected.text + "\n" and expected.text.strip()


def test_invalid_flag_value_is_one_line_error(tmp_path) -> None:
    proc = run_inferd("generate", "hi", "--dtype", "fp8", cwd=str(tmp_path))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "model.dtype" in proc.stderr
