"""The mixture-of-experts families token for token against transformers: Mixtral, Qwen2-MoE (a
shared expert behind a gate), Qwen3-MoE (renormalised top-k, a dense layer among sparse ones) and
gpt-oss (attention sinks, sliding and full layers, YaRN, a router with a bias that softmaxes its
top k, experts with biases, interleaved gate/up and the clamped SwiGLU), each a tiny random
checkpoint written by transformers; the harness is family_cases.py's.

Each feature that changes the maths is shown to matter: the same weights with it switched off in
transformers (or, for the interleaved gate/up, laid out the other way) give other tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import tiny_models as tm  # noqa: E402 - after the skips
from family_cases import (SMALL, WINDOW, Case, assert_alone_and_batched, generate, family_fixtures,  # noqa: E402
                          switched_off)

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402

EXPERTS = dict(num_experts_per_tok=2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def mixtral(vocab: int) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=vocab, num_local_experts=4, **EXPERTS, **SMALL))


def qwen2_moe(vocab: int) -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=vocab, num_experts=4, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, **EXPERTS, **SMALL))


def qwen3_moe(vocab: int, renormalize: bool = True) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=vocab, head_dim=16, num_experts=6, moe_intermediate_size=32,
                                              norm_topk_prob=renormalize, mlp_only_layers=[1], **EXPERTS, **SMALL))


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def gpt_oss(vocab: int, rope: dict[str, Any] = YARN, limit: float = 1.0) -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=vocab, head_dim=16, num_local_experts=4, sliding_window=WINDOW, rope_parameters=rope,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=limit, **EXPERTS,
        **SMALL | {"max_position_embeddings": 256}))
    return model


def strengthen(model: Any) -> Any:
    """Features stronger than in real checkpoints, so that each one shows in a tiny model."""
    if model.config.model_type == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.mul_(10).add_(1.0)  # sinks of ~1 ± 2
                layer.mlp.router.bias.mul_(10)  # router biases of ±1
    return model


def make(factory: Callable[..., Any], **kwargs: Any) -> Callable[[int], Any]:
    return lambda vocab: factory(vocab, **kwargs)


FAMILIES: dict[str, Callable[[int], Any]] = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe,
                                             "gpt_oss": gpt_oss}


cases, case = family_fixtures(FAMILIES, prepare=strengthen)


def test_greedy_alone_and_in_a_ragged_batch_match_transformers(case: Case) -> None:
    assert_alone_and_batched(case)


def test_small_prefill_chunks_and_preemption_match_transformers(case: Case) -> None:
    per_block = case.engine.kv_cache.storage[:, :, :1].nbytes * 4 // 16  # (blocks of 4)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(case.folder), dtype="float32", block_size=4,
                                                   max_num_batched_tokens=5, kv_cache_memory=24 * per_block))
    assert generate(engine, case.prompts) == case.reference
    assert sum(engine.scheduler.preemptions.values()) > 0


def test_tokens_routed_per_expert_are_counted(cases: Callable[[str], Case]) -> None:
    case = cases("qwen3_moe")
    mixtures = case.engine.model.mixtures()
    assert mixtures[1] is None  # mlp_only_layers: a dense MLP
    before = mixtures[0].routed.clone()
    fresh = case.prompts[0][::-1]  # (not in the prefix cache: every token is computed)
    generate(case.engine, [fresh])
    routed = mixtures[0].routed - before
    # every token of the prompt and of the continuation but the last, two experts each
    assert int(routed.sum()) == 2 * (len(fresh) + 24 - 1)


def test_operators_see_the_experts(cases: Callable[[str], Case]) -> None:
    """The engine's limits name the experts (/v1/models, inferd status); its snapshot carries the
    routed counts that /metrics turns into per-expert tokens and per-layer imbalance."""
    from inferd.api.telemetry.served_metrics import expert_metrics
    from inferd.engine.protocol import Histogram

    engine = cases("mixtral").engine
    assert engine.limits.experts == (4, 2)
    generate(engine, [[7, 8, 9, 10]])
    routed = engine.snapshot(0, 0.0, Histogram(), Histogram()).experts_routed
    assert len(routed) == 2 and all(len(layer) == 4 and sum(layer) > 0 for layer in routed)
    tokens, imbalance = expert_metrics(routed)
    assert sum(s.value for s in tokens.samples) == sum(map(sum, routed))
    assert all(s.value >= 1.0 for s in imbalance.samples) and len(imbalance.samples) == 2


def interleaved_the_other_way(model: Any) -> Any:
    """gpt-oss with its gate/up columns read as two halves instead of interleaved."""
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for p in (experts.gate_up_proj, experts.gate_up_proj_bias):
                halves = torch.cat([p[..., 0::2], p[..., 1::2]], dim=-1)
                p.copy_(halves)
    return model


def zero_router_bias(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias.zero_()
    return model


def without_sinks(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e9)
    return model


def without_shared_expert(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.shared_expert.down_proj.weight.zero_()
    return model


def same(model: Any) -> Any:
    return model


@pytest.mark.parametrize("family, feature, other, after", [
    ("qwen3_moe", "renormalisation", make(qwen3_moe, renormalize=False), same),
    ("qwen2_moe", "shared expert", qwen2_moe, without_shared_expert),
    ("gpt_oss", "router bias", gpt_oss, zero_router_bias),
    ("gpt_oss", "sinks", gpt_oss, without_sinks),
    ("gpt_oss", "clamp", make(gpt_oss, limit=1e9), same),
    ("gpt_oss", "interleaved gate/up", gpt_oss, interleaved_the_other_way),
    ("gpt_oss", "YaRN", make(gpt_oss, rope={"rope_type": "default", "rope_theta": 10000.0}), same),
])
def test_each_feature_matters(family: str, feature: str, other: Callable[[int], Any], after: Callable[[Any], Any],
                              cases: Callable[[str], Case]) -> None:
    assert switched_off(cases(family), other, after), f"{family}: switching off {feature} changes nothing here"


# config.json of the released checkpoints, as their repositories ship them (written out here: the
# tests fetch nothing), read into the switches they set
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_the_released_configs_are_read_into_their_switches() -> None:
    from inferd.model.families.registry import config_from_hf

    oss = config_from_hf(GPT_OSS_20B, "gpt-oss-20b")
    assert oss.experts is not None and (oss.experts.num_experts, oss.experts.top_k) == (32, 4)
    assert (oss.experts.scoring, oss.experts.router_bias, oss.experts.expert_bias, oss.experts.swiglu_limit) == (
        "topk_softmax", True, True, 7.0)
    assert oss.attention_sinks and oss.output_bias and oss.sliding_window == 128 and oss.layer_types[:2] == (
        "sliding", "full")
    assert oss.rope_scaling is not None and oss.rope_scaling["truncate"] is False and oss.rope_theta == 150000
    qwen = config_from_hf(QWEN3_30B_A3B, "Qwen3-30B-A3B")
    assert qwen.experts is not None and (qwen.experts.num_experts, qwen.experts.top_k, qwen.experts.intermediate_size,
                                         qwen.experts.renormalize, qwen.experts.dense_layers) == (128, 8, 768, True, ())
    assert qwen.qk_norm and not qwen.layer_types
