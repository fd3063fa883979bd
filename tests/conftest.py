"""What every test folder shares: the default model's float32 weights, loaded once a session.

An engine over them is `LLMEngine(*float32_weights, config)`: float32 engines may share one model
(their attention backend and batch-invariant mode are the same), so each test keeps its own
config, KV cache and scheduler without loading the file again (~2 s a load).
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def float32_weights() -> tuple[Any, Any]:
    """(LlamaModel, Tokenizer) of the embedded default model in float32."""
    from inferd.engine.builder import load_model
    from inferd.engine.config import EngineConfig

    return load_model(EngineConfig(dtype="float32"))
