"""Gemma 4 (text) from a GGUF file as llama.cpp's converter writes it (general.architecture
"gemma4"), token for token against transformers' Gemma4ForCausalLM.

The two tiny models of test_gemma4.py ("dense": sliding and full layers of their own head size and
KV heads, KV sharing, a double-wide MLP, per-layer inputs, keys as values, the proportional RoPE;
"moe": the MoE block beside the MLP, a final soft-cap, an untied head) are written here as the
converter (llama.cpp conversion/gemma.py, Gemma4Model over Gemma3Model and TextModel) writes them:

- tensor names from gguf-py's own gemma4 table (`get_tensor_name_map`), as the converter maps
  them, with its special cases: layer_scalar -> layer_output_scale.weight, the router's scale ->
  ffn_gate_inp.scale, its per_expert_scale -> ffn_down_exps.scale; norms as they are (x̂·w);
- rope_freqs: 1 for the pairs the full layers' proportional RoPE turns, 1e30 for the rest;
- its metadata keys: key_length / value_length the full layers' head size (global_head_dim),
  key_length_swa / value_length_swa the sliding ones', head_count_kv a per-layer array when
  config.json gives num_global_key_value_heads, feed_forward_length a per-layer array with
  use_double_wide_mlp, sliding_window_pattern a flag per layer, shared_kv_layers,
  embedding_length_per_layer_input, rope.freq_base(_swa), rope.dimension_count(_swa), the experts';
- its types (outtype q8_0): Q8_0 where a row splits into blocks of 32 (else its fallback, F16),
  F32 for 1-D tensors, norms, the router and names not ending in .weight.

The reference is transformers' model with every weight replaced by what the file holds (each
tensor through its GGUF type and back), so the file's conventions and inferd's reading of them are
what is compared. (The vocabulary is a SentencePiece one, tokenizer.ggml.model "llama": the
converter's own "gemma4" tokenizer is not what these tests are about.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

import tiny_models as tm  # noqa: E402 - after the skips
from family_cases import GREEDY, NEW_TOKENS, SMALL, WINDOW  # noqa: E402
from test_gemma4 import FULL, SLIDING, dense, moe, strengthen  # noqa: E402

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.model.families.registry import config_from_hf  # noqa: E402
from inferd.text.errors import ModelLoadError  # noqa: E402

# the factories' config.json keys that transformers 5 folds into per_layer_config (the converter
# reads them from config.json): full layers' head size, and their KV heads where given
CONVERTER_HPARAMS: dict[str, dict[str, Any]] = {"dense": {"global_head_dim": 32, "num_global_key_value_heads": 1},
                                                "moe": {"global_head_dim": 32, "num_global_key_value_heads": None}}
FACTORIES: dict[str, Callable[[int], Any]] = {"dense": dense, "moe": moe}
Q8_0, F16, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def gguf_names(model: Any) -> dict[str, str]:
    """transformers' tensor name -> the converter's (its name map and Gemma 4's special cases)."""
    hp = model.config.to_dict()
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, hp["num_hidden_layers"])
    names = {}
    for name in model.state_dict():
        if name == "lm_head.weight" and hp["tie_word_embeddings"]:
            continue  # (not in a tied checkpoint)
        if name.endswith("router.scale"):
            names[name] = f"blk.{name.split('.')[2]}.ffn_gate_inp.scale"
        elif name.endswith("router.per_expert_scale"):
            names[name] = f"blk.{name.split('.')[2]}.ffn_down_exps.scale"
        else:
            suffixed = name + ".weight" if name.endswith(("layer_scalar", "gate_up_proj", "down_proj")) else name
            names[name] = table.get_name(suffixed, try_suffixes=(".weight", ".bias"))
    return names


