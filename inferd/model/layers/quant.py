"""Packed (quantized) weights for the CPU: how they are read from a checkpoint and packed at load.
The products over them are inferd.model.layers.linear's.

    weights = "bf16"   dense, in the serving dtype (F.linear); the CUDA path always
    weights = "int4"   4-bit codes in groups of 32 along the input: GGUF's Q4_0 / Q4_1 blocks
                       kept exactly as stored, anything else quantized at load
    weights = "int8"   8-bit codes, one scale per output row, quantized at load
    weights = "auto"   what the GGUF file stores: Q4_0 / Q4_1 as int4, Q8_0 as int8, the
                       rest (and every Hugging Face folder) dense
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inferd.kernels import ops

GROUP = 32  # int4 group size along the input dimension (GGUF's Q4 block size too)
_LINEAR = {"q", "k", "v", "o", "gate", "up", "down", "q_gate"}
_LINEAR_ATTENTION = {"qkv", "z", "out"}  # a Gated DeltaNet's large products (layers.N.linear.*)
_AUTO = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}  # GGUF type -> what "auto" packs it as


def is_linear(name: str) -> bool:
    """A canonical tensor name (inferd.model.loading.loader) that a product reads: packable."""
    last = name.rsplit(".", 1)[-1]
    return name == "lm_head" or last in _LINEAR or ".linear." in name and last in _LINEAR_ATTENTION


@dataclass
class Int4Codes:
    """Unpacked 4-bit weights: w[n, k] = codes[n, k] * scale[n, k // 32] + minimum[n, k // 32]."""

    codes: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K // GROUP] float32
    minimum: torch.Tensor  # [N, K // GROUP] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        n, k = self.codes.shape
        w = self.codes.float().view(n, k // GROUP, GROUP) * self.scale[..., None] + self.minimum[..., None]
        return w.view(n, k)

    @staticmethod
    def cat(parts: list[Int4Codes]) -> Int4Codes:
        return Int4Codes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "minimum")))


@dataclass
class Int8Codes:
    """w[n, k] = codes[n, k] * scale[n]."""

    codes: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return self.codes.float() * self.scale[:, None]


@dataclass
class Q8Blocks:
    """w[n, k] = codes[n, k] * scale[n, k // 32]: GGUF's Q8_0 (block products only, BlockLinear)."""

    codes: torch.Tensor  # [N, K] int8, -127..127
    scale: torch.Tensor  # [N, K // GROUP] float32 (float16 values)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        n, k = self.codes.shape
        return (self.codes.float().view(n, k // GROUP, GROUP) * self.scale[..., None]).view(n, k)


def q8_from_gguf(raw: np.ndarray, type_name: str) -> Q8Blocks | None:
    """Q8_0 blocks (`raw`: uint8 [N, row_bytes]: {fp16 d, 32 int8 codes}, w = q * d) exactly;
    None for other types."""
    if type_name != "Q8_0":
        return None
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 2 + GROUP)  # [N, K / 32, 34]
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
    return Q8Blocks(torch.from_numpy(codes), torch.from_numpy(scale))


def int4_from_gguf(raw: np.ndarray, type_name: str) -> Int4Codes | None:
    """Q4_0 / Q4_1 blocks (`raw`: uint8 [N, row_bytes]) as codes, scales and minimums, exactly;
    None for other types. Q4_1: {fp16 d, fp16 m, 16 bytes}, w = q * d + m; Q4_0: {fp16 d,
    16 bytes}, w = (q - 8) * d. Byte j holds weight j (low nibble) and j + 16 (high)."""
    head = {"Q4_0": 2, "Q4_1": 4}.get(type_name)
    if head is None:
        return None
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, head + GROUP // 2)  # [N, K / 32, block bytes]
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        minimum = -8.0 * scale
    packed = blocks[..., head:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)  # [N, K]
    return Int4Codes(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(minimum))


def quantize_int4(w: torch.Tensor) -> Int4Codes:
    """Asymmetric 4-bit, one (scale, minimum) per group of 32 inputs, from the group's range."""
    n, k = w.shape
    groups = w.float().view(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-10)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Codes(codes.view(n, k), scale, low)


def quantize_int8(w: torch.Tensor) -> Int8Codes:
    """Symmetric 8-bit, one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(-1) / 127).clamp(min=1e-10)
    return Int8Codes((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale)


def packable(shape: tuple[int, ...]) -> bool:
    """What torch's int4 packing takes: outputs a multiple of 16, inputs of the group."""
    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % GROUP == 0


Weight = torch.Tensor | Int4Codes | Int8Codes | Q8Blocks


def fuse(parts: list[Weight], dtype: torch.dtype | None = None) -> Weight:
    """One weight for several stacked outputs (q/k/v, gate/up): of one kind, or else dense (in
    the dense parts' dtype, else `dtype`, else float32)."""
    if all(isinstance(p, Int4Codes) for p in parts):
        return Int4Codes.cat(parts)  # type: ignore[arg-type]
    if all(isinstance(p, Q8Blocks) for p in parts):
        return Q8Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))  # type: ignore[union-attr]
    if all(isinstance(p, Int8Codes) for p in parts):
        return Int8Codes(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))  # type: ignore[union-attr]
    dense = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), dtype or torch.float32)
    return torch.cat([d.to(dtype) for d in dense])



def blocks_fit(shape: tuple[int, ...]) -> bool:
    """This machine runs the block products (linear.BlockLinear), and on this shape (outputs in
    tiles of 16)."""
    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % GROUP == 0 and ops.block_products_available()


def pack(weight: Weight, mode: str) -> Weight:
    """A dense weight quantized for `mode` (int4 / int8) where torch's kernels take its shape."""
    if not isinstance(weight, torch.Tensor) or mode not in ("int4", "int8"):
        return weight
    if mode == "int4" and packable(tuple(weight.shape)):
        return quantize_int4(weight)
    if weight.shape[-1] % 16:  # (torch's int8 product crashes on such inputs from two rows on)
        return weight
    return quantize_int8(weight)


def pack_weights(tensors: dict[str, Weight], mode: str, stored_types: dict[str, str],
                 tied: bool, head_blocks: Q8Blocks | None = None) -> dict[str, Weight]:
    """The linear layers' weights packed for `mode`; a tied head gets its own packed copy of the
    embedding (the lookup keeps the dense one). `head_blocks`: the head's Q8_0 blocks as stored."""
    packed = dict(tensors)
    stored = dict(stored_types)
    if tied:
        packed["lm_head"], stored["lm_head"] = tensors["embed"], stored_types.get("embed", "")
    for name, weight in packed.items():
        if name == "lm_head":
            # the head reads only the sampled rows; auto leaves it dense (torch's int8 product is
            # 2-3x slower than bf16 from ~16 rows on), but for Q8_0 blocks on the block products,
            # which take them as stored; int4 is too coarse for it (perplexity +7% on the default
            # model, against +0.2% for int8: bench/RESULTS.md)
            if mode != "auto":
                packed[name] = pack(weight, "int8")
            elif head_blocks is not None and blocks_fit(head_blocks.shape):
                packed[name] = head_blocks
        elif is_linear(name):
            packed[name] = pack(weight, _AUTO.get(stored.get(name, ""), "bf16") if mode == "auto" else mode)
    if tied and isinstance(packed["lm_head"], torch.Tensor):
        del packed["lm_head"]  # left dense: the embedding itself
    return packed

