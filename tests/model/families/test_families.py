"""The families beyond Llama, token for token against transformers: Qwen3, Mistral with a sliding
window, Gemma 2, Gemma 3 and Phi-3, each a tiny random checkpoint written here by transformers
(`save_pretrained`) with a SentencePiece tokenizer trained on the spot.

Each family's greedy tokens must equal transformers' float32 `generate`, every prompt alone, all
in one ragged batch, and with prefill chunks of a few tokens; the window (12 positions, not a
multiple of the 16-token KV block) is crossed by every prompt's continuation. Each feature that
changes the maths is shown to matter: the same weights with it switched off (in transformers)
give other tokens, so an implementation that ignored it could not pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import tiny_models as tm  # noqa: E402 - after the skips
from family_cases import (NEW_TOKENS, SMALL, WINDOW, Case, assert_alone_and_batched, build,  # noqa: E402
                          chunked_engine, generate, family_fixtures, switched_off)

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.text.errors import ModelLoadError  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def qwen3(vocab: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, head_dim=32, tie_word_embeddings=True, **SMALL))


def mistral(vocab: int, window: int | None = WINDOW) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=vocab, sliding_window=window, **SMALL))


def gemma2(vocab: int, softcap: float | None = 5.0, window: int = WINDOW) -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=vocab, head_dim=16, query_pre_attn_scalar=24, tie_word_embeddings=False, attn_logit_softcapping=softcap,
        final_logit_softcapping=30.0, sliding_window=window, layer_types=["sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh", **SMALL))


GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}


def gemma3(vocab: int, rope: dict[str, Any] = GEMMA3_ROPE) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=vocab, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=rope, **SMALL))


def phi3(vocab: int, partial: float = 0.5, longrope: bool = True) -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    if longrope:  # short factors for contexts within the original length (here: all of them)
        half = int(16 * partial) // 2
        rope |= {"rope_type": "longrope", "short_factor": [1.0 + 0.5 * i for i in range(half)],
                 "long_factor": [2.0 + i for i in range(half)], "original_max_position_embeddings": 256}
    return Phi3ForCausalLM(Phi3Config(vocab_size=vocab, rope_parameters=rope, sliding_window=None, **SMALL))


FAMILIES: dict[str, Callable[[int], Any]] = {"qwen3": qwen3, "mistral": mistral, "gemma2": gemma2, "gemma3": gemma3,
                                             "phi3": phi3}


cases, case = family_fixtures(FAMILIES)


def test_greedy_alone_and_in_a_ragged_batch_match_transformers(case: Case) -> None:
    assert min(len(p) for p in case.prompts) + NEW_TOKENS > WINDOW + 16  # the window's edge is crossed
    assert_alone_and_batched(case)


def test_small_prefill_chunks_match_transformers(case: Case) -> None:
    assert generate(chunked_engine(case), case.prompts) == case.reference


@pytest.mark.parametrize("family", ["gemma3", "mistral"])  # sliding and full layers; sliding only
def test_sliding_layers_give_back_their_blocks_and_still_match(family: str, cases: Callable[[str], Case]) -> None:
    """Blocks of 4 and chunks of 5: sliding groups hold only their window (engine/kv/groups.py),
    and a second turn extending the first hits the prefix cache, token-exact all the same."""
    case = cases(family)
    engine = LLMEngine.from_config(EngineConfig.of(model=str(case.folder), dtype="float32", kv_cache_memory=16 * 2**20,
                                                block_size=4, max_num_batched_tokens=5))
    bm = engine.block_manager
    sliding = [g for g, w in enumerate(bm.windows) if w is not None]
    assert sliding and len(bm.windows) == (2 if family == "gemma3" else 1)
    released: list[int] = []
    commit = bm.commit

    def watched(seq_id: int, computed: int, tokens: Any) -> None:
        commit(seq_id, computed, tokens)
        for g in sliding:  # (at most the window behind the next chunk: 12 + 5 tokens, +2 blocks)
            assert len(bm.block_table(seq_id, g)) - bm._starts[seq_id][g] <= -(-(WINDOW + 5) // 4) + 2
            released.append(bm._starts[seq_id][g])

    bm.commit = watched  # type: ignore[method-assign]
    assert generate(engine, case.prompts) == case.reference
    assert max(released) >= 4
    second = case.prompts[0] + case.reference[0] + case.prompts[1]  # the next turn of a chat
    hits = bm.prefix_hits
    assert generate(engine, [second])[0][:8] == tm.greedy_reference(case.model, [second], 8)[0]
    assert bm.prefix_hits - hits >= len(case.prompts[0]) + NEW_TOKENS - 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_sliding_model_preempted_for_memory_still_matches(mode: str, cases: Callable[[str], Case]) -> None:
    """Gemma 3 (a full and a sliding group) on a pool too small for its running set."""
    from inferd.settings.policy import SchedulingPolicy

    case = cases("gemma3")
    per_block = case.engine.kv_cache.storage[:, :, :1].nbytes * 4 // 16  # (blocks of 4, not 16)
    engine = LLMEngine.from_config(EngineConfig.of(
        model=str(case.folder), dtype="float32", block_size=4, max_num_batched_tokens=8,
        kv_cache_memory=30 * per_block, swap_space=64 * per_block, policy=SchedulingPolicy(preemption_mode=mode)))
    assert engine.block_manager.pool.num_blocks == 30
    assert generate(engine, case.prompts) == case.reference
    assert engine.scheduler.preemptions[mode] > 0, engine.scheduler.preemptions
    assert engine.block_manager.num_free_host_blocks == engine.block_manager.num_host_blocks


def identity_qk_norms(model: Any) -> Any:
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()
    return model


@pytest.mark.parametrize("family, feature, make", [
    ("qwen3", "q/k norm", lambda v: identity_qk_norms(qwen3(v))),
    ("mistral", "window", lambda v: mistral(v, window=None)),
    ("gemma2", "soft-cap", lambda v: gemma2(v, softcap=None)),
    ("gemma2", "window", lambda v: gemma2(v, window=4096)),
    ("gemma3", "per-layer RoPE", lambda v: gemma3(v, rope={"sliding_attention": GEMMA3_ROPE["full_attention"],
                                                        "full_attention": GEMMA3_ROPE["full_attention"]})),
    ("gemma3", "q/k norm", lambda v: identity_qk_norms(gemma3(v))),
    ("phi3", "partial rotary", lambda v: phi3(v, partial=1.0, longrope=False)),
    ("phi3", "LongRoPE", lambda v: phi3(v, longrope=False)),
])
def test_each_feature_matters(family: str, feature: str, make: Callable[[int], Any],
                              cases: Callable[[str], Case]) -> None:
    assert switched_off(cases(family), make), f"{family}: switching off {feature} changes nothing here"


def test_gemma2_config_is_read_into_its_switches(cases: Callable[[str], Case]) -> None:
    cfg = cases("gemma2").engine.model_config
    assert (cfg.norm_offset, cfg.sandwich_norms, cfg.activation, cfg.attn_softcap) == (1.0, True, "gelu_tanh", 5.0)
    assert cfg.layer_types == ("sliding", "full") and cfg.sliding_window == WINDOW
    assert cfg.embed_scale == 8.0 and cfg.attention_scale == 24**-0.5


def test_an_unknown_tensor_is_refused_with_its_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    case = build(tmp_path / "qwen3", qwen3)
    weights = load_file(case.folder / "model.safetensors")
    weights["model.layers.0.self_attn.extra_gate.weight"] = torch.zeros(4)
    save_file(weights, case.folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.0.self_attn.extra_gate.weight"):
        LLMEngine.from_config(EngineConfig.of(model=str(case.folder), dtype="float32", kv_cache_memory=16 * 2**20))


@pytest.mark.parametrize("key, value, message", [
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "unsupported rope scaling type 'dynamic'"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0, "extrapolate": True}, "extrapolate"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("mlp_bias", True, "mlp_bias = True"),
])
def test_a_config_key_inferd_does_not_implement_is_refused(tmp_path: Path, key: str, value: Any,
                                                           message: str) -> None:
    case = build(tmp_path / "mistral", mistral)
    config = json.loads((case.folder / "config.json").read_text())
    config[key] = value
    (case.folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        LLMEngine.from_config(EngineConfig.of(model=str(case.folder), dtype="float32", kv_cache_memory=16 * 2**20))
