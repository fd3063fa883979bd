"""What the settings' own descriptions make: docs/configuration.md (`markdown`) and the defaults
file `inferd config --defaults` prints (`defaults_toml`: every key at its default, its
description above it, loadable as it is). tests/settings checks both against the code.

    python -m inferd.settings.docs > docs/configuration.md
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from inferd.settings.config import Settings
from inferd.settings.environment import VARIABLES
from inferd.settings.flags import FLAG_OF_KEY

WIDTH = 100
HEADER = """# Configuration

Generated from the settings' own descriptions (inferd/settings/) by `python -m inferd.settings.docs`;
tests/settings/test_docs.py fails when this page is stale. `inferd config --defaults` prints every key
below at its default, as a file `inferd serve --config` reads.

Settings come from the file (`--config`, else ./inferd.toml), then `INFERD_<TABLE>_<KEY>` environment
variables (upper case, lists comma-separated: `INFERD_CACHE_KV_CACHE_MEMORY=4GiB`), then `serve`'s flags.
A size takes bytes like `"2GiB"` or `"512MB"`; unset means the key is left out of the file.
"""


def _tables() -> list[tuple[str, str, type[BaseModel], str]]:
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


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return " \\| ".join(_type(a) for a in args if a is not type(None))
    if origin is tuple:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"table of {_type(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table (" + ", ".join(annotation.model_fields) + ")"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, str(annotation))


def _default(table: type[BaseModel], key: str) -> Any:
    field = table.model_fields[key]
    return field.get_default(call_default_factory=True) if not field.is_required() else ...


def _cell(value: Any) -> str:
    if value is ...:
        return "(required)"
    if value is None:
        return "unset"
    text = toml_value(value)
    return f"`{text}`" if len(text) <= 40 else f"`{text[:37]}...`"


def markdown() -> str:
    lines = [HEADER]
    for heading, name, table, doc in _tables():
        lines += [f"## {heading}", "", " ".join(doc.split()), "", "| key | type | default | description |",
                  "|---|---|---|---|"]
        for key, field in table.model_fields.items():
            flag = FLAG_OF_KEY.get(f"{name}.{key}")
            description = " ".join((field.description or "").split()).replace("|", "\\|")
            if flag:
                description += f" Flag: `serve {flag}`."
            lines.append(f"| `{key}` | {_type(field.annotation)} | {_cell(_default(table, key))} | {description} |")
        lines.append("")
    lines += ["## Environment variables", "", "| variable | unset | what it does |", "|---|---|---|"]
    lines += [f"| `{v.name}` | {v.default} | {v.description} |" for v in VARIABLES]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ defaults as TOML


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


def _comment(text: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), WIDTH - 2, initial_indent="# ", subsequent_indent="# ")


def _keys(table: type[BaseModel], values: dict[str, Any]) -> list[str]:
    lines = []
    for key, field in table.model_fields.items():
        lines += _comment(field.description or "")
        value = values.get(key)
        lines.append(f"{key} = {toml_value(value)}" if value is not None else f"# {key}: unset")
    return lines


def defaults_toml() -> str:
    """Every key at its default, its description as a comment above it; a key unset by default
    (TOML has no null) is a comment that says so."""
    defaults = Settings()
    lines = _comment("inferd's settings, every key at its default (`inferd config --defaults`); "
                     "docs/configuration.md describes each.")
    for heading, name, table, doc in _tables():
        value = getattr(defaults, name)
        if isinstance(value, dict):
            lines += ["", *_comment(f"{heading}: {doc}")]
            if not value:
                lines.append(f"# (none by default: keys {', '.join(table.model_fields)})")
            for entry, sub in value.items():
                lines += ["", f"[{name}.{entry}]", *_keys(table, sub.model_dump())]
            continue
        lines += ["", *_comment(doc), f"[{name}]", *_keys(table, value.model_dump())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
