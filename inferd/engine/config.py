"""The engine's configuration, derived from the settings (inferd/settings/config.py holds the one copy of
every default; nothing here repeats a number)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.settings.config import Settings
from inferd.engine.output.blocklist import Blocklist, read_blocklist
from inferd.settings.policy import SchedulingPolicy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_DEFAULTS = Settings()
# NOTE: "auto" KV memory means 2 GiB on the host (kv_cache.auto_kv_cache_memory); tests and
# benchmarks that build an EngineConfig by hand get that default without the settings layer.


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _DEFAULTS.model.path  # a GGUF file or a Hugging Face folder; None: the embedded default
    dtype: str = _DEFAULTS.model.dtype  # auto: bfloat16 on CPU and CUDA
    device: str = _DEFAULTS.model.device  # auto: cuda when available
    block_size: int = _DEFAULTS.cache.block_size
    kv_cache_memory: float | None = _DEFAULTS.cache.kv_cache_memory  # bytes, a fraction (0, 1] of free memory, or None: auto
    cuda_graphs: bool = _DEFAULTS.model.cuda_graphs  # on CUDA, replay decode steps from captured graphs
    deterministic: bool = _DEFAULTS.model.deterministic  # batch-invariant results on the CPU (builder.py)
    weights: str = _DEFAULTS.model.weights  # CPU: packed weights (inferd.model.layers.quant)
    max_num_seqs: int = _DEFAULTS.scheduler.max_num_seqs
    max_num_batched_tokens: int = _DEFAULTS.scheduler.max_num_batched_tokens
    max_model_len: int | None = _DEFAULTS.model.max_model_len  # None: the model's context length
    policy: SchedulingPolicy = _DEFAULTS.policy()
    enable_prefix_caching: bool = _DEFAULTS.cache.prefix_caching
    swap_space: float = _DEFAULTS.cache.swap_space  # bytes of host memory for swapped-out blocks
    failure_window_seconds: float = _DEFAULTS.health.failure_window_seconds  # see engine/health.py
    failure_recover_seconds: float = _DEFAULTS.health.recover_seconds
    output_filter: Blocklist | None = None  # the blocklist, read from output_filter.blocklist_file

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        """The engine's config; reads the blocklist file (SettingsError names a bad line)."""
        blocklist = settings.output_filter.blocklist_file
        return cls(
            model=settings.model.path,
            dtype=settings.model.dtype,
            device=settings.model.device,
            block_size=settings.cache.block_size,
            kv_cache_memory=settings.cache.kv_cache_memory,
            max_num_seqs=settings.scheduler.max_num_seqs,
            max_num_batched_tokens=settings.scheduler.max_num_batched_tokens,
            max_model_len=settings.model.max_model_len,
            cuda_graphs=settings.model.cuda_graphs,
            deterministic=settings.model.deterministic,
            weights=settings.model.weights,
            policy=settings.policy(),
            enable_prefix_caching=settings.cache.prefix_caching,
            swap_space=settings.cache.swap_space,
            failure_window_seconds=settings.health.failure_window_seconds,
            failure_recover_seconds=settings.health.recover_seconds,
            output_filter=read_blocklist(blocklist, settings.output_filter.action) if blocklist else None,
        )

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for, but torch sees no CUDA device")
        return torch.device(self.device)

    def resolved_weights(self) -> str:
        """What the loader packs: "auto" only where the packed kernels serve (the CPU, bfloat16)."""
        if self.weights == "bf16":
            return "bf16"
        if self.resolved_device().type != "cpu":
            if self.weights != "auto":
                raise ValueError(f"weights {self.weights!r} is a CPU mode (torch's packed CPU kernels); use bf16")
            return "bf16"
        if self.weights == "auto" and self.resolved_dtype() != torch.bfloat16:
            return "bf16"  # (the packed kernels' float32 path is a slow reference)
        return self.weights

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16
        return DTYPES[self.dtype]