def metadata(model: Any, hparams: dict[str, Any]) -> dict[str, Any]:
    """GGUFWriter method -> value, as TextModel, Gemma3Model and Gemma4Model's set_gguf_parameters
    leave them (a key written twice: its last value), from config.json's keys."""
    hp = model.config.to_dict() | hparams
    n, global_kv, head_dim = hp["num_hidden_layers"], hp["num_global_key_value_heads"], hp["global_head_dim"]
    sliding = [t == SLIDING for t in hp["layer_types"]]
    first_shared = n - hp["num_kv_shared_layers"]
    meta: dict[str, Any] = {
        "add_block_count": n, "add_context_length": hp["max_position_embeddings"],
        "add_embedding_length": hp["hidden_size"], "add_head_count": hp["num_attention_heads"],
        "add_feed_forward_length": ([hp["intermediate_size"] * (2 if i >= first_shared else 1) for i in range(n)]
                                    if hp["use_double_wide_mlp"] else hp["intermediate_size"]),
        "add_head_count_kv": hp["num_key_value_heads"] if global_kv is None else
        [hp["num_key_value_heads"] if s else global_kv for s in sliding],
        "add_rope_freq_base": hp["rope_parameters"][FULL]["rope_theta"],
        "add_rope_freq_base_swa": hp["rope_parameters"][SLIDING]["rope_theta"],
        "add_layer_norm_rms_eps": hp["rms_norm_eps"], "add_file_type": gguf.LlamaFileType.MOSTLY_Q8_0,
        "add_sliding_window": hp["sliding_window"], "add_shared_kv_layers": hp["num_kv_shared_layers"],
        "add_embedding_length_per_layer_input": hp["hidden_size_per_layer_input"] or 0,
        "add_sliding_window_pattern": sliding,
        "add_key_length": head_dim, "add_value_length": head_dim,
        "add_key_length_swa": hp["head_dim"], "add_value_length_swa": hp["head_dim"],
        "add_rope_dimension_count": head_dim, "add_rope_dimension_count_swa": hp["head_dim"],
    }
    if hp["final_logit_softcapping"]:
        meta["add_final_logit_softcapping"] = hp["final_logit_softcapping"]
    if hp["enable_moe_block"]:
        meta |= {"add_expert_count": hp["num_experts"], "add_expert_used_count": hp["top_k_experts"],
                 "add_expert_feed_forward_length": hp["moe_intermediate_size"]}
    return meta


def rope_freqs(model: Any, hparams: dict[str, Any]) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors: the proportional RoPE as frequency factors."""
    head_dim = hparams["global_head_dim"]
    turning = int(head_dim * model.config.to_dict()["rope_parameters"][FULL]["partial_rotary_factor"] / 2)
    return np.array([1.0] * turning + [1e30] * (head_dim // 2 - turning), dtype=np.float32)


def qtype(name: str, array: np.ndarray) -> Any:
    """The converter's type for a tensor at --outtype q8_0 (ModelBase.prepare_tensors)."""
    if array.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name or not name.endswith(".weight"):
        return F32
    return Q8_0 if array.shape[-1] % 32 == 0 else F16  # (its fallback where gguf cannot quantize)


def write(path: Path, model: Any, spm: dict[str, Any], hparams: dict[str, Any],
          edit: Callable[[dict[str, Any], dict[str, np.ndarray]], None] = lambda meta, tensors: None
          ) -> dict[str, np.ndarray]:
    """The GGUF file (`edit` changes its metadata or tensors first); returns what it holds, each
    tensor dequantized."""
    names = gguf_names(model)
    tensors = {"rope_freqs.weight": rope_freqs(model, hparams)}
    tensors |= {names[n]: t.detach().float().numpy().copy() for n, t in model.state_dict().items() if n in names}
    meta = metadata(model, hparams)
    edit(meta, tensors)
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_name("tiny-random-gemma4")
    for method, value in meta.items():
        getattr(w, method)(value)
    tm.write_spm_vocab(w, spm)
    return tm.write_tensors(w, tensors, qtype)


def load_held(model: Any, held: dict[str, np.ndarray]) -> Any:
    """transformers' model with each weight replaced by what the file holds."""
    params = model.state_dict()
    with torch.no_grad():
        for name, gguf_name in gguf_names(model).items():
            params[name].copy_(torch.from_numpy(held[gguf_name].copy()).reshape(params[name].shape))
    return model



def tiny(name: str, vocab: int) -> Any:
    torch.manual_seed(0)
    model = strengthen(tm.randomize(FACTORIES[name](vocab), seed=0, norm_centre=1.0))
    if model.config.to_dict()["tie_word_embeddings"]:
        model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def written(spm: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """A case's GGUF file and transformers' model holding the file's weights."""
    built: dict[str, tuple[Path, Any]] = {}

    def get(name: str) -> tuple[Path, Any]:
        if name not in built:
            model = tiny(name, len(spm["tokens"]))
            path = tmp_path_factory.mktemp(name) / f"tiny-gemma4-{name}.gguf"
            built[name] = path, load_held(model, write(path, model, spm, CONVERTER_HPARAMS[name]))
        return built[name]

    return get


def engine_for(path: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory=64 * 2**20))


@pytest.mark.parametrize("name", list(FACTORIES))
def test_gemma4_gguf_matches_transformers(name: str, spm: dict[str, Any],
                                          written: Callable[[str], tuple[Path, Any]]) -> None:
    from inferd.text.tokenizer_loader import load_tokenizer

    path, model = written(name)
    prompts = [load_tokenizer(spm["folder"]).encode(p) for p in tm.PROMPTS]
    assert min(len(p) for p in prompts) + NEW_TOKENS > model.config.to_dict()["sliding_window"] + 16  # past it
    reference = tm.greedy_reference(model, prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)

    engine = engine_for(path)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == reference
    assert engine.generate([prompts[0]], GREEDY)[0].token_ids == reference[0]


