"""docs/configuration.md, made from the settings' own descriptions (`markdown`): a section per
table (key, type, default, description, the `serve` flag that sets it) and the environment
variables inferd reads. tests/settings/test_docs.py fails when the page (or inferd.toml, made by
defaults.py) is stale; to write both again, from the repository root:

    python -m inferd.settings.docs
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from inferd.settings.defaults import field_value, starter_toml, tables, toml_value
from inferd.settings.environment import VARIABLES
from inferd.settings.flags import FLAG_OF_KEY

HEADER = """# Configuration

Generated from the settings' own descriptions (inferd/settings/) by `python -m inferd.settings.docs`
(which also writes the shipped inferd.toml); tests/settings/test_docs.py fails when this page is stale.
`inferd config --defaults` prints every key below at its default, as a file `inferd serve --config` reads.

Settings come from the file (`--config`, else ./inferd.toml), then `INFERD_<TABLE>_<KEY>` environment
variables (upper case, lists comma-separated: `INFERD_CACHE_KV_CACHE_MEMORY=4GiB`), then `serve`'s flags.
A size takes bytes like `"2GiB"` or `"512MB"`; unset means the key is left out of the file.
"""


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


def _field_type(field: FieldInfo) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("size"):
        return "size" + (f" \\| {json.dumps(extra['unset'])}" if "unset" in extra else "")
    return _type(field.annotation)


def _cell(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    text = field_value(field, field.get_default(call_default_factory=True))
    if text is None:
        return "unset"
    return f"`{text}`" if len(text) <= 40 else f"`{text[:37]}...`"


def _description(field: FieldInfo, flag: str | None) -> str:
    text = " ".join((field.description or "").split())
    if field.examples:
        text += f" E.g. `{toml_value(field.examples[0])}`."
    if flag:
        text += f" Flag: `serve {flag}`."
    return text.replace("|", "\\|")


def markdown() -> str:
    lines = [HEADER]
    for heading, name, table, doc in tables():
        lines += [f"## {heading}", "", " ".join(doc.split()), "", "| key | type | default | description |",
                  "|---|---|---|---|"]
        for key, field in table.model_fields.items():
            description = _description(field, FLAG_OF_KEY.get(f"{name}.{key}"))
            lines.append(f"| `{key}` | {_field_type(field)} | {_cell(field)} | {description} |")
        lines.append("")
    lines += ["## Environment variables", "", "| variable | unset | what it does |", "|---|---|---|"]
    lines += [f"| `{v.name}` | {v.default} | {v.description} |" for v in VARIABLES]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Write docs/configuration.md and inferd.toml (run from the repository root)."""
    for path, text in ((Path("docs/configuration.md"), markdown()), (Path("inferd.toml"), starter_toml())):
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
