"""What every test folder shares: the default model's weights, loaded once a session, two ways.

- `served_weights`: what `inferd serve` runs by default on the CPU (bfloat16, packed weights,
  batch-invariant): the tests of the server, the engine and the protocols run this path, the
  one operators get, at 2-4x float32's speed.
- `float32_weights`: the reference path, for what is compared with transformers token for
  token (bfloat16 is not token-exact against float32).
- `default_gguf_head`: the default model file's path and where its tensor data starts (the
  load-error and fuzzing tests cut or mutate its header).

An engine over them is `LLMEngine(*served_weights, config)`: engines of one dtype may share one
model (their attention backend and batch-invariant mode are the same), so each test keeps its own
config, KV cache and scheduler without loading the file again (~2 s a load).
"""

from __future__ import annotations

from typing import Any

import pytest

import inferd  # noqa: F401  (first: caps oneDNN's ISA before any product, see inferd/__init__.py)


@pytest.fixture(scope="session")
def float32_weights() -> tuple[Any, Any]:
    """(DecoderModel, Tokenizer) of the embedded default model in float32."""
    from inferd.engine.builder import load_model
    from inferd.engine.config import EngineConfig

    return load_model(EngineConfig.of(dtype="float32"))


@pytest.fixture(scope="session")
def served_weights() -> tuple[Any, Any]:
    """(DecoderModel, Tokenizer) of the embedded default model as served by default."""
    from inferd.engine.builder import load_model
    from inferd.engine.config import EngineConfig

    return load_model(EngineConfig())


@pytest.fixture(scope="session")
def default_gguf_head() -> tuple[Any, int]:
    """(path, the offset where the tensor data starts) of the embedded default GGUF; skips where
    the model is not installed."""
    from inferd.model.loading.loader import default_model_path
    from inferd.text.errors import ModelLoadError
    from inferd.text.gguf_file import GGUFFile

    try:
        path = default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    gguf_file = GGUFFile(path)
    data_start = min(t.data_offset for t in gguf_file.tensors.values())
    gguf_file.close()
    return path, data_start


@pytest.fixture(scope="session")
def transformers_gguf() -> Any:
    """`load(factory, path)`: `factory.from_pretrained(folder, gguf_file=name, ...)` of transformers,
    the reference, with two of gguf-py's pure lookups memoized while it loads: transformers parses
    the file once for the config and again for the weights (or the tokenizer), and builds the same
    tensor-name map once per submodule (397 times for the default model): 38 s a load here, 12 s so."""
    import functools
    from pathlib import Path

    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    reader = functools.cache(real_reader)  # (read-only: the file is mapped, never written)
    name_map = functools.cache(real_map)

    def load(factory: Any, path: Path, **kwargs: Any) -> Any:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        try:
            return factory.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map

    return load
