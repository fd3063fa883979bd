"""The engine's configuration: the settings tables it is built from, as they are (inferd/settings/
holds the one copy of every default and its description; nothing here repeats a number)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from inferd.engine.output.blocklist import Blocklist, read_blocklist
from inferd.settings.config import Settings
from inferd.settings.engine import CacheSettings, HealthSettings, ModelSettings, SchedulerSettings, SpeculativeSettings
from inferd.settings.fleet import KVEventsSettings
from inferd.settings.policy import SchedulingPolicy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_DEFAULT_POLICY = Settings().policy()
# NOTE: "auto" KV memory means 2 GiB on the host (kv_cache.auto_kv_cache_memory); tests and
# benchmarks that build an EngineConfig by hand get that default without the settings layer.

# the engine's short names for the settings keys it is built with, for `of` and `replace`
FLAT: dict[str, tuple[str, str]] = {
    "model": ("model", "path"), "dtype": ("model", "dtype"), "device": ("model", "device"),
    "max_model_len": ("model", "max_model_len"), "cuda_graphs": ("model", "cuda_graphs"),
    "weights": ("model", "weights"), "deterministic": ("model", "deterministic"),
    "task": ("model", "task"), "pooling": ("model", "pooling"), "normalize": ("model", "normalize"),
    "embeddings": ("model", "embeddings"),
    "block_size": ("cache", "block_size"), "kv_cache_memory": ("cache", "kv_cache_memory"),
    "enable_prefix_caching": ("cache", "prefix_caching"), "swap_space": ("cache", "swap_space"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"), "kv_host_cache_memory": ("cache", "kv_host_cache_memory"),
    "max_num_seqs": ("scheduler", "max_num_seqs"), "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "failure_window_seconds": ("health", "failure_window_seconds"),
    "failure_recover_seconds": ("health", "recover_seconds"),
    "speculative": ("speculative", "method"), "max_draft_tokens": ("speculative", "max_draft_tokens"),
    "spec_max_batch": ("speculative", "max_batch"),
}


@dataclass(frozen=True)
class EngineConfig:
    """The settings tables an engine is built from, as they are (settings/ holds every default and
    its description), the scheduling policy made from them, and the blocklist they name."""

    model: ModelSettings = ModelSettings()  # the checkpoint, dtype, device, packed weights
    cache: CacheSettings = CacheSettings()  # KV block size and memory, prefix caching, swap space
    scheduler: SchedulerSettings = SchedulerSettings()  # batch limits
    health: HealthSettings = HealthSettings()  # engine/health.py's windows
    policy: SchedulingPolicy = _DEFAULT_POLICY  # classes, aging, preemption, fairness, shedding
    output_filter: Blocklist | None = None  # the blocklist, read from output_filter.blocklist_file
    speculative: SpeculativeSettings = SpeculativeSettings()  # drafting and verifying several tokens a step
    kv_events: KVEventsSettings = KVEventsSettings()  # recorded (kv/events.py) only when enabled

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        """The engine's config; reads the blocklist file (SettingsError names a bad line)."""
        blocklist = settings.output_filter.blocklist_file
        return cls(settings.model, settings.cache, settings.scheduler, settings.health, settings.policy(),
                   read_blocklist(blocklist, settings.output_filter.action) if blocklist else None,
                   settings.speculative, settings.kv_events)

    @classmethod
    def of(cls, *, policy: SchedulingPolicy | None = None, output_filter: Blocklist | None = None,
           **keys: Any) -> EngineConfig:
        """A config from the defaults and a few keys by their short names (FLAT): tests and benches."""
        return cls(policy=policy or _DEFAULT_POLICY, output_filter=output_filter).replace(**keys)

    def replace(self, **keys: Any) -> EngineConfig:
        """This config with keys changed by their short names (FLAT), or whole tables by name."""
        tables: dict[str, dict[str, Any]] = {}
        fields: dict[str, Any] = {}
        for name, value in keys.items():
            if name in FLAT:
                table, key = FLAT[name]
                tables.setdefault(table, {})[key] = value
            else:
                fields[name] = value
        for table, changes in tables.items():
            fields[table] = getattr(self, table).model_copy(update=changes)
        return dataclasses.replace(self, **fields)

    def resolved_device(self) -> torch.device:
        device = self.model.device
        if device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA device")
        return torch.device(device)

    def resolved_weights(self) -> str:
        """What the loader packs: "auto" only where the packed kernels serve (the CPU, bfloat16)."""
        weights = self.model.weights
        if weights == "bf16":
            return "bf16"
        if self.resolved_device().type != "cpu":
            if weights != "auto":
                raise ValueError(f"weights {weights!r} is a CPU mode (torch's packed CPU kernels); use bf16")
            return "bf16"
        if weights == "auto" and self.resolved_dtype() != torch.bfloat16:
            return "bf16"  # (the packed kernels' float32 path is a slow reference)
        return weights

    def resolved_dtype(self) -> torch.dtype:
        if self.model.dtype == "auto":
            return torch.bfloat16
        return DTYPES[self.model.dtype]
