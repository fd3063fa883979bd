"""The hybrid families token for token against transformers, served by inferd's engine: Qwen3.5
(dense), Qwen3.5-MoE, Qwen3-Next (its fused, per-key-head interleaved input projections) and a
Qwen3_5ForConditionalGeneration checkpoint read as its language model alone, each a tiny random
checkpoint written by transformers (the harness is family_cases.py's; the checkpoints are
tests/model/test_gated_deltanet.py's, where the model runs without the engine).

Three of every four layers are Gated DeltaNet, whose cache is a state slot per sequence: the
tokens match alone, in a ragged batch, in prefill chunks of 5 and 64, after preemption by
recompute and by swap, and on a second turn resumed from the prefix cache's state checkpoint.
Each feature is shown to matter: the same weights with it switched off in transformers give
other tokens.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import tiny_models as tm  # noqa: E402 - after the skips
from family_cases import (NEW_TOKENS, Case, assert_alone_and_batched, chunked_engine, generate,  # noqa: E402
                          family_fixtures, switched_off)
from test_gated_deltanet import SMALL, qwen3_5, qwen3_5_moe, qwen3_next, randomized  # noqa: E402

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.engine.worker.kv_cache import bytes_per_block, state_bytes_per_slot  # noqa: E402
from inferd.model.layers.linear import DenseLinear, SplitLinear  # noqa: E402
from inferd.text.errors import ModelLoadError  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def qwen3_5_vl(vocab: int) -> Any:
    """Qwen3.5 as its checkpoints ship: Qwen3_5ForConditionalGeneration, a (tiny) vision tower beside."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=SMALL["hidden_size"])
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=SMALL | {"vocab_size": vocab, "intermediate_size": 128}, vision_config=vision))


FAMILIES: dict[str, Callable[[int], Any]] = {"qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "qwen3_next": qwen3_next,
                                             "qwen3_5_vl": qwen3_5_vl}


cases, case = family_fixtures(FAMILIES, prepare=randomized)


def engine_of(folder: Path, **settings: Any) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.of(model=str(folder), dtype="float32", **{"kv_cache_memory": 16 * 2**20}
                                                 | settings))


def test_greedy_alone_and_in_a_ragged_batch_match_transformers(case: Case) -> None:
    assert case.engine.model_config.has_linear_layers
    # (speculation is off, with the reason: the linear layers' state cannot take back a rejected draft)
    assert case.engine.speculator.method == "off" and "linear-attention" in case.engine.speculator.off_reason
    assert_alone_and_batched(case)


def test_prefill_chunks_of_5_match_transformers(case: Case) -> None:
    assert generate(chunked_engine(case), case.prompts) == case.reference


def test_prefill_chunks_of_64_over_a_long_prompt_match_transformers(cases: Callable[[str], Case]) -> None:
    """A prompt longer than the delta rule's chunks of 64 tokens, prefilled 64 at a time beside the others."""
    case = cases("qwen3_next")
    long = (case.prompts[2] + case.prompts[0] + case.prompts[1]) * 2
    assert len(long) > 100
    engine = engine_of(case.folder, max_num_batched_tokens=64)
    prompts = [long] + case.prompts
    assert generate(engine, prompts) == tm.greedy_reference(case.model, [long], NEW_TOKENS) + case.reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_prefill_chunks_and_preemption_match_transformers(mode: str, cases: Callable[[str], Case]) -> None:
    """Blocks of 4, chunks of 5, a pool too small for the running set: preempted sequences come
    back by recomputing their state, or from host copies of their blocks and state slot."""
    from inferd.settings.policy import SchedulingPolicy

    case = cases("qwen3_5_moe")
    cfg = case.engine.model_config
    per_block, per_slot = bytes_per_block(cfg, 4, torch.float32), state_bytes_per_slot(cfg, torch.float32)
    # (the state slots take most of it: 3 working, a spare and checkpoints; ~18 blocks are left)
    engine = engine_of(case.folder, block_size=4, max_num_batched_tokens=5, max_num_seqs=3,
                       kv_cache_memory=8 * per_slot, swap_space=64 * per_block + 8 * per_slot,
                       policy=SchedulingPolicy(preemption_mode=mode))
    assert generate(engine, case.prompts) == case.reference
    assert engine.scheduler.preemptions[mode] > 0, (engine.scheduler.preemptions, engine.block_manager.pool.num_blocks)
    assert engine.block_manager.num_free_host_blocks == engine.block_manager.num_host_blocks


