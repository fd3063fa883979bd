"""Our block products (inferd/kernels/csrc/cpu_matmul.cpp) against their specification, the
float64 reference in inferd.kernels.reference, and a row's bits alone against the same row in
batches of 1 to 64 rows."""

from __future__ import annotations

import pytest
import torch

from gguf.quants import dequantize

from inferd.kernels import cpu, reference
from inferd.model import quant
from inferd.model.gguf_file import GGUFFile
from inferd.model.loader import default_model_path

pytestmark = pytest.mark.skipif(not cpu.block_matmul_available(),
                                reason="the block products need a CPU with AVX-512 VNNI (and the kernels built)")


def _int4(n: int, k: int, seed: int) -> quant.Int4Codes:
    torch.manual_seed(seed)
    return quant.quantize_int4(torch.randn(n, k) * 0.05)


def _q8(n: int, k: int, seed: int) -> quant.Q8Blocks:
    torch.manual_seed(seed)
    scale = (torch.rand(n, k // 32) * 0.001 + 1e-4).to(torch.float16).float()
    return quant.Q8Blocks(torch.randint(-127, 128, (n, k), dtype=torch.int8), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 48, 576), (9, 1536, 576), (33, 576, 1536)])
def test_block_products_match_the_reference(dtype: torch.dtype, bits: int, m: int, n: int, k: int) -> None:
    weight = _int4(n, k, m + n) if bits == 4 else _q8(n, k, m + n)
    layer = quant.BlockLinear(weight.codes, weight.scale, getattr(weight, "minimum", None), None)
    x = torch.randn(m, k).to(dtype)
    x[0, :32] = 0  # a block of zeros: scale 0
    got = layer(x)
    expected = reference.block_matmul(x, layer.codes, layer.scale, layer.minimum)
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected.to(dtype).double(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_product_is_near_the_dense_one(bits: int) -> None:
    """Quantizing the activations to 8 bits per block costs ~1% of a product's size."""
    weight = _int4(256, 576, 5) if bits == 4 else _q8(256, 576, 5)
    layer = quant.BlockLinear(weight.codes, weight.scale, getattr(weight, "minimum", None), None)
    x = torch.randn(8, 576)
    dense = x @ layer.dequantize().t()
    assert ((layer(x) - dense).norm() / dense.norm()).item() < 0.02


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_the_same_bits_at_batch_sizes_1_to_64(bits: int) -> None:
    weight = _int4(1536, 576, 1) if bits == 4 else _q8(1536, 576, 1)
    layer = quant.BlockLinear(weight.codes, weight.scale, getattr(weight, "minimum", None), None)
    row = torch.randn(1, 576, dtype=torch.bfloat16)
    alone = layer(row)[0]
    for batch in (2, 3, 7, 8, 9, 16, 31, 64):
        x = torch.randn(batch, 576, dtype=torch.bfloat16)
        at = batch // 2
        x[at] = row[0]
        assert torch.equal(layer(x)[at], alone), batch


def test_q8_0_blocks_are_kept_exactly_as_stored() -> None:
    """The default model's tied head: its Q8_0 embedding's codes and scales, as the file has them."""
    gguf = GGUFFile(default_model_path())
    info = gguf.tensors["token_embd.weight"]
    blocks = quant.q8_from_gguf(gguf.raw("token_embd.weight"), info.ggml_type.name)
    assert blocks is not None and blocks.codes.dtype == torch.int8
    expected = torch.from_numpy(dequantize(gguf.raw("token_embd.weight"), info.ggml_type).copy())
    assert torch.equal(blocks.dequantize(), expected)
