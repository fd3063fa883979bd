"""Gemma 4 (text) token for token against transformers' Gemma4ForCausalLM: tiny random checkpoints
written by transformers (the harness is family_cases.py's), served by inferd's engine.

Two cases, between them every Gemma 4 switch inferd implements:
- "dense": five layers (sliding, sliding, full, sliding, full), the last two KV-shared (layer 3
  reads layer 1's cache, layer 4 layer 2's) with double-wide MLPs, per-layer inputs, full layers
  with their own head size (32 against 16), one KV head and keys as values, the proportional RoPE
  of full layers, the value norm, layer scalars;
- "moe": two layers, the MoE block beside the dense MLP (a router over the normed residual, a
  per-expert scale), a final soft-cap, an untied head.

Each feature is shown to matter: the same weights with it switched off in transformers give other
tokens. Features are made stronger than in real checkpoints, so that each shows in a tiny model
(layer scalars 0.5 to 0.9, router and expert scales of 1 ± 0.5).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import tiny_models as tm  # noqa: E402 - after the skips
from family_cases import (NEW_TOKENS, SMALL, WINDOW, Case, assert_alone_and_batched, chunked_engine,  # noqa: E402
                          generate, family_fixtures, switched_off)

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.engine.worker.kv_cache import bytes_per_block  # noqa: E402
from inferd.text.errors import ModelLoadError  # noqa: E402

SLIDING, FULL = "sliding_attention", "full_attention"
SOURCES = {3: 1, 4: 2}  # the dense case's KV-shared layers and the layers whose caches they read
HIDDEN, INTERMEDIATE = SMALL["hidden_size"], SMALL["intermediate_size"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def dense(vocab: int, **overrides: Any) -> Any:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    settings: dict[str, Any] = dict(
        vocab_size=vocab, head_dim=16, global_head_dim=32, sliding_window=WINDOW, tie_word_embeddings=True,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, attention_k_eq_v=True,
        num_global_key_value_heads=1, **SMALL | {"num_hidden_layers": 5})
    return Gemma4ForCausalLM(Gemma4TextConfig(**settings | overrides))


def moe(vocab: int) -> Any:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    return Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=vocab, head_dim=16, global_head_dim=32, sliding_window=WINDOW, tie_word_embeddings=False,
        layer_types=[SLIDING, FULL], hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=24, final_logit_softcapping=30.0, **SMALL))


def strengthen(model: Any) -> Any:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.1 * i)
            if model.config.enable_moe_block:
                for scale in (layer.router.scale, layer.router.per_expert_scale):
                    scale.copy_(1 + 0.5 * torch.randn(scale.shape, generator=gen))
    return model


FAMILIES: dict[str, Callable[[int], Any]] = {"dense": dense, "moe": moe}


cases, case = family_fixtures(FAMILIES, prepare=strengthen)


def test_greedy_alone_and_in_a_ragged_batch_match_transformers(case: Case) -> None:
    assert min(len(p) for p in case.prompts) + NEW_TOKENS > WINDOW + 16  # the window's edge is crossed
    assert_alone_and_batched(case)


def test_small_prefill_chunks_match_transformers(case: Case) -> None:
    assert generate(chunked_engine(case), case.prompts) == case.reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_prefill_chunks_and_preemption_match_transformers(mode: str, cases: Callable[[str], Case]) -> None:
    """Blocks of 4, chunks of 5, a pool too small for the running set: preempted sequences come
    back by recomputing, or from host copies of every K/V shape's blocks."""
    from inferd.settings.policy import SchedulingPolicy

    case = cases("dense")
    per_block = bytes_per_block(case.engine.model_config, 4, torch.float32)
    engine = LLMEngine.from_config(EngineConfig.of(
        model=str(case.folder), dtype="float32", block_size=4, max_num_batched_tokens=5,
        kv_cache_memory=30 * per_block, swap_space=64 * per_block, policy=SchedulingPolicy(preemption_mode=mode)))
    assert engine.block_manager.pool.num_blocks == 30
    assert generate(engine, case.prompts) == case.reference
    assert engine.scheduler.preemptions[mode] > 0, engine.scheduler.preemptions
    assert engine.block_manager.num_free_host_blocks == engine.block_manager.num_host_blocks


