"""Building a `Tokenizer` from a GGUF file's metadata or a Hugging Face-style model folder.

Sources `load_tokenizer` understands:

    GGUF, tokenizer.ggml.model == "gpt2"   byte-level BPE rebuilt from the vocab + merges;
                                           `tokenizer.ggml.pre` picks the split regex
    GGUF, tokenizer.ggml.model == "llama"  SentencePiece BPE rebuilt from tokens, scores, types
    folder with tokenizer.json             `tokenizers.Tokenizer.from_file`
    folder with tokenizer.model only       SentencePiece
    (folders: BOS / EOS / chat template from tokenizer_config.json, special_tokens_map.json,
     generation_config.json, config.json and chat_template.jinja)

Everything here runs once, at load time: tokenizer_gguf.py and tokenizer_folder.py build them; the
run-time classes live in `inferd.text.tokenizer`.
"""

from __future__ import annotations

from pathlib import Path

from inferd.text.errors import ModelLoadError
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_folder import from_folder
from inferd.text.tokenizer_gguf import from_gguf


def load_tokenizer(path: str | Path, gguf_metadata: dict | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file or a Hugging Face-style model folder.

    `gguf_metadata`: the GGUF's metadata when the caller has already read it (saves a second open).
    """
    path = Path(path)
    if gguf_metadata is not None or path.is_file():
        if gguf_metadata is None:
            from inferd.text.gguf_file import GGUFFile

            gguf = GGUFFile(path)
            gguf_metadata = gguf.metadata
            gguf.close()
        return from_gguf(gguf_metadata, str(path))
    if path.is_dir():
        return from_folder(path)
    raise ModelLoadError(f"{path}: no such file or folder")

