"""Every setting described once, and what is made from it: docs/configuration.md (stale: this
fails), `inferd config --defaults` (loads back as the defaults), the `serve` flags (their help is
the key's description), the shipped inferd.toml (short, at the defaults), and every environment
variable the program reads declared in inferd/settings/environment.py."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

from pydantic import BaseModel

from inferd.settings import environment
from inferd.settings.config import Settings, load_settings
from inferd.settings.defaults import starter_toml
from inferd.settings.docs import markdown
from inferd.settings.flags import SERVE_FLAGS

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "configuration.md"
INFERD_TOML = REPO / "inferd.toml"


def _tables() -> list[type[BaseModel]]:
    """Every table class the settings hold, nested ones (a route's rules) included."""
    seen: list[type[BaseModel]] = []

    def visit(annotation: typing.Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in seen:
                seen.append(annotation)
                for field in annotation.model_fields.values():
                    visit(field.annotation)
        for arg in typing.get_args(annotation):
            visit(arg)

    visit(Settings)
    return seen


def test_every_setting_has_a_description() -> None:
    missing = [f"{table.__name__}.{key}" for table in _tables() for key, field in table.model_fields.items()
               if table is not Settings and not (field.description or "").strip()]
    assert not missing, f"settings without a description (a docstring under the field): {missing}"


def test_the_configuration_page_is_generated_and_current() -> None:
    assert DOCS.read_text() == markdown(), "regenerate it (from the repository root): python -m inferd.settings.docs"


def test_config_defaults_prints_every_key_and_loads_back_as_the_defaults(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "inferd.cli", "config", "--defaults"], capture_output=True,
                         text=True, check=True).stdout
    data = tomllib.loads(out)
    defaults = Settings()
    for name in Settings.model_fields:
        value = getattr(defaults, name)
        if isinstance(value, BaseModel):  # a table: each key set, or said to be unset
            for key in type(value).model_fields:
                assert key in data[name] or f"# {key}: unset" in out, f"{name}.{key}"
    path = tmp_path / "defaults.toml"
    path.write_text(out)
    assert load_settings(path, environ={}) == defaults
    # the descriptions are the comments above the keys; sizes and "auto" are written as a user would
    assert "# Port to bind; 0: any free port.\nport = 8000" in out
    assert 'kv_cache_memory = "auto"' in out and 'swap_space = "1GiB"' in out and 'max_bytes = "64MiB"' in out


def test_each_serve_flag_is_named_by_its_key_and_helped_by_its_description() -> None:
    help_text = subprocess.run([sys.executable, "-m", "inferd.cli", "serve", "--help"], capture_output=True,
                               text=True, check=True, env={"COLUMNS": "300", "PATH": ""}).stdout
    for flag in SERVE_FLAGS:
        assert flag.flag in help_text and flag.key in help_text, flag
        assert flag.help.startswith(flag.field.description or "?"), flag
    assert "--no-prefix-caching" in help_text and "--api-key" in help_text and "--config" in help_text


def test_the_shipped_file_is_short_and_at_the_defaults() -> None:
    text = INFERD_TOML.read_text()
    assert text == starter_toml(), "regenerate it (from the repository root): python -m inferd.settings.docs"
    assert len(text.splitlines()) <= 80
    data = tomllib.loads(text)
    assert data, "it sets the keys a first run changes"
    assert load_settings(INFERD_TOML, environ={}) == Settings()  # each key at the program's default
    for table, keys in data.items():
        for key in keys:
            assert f"`{key}`" in DOCS.read_text(), f"{table}.{key}"


def test_every_environment_variable_read_is_declared() -> None:
    declared = {v.name for v in environment.VARIABLES}
    read = set()
    for path in (REPO / "inferd").rglob("*.py"):
        read |= set(re.findall(r"""environ(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]+)["']""", path.read_text()))
        read |= set(re.findall(r"""["']([A-Z][A-Z0-9_]+)["']\s+(?:not\s+)?in\s+os\.environ""", path.read_text()))
    assert not read - declared, f"read but not declared in inferd/settings/environment.py: {read - declared}"
    assert all(v.name in DOCS.read_text() for v in environment.VARIABLES)
