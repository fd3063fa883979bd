"""MXFP4 (OCP microscaling FP4), how gpt-oss checkpoints store their experts: blocks of 32 values,
each a 4-bit e2m1 float (sign, 2 exponent bits, 1 mantissa bit: 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6),
sharing one 8-bit exponent (E8M0: 2^(e - 127)). Two values per byte, the first in the low nibble.

    blocks  uint8 [..., rows, K / 32, 16]
    scales  uint8 [..., rows, K / 32]

Every e2m1 value times 2 is an integer in -12..12, so a block is exactly 8-bit codes (2·v) with the
scale 2^(e - 128): the block products' Q8 layout (quant.Q8Blocks) holds MXFP4 without rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inferd.model.layers.quant import Q8Blocks

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8 (got {blocks.dtype} and {scales.dtype})")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")


@dataclass
class Mxfp4Weight:
    """A matrix kept in MXFP4 as stored, dequantized where it is multiplied (linear.Mxfp4Linear): how
    a GPU holds gpt-oss's experts (the 120b's ~61 GB instead of ~230 GB in bf16)."""

    blocks: torch.Tensor  # uint8 [N, K / 32, 16]
    scales: torch.Tensor  # uint8 [N, K / 32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    def to(self, device: torch.device) -> Mxfp4Weight:
        return Mxfp4Weight(self.blocks.to(device), self.scales.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        return dequantize(self.blocks, self.scales, dtype)

    @staticmethod
    def cat(parts: list[Mxfp4Weight]) -> Mxfp4Weight:
        return Mxfp4Weight(torch.cat([p.blocks for p in parts]), torch.cat([p.scales for p in parts]))


def codes(blocks: torch.Tensor) -> torch.Tensor:
    """Each value times 2, as int8: [..., G, 16] uint8 -> [..., G, 32]."""
    doubled = torch.tensor([2 * v for v in E2M1], dtype=torch.int8)
    return torch.stack([doubled[(blocks & 0x0F).long()], doubled[(blocks >> 4).long()]], dim=-1).flatten(-2)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., rows, G, 16] blocks and [..., rows, G] scales -> [..., rows, G · 32] values."""
    _check(blocks, scales)
    exponent = scales.to(torch.int32) - 128  # (the codes are doubled)
    lookup = torch.tensor([2 * v for v in E2M1], dtype=torch.float32, device=blocks.device)
    values = torch.stack([lookup[(blocks & 0x0F).long()], lookup[(blocks >> 4).long()]], dim=-1).flatten(-2)
    return torch.ldexp(values, exponent[..., None].float()).flatten(-2).to(dtype)


def to_q8_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> Q8Blocks | None:
    """One matrix [rows, G, 16] as 8-bit codes per block of 32 with float16 scales, the same values;
    None where a scale lies outside float16's range (then the weights are dequantized instead)."""
    _check(blocks, scales)
    exponent = scales.to(torch.int32) - 128
    if int(exponent.min()) < -24 or int(exponent.max()) > 15:
        return None
    scale = torch.ldexp(torch.ones(exponent.shape), exponent.float())
    rows, groups = scales.shape
    return Q8Blocks(codes(blocks).reshape(rows, groups * BLOCK), scale)


def q8_from_gguf(raw: np.ndarray) -> Q8Blocks | None:
    """MXFP4 as a GGUF stores it (uint8 [rows, row bytes]: per block of 32 one E8M0 byte, then 16
    bytes whose low nibbles are values 0..15 and high nibbles 16..31) as 8-bit blocks; None where a
    scale lies outside float16's range."""
    rows = raw.shape[0]
    blocks = torch.from_numpy(raw.reshape(rows, -1, 1 + BLOCK // 2).copy())  # [rows, G, 17]
    exponent, nibbles = blocks[..., 0].to(torch.int32) - 128, blocks[..., 1:]
    if int(exponent.min()) < -24 or int(exponent.max()) > 15:
        return None
    doubled = torch.tensor([2 * v for v in E2M1], dtype=torch.int8)
    codes = torch.cat([doubled[(nibbles & 0x0F).long()], doubled[(nibbles >> 4).long()]], dim=-1)
    scale = torch.ldexp(torch.ones(exponent.shape), exponent.float())
    return Q8Blocks(codes.reshape(rows, -1), scale)