def test_a_second_turn_resumes_from_the_prefix_cache(cases: Callable[[str], Case]) -> None:
    """The next turn of a chat (the first prompt, its answer, a new message) hits the prefix cache:
    its attention blocks, and the linear layers' state checkpointed at a block end."""
    case = cases("qwen3_5")
    engine = engine_of(case.folder, block_size=4)
    bm = engine.block_manager
    assert generate(engine, case.prompts[:1]) == case.reference[:1]
    second = case.prompts[0] + case.reference[0] + case.prompts[1]
    hits = bm.prefix_hits
    assert generate(engine, [second]) == tm.greedy_reference(case.model, [second], NEW_TOKENS)
    assert bm.prefix_hits - hits >= len(case.prompts[0]) + NEW_TOKENS - 2 * 4


def test_packed_weights_pack_the_linear_layers_large_products(cases: Callable[[str], Case]) -> None:
    """weights = "int4": a Gated DeltaNet's input (q/k/v, z) and output products packed, its
    small b/a product dense, and every answer whole (a random tiny model's tokens are too
    sensitive to 4-bit weights to compare)."""
    case = cases("qwen3_5")
    engine = engine_of(case.folder, weights="int4")
    mixer = engine.model.layers[0].mixer
    assert isinstance(mixer.in_proj, SplitLinear) and isinstance(mixer.out, SplitLinear)
    assert isinstance(mixer.in_gates, DenseLinear)
    assert [len(p) for p in generate(engine, case.prompts)] == [NEW_TOKENS] * len(case.prompts)


def test_perplexity_runs_the_linear_layers_as_transformers_does(cases: Callable[[str], Case]) -> None:
    """inferd.model.evaluate on a hybrid model (a fresh state per window) against transformers'
    own negative log-likelihood of the same windows."""
    from inferd.engine.worker.kv_cache import KVCache
    from inferd.model.evaluate import perplexity

    case = cases("qwen3_5")
    ids = [t for p in case.prompts for t in p] * 3
    model = case.engine.model
    cache = KVCache(model.cfg, 32, 16, torch.float32, model.device, num_state_slots=1)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, 40):
        window = torch.tensor([ids[start:start + 41]])
        with torch.inference_mode():
            logits = case.model(window[:, :-1]).logits[0]
        nll += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    assert perplexity(model, cache.layers, 16, ids, window=40) == pytest.approx(math.exp(nll / count), rel=1e-4)


# ------------------------------------------------------------------------------ each feature matters


