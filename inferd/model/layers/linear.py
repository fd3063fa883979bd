"""Linear layers: dense, or over packed weights (inferd.model.layers.quant) on the CPU.

On a CPU with AVX-512 VNNI the int4 layers (and, under "auto", the head: 8-bit codes in blocks
of 32, as GGUF's Q8_0 stores the default model's tied embedding) run on our block products
(`BlockLinear`, inferd/kernels/cpu/csrc/cpu_matmul.cpp): activations quantized to 8 bits per block
of 32 (16 for the layers whose inputs have outliers: the decoder's qkv and down), integer dot
products, llama.cpp's arithmetic; they read a quarter of bf16's bytes (their
time per step: bench/kernels/profile_decode.py --batch N). Where the CPU has AMX, a layer's calls
from a measured row count run on int8 tiles instead, the same bits (`BlockLinear.tile_rows`), and
if the tiles beat the dense copy on a prompt's rows, prompts take them too and no copy is kept
(inferd/kernels/cpu/tiles.py). Elsewhere the products are torch's
packed CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`): 2-5x faster than
bf16 at a few rows, slower from ~16. Every one of them gives a row the same result whatever
else shares the call (tests/engine/test_batch_invariance.py), which the default,
batch-invariant configuration relies on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferd.kernels import ops
from inferd.model.layers.mxfp4 import Mxfp4Weight
from inferd.model.layers.quant import GROUP, Int4Codes, Int8Codes, Q8Blocks, Weight, blocks_fit


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.min_rows = 1  # 2: batch-invariant (see `linear`)

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.min_rows)


class Int4Linear:
    def __init__(self, weight: Int4Codes, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        # the kernel computes (code - 8) * scale + zero: zero = minimum + 8 * scale
        self.scales_zeros = torch.stack([weight.scale.t(), (weight.minimum + 8 * weight.scale).t()], -1)
        self.scales_zeros = self.scales_zeros.to(dtype).contiguous()  # [K / 32, N, 2], in the activations' dtype
        self.bias = bias

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weights this layer multiplies by (its scales and zeros as rounded to the activations'
        dtype), in float32: the reference of the golden tests."""
        k, n = self.scales_zeros.shape[0] * GROUP, self.out_features
        # (code - 8) * 1 + 8: the codes themselves, exact in bf16 (whose product is the fast one)
        unit = torch.zeros(self.scales_zeros.shape, dtype=torch.bfloat16)
        unit[..., 0], unit[..., 1] = 1, 8
        codes = torch._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), self.packed, GROUP, unit)
        codes = codes.float().t().reshape(n, k // GROUP, GROUP)
        scale, zero = (t.float().t()[..., None] for t in self.scales_zeros.unbind(-1))  # [N, K / 32, 1]
        return ((codes - 8) * scale + zero).reshape(n, k)


class Int8Linear:
    def __init__(self, weight: Int8Codes, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.codes = weight.codes.contiguous()  # [N, K] int8
        self.scale = weight.scale.to(dtype)  # [N]
        self.bias = bias

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x, self.codes, self.scale)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float()[:, None]


class BlockLinear:
    """A product on our block kernels (inferd.kernels.ops.block_matmul): `bits` 4 (Int4Codes:
    code * scale + minimum) or 8 (code * scale, codes -127..127), per block of 32 inputs, the
    scales (and minimums) held in float16 as GGUF stores them. `activation_bits`: the inputs
    quantized to 8 bits per block, or to 16 (4-bit weights only: twice the integer work, for a
    layer whose inputs have outliers inside a block)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                 bias: torch.Tensor | None, activation_bits: int = 8) -> None:
        n, k = codes.shape
        self.out_features, self.bits = n, 4 if minimum is not None else 8
        assert activation_bits == 8 or (activation_bits == 16 and self.bits == 4), (activation_bits, self.bits)
        self.activation_bits = activation_bits
        self.bias = bias
        tiles, blocks = n // 16, k // GROUP
        half = [t.to(torch.float16).view(tiles, 16, blocks).transpose(1, 2).contiguous()
                for t in (scale, minimum) if t is not None]  # [tiles, blocks, 16] each
        if self.bits == 4:
            c = codes.view(tiles, 16, blocks, GROUP)
            nibbles = c[..., :16] | (c[..., 16:] << 4)  # byte q: code q (low nibble), code 16 + q (high)
            # vector j, lane n, byte i: the lane's inputs 4j .. 4j + 3 (and 16 + 4j ..)
            body = nibbles.view(tiles, 16, blocks, 4, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)
            tail = [h.view(torch.uint8) for h in half]  # scales, minimums
        else:
            c = codes.view(tiles, 16, blocks, GROUP)
            body = c.view(tiles, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 512).view(torch.uint8)
            # the kernel feeds activations as unsigned (q + 128): starting each sum at -128 x the
            # block's codes takes the offset back out, exactly
            offset = (-128 * c.sum(-1, dtype=torch.int32)).transpose(1, 2).contiguous()  # [tiles, blocks, 16]
            tail = [half[0].view(torch.uint8), offset.view(torch.uint8)]
        self.weight = torch.cat([body, *tail], dim=-1).contiguous()  # uint8 [tiles, blocks, 320 | 608]
        self.in_features = k
        # nothing else is kept: the codes and scales are read back from the blob on demand (unpack)
        # calls of at least this many rows run on AMX tiles (the same bits); None: all on VNNI
        self.tile_rows = ops.tile_rows(self.weight, self.bits, activation_bits)

    @staticmethod
    def fits(shape: tuple[int, ...]) -> bool:
        """This machine runs the block products, and on this shape (outputs in tiles of 16)."""
        return blocks_fit(shape)

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        if self.tile_rows is not None and x.shape[0] >= self.tile_rows:
            y = ops.block_matmul_tiles(x, self.weight, self.bits, self.activation_bits)
        else:
            y = ops.block_matmul(x, self.weight, self.bits, self.activation_bits)
        return y if self.bias is None else y + self.bias

    def unpack(self, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows [start, end) of the packed weights (multiples of 16) as the kernel holds them: codes
        [rows, K] (uint8 0..15, or int8), scales float32 [rows, K / 32] and (4 bits) minimums, or None."""
        end = self.out_features if end is None else min(end, self.out_features)
        assert start % 16 == 0 and end % 16 == 0, (start, end)
        blob = self.weight[start // 16:end // 16]  # [tiles, blocks, bytes]
        tiles, blocks = blob.shape[:2]
        if self.bits == 4:
            nibbles = blob[..., :256].reshape(tiles, blocks, 4, 16, 4).permute(0, 3, 1, 2, 4)  # [tiles, 16, blocks, 4, 4]
            codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3)  # inputs 0..15, then 16..31
            tail = 256
        else:
            codes = blob[..., :512].reshape(tiles, blocks, 8, 16, 4).permute(0, 3, 1, 2, 4).view(torch.int8)
            tail = 512
        codes = codes.reshape(end - start, blocks * GROUP)

        def halves(at: int) -> torch.Tensor:  # 16 float16 per tile and block -> [rows, blocks] float32
            return blob[..., at:at + 32].contiguous().view(torch.float16).transpose(1, 2).reshape(end - start, blocks).float()

        return codes, halves(tail), halves(tail + 32) if self.bits == 4 else None

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) of the weights this layer multiplies by, [rows, K] float32."""
        codes, scale, minimum = self.unpack(start, end)
        n, k = codes.shape
        w = codes.float().view(n, k // GROUP, GROUP) * scale[:, :, None]
        if minimum is not None:
            w = w + minimum[:, :, None]
        return w.view(n, k)


# Prompts of at least this many tokens prefill on a packed layer's dense copy; shorter ones, and
# every decode row, on the packed product. A property of the request, never of the batch.
# (torch's int4 product costs ~6.5 us a row on a 576 x 960 layer against ~4.7 for bf16 GEMM
# rows, but bf16 reads all 270 MB of weights whatever the row count: a 7-token prompt beside 7
# decodes took 56 ms dense against 23 ms for the decodes alone.)
DENSE_PREFILL_MIN_TOKENS = 64


class SplitLinear:
    """A decoder layer's product on packed weights. The first `dense_rows` rows (long prompts'
    prefill rows, which the runner puts first) go through a dense copy of the same weights,
    where GEMMs win (~2x on a 1,024-token window); the rest through the packed product, which
    reads a quarter of the bytes. Which kernel a row meets depends on its request, never on
    the batch: rows stay batch-invariant."""

    def __init__(self, packed: Int4Linear | Int8Linear, dense: DenseLinear) -> None:
        self.packed = packed
        self.dense = dense

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        p = dense_rows
        if p == 0:
            return self.packed(x)
        if p == x.shape[0]:
            return self.dense(x)
        return torch.cat([self.dense(x[:p]), self.packed(x[p:])])


class Mxfp4Linear:
    """A product over weights kept in MXFP4 (a GPU's gpt-oss experts): dequantized into the
    activations' dtype at each call, then a dense product; only the experts a step routes to pay it."""

    def __init__(self, weight: Mxfp4Weight, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize(x.dtype), self.bias)

    def dequantize(self) -> torch.Tensor:
        return self.weight.dequantize()


Linear = DenseLinear | Int4Linear | Int8Linear | BlockLinear | SplitLinear | Mxfp4Linear


def make_linear(weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype, split: bool = False,
                wide_inputs: bool = False) -> Linear:
    """The product for `weight`; `split`: a packed one keeps a dense copy for prefill rows;
    `wide_inputs`: the block products take this layer's inputs at 16 bits where its weights are 4."""
    if isinstance(weight, torch.Tensor):
        return DenseLinear(weight, bias)
    if isinstance(weight, Mxfp4Weight):
        return Mxfp4Linear(weight, bias)
    packed: Int4Linear | Int8Linear | BlockLinear
    if isinstance(weight, Int4Codes | Q8Blocks) and BlockLinear.fits(weight.shape):
        activation_bits = 16 if wide_inputs and isinstance(weight, Int4Codes) else 8
        packed = BlockLinear(weight.codes, weight.scale, getattr(weight, "minimum", None), bias, activation_bits)
    elif isinstance(weight, Q8Blocks):
        return DenseLinear(weight.dequantize().to(dtype), bias)
    elif isinstance(weight, Int4Codes):
        packed = Int4Linear(weight, bias, dtype)
    else:
        packed = Int8Linear(weight, bias, dtype)
    if not split:
        return packed
    if isinstance(packed, BlockLinear) and ops.tiles_beat_dense(packed.weight, packed.bits, packed.activation_bits):
        return packed  # prompts too on AMX tiles: no dense copy made (their quality: bench/RESULTS.md, issue 44)
    return SplitLinear(packed, DenseLinear(dense_copy(weight, packed, dtype), bias))


_DENSE_COPY_ROWS = 128  # rows of a dense copy computed at once (see dense_copy)


def dense_copy(weight: Int4Codes | Int8Codes, packed: Int4Linear | Int8Linear | BlockLinear,
               dtype: torch.dtype) -> torch.Tensor:
    """The weights `packed` multiplies by, as [N, K] in `dtype` (row-major: a bf16 GEMM over a
    column-major weight took 20x longer on a CPU without AVX-512 BF16). For int4, from the codes
    read at load and the scales and zeros as the kernel holds them: `packed.dequantize()`'s numbers,
    without its identity product (most of a bf16 load's time), computed in float32 a slice of rows
    at a time (the slice stays in cache: ~3x faster than whole-tensor passes, the same bits)."""
    if isinstance(packed, BlockLinear):
        dense = torch.empty(packed.out_features, packed.in_features, dtype=dtype)
        for start in range(0, packed.out_features, _DENSE_COPY_ROWS):
            dense[start:start + _DENSE_COPY_ROWS] = packed.dequantize(start, start + _DENSE_COPY_ROWS)
        return dense
    if not isinstance(weight, Int4Codes) or not isinstance(packed, Int4Linear):
        return packed.dequantize().to(dtype).contiguous()
    n, k = weight.shape
    dense = torch.empty(n, k, dtype=dtype)
    for start in range(0, n, _DENSE_COPY_ROWS):
        end = min(n, start + _DENSE_COPY_ROWS)
        scale, zero = (t.float().t()[..., None] for t in packed.scales_zeros[:, start:end].unbind(-1))  # [rows, K / 32, 1]
        rows = weight.codes[start:end].float().view(end - start, k // GROUP, GROUP)
        dense[start:end] = rows.sub_(8).mul_(scale).add_(zero).view(end - start, k)
    return dense


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int) -> torch.Tensor:
    """F.linear, with at least `min_rows` rows. NOTE: on the CPU, oneDNN's bf16 product takes
    another path for one row than for two or more, and real activations then differ in the
    last bits (random test data does not show it); rows 2..N are bit-identical to each other.
    So the batch-invariant mode (min_rows 2) runs a lone row beside a zero row."""
    if x.shape[0] < min_rows:
        padded = torch.cat([x, x.new_zeros(min_rows - x.shape[0], x.shape[1])])
        return F.linear(padded, weight, bias)[: x.shape[0]]
    return F.linear(x, weight, bias)
