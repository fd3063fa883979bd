"""The paged KV cache tensors, sized from `kv_cache_memory`, allocated once at start-up, and the
host copy space that preempted sequences are swapped out to.

A block id is `group_size` layers' K/V (kv/groups.py): every layer for a model without sliding
layers; for a hybrid one, slot i of a block is layer i of whichever KV group holds the block.

Where layers differ in K/V shape (Gemma 4's full layers), each shape has its own tensor of every
block, and a group's layers use their shape's: a block id is then `group_size` layers' K/V in every
shape, of which the group holding it uses one (a model of one shape has one tensor, as always).
NOTE: so such a model's blocks cost the sum of its shapes; one pool per shape would not.
A KV-shared layer (Gemma 4) has no slot: its entry in `layers` is its source's tensors.

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
from inferd.model.families.config import ModelConfig
from inferd.kernels.tensors import device_tensor, to_device


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


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block: its group_size layers (all of them without sliding layers), in each shape."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout = kv_layout(cfg)
    per_token = sum(heads * head_dim for heads, head_dim in kv_shapes(cfg, layout))
    return 2 * layout.group_size * block_size * per_token * itemsize


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


def num_blocks_for(memory: float, cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """`memory` is bytes (> 1) or a fraction (0, 1] of the device's free memory."""
    budget = memory * available_memory(device) if memory <= 1 else memory
    return int(budget // bytes_per_block(cfg, block_size, dtype))


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


def host_blocks_for(swap_space_bytes: float, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Host blocks that fit in `swap_space_bytes` (0 turns swapping off)."""
    if swap_space_bytes < 0:
        raise ValueError(f"swap space must be >= 0 bytes, got {swap_space_bytes}")
    return int(swap_space_bytes // bytes_per_block(cfg, block_size, dtype))


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 num_host_blocks: int = 0, num_state_slots: int = 0, num_host_state_slots: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has room for no block: raise kv_cache_memory")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.layout = layout = kv_layout(cfg)
        self.bytes_per_block = bytes_per_block(cfg, block_size, dtype)
        shapes = kv_shapes(cfg, layout)
        # per K/V shape: [group_size, 2 (K, V), num_blocks, block_size, n_kv_heads, head_dim]
        self.storages = [_zeroed((layout.group_size, 2, num_blocks, block_size, *shape), dtype, device)
                         for shape in shapes]
        self.storage = self.storages[0]  # (the one tensor of a model of one shape)
        # per layer: (key_cache, value_cache), each [num_blocks, block_size, n_kv_heads, head_dim];
        # layers in the same slot of different groups share tensors (their groups' blocks differ)
        of_group = [shapes.index(shape) for shape in kv_shapes_of_groups(cfg, layout)]
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.storages[of_group[group]][slot, 0], self.storages[of_group[group]][slot, 1])
            for group, slot in layout.placement()]
        self.num_state_slots = num_state_slots
        self.state_bytes_per_slot = state_bytes_per_slot(cfg, dtype)
        self.states: StateTensors | None = None
        if layout.linear:
            if num_state_slots < 1:
                raise ValueError("a model with linear-attention layers needs state slots")
            self.states = StateTensors(cfg, len(layout.linear), num_state_slots, num_host_state_slots, dtype, device)
            for j, layer in enumerate(layout.linear):
                self.layers[layer] = (self.states.conv[j], self.states.recurrent[j])
        # as storages, [group_size, 2, num_host_blocks, ...] on the CPU; None when swapping is off
        self.host_storages: list[torch.Tensor] | None = None
        if num_host_blocks > 0:
            self.host_storages = [_host_zeroed((layout.group_size, 2, num_host_blocks, block_size, *shape), dtype,
                                               device) for shape in shapes]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's contents into block dst, in every layer."""
        if not pairs:
            return
        device = self.storage.device
        src = device_tensor([s for s, _ in pairs], torch.int64, device)
        dst = device_tensor([d for _, d in pairs], torch.int64, device)
        for storage in self.storages:
            for key_cache, value_cache in storage:  # (each slot once)
                key_cache[dst] = key_cache[src]
                value_cache[dst] = value_cache[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into host blocks, all layers at once: (device_block, host_block) pairs."""
        if not pairs:
            return
        device_idx = device_tensor([d for d, _ in pairs], torch.int64, self.storage.device)
        host_idx = torch.tensor([h for _, h in pairs])
        for host, storage in zip(self._host(), self.storages):
            # [group_size, 2, len(pairs), block_size, n_kv_heads, head_dim]
            host[:, :, host_idx] = storage[:, :, device_idx].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks into device blocks, all layers at once: (host_block, device_block) pairs."""
        if not pairs:
            return
        host_idx = torch.tensor([h for h, _ in pairs])
        device_idx = device_tensor([d for _, d in pairs], torch.int64, self.storage.device)
        for host, storage in zip(self._host(), self.storages):
            # [group_size, 2, len(pairs), block_size, n_kv_heads, head_dim]
            storage[:, :, device_idx] = to_device(host[:, :, host_idx], storage.device)

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
