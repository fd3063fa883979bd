"""Settings: inferd.toml, then INFERD_* environment variables, then command-line flags.

Everything is validated here, once; an invalid value names its key and what is allowed.
Environment variables are `INFERD_<SECTION>_<KEY>` in upper case, e.g. `INFERD_MODEL_DTYPE`.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from inferd.engine.llm_engine import EngineConfig

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class SettingsError(ValueError):
    """An invalid setting; the message names the key and the allowed values."""


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


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSettings(_Section):
    path: str | None = None  # GGUF file or Hugging Face folder; None: the embedded SmolLM2
    name: str | None = None  # the name clients use; None: derived from the path
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(default=None, ge=16)


class CacheSettings(_Section):
    block_size: int = Field(default=16, ge=1, le=128)
    kv_cache_memory: float = 2 * 2**30

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two in [1, 128]")
        return value

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> float:
        return parse_memory(value)


class SchedulerSettings(_Section):
    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=512, ge=16, le=1 << 20)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    # SHA-256 hex digests of the accepted API keys, one per line ('#' comments allowed); keys
    # also come from --api-key and INFERD_API_KEYS (comma-separated, in the clear)
    api_keys_file: str | None = None
    open_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")  # served without a key
    keepalive_seconds: float = Field(default=10.0, gt=0, le=300)  # SSE comment while queued


class LimitSettings(_Section):
    max_tokens_default: int = Field(default=256, ge=1)  # when a request names no max_tokens
    max_tokens_limit: int = Field(default=4096, ge=1)  # a request asking more gets a 400
    max_n: int = Field(default=8, ge=1, le=128)  # choices per request
    max_prompts: int = Field(default=64, ge=1)  # prompts in one batched /v1/completions request


class RuntimeSettings(_Section):
    threads: int = Field(default=0, ge=0, le=1024)  # torch CPU threads; 0: one per core


class Settings(_Section):
    server: ServerSettings = ServerSettings()
    limits: LimitSettings = LimitSettings()
    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    runtime: RuntimeSettings = RuntimeSettings()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model.path,
            dtype=self.model.dtype,
            device=self.model.device,
            block_size=self.cache.block_size,
            kv_cache_memory=self.cache.kv_cache_memory,
            max_num_seqs=self.scheduler.max_num_seqs,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            max_model_len=self.model.max_model_len,
        )


def load_settings(
    path: str | Path | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Merge the TOML file, the environment and the overrides (flags), then validate once."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise SettingsError(f"{path}: cannot read the settings file ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"{path}: invalid TOML ({e})") from None
    environ = os.environ if environ is None else environ
    for section, fields in Settings.model_fields.items():
        for key, field in fields.annotation.model_fields.items():  # type: ignore[union-attr]
            value = environ.get(f"INFERD_{section}_{key}".upper())
            if value is not None:
                is_list = getattr(field.annotation, "__origin__", None) is tuple
                data.setdefault(section, {})[key] = [v.strip() for v in value.split(",") if v.strip()] if is_list else value
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            if value is not None:
                data.setdefault(section, {})[key] = value
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise SettingsError("; ".join(_describe(err) for err in e.errors())) from None


def _describe(err: Any) -> str:
    key = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown setting {key!r}"
    return f"invalid setting {key} = {err.get('input')!r}: {err['msg']}"
