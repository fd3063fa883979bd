"""Routes: weighted splits (random and sticky per user), rules, cascades, and their validation."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferd.api.routing.routes import Caller, Cascade, Route, RouteRule, check_routes


def canary(name: str = "chat") -> Route:
    return Route(name, {"llama-8b": 90, "llama-8b-rc": 10})


# ------------------------------------------------------------------------------ weighted split


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 42])
def test_split_without_user_follows_weights(seed: int) -> None:
    route, rng = canary(), random.Random(seed)
    picks = [route.choose(Caller("interactive"), rng) for _ in range(400)]
    assert set(picks) == {"llama-8b", "llama-8b-rc"}
    assert abs(picks.count("llama-8b-rc") / 400 - 0.10) <= 0.05


def test_split_over_distinct_users_follows_weights() -> None:
    route = canary()
    picks = [route.choose(Caller("interactive", user=f"user-{i}")) for i in range(400)]
    assert abs(picks.count("llama-8b-rc") / 400 - 0.10) <= 0.05


def test_shares_are_normalised() -> None:
    assert canary().shares() == pytest.approx({"llama-8b": 0.9, "llama-8b-rc": 0.1})
    assert Route("r", {"a": 3}).shares() == {"a": 1.0}


# ------------------------------------------------------------------------------ stickiness


def test_same_user_always_gets_the_same_target() -> None:
    route, rng = Route("ab", {"a": 1, "b": 1}), random.Random(0)
    for i in range(20):
        caller = Caller("interactive", user=f"user-{i}")
        first = route.choose(caller, rng)
        assert all(route.choose(caller, rng) == first for _ in range(1000))


def test_route_names_hash_independently() -> None:
    one, two = Route("ab-1", {"a": 1, "b": 1}), Route("ab-2", {"a": 1, "b": 1})
    callers = [Caller("interactive", user=f"user-{i}") for i in range(50)]
    assert any(one.choose(c) != two.choose(c) for c in callers)


def test_pick_does_not_depend_on_dict_order() -> None:
    forward = Route("r", {"a": 1, "b": 2, "c": 3})
    backward = Route("r", {"c": 3, "b": 2, "a": 1})
    for i in range(200):
        caller = Caller("interactive", user=f"user-{i}")
        assert forward.choose(caller) == backward.choose(caller)
    for seed in range(20):
        caller = Caller("interactive")
        assert forward.choose(caller, random.Random(seed)) == backward.choose(caller, random.Random(seed))


def test_empty_user_is_not_sticky() -> None:
    route = canary()
    picks = {route.choose(Caller("interactive", user=""), random.Random(seed)) for seed in range(100)}
    assert picks == {"llama-8b", "llama-8b-rc"}


@given(
    weights=st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=6,
    ),
    user=st.text(min_size=1),
)
def test_choose_returns_a_target_deterministically(weights: dict[str, float], user: str) -> None:
    route = Route("prop", weights)
    caller = Caller("interactive", user=user)
    picked = route.choose(caller)
    assert picked in weights
    assert route.choose(caller) == picked == Route("prop", dict(reversed(weights.items()))).choose(caller)


# ------------------------------------------------------------------------------ rules


def ruled(*rules: RouteRule) -> Route:
    return Route("chat", {"medium": 1}, rules=rules)


def test_class_rule() -> None:
    route = ruled(RouteRule("small", classes=frozenset({"batch"})))
    assert route.choose(Caller("batch")) == "small"
    assert route.choose(Caller("interactive")) == "medium"


def test_tenant_rule() -> None:
    route = ruled(RouteRule("large", tenants=frozenset({"acme"})))
    assert route.choose(Caller("interactive", tenant="acme")) == "large"
    assert route.choose(Caller("interactive", tenant="globex")) == "medium"
    assert route.choose(Caller("interactive")) == "medium"


def test_tier_rule() -> None:
    route = ruled(RouteRule("large", tiers=frozenset({"vip"})))
    assert route.choose(Caller("interactive", tier="vip")) == "large"
    assert route.choose(Caller("interactive", tier="free")) == "medium"


def test_rule_sets_are_anded() -> None:
    route = ruled(RouteRule("large", classes=frozenset({"interactive"}), tiers=frozenset({"vip"})))
    assert route.choose(Caller("interactive", tier="vip")) == "large"
    assert route.choose(Caller("batch", tier="vip")) == "medium"
    assert route.choose(Caller("interactive", tier="free")) == "medium"


def test_first_matching_rule_wins() -> None:
    route = ruled(RouteRule("large", tiers=frozenset({"vip"})), RouteRule("small", classes=frozenset({"batch"})))
    assert route.choose(Caller("batch", tier="vip")) == "large"
    assert route.choose(Caller("batch")) == "small"


def test_no_matching_rule_falls_to_the_split() -> None:
    route = Route("chat", {"a": 1, "b": 1}, rules=(RouteRule("large", tiers=frozenset({"vip"})),))
    picks = {route.choose(Caller("interactive", user=f"user-{i}")) for i in range(50)}
    assert picks == {"a", "b"}


def test_rule_with_empty_sets_matches_everyone() -> None:
    assert RouteRule("x").matches(Caller("batch", tenant="t", tier="vip"))


def test_models_lists_every_destination() -> None:
    route = Route("r", {"a": 1}, rules=(RouteRule("b"),), cascade=Cascade("a", "c", threshold=-1.0))
    assert route.models() == {"a", "b", "c"}


# ------------------------------------------------------------------------------ cascade


def test_cascade_route_answers_with_the_small_model() -> None:
    route = Route("cheap-first", {"small": 1}, cascade=Cascade("small", "large", threshold=-1.0))
    assert route.choose(Caller("interactive", user="u")) == "small"
    assert route.choose(Caller("interactive")) == "small"


def test_cascade_rules_come_first() -> None:
    route = Route("c", {"small": 1}, rules=(RouteRule("large", tiers=frozenset({"vip"})),),
                  cascade=Cascade("small", "large", threshold=-1.0))
    assert route.choose(Caller("interactive", tier="vip")) == "large"


def test_unsure_by_mean() -> None:
    cascade = Cascade("s", "l", threshold=-1.0)
    assert not cascade.unsure([-0.5, -1.5])  # mean exactly at the threshold: sure
    assert not cascade.unsure([-0.1, -0.3])  # above
    assert cascade.unsure([-1.0, -1.2])  # below
    assert not cascade.unsure([-0.1, -1.5])  # one bad token does not sink the mean


def test_unsure_by_min() -> None:
    cascade = Cascade("s", "l", threshold=-1.0, measure="min")
    assert not cascade.unsure([-0.2, -1.0])  # at
    assert not cascade.unsure([-0.2, -0.9])  # above
    assert cascade.unsure([-0.1, -1.5])  # one token below is enough


def test_unsure_without_tokens_or_with_nan() -> None:
    assert Cascade("s", "l", threshold=-1.0).unsure([])
    assert Cascade("s", "l", threshold=-1.0, measure="min").unsure([])
    assert Cascade("s", "l", threshold=-1.0).unsure([-0.1, math.nan])


@pytest.mark.parametrize("kwargs", [{"threshold": 0.5}, {"threshold": math.nan}, {"threshold": -1.0, "measure": "max"}])
def test_bad_cascade_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="cascade"):
        Cascade("s", "l", **kwargs)


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("weight", [0, -1, math.inf, math.nan])
def test_bad_weight_is_refused(weight: float) -> None:
    with pytest.raises(ValueError, match="'canary'.*'llama-rc'"):
        Route("canary", {"llama": 1, "llama-rc": weight})


def test_empty_targets_are_refused() -> None:
    with pytest.raises(ValueError, match="'canary'"):
        Route("canary", {})


def test_targets_are_a_frozen_copy() -> None:
    weights = {"a": 1.0}
    route = Route("r", weights)
    weights["b"] = 1.0
    assert route.models() == {"a"}
    with pytest.raises(TypeError):
        route.targets["c"] = 1.0  # type: ignore[index]


MODELS = {"llama-8b", "llama-70b"}
ALIASES = {"llama"}


def test_good_routes_pass() -> None:
    route = Route("chat", {"llama-8b": 9, "llama-70b": 1}, rules=(RouteRule("llama-70b", tiers=frozenset({"vip"})),))
    cascade = Route("cheap", {"llama-8b": 1}, cascade=Cascade("llama-8b", "llama-70b", threshold=-0.7))
    check_routes({"chat": route, "cheap": cascade}, MODELS, ALIASES)


@pytest.mark.parametrize(
    ("route", "named"),
    [
        (Route("llama-8b", {"llama-70b": 1}), "'llama-8b'"),  # a model's name
        (Route("llama", {"llama-70b": 1}), "'llama'"),  # an alias's name
        (Route("chat", {"llama-8b": 1, "mistral": 1}), "target 'mistral'"),
        (Route("chat", {"llama-8b": 1}, rules=(RouteRule("qwen"),)), "rule target 'qwen'"),
        (Route("chat", {"llama-8b": 1}, cascade=Cascade("llama-8b", "gpt-9", -1.0)), "large model 'gpt-9'"),
        (Route("chat", {"phi": 1}, cascade=Cascade("phi", "llama-70b", -1.0)), "'phi'"),
    ],
)
def test_check_routes_names_the_problem(route: Route, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        check_routes({route.name: route}, MODELS, ALIASES)


def test_routes_never_point_at_routes() -> None:
    inner = Route("inner", {"llama-8b": 1})
    outer = Route("outer", {"inner": 1})
    with pytest.raises(ValueError, match="'inner' is a route"):
        check_routes({"inner": inner, "outer": outer}, MODELS, ALIASES)


def test_route_listed_under_another_name_is_refused() -> None:
    with pytest.raises(ValueError, match="'chat'.*'talk'"):
        check_routes({"talk": Route("chat", {"llama-8b": 1})}, MODELS, ALIASES)
