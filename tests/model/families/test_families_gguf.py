"""GGUF files of the families beyond Llama (qwen3, gemma2, gemma3, phi3), token for token against
transformers reading the same file.

Each file is a tiny random transformers model written here the way llama.cpp's converter writes
that architecture: its tensor names, Gemma's norms stored as 1 + w, Phi-3's fused attn_qkv and
ffn_up (gate and up), Q8_0 2-D weights. transformers reads the file itself
(`from_pretrained(dir, gguf_file=...)`), so the reference is an independent reader of the same
bytes and of the same conventions. What transformers' GGUF reader does not read (Gemma's
soft-caps, query scale, window pattern) stays at its defaults in the model written, which are
llama.cpp's too: head size 256 (so the query scale is 256^-0.5 by either rule), soft-caps 50 / 30,
window 4096 with every 2nd (Gemma 2) or 6th (Gemma 3) layer full.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

import tiny_models as tm  # noqa: E402 - after the skips

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.text.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def make(arch: str, vocab: int) -> Any:
    import transformers as t

    if arch == "qwen3":
        # (head size 128, Qwen3's own: transformers' GGUF reader takes no qwen3.attention.key_length)
        return t.Qwen3ForCausalLM(t.Qwen3Config(vocab_size=vocab, head_dim=128, num_hidden_layers=2,
                                                tie_word_embeddings=False, rope_theta=1e6, **SMALL))
    if arch == "gemma2":
        return t.Gemma2ForCausalLM(t.Gemma2Config(vocab_size=vocab, head_dim=256, num_hidden_layers=2, **SMALL))
    if arch == "gemma3":
        return t.Gemma3ForCausalLM(t.Gemma3TextConfig(vocab_size=vocab, head_dim=256, num_hidden_layers=6, **SMALL))
    return t.Phi3ForCausalLM(t.Phi3Config(vocab_size=vocab, num_hidden_layers=2, tie_word_embeddings=False, **SMALL))


LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GEMMA_LAYER = LAYER | {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                       "post_feedforward_layernorm": "post_ffw_norm"}


def converted(arch: str, model: Any) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names for `arch`, as its converter changes them."""
    names = GEMMA_LAYER if arch.startswith("gemma") else LAYER
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        w = t.detach().float().numpy().copy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1  # the converter stores Gemma's (1 + w)
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                out["output.weight"] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            out[f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"] = w
    return out


def write_gguf(path: Path, arch: str, model: Any, spm: dict[str, Any]) -> None:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    w = tm.gguf_writer(path, arch, cfg, head_dim, float(rope["rope_theta"] if "rope_theta" in rope
                                                        else rope["full_attention"]["rope_theta"]))
    if arch != "phi3":  # (Phi-3's converter writes no key length)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    tm.write_spm_vocab(w, spm)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    types = gguf.GGMLQuantizationType
    tm.write_tensors(w, converted(arch, model), lambda name, array: types.Q8_0 if array.ndim == 2 else types.F32)



@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_family_gguf_matches_transformers(arch: str, spm: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from inferd.text.tokenizer_loader import load_tokenizer

    torch.manual_seed(0)
    gemma = arch.startswith("gemma")
    model = tm.randomize(make(arch, len(spm["tokens"])), seed=0, norm_centre=0.0 if gemma else 1.0)
    if gemma:  # embeddings times √hidden and tied to the head: smaller, or each token repeats itself
        with torch.no_grad():
            model.model.embed_tokens.weight /= 8
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, model, spm)
    reference_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    prompts = [load_tokenizer(spm["folder"]).encode(p) for p in tm.PROMPTS]
    reference = tm.greedy_reference(reference_model, prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)

    engine = LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory=64 * 2**20))
    assert engine.model_config.architecture == arch
    assert [engine.generate([p], GREEDY)[0].token_ids for p in prompts] == reference
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == reference
