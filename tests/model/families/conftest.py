"""The model families' tests: each family token for token against transformers (family_cases.py is
their harness); tests/model's builders of tiny checkpoints (tiny_models.py) are imported from the
folder above."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def spm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A SentencePiece vocabulary for the GGUF files the tests write: tokens, scores, types, and
    the folder of its tokenizer.model."""
    pytest.importorskip("sentencepiece")
    import tiny_models as tm

    folder = tmp_path_factory.mktemp("spm")
    tm.train_sentencepiece(folder)
    tokens, scores, types = tm.sentencepiece_vocab(folder / "tokenizer.model")
    return {"tokens": tokens, "scores": scores, "types": types, "folder": folder}