def test_kv_shared_layers_hold_no_blocks_and_read_their_sources_cache(cases: Callable[[str], Case]) -> None:
    engine = cases("dense").engine
    cache, cfg = engine.kv_cache, engine.model_config
    assert cfg.kv_sources == (0, 1, 2, 1, 2)
    # three groups of one layer (a full one, two sliding ones), none of them a shared layer's
    assert [(g.window, g.layers) for g in cache.layout.groups] == [(None, (2,)), (WINDOW, (0,)), (WINDOW, (1,))]
    assert len(engine.block_manager.windows) == 3
    for layer, source in SOURCES.items():
        for mine, theirs in zip(cache.layers[layer], cache.layers[source]):  # (K, V): the same memory
            assert (mine.data_ptr(), mine.shape) == (theirs.data_ptr(), theirs.shape)
    # a tensor per K/V shape: sliding layers' 2 heads of 16, full layers' 1 head of 32
    assert [tuple(s.shape[-2:]) for s in cache.storages] == [(1, 32), (2, 16)]
    assert cache.bytes_per_block == 2 * 1 * cache.block_size * (1 * 32 + 2 * 16) * 4
    assert cache.bytes_per_block == sum(s[:, :, :1].nbytes for s in cache.storages)


def test_the_config_is_read_into_its_switches(cases: Callable[[str], Case]) -> None:
    cfg = cases("dense").engine.model_config
    assert (cfg.architecture, cfg.norm_offset, cfg.norm_float32, cfg.activation) == ("gemma4", 0.0, True, "gelu_tanh")
    assert (cfg.head_dim, cfg.full_head_dim, cfg.num_kv_heads, cfg.full_kv_heads) == (16, 32, 2, 1)
    assert (cfg.keys_as_values, cfg.value_norm, cfg.double_wide_mlp, cfg.attention_scale) == (True, True, True, 1.0)
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (8, cfg.vocab_size)
    assert cfg.rope().kind == "proportional" and cfg.rope().rotary_dim == 32 and cfg.partial_rotary_factor == 1.0
    assert cfg.rope(local=True).kind == "default" and cfg.rope(local=True).rotary_dim == 16
    assert [cfg.intermediate_of(i) for i in range(5)] == [INTERMEDIATE] * 3 + [2 * INTERMEDIATE] * 2
    experts = cases("moe").engine.model_config.experts
    assert experts is not None and (experts.top_k, experts.router_norm_eps, experts.expert_scale) == (2, 1e-6, True)


def test_tokens_routed_per_expert_are_counted(cases: Callable[[str], Case]) -> None:
    case = cases("moe")
    mixtures = case.engine.model.mixtures()
    before = mixtures[0].routed.clone()
    fresh = case.prompts[0][::-1]  # (not in the prefix cache: every token is computed)
    generate(case.engine, [fresh])
    assert int((mixtures[0].routed - before).sum()) == 2 * (len(fresh) + NEW_TOKENS - 1)


# ------------------------------------------------------------------------------ each feature matters


def unshared(vocab: int) -> Any:
    """The dense case without KV sharing, its last layers' MLPs still double-wide."""
    model = dense(vocab, num_kv_shared_layers=0)
    for i in SOURCES:
        mlp = model.model.layers[i].mlp
        mlp.gate_proj, mlp.up_proj = (torch.nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False) for _ in range(2))
        mlp.down_proj = torch.nn.Linear(2 * INTERMEDIATE, HIDDEN, bias=False)
    return model


def own_kv_from_sources(model: Any) -> Any:
    """Each formerly shared layer computes its own K/V, with its source's weights."""
    for layer, source in SOURCES.items():
        mine, theirs = model.model.layers[layer].self_attn, model.model.layers[source].self_attn
        for name in ("k_proj", "v_proj", "k_norm"):
            if getattr(theirs, name) is not None:
                getattr(mine, name).load_state_dict(getattr(theirs, name).state_dict())
    return model


