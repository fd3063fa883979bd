"""Each model's lifecycle (routing/lifecycle.py), for /metrics and /v1/status: its state, and its
loads, unloads, switches, sleeps, wakes and the requests that waited for them."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inferd.api.routing.life import STATES
from inferd.api.routing.registry import ModelRegistry, ModelSlot
from inferd.api.telemetry import status_wire as s
from inferd.engine.protocol import TOKEN_BUCKETS, EngineSnapshot, Histogram

COUNTERS = {  # LifeCounts' field -> (family, help)
    "loads": ("inferd_model_loads", "Loads that served (on demand, or a wake from sleep level 2)."),
    "load_failures": ("inferd_model_load_failures", "Loads that failed (file, memory, probe)."),
    "unloads": ("inferd_model_unloads", "Unloads: idle for idle_unload_seconds, or room for another model."),
    "switches": ("inferd_model_switches", "Its loads that unloaded another model to make room (models_max)."),
    "sleeps": ("inferd_model_sleeps", "Times it was put to sleep (POST /admin/models/NAME/sleep)."),
    "wakes": ("inferd_model_wakes", "Times it woke (POST /admin/models/NAME/wake)."),
    "load_waits": ("inferd_model_load_waits", "Requests that waited for it to load, wake or find room."),
    "load_wait_timeouts": ("inferd_model_load_wait_timeouts", "Of which gave up after "
                           "model_load_wait_seconds (503)."),
}


def lifecycle_metrics(registry: ModelRegistry) -> Iterator[Metric]:
    """Labels: model (and state: one series per state, 1 for the one it is in)."""
    state = GaugeMetricFamily("inferd_model_state", "1 for the state the model is in (serving, loading, "
                              "unloading, asleep, waking, unloaded, failed).", labels=["model", "state"])
    level = GaugeMetricFamily("inferd_model_sleep_level", "Asleep: 1 (KV cache freed) or 2 (weights freed "
                              "too); 0 otherwise.", labels=["model"])
    seconds = GaugeMetricFamily("inferd_model_load_seconds", "Its last load's (or wake's) seconds.",
                                labels=["model"])
    counters = {attr: CounterMetricFamily(name, doc, labels=["model"]) for attr, (name, doc) in COUNTERS.items()}
    for slot in registry.slots.values():
        life = slot.life
        for name in STATES:
            state.add_metric([slot.name, name], float(life.state == name))
        level.add_metric([slot.name], float(life.level))
        seconds.add_metric([slot.name], life.counts.load_seconds)
        for attr, family in counters.items():
            family.add_metric([slot.name], getattr(life.counts, attr))
    yield from (state, level, seconds, *counters.values())


def model_life(slot: ModelSlot) -> s.ModelLife:
    life, counts = slot.life, slot.life.counts
    return s.ModelLife(
        load="on_demand" if slot.spec.load == "on_demand" else "start", pinned=slot.pinned,
        sleep_level=life.level or None, idle_unload_seconds=slot.idle_unload_seconds,
        idle_seconds=time.monotonic() - max(life.last_used, life.since),
        holders=slot.current.holders if slot.current is not None else 0, loads=counts.loads,
        load_failures=counts.load_failures, load_error=life.error, load_seconds=counts.load_seconds,
        unloads=counts.unloads, switches=counts.switches, sleeps=counts.sleeps, wakes=counts.wakes,
        load_waits=counts.load_waits, load_wait_timeouts=counts.load_wait_timeouts)


# a model not loaded: its engine's figures are all zero
NOT_LOADED = EngineSnapshot(kv_blocks_total=0, kv_blocks_used=0, kv_blocks_cached=0, running=0, waiting=0, steps=0,
                            preemptions={}, timeouts={}, prefix_queries=0, prefix_hits=0, shed_level=0,
                            shed_actions={}, last_step_seconds=0.0, classes=(), requests=(), step_seconds=Histogram(),
                            batch_tokens=Histogram(TOKEN_BUCKETS))