def without_linear_attention(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.out_proj.weight.zero_()
    return model


def even_gates(model: Any) -> Any:
    """The attention output gates' weights zeroed: σ(0) = ½ on every channel."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "self_attn"):
                attn = layer.self_attn
                attn.q_proj.weight.view(attn.config.num_attention_heads, 2, attn.head_dim, -1)[:, 1] = 0
    return model


def qkvz_the_other_way(model: Any) -> Any:
    """Qwen3-Next with its in_proj_qkvz / in_proj_ba rows read as [q | k | v | z] of all heads
    (and [b | a]), not per key head."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                net = layer.linear_attn
                hidden = net.in_proj_qkvz.weight.shape[1]
                q, k, v, z, b, a = net.fix_query_key_value_ordering(net.in_proj_qkvz.weight.t()[None],
                                                                    net.in_proj_ba.weight.t()[None])
                net.in_proj_qkvz.weight.copy_(torch.cat([x.reshape(hidden, -1) for x in (q, k, v, z)], 1).t())
                net.in_proj_ba.weight.copy_(torch.cat([x.reshape(hidden, -1) for x in (b, a)], 1).t())
    return model


def without_shared_expert(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.shared_expert.down_proj.weight.zero_()
    return model


def same(model: Any) -> Any:
    return model


FULL_ROTARY = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}


@pytest.mark.parametrize("family, feature, other, after", [
    ("qwen3_5", "linear attention", qwen3_5, without_linear_attention),
    ("qwen3_5", "output gate", qwen3_5, even_gates),
    ("qwen3_5", "partial rotary", lambda v: qwen3_5(v, **FULL_ROTARY), same),
    ("qwen3_next", "interleaved qkvz", qwen3_next, qkvz_the_other_way),
    ("qwen3_5_moe", "shared expert", qwen3_5_moe, without_shared_expert),
])
def test_each_feature_matters(family: str, feature: str, other: Callable[[int], Any], after: Callable[[Any], Any],
                              cases: Callable[[str], Case]) -> None:
    assert switched_off(cases(family), other, after), f"{family}: switching off {feature} changes nothing here"


# ------------------------------------------------------------------------------ the configs


def test_the_configs_are_read_into_their_switches(cases: Callable[[str], Case]) -> None:
    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        cfg = cases(family).engine.model_config
        assert (cfg.architecture, cfg.layer_types, cfg.attn_output_gate, cfg.qk_norm, cfg.norm_offset) == (
            family, ("linear", "linear", "linear", "full"), True, True, 1.0)
        assert cfg.partial_rotary_factor == 0.25 and cfg.rope().rotary_dim == 4
        assert cfg.linear_attention is not None and cfg.linear_attention.state_shapes == ((3, 96), (4, 16, 8))
    experts = cases("qwen3_next").engine.model_config.experts
    assert experts is not None and (experts.dense_layers, experts.shared_gate, experts.renormalize) == ((1,), True, True)
    assert cases("qwen3_5_moe").engine.model_config.experts.dense_layers == ()  # type: ignore[union-attr]


# config.json in the shape of the released checkpoints' (written out here: the tests fetch nothing)
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 151936,
}
QWEN3_5_TEXT = {
    "model_type": "qwen3_5_text", "attn_output_gate": True, "full_attention_interval": 4, "head_dim": 256,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
    "num_attention_heads": 16, "num_hidden_layers": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "vocab_size": 248320,
}
QWEN3_5_9B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "image_token_id": 248056,
              "text_config": QWEN3_5_TEXT, "tie_word_embeddings": False,
              "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "out_hidden_size": 4096}}
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {k: v for k, v in QWEN3_5_TEXT.items() if k != "intermediate_size"} | {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
        "num_experts_per_tok": 8},
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152, "out_hidden_size": 2048},
}


def test_the_released_configs_are_read_into_their_switches() -> None:
    from inferd.model.families.registry import config_from_hf

    nxt = config_from_hf(QWEN3_NEXT_80B_A3B, "Qwen3-Next-80B-A3B")
    assert nxt.layer_types == ("linear", "linear", "linear", "full") * 12 and nxt.rope().rotary_dim == 64
    assert nxt.linear_attention is not None and nxt.linear_attention.state_shapes == ((3, 8192), (32, 128, 128))
    assert nxt.experts is not None and (nxt.experts.num_experts, nxt.experts.top_k, nxt.experts.shared_intermediate_size,
                                        nxt.experts.dense_layers) == (512, 10, 512, ())
    assert nxt.rope_theta == 1e7 and not nxt.vision_tower_skipped
    dense = config_from_hf(QWEN3_5_9B, "Qwen3.5-9B")
    assert (dense.architecture, dense.hidden_size, dense.num_layers, dense.head_dim, dense.vision_tower_skipped) == (
        "qwen3_5", 4096, 32, 256, True)
    assert dense.experts is None and dense.rope_scaling is None and dense.rope().rotary_dim == 64
    moe = config_from_hf(QWEN3_5_35B_A3B, "Qwen3.5-35B-A3B")
    assert moe.architecture == "qwen3_5_moe" and moe.intermediate_size == 512 and moe.vision_tower_skipped
    assert moe.experts is not None and (moe.experts.num_experts, moe.experts.top_k, moe.experts.renormalize) == (
        256, 8, True)


