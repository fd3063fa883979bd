"""Routes: one `model` name that splits traffic between served models (canary, A/B, cascade).

How a request's `model` resolves:

    model -> that model        alias -> its model
    route -> 1. the first rule matching the caller's class / tenant / tier -> rule.target
             2. a cascade route -> its small model (the caller escalates to the large one
                when Cascade.unsure(the small answer's logprobs))
             3. a weighted pick over the targets, in sorted-name order by cumulative share, at
                  point = SHA-256(f"{route}\\0{user}")[:8] / 2**64   with a user (sticky)
                  point = rng.random()                                without one

NOTE: the sticky point hashes the user instead of remembering a choice: one user sees one
revision of a canary for a whole conversation, there is no table to keep or expire, and the
pick is the same on every replica and after a restart. Standard library only, so the API layer
and the tests share it.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

_RNG = random.Random()


@dataclass(frozen=True)
class Caller:
    """Who asks, as routing sees it."""

    class_name: str
    user: str | None = None
    tenant: str | None = None
    tier: str | None = None


@dataclass(frozen=True)
class RouteRule:
    """Send matching callers to `target`; every non-empty set must match (AND), an empty one matches all."""

    target: str
    classes: frozenset[str] = frozenset()
    tenants: frozenset[str] = frozenset()
    tiers: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # A list or set from a config file becomes a frozenset, so the rule stays hashable.
        for name in ("classes", "tenants", "tiers"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))

    def matches(self, caller: Caller) -> bool:
        return (
            (not self.classes or caller.class_name in self.classes)
            and (not self.tenants or caller.tenant in self.tenants)
            and (not self.tiers or caller.tier in self.tiers)
        )


@dataclass(frozen=True)
class Cascade:
    """Answer with `small`; escalate to `large` when the small answer's logprobs are unsure."""

    small: str
    large: str
    threshold: float  # a logprob (<= 0): below it the small answer is unsure
    measure: Literal["mean", "min"] = "mean"

    def __post_init__(self) -> None:
        where = f"cascade {self.small!r} -> {self.large!r}"
        if self.measure not in ("mean", "min"):
            raise ValueError(f"{where}: measure must be 'mean' or 'min', not {self.measure!r}")
        if not (math.isfinite(self.threshold) and self.threshold <= 0):
            raise ValueError(f"{where}: threshold must be a logprob <= 0, not {self.threshold}")

    def unsure(self, logprobs: Sequence[float]) -> bool:
        if not logprobs:
            return True  # nothing to judge the answer by: let the large model answer
        value = min(logprobs) if self.measure == "min" else math.fsum(logprobs) / len(logprobs)
        # NOTE: `not >=` rather than `<`, so a NaN logprob counts as unsure too.
        return not value >= self.threshold


@dataclass(frozen=True)
class Route:
    name: str
    # model name -> weight (> 0); for a cascade: {small: 1}. Kept as a read-only copy.
    targets: Mapping[str, float] = field(hash=False)
    rules: tuple[RouteRule, ...] = ()
    cascade: Cascade | None = None

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError(f"route {self.name!r}: needs at least one target")
        for target, weight in self.targets.items():
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"route {self.name!r}: target {target!r} needs a finite weight > 0, not {weight}")
        object.__setattr__(self, "targets", MappingProxyType(dict(self.targets)))
        object.__setattr__(self, "rules", tuple(self.rules))

    def models(self) -> set[str]:
        """Every model this route may send a request to."""
        return {model for _, model in self._destinations()}

    def shares(self) -> dict[str, float]:
        total = math.fsum(self.targets.values())
        return {target: weight / total for target, weight in self.targets.items()}

    def choose(self, caller: Caller, rng: random.Random | None = None) -> str:
        for rule in self.rules:
            if rule.matches(caller):
                return rule.target
        if self.cascade is not None:
            return self.cascade.small
        # NOTE: an empty user ("") counts as none: hashing it would stick every such caller to one target.
        point = _sticky_point(self.name, caller.user) if caller.user else (rng or _RNG).random()
        return _pick(self.shares(), point)

    def _destinations(self) -> list[tuple[str, str]]:
        """(what points there, model) for every model the route names."""
        found = [("target", t) for t in self.targets] + [("rule target", rule.target) for rule in self.rules]
        if self.cascade is not None:
            found += [("cascade small model", self.cascade.small), ("cascade large model", self.cascade.large)]
        return found


def _sticky_point(route: str, user: str) -> float:
    """A point in [0, 1) fixed by route and user: the same in every call, process and replica."""
    digest = hashlib.sha256(f"{route}\0{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _pick(shares: Mapping[str, float], point: float) -> str:
    """The target whose slice of [0, 1) holds `point`, slices laid out in sorted-name order."""
    names = sorted(shares)
    cumulative = 0.0
    for name in names:
        cumulative += shares[name]
        if point < cumulative:
            return name
    return names[-1]  # shares may sum to a hair under 1


def check_routes(routes: Mapping[str, Route], models: Collection[str], names_taken: Collection[str]) -> None:
    """ValueError naming the problem: a route named like a model or an alias (names_taken), a target/rule target/cascade
    model that is not a served model (routes never point at routes)."""
    for key, route in routes.items():
        if key != route.name:
            raise ValueError(f"route {route.name!r} is listed under another name, {key!r}")
        if key in models or key in names_taken:
            raise ValueError(f"route {key!r}: the name is already a model's or an alias's")
        for what, model in route._destinations():
            if model in routes:
                raise ValueError(f"route {key!r}: {what} {model!r} is a route (routes never point at routes)")
            if model not in models:
                raise ValueError(f"route {key!r}: {what} {model!r} is not a served model")
