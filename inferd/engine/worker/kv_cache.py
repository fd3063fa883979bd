"""The paged KV cache tensors, sized from `kv_cache_memory`, allocated once at start-up, and the
host copy space that preempted sequences are swapped out to.

A block id is `group_size` layers' K/V (kv/groups.py): every layer for a model without sliding
layers; for a hybrid one, slot i of a block is layer i of whichever KV group holds the block.

Where layers differ in K/V shape (Gemma 4's full layers), each shape has its own tensor of every
block, and a group's layers use their shape's: a block id is then `group_size` layers' K/V in every
shape, of which the group holding it uses one (a model of one shape has one tensor, as always).
NOTE: so such a model's blocks cost the sum of its shapes; one pool per shape would not.
A KV-shared layer (Gemma 4) has no slot: its entry in `layers` is its source's tensors.

In 8 bits (`kv_format`, kernels/kv_quant.py) a layer's K (and V) is a QuantizedCache: float8 codes
in the storage's place and an int8 exponent per (token, KV head) in a storage of its own, indexed
by block the same way; `block_tensors` lists every block-indexed tensor for the block copies.

A linear-attention layer (Qwen3.5) has no blocks: its entry in `layers` is its state tensors,
(conv [num_state_slots, K-1, C], recurrent [num_state_slots, Hv, dk, dv] in float32), indexed by
state slot (engine/kv/state_slots.py). The state pool takes its share of `kv_cache_memory` first
(`state_slots_for`); the blocks get the rest."""

from __future__ import annotations

import math
import mmap
import os

import torch

from inferd.engine.kv.groups import KVLayout
from inferd.engine.protocol import DeviceMemory
from inferd.kernels import kv_quant
from inferd.kernels.kv_quant import QuantizedCache
from inferd.kernels.reference import Cache
from inferd.kernels.tensors import device_tensor, to_device
from inferd.model.families.config import ModelConfig

# a hybrid model's state checkpoints take at most this share of kv_cache_memory, and at most
# this many per sequence seat (max_num_seqs): bench/RESULTS.md, issue 41, measures the memory
STATE_CHECKPOINT_SHARE = 0.25
STATE_CHECKPOINTS_PER_SEAT = 8


def kv_layout(cfg: ModelConfig) -> KVLayout:
    """The model's KV groups: one of every layer, unless it has sliding and full layers (or
    layers of several K/V shapes, or KV-shared ones); linear-attention layers in none."""
    windows = [cfg.sliding_window if cfg.is_sliding(i) else None for i in range(cfg.num_layers)]
    linear = linear_layers(cfg)
    if linear:
        return KVLayout.for_layers(windows, linear=linear)
    if not cfg.has_layer_shapes:
        return KVLayout.for_layers(windows)
    layers = range(cfg.num_layers)
    return KVLayout.for_layers(windows, [cfg.kv_shape(i) for i in layers], [cfg.kv_source(i) for i in layers])


def kv_shapes(cfg: ModelConfig, layout: KVLayout) -> list[tuple[int, int]]:
    """The distinct (KV heads, head size) of the layout's groups, in order: one tensor each."""
    shapes: list[tuple[int, int]] = []
    for shape in kv_shapes_of_groups(cfg, layout):
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def kv_shapes_of_groups(cfg: ModelConfig, layout: KVLayout) -> list[tuple[int, int]]:
    """Each group's (KV heads, head size)."""
    return [group.shape if group.shape is not None else (cfg.num_kv_heads, cfg.head_dim)  # type: ignore[misc]
            for group in layout.groups]


def linear_layers(cfg: ModelConfig) -> list[int]:
    """The model's linear-attention layers (none but in a hybrid model)."""
    return [i for i in range(cfg.num_layers) if cfg.is_linear(i)] if cfg.has_linear_layers else []


def state_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One state slot: every linear layer's conv state (in `dtype`) and recurrent state (float32)."""
    if cfg.linear_attention is None:
        return 0
    conv, recurrent = cfg.linear_attention.state_shapes
    itemsize = torch.empty((), dtype=dtype).element_size()
    return len(linear_layers(cfg)) * (math.prod(conv) * itemsize + math.prod(recurrent) * 4)