@pytest.mark.parametrize("key, value, message", [
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("attention_bias", True, "attention_bias = True"),
    ("attn_output_gate", False, "attn_output_gate = False"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
     "sliding_attention"),
])
def test_a_switch_inferd_does_not_implement_is_refused_by_name(key: str, value: Any, message: str, tmp_path: Path,
                                                               cases: Callable[[str], Case]) -> None:
    folder = shutil.copytree(cases("qwen3_5").folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        engine_of(folder)


# ------------------------------------------------------------------------------ the multimodal checkpoint


def test_a_multimodal_checkpoint_is_served_as_its_language_model(tmp_path: Path,
                                                                 cases: Callable[[str], Case]) -> None:
    """The vision tower's and the multi-token-prediction layers' tensors are skipped, as
    transformers' text model skips them; the config says the vision tower is not loaded. Any other
    stray tensor is still refused by name."""
    from safetensors.torch import load_file, save_file

    case = cases("qwen3_5_vl")
    cfg = case.engine.model_config
    assert cfg.architecture == "qwen3_5" and cfg.vision_tower_skipped
    folder = shutil.copytree(case.folder, tmp_path / "model")
    weights = load_file(folder / "model.safetensors")
    assert any(name.startswith("model.visual.") for name in weights)
    weights["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert generate(engine_of(folder), case.prompts[:1]) == case.reference[:1]
    weights["model.language_model.layers.0.linear_attn.extra.weight"] = torch.zeros(4)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.language_model.layers.0.linear_attn.extra.weight"):
        engine_of(folder)


# ------------------------------------------------------------------------------ chat and requests

# A template written here in the shape of Qwen3.5's (its constructs, not its text): content parts
# rendered by a macro, namespaces, the last user query found backwards, calls as XML parameters
# from mapping arguments, tool results grouped into one user turn, reasoning replayed after the
# last query, and a generation prompt that opens <think> unless enable_thinking is false.
QWEN35_STYLE = """{%- macro text(content) %}{%- if content is string %}{{- content }}{%- elif content is iterable \
and content is not mapping %}{%- for part in content %}{{- part.text }}{%- endfor %}{%- endif %}{%- endmacro %}
{%- if tools and tools is iterable and tools is not mapping %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}\
{{- '\\n' + tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- if message.role == 'user' and ns.last_query == messages|length - 1 %}\
{%- set ns.last_query = (messages|length - 1) - loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}{%- set content = text(message.content)|trim %}
{%- if message.role == 'assistant' %}{%- set reasoning = (message.reasoning_content or '')|trim %}
{%- if loop.index0 > ns.last_query %}{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}\
{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
{%- for call in message.tool_calls or [] %}{%- set call = call.function if call.function is defined else call %}\
{{- '\\n<tool_call>\\n<function=' + call.name + '>\\n' }}{%- for name, value in call.arguments|items %}\
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}\
{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}{%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}\
{%- endif %}{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}\
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking \
is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"""
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "content": "warm"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("thinking", [True, False])
def test_a_qwen35_style_template_renders_as_transformers_renders_it(thinking: bool) -> None:
    """inferd's Jinja rendering (text/chat_template.py) of the constructs Qwen3.5's template uses
    (checked against the released template too, outside the tests), and the reasoning block its
    generation prompt leaves open or closed."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from inferd.api.conversation.reasoning import THINK, starts_inside
    from inferd.text.chat_template import render_chat_template

    ours = render_chat_template(QWEN35_STYLE, CHAT, tools=TOOLS, enable_thinking=thinking)
    theirs = render_jinja_template(conversations=[CHAT], tools=TOOLS, chat_template=QWEN35_STYLE,
                                   add_generation_prompt=True, enable_thinking=thinking)[0][0]
    assert ours == theirs
    assert "<parameter=days>\n2\n</parameter>" in ours and ours.count("<tool_response>") == 2
    assert starts_inside(ours, THINK) == thinking


@pytest.mark.parametrize("wire, body", [
    ("openai", {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}),
    ("anthropic", {"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                            "media_type": "image/png", "data": "AA=="}}]}),
    ("responses", {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}),
])
def test_an_image_in_a_request_is_refused_naming_the_limitation(wire: str, body: dict[str, Any]) -> None:
    """A multimodal checkpoint runs without its vision tower (ModelConfig.vision_tower_skipped):
    an image part is a 400 that says so, on every protocol."""
    from pydantic import ValidationError

    from inferd.api.anthropic.wire import Message
    from inferd.api.errors import from_validation_error
    from inferd.api.openai.chat_wire import ChatMessage
    from inferd.api.responses.wire import MessageItem

    model = {"openai": ChatMessage, "anthropic": Message, "responses": MessageItem}[wire]
    with pytest.raises(ValidationError) as refused:
        model.model_validate(body)
    error = from_validation_error(refused.value)
    assert error.status == 400 and "not supported" in str(error) and "text only" in str(error)
