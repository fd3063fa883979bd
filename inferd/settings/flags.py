"""The settings promoted to `inferd serve` flags: one row each, the flag's name beside the key it
sets. cli.py makes the options from these rows (type and help from the key's own field), and
`overrides` turns what was given into the settings' overrides; docs/configuration.md shows the
flag beside its key. A flag not given (None) leaves the file's or the environment's value.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic.fields import FieldInfo

from inferd.settings.config import Settings


@dataclass(frozen=True)
class Flag:
    flag: str  # "--kv-cache-memory"
    key: str  # "cache.kv_cache_memory": [table] key
    kind: type | None = None  # the option's type when not the key's own (sizes are written "2GiB")

    @property
    def param(self) -> str:
        """The option's Python parameter name."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def field(self) -> FieldInfo:
        table, key = self.key.split(".")
        return Settings.model_fields[table].annotation.model_fields[key]  # type: ignore[union-attr]

    @property
    def type(self) -> type:
        if self.kind is not None:
            return self.kind
        annotation = self.field.annotation
        return next((t for t in (bool, int, float) if annotation in (t, t | None)), str)

    @property
    def help(self) -> str:
        """The key's description, then its allowed values (a choice of words) and the key."""
        choices = [str(c) for c in typing.get_args(self.field.annotation) if c is not None]
        if typing.get_origin(self.field.annotation) is not Literal or len(choices) < 2:
            return f"{self.field.description} (settings: {self.key})"
        words = ", ".join(choices[:-1]) + f" or {choices[-1]}"
        return f"{self.field.description} ({words}; settings: {self.key})"


SERVE_FLAGS = (
    Flag("--model", "model.path"),
    Flag("--served-model-name", "model.name"),
    Flag("--host", "server.host"),
    Flag("--port", "server.port"),
    Flag("--dtype", "model.dtype"),
    Flag("--device", "model.device"),
    Flag("--kv-cache-memory", "cache.kv_cache_memory", str),
    Flag("--kv-cache-dtype", "cache.kv_cache_dtype"),
    Flag("--block-size", "cache.block_size"),
    Flag("--max-num-seqs", "scheduler.max_num_seqs"),
    Flag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens"),
    Flag("--max-model-len", "model.max_model_len"),
    Flag("--log-format", "server.log_format"),
    Flag("--drain-seconds", "server.drain_seconds"),
    Flag("--probe-interval", "server.probe_interval_seconds"),
    Flag("--preemption-mode", "scheduler.preemption_mode"),
    Flag("--prefix-caching", "cache.prefix_caching"),
    Flag("--threads", "runtime.threads"),
    Flag("--deterministic", "model.deterministic"),
    Flag("--weights", "model.weights"),
    Flag("--task", "model.task"),
    Flag("--pooling", "model.pooling"),
    Flag("--speculative", "speculative.method"),
)

FLAG_OF_KEY = {f.key: f.flag for f in SERVE_FLAGS}


def overrides(given: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The settings' overrides from the flags' values by parameter name (None: not given)."""
    out: dict[str, dict[str, Any]] = {}
    for f in SERVE_FLAGS:
        value = given.get(f.param)
        if value is not None:
            table, key = f.key.split(".")
            out.setdefault(table, {})[key] = value
    return out
