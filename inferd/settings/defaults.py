"""The settings as TOML, made from their own descriptions: `defaults_toml` (what `inferd config
--defaults` prints: every key at its default, its description above it, loadable as it is) and
`starter_toml` (the shipped inferd.toml: the keys a first run changes, at the defaults, and
pointers). `python -m inferd.settings.docs` writes the starter; tests/settings checks both.
"""

from __future__ import annotations

import json
import textwrap
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from inferd.settings.config import Settings
from inferd.settings.values import format_size

WIDTH = 100

# the keys a first run changes, by table: the shipped inferd.toml sets them, at the defaults
FIRST_RUN: dict[str, tuple[str, ...]] = {
    "model": ("path", "name", "dtype", "device"),
    "server": ("host", "port", "api_keys_file", "admin_key_sha256"),
    "cache": ("kv_cache_memory",),
    "scheduler": ("max_num_seqs", "max_num_batched_tokens"),
    "limits": ("max_tokens_default", "max_tokens_limit"),
}

STARTER_HEAD = """\
# inferd's settings: the keys a first run changes, each at the program's default.
#
# Every other key, with its description, type and default: docs/configuration.md.
# Every key at its default, as a file this one can grow from:  inferd config --defaults
# Precedence: this file, then INFERD_<TABLE>_<KEY> environment variables, then `inferd serve`
# flags (`inferd serve --help`; each flag names the key it sets).
# (Made from the settings' descriptions by `python -m inferd.settings.docs`.)
"""

STARTER_TAIL = """
# Tenants (keys, rate limits, fair shares), priority classes, several models and routes, the
# request file, the output filter: docs/configuration.md, and docs/scheduling.md for tenants.
# [tenants.acme]
# key_sha256 = ["<64 hex characters>"]
# requests_per_second = 5.0
"""


def tables() -> list[tuple[str, str, type[BaseModel], str]]:
    """(heading, field, table class, what the table is) for each table of Settings, in order."""
    out = []
    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        if typing.get_origin(annotation) is dict:
            table = typing.get_args(annotation)[1]
            out.append((f"[{name}.NAME]", name, table, field.description or table.__doc__ or ""))
        else:
            assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
            out.append((f"[{name}]", name, annotation, annotation.__doc__ or ""))
    return out


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # (a JSON string is a TOML basic string)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, BaseModel):
        return toml_value(value.model_dump())
    raise TypeError(f"no TOML form for {value!r}")


def field_value(field: FieldInfo, value: Any) -> str | None:
    """A key's value as TOML, a size as bytes like "64MiB"; None: unset, and TOML has no null."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if value is None:
        return toml_value(extra["unset"]) if "unset" in extra else None
    if extra.get("size") and isinstance(value, (int, float)) and value >= 1 and value == int(value):
        return toml_value(format_size(value))
    return toml_value(value)


def comment(text: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), WIDTH - 2, initial_indent="# ", subsequent_indent="# ")


def _keys(table: type[BaseModel], values: dict[str, Any]) -> list[str]:
    lines = []
    for key, field in table.model_fields.items():
        lines += comment(field.description or "")
        text = field_value(field, values.get(key))
        lines.append(f"{key} = {text}" if text is not None else f"# {key}: unset")
    return lines


def defaults_toml() -> str:
    """Every key at its default, its description as a comment above it; a key unset by default
    (TOML has no null) is a comment that says so."""
    defaults = Settings()
    lines = comment("inferd's settings, every key at its default (`inferd config --defaults`); "
                    "docs/configuration.md describes each.")
    for heading, name, table, doc in tables():
        value = getattr(defaults, name)
        if isinstance(value, dict):
            lines += ["", *comment(doc if doc.startswith(heading) else f"{heading}: {doc}")]
            if not value:
                lines += comment(f"(none by default: keys {', '.join(table.model_fields)})")
            for entry, sub in value.items():
                lines += ["", f"[{name}.{entry}]", *_keys(table, sub.model_dump())]
            continue
        lines += ["", *comment(doc), f"[{name}]", *_keys(table, value.model_dump())]
    return "\n".join(lines) + "\n"


def starter_toml() -> str:
    """The shipped inferd.toml: FIRST_RUN's keys at the defaults, each under its description (an
    unset one as its example, commented out), between pointers to the rest."""
    defaults = Settings()
    lines = [STARTER_HEAD.rstrip("\n")]
    for name, keys in FIRST_RUN.items():
        table = getattr(defaults, name)
        lines += ["", f"[{name}]"]
        for key in keys:
            field = type(table).model_fields[key]
            lines += comment(field.description or "")
            text = field_value(field, getattr(table, key))
            if text is None:
                assert field.examples, f"{name}.{key}: unset by default, so the starter shows its example"
                lines.append(f"# {key} = {toml_value(field.examples[0])}")
            else:
                lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n" + STARTER_TAIL
