"""Construction: weights and tokenizer from disk, then the KV cache, the attention backend, the
CUDA graphs and the model runner sized for them. Everything here runs once, at start-up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from inferd.engine.config import EngineConfig
from inferd.engine.worker.cuda_graphs import DecodeGraphs
from inferd.engine.worker.kv_cache import (KVCache, auto_kv_cache_memory, available_memory, host_blocks_for,
                                           kv_layout, num_blocks_for, state_bytes_per_slot, state_slots_for)
from inferd.engine.worker.runner import ModelRunner
from inferd.kernels.kv_quant import kv_format
from inferd.kernels.ops import CudaAttention, TorchAttention, select_attention
from inferd.text.errors import ModelLoadError
from inferd.model.decoder import DecoderModel
from inferd.model.layers.mxfp4 import Mxfp4Weight
from inferd.model.loading.loader import default_model_path, load_checkpoint
from inferd.model.models import decoder_for
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")


def in_passing_thread(build: Callable[..., T], *args: object) -> T:
    """`build(*args)` in a thread of its own that then ends: how a server builds an engine.

    NOTE: torch's OpenMP keeps a pool of workers for every thread that ever ran a parallel op.
    Build in the main thread (or an executor thread that lives on) and run in the engine
    thread, and two pools live; once their threads outnumber the cores, libgomp stops spinning
    between parallel regions and every packed product or attention call pays a ~40 us wake-up
    (a batch-1 decode step: 19.5 ms in the server, 12 ms alone). A thread that ends takes its
    pool with it."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferd-build") as builder:
        return builder.submit(build, *args).result()


def load_model(config: EngineConfig) -> tuple[DecoderModel, Tokenizer]:
    """The model's weights on its device, and its tokenizer; ModelLoadError names what is wrong."""
    path = Path(config.model.path) if config.model.path else default_model_path()
    device, dtype = config.resolved_device(), config.resolved_dtype()
    start = time.perf_counter()
    # (a GPU keeps MXFP4 experts as stored: gpt-oss-120b's fit one H200 only so)
    checkpoint = load_checkpoint(path, dtype, config.resolved_weights(), keep_mxfp4=device.type == "cuda")
    tokenizer = load_tokenizer(path, gguf_metadata=checkpoint.gguf_metadata)
    # (packed weights are CPU-only: resolved_weights; MXFP4 ones move with the rest)
    weights = {name: t.to(device) if isinstance(t, torch.Tensor | Mxfp4Weight) else t
               for name, t in checkpoint.tensors.items()}
    try:
        model = decoder_for(checkpoint.config, weights, dtype)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    log.info("loaded %s (%s, weights %s, %s) in %.2f s", path, dtype, config.resolved_weights(), device,
             time.perf_counter() - start)
    return model, tokenizer


@dataclass
class Execution:
    """What runs the model over the paged cache: sized once, owned by the engine."""

    kv_cache: KVCache
    runner: ModelRunner
    num_blocks: int  # on the device
    num_host_blocks: int  # for swapped-out blocks (0: swapping off)
    num_state_slots: int = 0  # a hybrid model's state slots (kv/state_slots.py), working and checkpoints
    num_working_slots: int = 0  # of which this many sequences may hold one at once (caps max_num_seqs)
    num_host_state_slots: int = 0
    num_tier_blocks: int = 0  # the prefix cache's host tier (kv/host_tier.py; 0: none)