def without_value_norm(model: Any) -> Any:
    for i, layer in enumerate(model.model.layers):
        if i not in SOURCES:
            layer.self_attn.v_norm = torch.nn.Identity()
    return model


def values_of_their_own(model: Any) -> Any:
    """Full layers with a v projection of their own (one KV head of 32, as their keys)."""
    gen = torch.Generator().manual_seed(2)
    for i, layer in enumerate(model.model.layers):
        if model.config.layer_types[i] == FULL and i not in SOURCES:
            layer.self_attn.v_proj = torch.nn.Linear(HIDDEN, 32, bias=False)
            with torch.no_grad():
                layer.self_attn.v_proj.weight.copy_(0.2 * torch.randn(32, HIDDEN, generator=gen))
    return model


def single_wide_mlps(model: Any) -> Any:
    """The double-wide MLPs' second half silenced: a normal-width MLP of the first."""
    with torch.no_grad():
        for i in SOURCES:
            model.model.layers[i].mlp.up_proj.weight[INTERMEDIATE:] = 0
    return model


def unit_layer_scalars(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.fill_(1.0)
    return model


def without_experts(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.experts.down_proj.zero_()
    return model


def unit_expert_scales(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.router.per_expert_scale.fill_(1.0)
    return model


def same(model: Any) -> Any:
    return model


def plain_rope(vocab: int) -> Any:
    return dense(vocab, rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                                         FULL: {"rope_type": "default", "rope_theta": 1e6}})


@pytest.mark.parametrize("name, feature, make, after", [
    ("dense", "per-layer inputs", lambda v: dense(v, hidden_size_per_layer_input=0), same),
    ("dense", "KV sharing", unshared, own_kv_from_sources),
    ("dense", "value norm", dense, without_value_norm),
    ("dense", "keys as values", dense, values_of_their_own),
    ("dense", "proportional RoPE", plain_rope, same),
    ("dense", "double-wide MLP", dense, single_wide_mlps),
    ("dense", "layer scalar", dense, unit_layer_scalars),
    ("moe", "experts beside the MLP", moe, without_experts),
    ("moe", "per-expert scale", moe, unit_expert_scales),
])
def test_each_feature_matters(name: str, feature: str, make: Callable[[int], Any], after: Callable[[Any], Any],
                              cases: Callable[[str], Case]) -> None:
    assert switched_off(cases(name), make, after), f"Gemma 4: switching off {feature} changes nothing here"


# ------------------------------------------------------------------------------ what is refused


def copy_of(case: Case, folder: Path) -> Path:
    shutil.copytree(case.folder, folder)
    return folder


def load(folder: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=16 * 2**20))


@pytest.mark.parametrize("key, value, message", [
    ("hidden_activation", "gelu", "hidden_activation = 'gelu'"),
    ("attention_bias", True, "attention_bias = True"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention = 'all'"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("num_kv_shared_layers", 5, "num_kv_shared_layers = 5"),
    ("per_layer_config", {"2": {"head_dim": 32, "intermediate_size": 64}}, "intermediate_size"),
    ("per_layer_config", {"0": {"head_dim": 32}}, "sliding_attention layers of several shapes"),
    ("rope_parameters", {FULL: {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}}, "'dynamic'"),
])
def test_a_switch_inferd_does_not_implement_is_refused_by_name(key: str, value: Any, message: str, tmp_path: Path,
                                                               cases: Callable[[str], Case]) -> None:
    folder = copy_of(cases("dense"), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        load(folder)


def test_a_shared_layers_own_kv_weights_are_ignored_as_transformers_does(tmp_path: Path,
                                                                         cases: Callable[[str], Case]) -> None:
    """Checkpoints may carry k/v weights for KV-shared layers; transformers drops them
    (_keys_to_ignore_on_load_unexpected), and so does inferd; any other stray tensor is refused."""
    from safetensors.torch import load_file, save_file

    case = cases("dense")
    folder = copy_of(case, tmp_path / "model")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(32, HIDDEN)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert generate(load(folder), case.prompts[:1]) == case.reference[:1]
    weights["model.layers.1.self_attn.extra.weight"] = torch.zeros(4)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.extra.weight"):
        load(folder)
