"""The start-up line `inferd serve` logs: what the server writes, the tests and bench scripts read back."""

from __future__ import annotations

from inferd.api.startup import StartupLine

LINE = StartupLine("smollm2", "llama", 30, "bfloat16", "cpu", 1170, 16, 8192, 2, "http://127.0.0.1:41234")


def test_a_written_line_reads_back_as_written() -> None:
    text = f"2026-12-04 INFO inferd.api.server {LINE.format()}\nother lines\n"
    assert StartupLine.parse(text) == LINE
    assert "kv_blocks=1170 x 16 tokens" in LINE.format()  # (the field operators grep for)


def test_one_line_per_model_and_none_without_one() -> None:
    second = StartupLine("tiny@r2", "qwen3", 2, "float32", "cpu", 64, 16, 2048, 0, "http://[::1]:8000")
    assert StartupLine.parse_all(f"{LINE.format()}\n{second.format()}\n") == [LINE, second]
    assert StartupLine.parse("inferd: loading the model") is None