def build_execution(model: DecoderModel, config: EngineConfig, max_model_len: int) -> Execution:
    """The KV cache (from `kv_cache_memory`, in `kv_cache_dtype`), the attention backend, CUDA
    graphs, the runner."""
    cfg = model.cfg
    fmt = kv_format(config.cache.kv_cache_dtype)  # None: K/V in the model's dtype
    memory = config.cache.kv_cache_memory
    if memory is None:
        memory = auto_kv_cache_memory(cfg, model.dtype, model.device, config.scheduler.max_num_batched_tokens,
                                      config.scheduler.max_num_seqs, max_model_len)
    budget = memory * available_memory(model.device) if memory <= 1 else memory
    max_num_seqs, per_slot = config.scheduler.max_num_seqs, state_bytes_per_slot(cfg, model.dtype)
    # a hybrid model's state slots first, the blocks from the rest
    num_slots, working = state_slots_for(budget, cfg, model.dtype, max_num_seqs)
    num_blocks = num_blocks_for(budget - num_slots * per_slot, cfg, config.cache.block_size, model.dtype, model.device,
                                fmt)
    num_host_blocks = num_host_slots = 0
    if config.policy.preemption_mode == "swap":
        swap = config.cache.swap_space
        num_host_slots = min(max_num_seqs, int(swap / 2 // per_slot)) if per_slot else 0
        num_host_blocks = host_blocks_for(swap - num_host_slots * per_slot, cfg, config.cache.block_size, model.dtype,
                                          fmt)
    num_tier_blocks = _tier_blocks(model, config, fmt)
    if working and working < max_num_seqs:
        log.warning("[cache] the state slots of %d sequences (%.1f MiB each) fit half of kv_cache_memory: "
                    "max_num_seqs lowered from %d", working, per_slot / 2**20, max_num_seqs)
    kv_cache = KVCache(cfg, num_blocks, config.cache.block_size, model.dtype, model.device,
                       num_host_blocks=num_host_blocks, num_state_slots=num_slots, num_host_state_slots=num_host_slots,
                       kv_format=fmt, num_tier_blocks=num_tier_blocks)
    if fmt is not None:
        log.info("[cache] K/V in %s: %d blocks of %d bytes", fmt, num_blocks, kv_cache.bytes_per_block)
    # a CPU mode, for bfloat16 only (the default dtype, where the drift was seen): in float32 the
    # one-row path is a fast matrix-vector product that two rows would give up (-38% at batch 1)
    deterministic = config.model.deterministic and model.dtype == torch.bfloat16 and model.device.type == "cpu"
    model.set_attention(_attention(model, config, max_model_len, deterministic, fmt))
    model.set_batch_invariant(deterministic)
    graphs = None
    # (a hybrid model's decode steps run eagerly: the graphs hold one block table per row)
    if (config.model.cuda_graphs and isinstance(model.attention, CudaAttention) and len(kv_cache.layout.groups) == 1
            and not kv_cache.layout.linear):
        graphs = DecodeGraphs(model, kv_cache, config.scheduler.max_num_seqs, max_model_len)
        try:
            graphs.capture()
        except RuntimeError as e:  # (an op of a newer family that cannot be captured: the steps still run)
            log.warning("decode steps run without CUDA graphs: capturing them failed (%s)", e)
            graphs = None
    return Execution(kv_cache, ModelRunner(model, kv_cache, graphs=graphs), num_blocks, num_host_blocks, num_slots,
                     working, num_host_slots, num_tier_blocks)


EXECUTION_PARTS = ("runner", "executor", "kv_cache")  # an engine's attributes that hold its KV cache


def free_execution(engine: object) -> int:
    """Sleep, level 1: what `build_execution` built for `engine` (an LLMEngine whose thread has
    stopped, no request left) goes, its weights stay; the KV cache's bytes, freed (on CUDA given
    back to the device). The engine is unusable until it is built again (LLMEngine.restore_kv)."""
    cache: KVCache = getattr(engine, "kv_cache")
    storages = [*cache.block_tensors, *(cache.host_storages or ()), *(cache.tier_storages or ())]
    freed = sum(t.numel() * t.element_size() for t in storages)
    if cache.states is not None:
        freed += cache.num_state_slots * cache.state_bytes_per_slot
    del cache, storages
    for name in EXECUTION_PARTS:  # NOTE: no gc.collect(): no cycle holds them, and a full one holds the GIL ~0.1 s
        delattr(engine, name)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


def _tier_blocks(model: DecoderModel, config: EngineConfig, fmt: str | None) -> int:
    """The host tier's blocks from `kv_host_cache_memory` ("auto": none on a CPU, where the KV
    cache is host memory already; on CUDA 8 GiB or a quarter of the free host memory, the less).
    Models with sliding windows or linear layers have none: a hit there needs every group's
    blocks, or a state checkpoint, which the tier does not keep."""
    memory = config.cache.kv_host_cache_memory
    if memory is None:
        memory = min(8 * 2**30, available_memory(torch.device("cpu")) / 4) if model.device.type == "cuda" else 0
    layout = kv_layout(model.cfg)
    if not memory or not config.cache.prefix_caching or len(layout.groups) > 1 or layout.linear:
        return 0
    blocks = host_blocks_for(memory, model.cfg, config.cache.block_size, model.dtype, fmt)
    log.info("[cache] host tier: %d blocks (%.0f MiB)", blocks, memory / 2**20)
    return blocks


def _attention(model: DecoderModel, config: EngineConfig, max_model_len: int, deterministic: bool,
               fmt: str | None) -> TorchAttention:
    """The device's attention backend for the model's layers, over K/V in `fmt` (8 bits) or the
    model's dtype (None). Where layers differ in K/V shape (Gemma 4), the backend that serves
    every shape: the CPU kernel's if it covers them all, else the reference (CUDA's decode
    scratch is sized for one head size)."""
    cfg = model.cfg
    shapes = sorted({cfg.kv_shape(i) for i in range(cfg.num_layers)}) or [(cfg.num_kv_heads, cfg.head_dim)]
    backends = [select_attention(model.device, model.dtype, cfg.num_heads, kv_heads, head_dim,
                                 config.cache.block_size, config.scheduler.max_num_seqs, max_model_len, deterministic,
                                 fmt)
                for kv_heads, head_dim in shapes]
    if len(backends) == 1 or (len({type(b) for b in backends}) == 1 and not isinstance(backends[0], CudaAttention)):
        return backends[0]
    log.warning("[model] layers of %d K/V shapes %s: attention runs on the torch reference", len(shapes), shapes)
    return TorchAttention(backends[0].kv_block, fmt)
