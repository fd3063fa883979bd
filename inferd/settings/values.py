"""What every settings table shares: the table base, sizes, text files, key digests, the error."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class Section(BaseModel):
    """A settings table: frozen, unknown keys refused, each key described by the docstring under it
    (its one description: settings/docs.py and defaults.py make the docs page and the TOML files
    from it)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class SettingsError(ValueError):
    """An invalid setting; the message names the key and the allowed values."""


def read_lines(path: str, setting: str) -> list[str]:
    """The lines of a text file a setting names (keys file, blocklist); SettingsError naming the
    setting and the reason when it cannot be read as UTF-8 text."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise SettingsError(f"{setting}: cannot read {path} ({reason})") from None


def parse_memory(value: Any) -> float:
    """Bytes ("2GiB", "512MB", 1073741824) or a fraction of free memory (0 < x <= 1)."""
    if isinstance(value, bool):
        raise ValueError("expected bytes like '2GiB' or a fraction in (0, 1]")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{value!r} is not a size: use bytes like '2GiB' or '512MB', or a fraction in (0, 1]")
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number <= 0:
        raise ValueError("must be positive")
    return number


# a size key's json_schema_extra: the docs and the defaults file write it as bytes like "64MiB";
# AUTO_SIZE's key is also written "auto" where it is unset (its validator reads "auto" as unset)
SIZE: dict[str, Any] = {"size": True}
AUTO_SIZE: dict[str, Any] = {"size": True, "unset": "auto"}


def format_size(number: float) -> str:
    """Bytes as the largest binary unit that holds them whole ("64MiB"), else plain bytes."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if number >= scale and number % scale == 0:
            return f"{int(number // scale)}{unit}"
    return f"{int(number)}B" if number == int(number) else repr(number)


SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")  # a key's digest, as settings and the keys file hold it
DIGEST_HINT = "64 hex characters; make one with `printf %s KEY | sha256sum`"
