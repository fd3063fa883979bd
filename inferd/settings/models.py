"""Settings of several models in one process: [models.NAME], [routes.NAME] and [degradation].

    [models.small]                      one engine (and engine thread) per table
    path = "/models/small.gguf"         a GGUF file or a Hugging Face folder; none: the embedded one
    aliases = ["fast"]                  more names clients may send
    revision = "2026-11-30"             shown in /v1/models, the x-inferd-model header, metrics
    kv_cache_memory = "512MiB"          its own share, so a second model never starves the first
    fallback = "tiny"                   where its new requests go while it is unhealthy or overloaded

    [routes.chat]                       a name clients send that is neither a model nor an alias
    targets = { small = 95, large = 5 } a split by weight, sticky per `user`
    rules = [{ tiers = ["vip"], model = "large" }]      tenant tiers, tenants or classes first

No [models] table: the one model of [model], as before.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from inferd.settings.values import SIZE, Section, parse_memory

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")  # (a label value and a URL path segment)


class ModelTable(Section):
    """One model of several: one engine (and engine thread) per table."""

    path: str | None = None
    """GGUF file or Hugging Face folder; unset: the embedded SmolLM2."""
    aliases: tuple[str, ...] = ()
    """More names clients may send."""
    revision: str = "1"
    """Shown in /v1/models, the x-inferd-model header and metrics; a SIGHUP reloads a changed one."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    """Its dtype; unset: [model] dtype."""
    kv_cache_memory: float | None = Field(default=None, json_schema_extra=SIZE)
    """Its own KV share (bytes or a fraction of free memory), so a second model never starves the
    first; unset: [cache] kv_cache_memory."""
    fallback: str | None = None
    """A model (not a route) for its new requests while it is degraded."""
    task: Literal["generate", "embed", "score"] | None = None
    """What it serves ([model] task); unset: [model] task."""
    pooling: Literal["last", "mean", "cls"] | None = None
    """[model] pooling; unset: [model]'s."""
    normalize: bool | None = None
    """[model] normalize; unset: [model]'s."""
    embeddings: bool | None = None
    """[model] embeddings; unset: [model]'s."""
    eval_file: str | None = None
    """JSON lines {"prompt": ..., "expected": ...}: greedy continuations a new revision must reproduce
    before a reload moves traffic to it."""
    load: Literal["start", "on_demand"] = "start"
    """"start": loaded when the server starts; "on_demand": on its first request (which waits)."""
    pinned: bool = False
    """Never unloaded to make room or when idle (it may still sleep); not counted in [server] models_max."""
    idle_unload_seconds: float | None = Field(default=None, gt=0)
    """Unloaded after this long without a request (unpinned models only); unset: kept."""

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> float | None:
        return None if value is None or value == "auto" else parse_memory(value)


class RuleTable(Section):
    """Callers matching every non-empty list go to `model`."""

    model: str
    """The model they go to."""
    classes: tuple[str, ...] = ()
    """Their priority classes."""
    tenants: tuple[str, ...] = ()
    """Their tenants."""
    tiers: tuple[str, ...] = ()
    """Their tenants' tiers."""


class RouteTable(Section):
    """A name clients send that is neither a model nor an alias."""

    kind: Literal["split", "cascade"] = "split"
    """"split": by weight (sticky per `user`) after the rules; "cascade": small first, then large."""
    targets: dict[str, float] = Field(default_factory=dict)
    """split: model -> weight."""
    rules: tuple[RuleTable, ...] = ()
    """split: tenant tiers, tenants or classes first."""
    small: str | None = None
    """cascade: answer with this model first."""
    large: str | None = None
    """cascade: escalate to this one when the small answer is unsure."""
    threshold: float = Field(default=-1.0, le=0)
    """cascade: unsure is its token logprobs' measure under this."""
    measure: Literal["mean", "min"] = "mean"
    """cascade: the measure of the small answer's token logprobs."""

    @model_validator(mode="after")
    def _complete(self) -> RouteTable:
        if self.kind == "cascade" and (self.small is None or self.large is None):
            raise ValueError("a cascade route needs small and large")
        if self.kind == "split" and not self.targets and not self.rules:
            raise ValueError("a split route needs targets")
        return self


class DegradationSettings(Section):
    """Persistent overload triggers (unset: off), for fallbacks and the functional ladder."""

    queue_p95_seconds: float | None = Field(default=None, gt=0)
    """Trigger: p95 time in the queue over this."""
    preemptions_per_minute: float | None = Field(default=None, gt=0)
    """Trigger: preemptions per minute over this."""
    ooms_per_minute: float | None = Field(default=None, gt=0)
    """Trigger: out-of-memory steps per minute over this."""
    hold_seconds: float = Field(default=10.0, ge=0)
    """A trigger must hold this long to count."""
    recover_seconds: float = Field(default=30.0, ge=0)
    """And be clear this long to end."""
    classes: tuple[str, ...] = ()
    """The functional ladder (streams answered whole, then max_tokens capped, then the lowest of
    these classes refused) applies to these classes; empty: off."""
    max_tokens_ceiling: int = Field(default=256, ge=1)
    """The ladder's max_tokens cap."""


def check_models(models: dict[str, ModelTable], routes: dict[str, RouteTable], classes: set[str]) -> None:
    """ValueError naming the problem: a name twice (models, aliases, routes), a fallback or a
    route target that is not a model, an unknown class."""
    owner: dict[str, str] = {}
    for name, table in models.items():
        for served in (name, *table.aliases):
            if not MODEL_NAME.fullmatch(served):
                raise ValueError(f"models.{name}: {served!r} is not a valid model name")
            if served in owner:
                raise ValueError(f"models.{name}: the name {served!r} is already taken by {owner[served]}")
            owner[served] = f"model {name!r}"
    for name, table in models.items():
        if table.fallback is not None and (table.fallback not in models or table.fallback == name):
            raise ValueError(f"models.{name}: fallback {table.fallback!r} is not another model; "
                             f"the models are {list(models)}")
    for name, route in routes.items():
        if not MODEL_NAME.fullmatch(name) or name in owner:
            raise ValueError(f"routes.{name}: the name is invalid or already taken by {owner.get(name)}")
        named = [*route.targets, *(r.model for r in route.rules), *filter(None, (route.small, route.large))]
        unknown = [m for m in named if m not in models]
        if unknown:
            raise ValueError(f"routes.{name}: {unknown} are not models; the models are {list(models)}")
        bad = [c for r in route.rules for c in r.classes if c not in classes]
        if bad:
            raise ValueError(f"routes.{name}: unknown classes {bad}")