def state_slots_for(budget: float, cfg: ModelConfig, dtype: torch.dtype, max_num_seqs: int) -> tuple[int, int]:
    """(state slots, sequences that may hold one at once) from a KV budget in bytes: a working
    slot per sequence seat (at most half the budget: fewer seats where it holds fewer) and one
    spare, plus checkpoints (STATE_CHECKPOINT_SHARE, STATE_CHECKPOINTS_PER_SEAT). (0, 0) for a
    model without linear layers."""
    per_slot = state_bytes_per_slot(cfg, dtype)
    if not per_slot:
        return 0, 0
    seats = min(max_num_seqs, int(budget / 2 // per_slot) - 1)
    if seats < 1:
        raise ValueError(f"kv_cache_memory holds no sequence's state ({per_slot / 2**20:.1f} MiB each): raise it")
    checkpoints = min(STATE_CHECKPOINTS_PER_SEAT * max_num_seqs, int(budget * STATE_CHECKPOINT_SHARE // per_slot))
    return seats + 1 + checkpoints, seats


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_format: str | None = None) -> int:
    """K and V of one block: its group_size layers (all of them without sliding layers), in each
    shape; in 8 bits (`kv_format`), a byte an element and one a (token, KV head) for its exponent."""
    layout = kv_layout(cfg)
    shapes = kv_shapes(cfg, layout)
    if kv_format is None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_token = sum(heads * head_dim for heads, head_dim in shapes) * itemsize
    else:
        per_token = sum(heads * head_dim + heads for heads, head_dim in shapes)
    return 2 * layout.group_size * block_size * per_token


def device_memory(device: torch.device) -> DeviceMemory | None:
    """CUDA: the device's memory in use, for the status page (None on the CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(used_bytes=total - free, total_bytes=total)


def available_memory(device: torch.device) -> int:
    """Free memory on the device now: CUDA's free bytes, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks_for(memory: float, cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   kv_format: str | None = None) -> int:
    """`memory` is bytes (> 1) or a fraction (0, 1] of the device's free memory."""
    budget = memory * available_memory(device) if memory <= 1 else memory
    return int(budget // bytes_per_block(cfg, block_size, dtype, kv_format))


def auto_kv_cache_memory(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_num_batched_tokens: int,
                         max_num_seqs: int, max_model_len: int) -> float:
    """The KV cache budget `kv_cache_memory = "auto"` stands for, in bytes. On the host, 2 GiB.
    On CUDA (call it after the weights are on the device), 90% of the free device memory less
    twice an estimate of the step's activations, which come out of the same memory."""
    if device.type != "cuda":
        return 2 * 2**30
    itemsize = torch.empty((), dtype=dtype).element_size()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # one layer's live tensors per token: residual, norm, qkv, q copy, attention out, gate|up, silu*up
    # (a mixture of experts: each token's top-k rows through its experts, gathered and put back)
    experts = cfg.experts
    mlp = (cfg.intermediate_size if experts is None else
           max(cfg.intermediate_size, experts.top_k * experts.intermediate_size + 2 * experts.top_k * cfg.hidden_size))
    per_token = (3 * cfg.hidden_size + 3 * q + 2 * kv + 3 * mlp) * itemsize
    logits = max_num_seqs * cfg.vocab_size * 4 * 4  # float32 logits and the sampler's temporaries
    # a prefill chunk gathers its whole context (K and V) and masks it per query token
    gather = 2 * max_model_len * kv * itemsize + max_num_batched_tokens * max_model_len
    activations = max_num_batched_tokens * per_token + logits + gather
    return max(0.0, 0.9 * available_memory(device) - 2 * activations)


def host_blocks_for(swap_space_bytes: float, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                    kv_format: str | None = None) -> int:
    """Host blocks that fit in `swap_space_bytes` (0 turns swapping off)."""
    if swap_space_bytes < 0:
        raise ValueError(f"swap space must be >= 0 bytes, got {swap_space_bytes}")
    return int(swap_space_bytes // bytes_per_block(cfg, block_size, dtype, kv_format))


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 num_host_blocks: int = 0, num_state_slots: int = 0, num_host_state_slots: int = 0,
                 kv_format: str | None = None, num_tier_blocks: int = 0) -> None:
        """`kv_format`: K/V in 8 bits (kv_quant.FORMATS), None: in `dtype`. `num_tier_blocks`: the
        prefix cache's host tier (engine/kv/host_tier.py), host blocks like the swap space's."""
        if num_blocks < 1:
            raise ValueError("the KV cache has room for no block: raise kv_cache_memory")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.layout = layout = kv_layout(cfg)
        self.kv_format = kv_format
        self.bytes_per_block = bytes_per_block(cfg, block_size, dtype, kv_format)
        shapes = kv_shapes(cfg, layout)
        # per K/V shape: [group_size, 2 (K, V), num_blocks, block_size, n_kv_heads, head_dim]
        sizes = [(layout.group_size, 2, num_blocks, block_size, *shape) for shape in shapes]
        raw = [_zeroed(size, dtype if kv_format is None else torch.uint8, device) for size in sizes]
        # 8 bits: the codes as float8 (allocated as bytes: float8 has no zero-fill of its own), and
        # per shape [group_size, 2, num_blocks, block_size, n_kv_heads] int8 exponents
        self.storages = raw if kv_format is None else [t.view(kv_quant.FORMATS[kv_format][0]) for t in raw]
        self.exponents = [] if kv_format is None else [_zeroed(size[:-1], torch.int8, device) for size in sizes]
        self.storage = self.storages[0]  # (the one tensor of a model of one shape)
        # every block-indexed tensor (block dim 2), as the block copies move them
        self.block_tensors: list[torch.Tensor] = raw + self.exponents
        # per layer: (key_cache, value_cache), each [num_blocks, block_size, n_kv_heads, head_dim];
        # layers in the same slot of different groups share tensors (their groups' blocks differ)
        of_group = [shapes.index(shape) for shape in kv_shapes_of_groups(cfg, layout)]
        self.layers: list[tuple[Cache, Cache]] = [
            (self._layer_cache(of_group[group], slot, 0), self._layer_cache(of_group[group], slot, 1))
            for group, slot in layout.placement()]
        self.num_state_slots = num_state_slots
        self.state_bytes_per_slot = state_bytes_per_slot(cfg, dtype)
        self.states: StateTensors | None = None
        if layout.linear:
            if num_state_slots < 1:
                raise ValueError("a model with linear-attention layers needs state slots")
            self.states = StateTensors(cfg, len(layout.linear), num_state_slots, num_host_state_slots, dtype, device)
            for j, layer in enumerate(layout.linear):
                self.layers[layer] = (self.states.conv[j], self.states.recurrent[j])  # (in the model's dtype)
        # as block_tensors, [group_size, 2, num_host_blocks, ...] on the CPU; None when swapping is off
        self.host_storages: list[torch.Tensor] | None = None
        if num_host_blocks > 0:
            self.host_storages = [_host_zeroed((*t.shape[:2], num_host_blocks, *t.shape[3:]), t.dtype, device)
                                  for t in self.block_tensors]
        # the host tier's, block first ([num_tier_blocks, group_size, 2, ...]): a block is one
        # contiguous run, copied without a host sync (pinned memory, the copies in stream order)
        self.tier_storages = [_host_zeroed((num_tier_blocks, *t.shape[:2], *t.shape[3:]), t.dtype, device)
                              for t in self.block_tensors] if num_tier_blocks > 0 else None

    def _layer_cache(self, shape: int, slot: int, kv: int) -> Cache:
        """One layer's K (kv 0) or V (1): views of its shape's storages, [num_blocks, block_size,
        n_kv_heads, head_dim] (and 8-bit, its exponents [num_blocks, block_size, n_kv_heads])."""
        if self.kv_format is None:
            return self.storages[shape][slot, kv]
        return QuantizedCache(self.storages[shape][slot, kv], self.exponents[shape][slot, kv])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's contents into block dst, in every layer."""
        if not pairs:
            return
        device = self.storage.device
        src = device_tensor([s for s, _ in pairs], torch.int64, device)
        dst = device_tensor([d for _, d in pairs], torch.int64, device)
        for tensor in self.block_tensors:  # [group_size, 2, num_blocks, ...]
            tensor[:, :, dst] = tensor[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into host blocks, all layers at once: (device_block, host_block) pairs."""
        if pairs:
            _to_host(pairs, self.block_tensors, self._host())

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks into device blocks, all layers at once: (host_block, device_block) pairs."""
        if pairs:
            _from_host(pairs, self._host(), self.block_tensors)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """The host tier: evicted device blocks into its blocks, (device_block, tier_block) pairs.
        On CUDA the copies are queued on the stream (nothing on the host reads the tier: only a
        later onload, queued after them)."""
        assert not pairs or self.tier_storages is not None, "no host tier"
        for device_block, tier_block in pairs:
            for tier, tensor in zip(self.tier_storages, self.block_tensors):  # type: ignore[arg-type]
                tier[tier_block].copy_(tensor[:, :, device_block], non_blocking=True)

    def onload(self, pairs: list[tuple[int, int]]) -> None:
        """The host tier: its blocks back into device blocks, (tier_block, device_block) pairs,
        queued before the step's forward."""
        assert not pairs or self.tier_storages is not None, "no host tier"
        for tier_block, device_block in pairs:
            for tier, tensor in zip(self.tier_storages, self.block_tensors):  # type: ignore[arg-type]
                tensor[:, :, device_block].copy_(tier[tier_block], non_blocking=True)

    def apply_state_ops(self, ops: list[tuple[str, int, int]]) -> None:
        """The state slots' copies, in order (kv/state_slots.py)."""
        if ops:
            assert self.states is not None
            self.states.apply(ops)

    @property
    def host_storage(self) -> torch.Tensor | None:
        """The host tensor of a model of one shape (None when swapping is off)."""
        return self.host_storages[0] if self.host_storages else None

    def _host(self) -> list[torch.Tensor]:
        if self.host_storages is None:
            raise ValueError("no host blocks: swap space is 0")
        return self.host_storages


def _to_host(pairs: list[tuple[int, int]], tensors: list[torch.Tensor], hosts: list[torch.Tensor]) -> None:
    device_idx = device_tensor([d for d, _ in pairs], torch.int64, tensors[0].device)
    host_idx = torch.tensor([h for _, h in pairs])
    for host, tensor in zip(hosts, tensors):  # [group_size, 2, len(pairs), block_size, n_kv_heads(, head_dim)]
        host[:, :, host_idx] = tensor[:, :, device_idx].cpu()


def _from_host(pairs: list[tuple[int, int]], hosts: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    host_idx = torch.tensor([h for h, _ in pairs])
    device_idx = device_tensor([d for _, d in pairs], torch.int64, tensors[0].device)
    for host, tensor in zip(hosts, tensors):
        tensor[:, :, device_idx] = to_device(host[:, :, host_idx], tensor.device)


def _host_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # NOTE: pinned (page-locked), as the copies to and from it cross PCIe; zeroed, like the
        # device cache, because a swapped-in partial block brings its unwritten slots.
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return _zeroed(shape, dtype, torch.device("cpu"))


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. Zeros matter: attention reads (and masks) never-written slots, and
    masked garbage that happens to be NaN would still poison the softmax."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # NOTE: an anonymous mapping is zero-filled by the kernel page by page on first touch, so a
    # large cache costs nothing at start-up (torch.zeros would fault in every page: ~1.2 s/GiB).
    n_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(n_bytes, 1))
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


class StateTensors:
    """The linear layers' state slots: conv [L, S, K-1, C] in the model dtype and recurrent
    [L, S, Hv, dk, dv] in float32 (L linear layers, S slots), and their host copies for swap."""

    def __init__(self, cfg: ModelConfig, num_linear: int, num_slots: int, num_host_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        assert cfg.linear_attention is not None
        conv, recurrent = cfg.linear_attention.state_shapes
        self.conv = _zeroed((num_linear, num_slots, *conv), dtype, device)
        self.recurrent = _zeroed((num_linear, num_slots, *recurrent), torch.float32, device)
        self.host: tuple[torch.Tensor, torch.Tensor] | None = None
        if num_host_slots:
            self.host = (_host_zeroed((num_linear, num_host_slots, *conv), dtype, device),
                         _host_zeroed((num_linear, num_host_slots, *recurrent), torch.float32, device))

    def apply(self, ops: list[tuple[str, int, int]]) -> None:
        for op, a, b in ops:
            for device, host in zip((self.conv, self.recurrent), self.host or (None, None)):
                if op == "copy":
                    device[:, b] = device[:, a]
                elif op == "out":
                    assert host is not None, "no host state slots: swap space is 0"
                    host[:, b] = device[:, a].cpu()
                else:  # "in"
                    assert host is not None, "no host state slots: swap space is 0"
                    device[:, b] = to_device(host[:, a], device.device)
