"""The start-up line `inferd serve` logs once a model is served, written and read in one place:
tests, bench scripts and deploy scripts that start a server find its address (and what it
loaded) here rather than with regexes of their own.

    inferd serving smollm2 (llama, 30 layers) dtype=bfloat16 device=cpu kv_blocks=1170 x 16 tokens,
        max_model_len=8192, api_keys=0 on http://127.0.0.1:8000   (one line)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(
    r"inferd serving (?P<name>\S+) \((?P<architecture>[^,]+), (?P<layers>\d+) layers\) dtype=(?P<dtype>\S+) "
    r"device=(?P<device>\S+) kv_blocks=(?P<kv_blocks>\d+) x (?P<block_size>\d+) tokens, "
    r"max_model_len=(?P<max_model_len>\d+), api_keys=(?P<api_keys>\d+) on (?P<url>http://[\w.\[\]:-]+:\d+)")


@dataclass(frozen=True)
class StartupLine:
    """One served model's start-up line: its served name (or `name@revision` with several models)."""

    name: str
    architecture: str
    layers: int
    dtype: str
    device: str
    kv_blocks: int
    block_size: int
    max_model_len: int
    api_keys: int
    url: str  # http://HOST:PORT

    def format(self) -> str:
        return (f"inferd serving {self.name} ({self.architecture}, {self.layers} layers) dtype={self.dtype} "
                f"device={self.device} kv_blocks={self.kv_blocks} x {self.block_size} tokens, "
                f"max_model_len={self.max_model_len}, api_keys={self.api_keys} on {self.url}")

    @classmethod
    def parse(cls, text: str) -> StartupLine | None:
        """The first start-up line in `text` (a log, or one line of it); None if there is none."""
        found = cls.parse_all(text)
        return found[0] if found else None

    @classmethod
    def parse_all(cls, text: str) -> list[StartupLine]:
        """Every start-up line in `text`, in order (one per served model)."""
        lines = []
        for m in _LINE.finditer(text):
            g = m.groupdict()
            lines.append(cls(g["name"], g["architecture"], int(g["layers"]), g["dtype"], g["device"],
                             int(g["kv_blocks"]), int(g["block_size"]), int(g["max_model_len"]),
                             int(g["api_keys"]), g["url"]))
        return lines


if __name__ == "__main__":  # `python -m inferd.api.startup LOG`: the first server's URL, for shell scripts
    import sys
    from pathlib import Path

    found = StartupLine.parse(Path(sys.argv[1]).read_text(errors="replace"))
    sys.exit(print(found.url) if found else 1)