@pytest.mark.parametrize("name", list(FACTORIES))
def test_the_gguf_reader_builds_the_hf_readers_config(name: str, written: Callable[[str], tuple[Path, Any]]) -> None:
    """Every switch as config.json sets it, but the full layers' RoPE: their factors as the file
    stores them (the proportional RoPE's frequencies, the unturned ones divided by 1e30)."""
    path, model = written(name)
    cfg = engine_for(path).model_config
    hf = config_from_hf(model.config.to_dict(), "hf")
    skip = {"name", "rope_scaling"}
    assert _float32({k: v for k, v in asdict(cfg).items() if k not in skip}) == _float32(
        {k: v for k, v in asdict(hf).items() if k not in skip})
    assert cfg.rope().kind == "factors" and cfg.rope().rotary_dim == 32
    assert (cfg.rope().inv_freq()[0][:4] == hf.rope().inv_freq()[0][:4]).all()  # the turning pairs: the same
    assert (cfg.rope().inv_freq()[0][4:] < 1e-30).all() and (hf.rope().inv_freq()[0][4:] == 0).all()


def test_packed_weights_keep_the_fused_experts_as_stored(spm: dict[str, Any], tmp_path: Path) -> None:
    """ffn_gate_up_exps' Q8_0 blocks split into each expert's gate and up as the file holds them."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from inferd.model.layers.linear import BlockLinear

    if not BlockLinear.fits((64, 64)):
        pytest.skip("this CPU does not run the block products (AVX-512 VNNI)")
    torch.manual_seed(0)
    model = strengthen(tm.randomize(Gemma4ForCausalLM(Gemma4TextConfig(  # (the "moe" case, experts 32 wide)
        vocab_size=len(spm["tokens"]), head_dim=16, global_head_dim=32, sliding_window=WINDOW,
        tie_word_embeddings=False, layer_types=[SLIDING, FULL], hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, **SMALL)), seed=0))
    held = write(tmp_path / "tiny.gguf", model, spm, CONVERTER_HPARAMS["moe"])
    engine = LLMEngine.from_config(EngineConfig.of(model=str(tmp_path / "tiny.gguf"), dtype="bfloat16",
                                                   weights="auto", kv_cache_memory=16 * 2**20))
    experts = engine.model.mixtures()[1].experts
    assert all(isinstance(op, BlockLinear) for e in experts for op in e.linears())
    for e, expert in enumerate(experts):
        assert np.array_equal(expert.gate_up.dequantize().numpy(), held["blk.1.ffn_gate_up_exps.weight"][e])
    assert len(engine.generate([[5, 6, 7]], GREEDY)[0].token_ids) == NEW_TOKENS


def _float32(value: Any) -> Any:
    """Floats as the file stores them (rms_norm_eps 1e-6 in float32)."""
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    return float(np.float32(value)) if isinstance(value, float) else value


def _set(**changes: Any) -> Callable[[dict[str, Any], dict[str, np.ndarray]], None]:
    """Metadata changed: GGUFWriter method -> its value (None: the key left out)."""
    def edit(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        for key, value in changes.items():
            if value is None:
                del meta[key]
            else:
                meta[key] = value
    return edit


def _tensor(name: str, value: np.ndarray | None) -> Callable[[dict[str, Any], dict[str, np.ndarray]], None]:
    def edit(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set(add_sliding_window_pattern=None), "lacks gemma4.attention.sliding_window_pattern"),
    (_set(add_rope_dimension_count_swa=8), "gemma4.rope.dimension_count_swa = 8"),
    (_set(add_feed_forward_length=[128, 256, 128, 128, 256]), "gemma4.feed_forward_length"),
    (_set(add_head_count_kv=[2, 1, 1, 2, 1]), "gemma4.attention.head_count_kv"),
    (_set(add_sliding_window_pattern=[True, False, True, True, False]), "gemma4.attention.shared_kv_layers = 2"),
    (_set(add_causal_attention=False), "gemma4.attention.causal"),
    (_set(add_rope_scaling_type=gguf.RopeScalingType.LINEAR, add_rope_scaling_factor=2.0), "gemma4.rope.scaling.type"),
    (_tensor("rope_freqs.weight", None), "rope_freqs.weight"),
    (_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32)), "rope_freqs.weight' holds 8 factors"),
    (_tensor("blk.0.attn_q.bias", np.zeros(64, dtype=np.float32)), "blk.0.attn_q.bias"),
])
def test_what_inferd_does_not_implement_is_refused_by_name(edit: Any, message: str, spm: dict[str, Any],
                                                           tmp_path: Path) -> None:
    model = tiny("dense", len(spm["tokens"]))
    path = tmp_path / "edited.gguf"
    write(path, model, spm, CONVERTER_HPARAMS["dense"], edit)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        engine_for(path)
