"""Settings: inferd.toml, then INFERD_* environment variables, then command-line flags.

The tables live in engine.py ([model], [cache], [scheduler], ...), server.py ([server],
[tenants.NAME], ...) and models.py ([models.NAME], [routes.NAME]); each key's docstring is its
one description, from which docs.py writes docs/configuration.md and `inferd config --defaults`.

Everything is validated here, once; an invalid value names its key and what is allowed.
Environment variables are `INFERD_<SECTION>_<KEY>` in upper case, e.g. `INFERD_MODEL_DTYPE`.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from inferd.settings.engine import (BUILTIN_CLASSES, CacheSettings, ClassSettings, HealthSettings, LimitSettings,
                                    ModelSettings, RuntimeSettings, SchedulerSettings, SheddingSettings,
                                    SpeculativeSettings)
from inferd.settings.fleet import KVEventsSettings
from inferd.settings.models import DegradationSettings, ModelTable, RouteTable, check_models
from inferd.settings.policy import SchedulingPolicy, ShedConfig
from inferd.settings.server import (OutputFilterSettings, RequestLogSettings, ResponsesSettings, ServerSettings,
                                    TenantSettings)
from inferd.settings.values import Section, SettingsError

__all__ = ["CacheSettings", "ClassSettings", "HealthSettings", "LimitSettings", "ModelSettings", "OutputFilterSettings",
           "RequestLogSettings", "ResponsesSettings", "RuntimeSettings", "SchedulerSettings", "ServerSettings",
           "Settings", "SheddingSettings", "SpeculativeSettings", "TenantSettings", "load_settings"]

_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

class Settings(Section):
    """Every setting: inferd.toml's tables, in the order docs/configuration.md lists them."""

    server: ServerSettings = ServerSettings()
    limits: LimitSettings = LimitSettings()
    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()
    shedding: SheddingSettings = SheddingSettings()
    classes: dict[str, ClassSettings] = Field(
        default_factory=lambda: {name: ClassSettings(**t) for name, t in BUILTIN_CLASSES.items()})
    """[classes.NAME] tables replace the built-in classes (interactive, batch); a table named like a
    built-in class starts from that class's values."""
    health: HealthSettings = HealthSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    output_filter: OutputFilterSettings = OutputFilterSettings()
    request_log: RequestLogSettings = RequestLogSettings()
    responses: ResponsesSettings = ResponsesSettings()
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    """[tenants.NAME] tables: who may call, at what rate, with what share (api/gateway/tenants.py)."""
    models: dict[str, ModelTable] = Field(default_factory=dict)
    """[models.NAME] tables: several models in one process (settings/models.py); none: the one
    model of [model]."""
    routes: dict[str, RouteTable] = Field(default_factory=dict)
    """[routes.NAME] tables: names that split or cascade between models."""
    degradation: DegradationSettings = DegradationSettings()
    kv_events: KVEventsSettings = KVEventsSettings()

    @field_validator("classes", mode="before")
    @classmethod
    def _start_from_builtins(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        if not value:
            raise ValueError("at least one class is needed")
        return {name: {**BUILTIN_CLASSES.get(name, {}), **table} if isinstance(table, dict) else table
                for name, table in value.items()}

    @model_validator(mode="after")
    def _valid_policy(self) -> Settings:
        self.policy()  # raises ValueError naming what is wrong (duplicate priority, default_class)
        self._check_tenants()
        check_models(self.models, self.routes, set(self.classes))
        unknown = [c for c in self.degradation.classes if c not in self.classes]
        if unknown:
            raise ValueError(f"degradation.classes: unknown classes {unknown}; the classes are {list(self.classes)}")
        return self

    def _check_tenants(self) -> None:
        owners: dict[str, str] = {d: "the admin keys" for d in self.server.admin_key_sha256}
        for name, tenant in self.tenants.items():
            if not _TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: letters, digits, '_', '.', '-', at most 64")
            named = [*(tenant.classes or ()), *([tenant.default_class] if tenant.default_class else [])]
            unknown = [c for c in named if c not in self.classes]
            if unknown:
                raise ValueError(f"tenants.{name}: unknown classes {unknown}; the classes are {list(self.classes)}")
            for d in tenant.key_sha256:
                if d in owners:
                    raise ValueError(f"tenants.{name}: one of its keys is also a key of {owners[d]}")
                owners[d] = f"tenant {name!r}"

    def policy(self) -> SchedulingPolicy:
        sched, shed = self.scheduler, self.shedding
        return SchedulingPolicy(
            classes=tuple(c.priority_class(name) for name, c in self.classes.items()),
            default_class=sched.default_class,
            pooling_class=sched.pooling_class,
            pooling_step_tokens=sched.pooling_step_tokens,
            aging_seconds=sched.aging_seconds,
            preemption_mode=sched.preemption_mode,
            fairness=sched.fairness,
            shedding=ShedConfig(
                enabled=shed.enabled, margin=shed.margin, window_seconds=shed.window_seconds,
                min_samples=shed.min_samples, escalate_seconds=shed.escalate_seconds,
                recover_seconds=shed.recover_seconds, max_running=shed.max_running, max_tokens=shed.max_tokens,
            ),
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
        if section in ("classes", "tenants", "models", "routes"):
            continue  # tables of tables: the file only
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
    if not key:  # a rule across keys (the scheduling policy)
        return f"invalid settings: {err['msg']}"
    if err["type"] == "missing":
        return f"missing setting {key}"
    if "key_sha256" in key:  # NOTE: not echoed: it may be a key pasted in the clear
        return f"invalid setting {key}: {err['msg']}"
    return f"invalid setting {key} = {err.get('input')!r}: {err['msg']}"
