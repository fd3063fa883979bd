"""GGUF files end to end: a tiny random Llama written as llama.cpp's converter writes it, token for
token against transformers loading the same file.

The files are made here with `gguf.GGUFWriter`: arch "llama" with the `llama.*` hyper-parameters,
llama.cpp's tensor names, attn_q / attn_k rows permuted for interleaved RoPE, 2-D weights
quantized with `gguf.quants.quantize` (norms stay F32), and a tokenizer (SentencePiece pieces,
scores and types as tokenizer.ggml.model "llama", or a byte-level BPE's tokens and merges as
"gpt2"). transformers reads every one of these files itself
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, dequantizing to float32), so the
reference is an independent reader of the same bytes; inferd runs float32 too.

K-quants (Q2_K .. Q6_K): gguf 0.19 dequantizes them but has no quantizer, so `tm.random_kquant`
writes their blocks itself in ggml's layout (random quant and sub-block scale bits, fp16 super-block
d / dmin set for weights of spread ~0.2): the file is then a random model of its own, not the
transformers one quantized, and both readers are compared on it exactly as above. Their rows are
256-value super-blocks, so these models are 256 wide (intermediate 512).
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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from inferd.engine.config import EngineConfig  # noqa: E402
from inferd.engine.llm_engine import LLMEngine  # noqa: E402
from inferd.model.loading.loader import load_checkpoint  # noqa: E402
from inferd.text.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
Q = GGMLQuantizationType
QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


def reference_model(folder: Path, name: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)


def inferd_tokens(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of each prompt alone, then of all prompts in one batch."""
    engine = LLMEngine.from_config(EngineConfig.of(model=str(path), dtype="float32", kv_cache_memory=64 * 2**20))
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    batch = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    return alone, batch


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A trained SentencePiece model as tokenizer.ggml.* lists, and the folder it came from."""
    folder = tmp_path_factory.mktemp("spm")
    tm.train_sentencepiece(folder)
    tokens, scores, types = tm.sentencepiece_vocab(folder / "tokenizer.model")
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "folder": folder}


@pytest.fixture(scope="module")
def spm_prompts(spm: dict[str, Any]) -> list[list[int]]:
    from inferd.text.tokenizer_loader import load_tokenizer

    return [load_tokenizer(spm["folder"]).encode(p) for p in tm.PROMPTS]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_quantized_gguf_matches_transformers(
    qtype: GGMLQuantizationType, spm: dict[str, Any], spm_prompts: list[list[int]], tmp_path: Path
) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    # row lengths (hidden, intermediate) must be whole blocks: 32 for the legacy types, 256 for K-quants
    wide = {} if 64 % block == 0 else {"hidden_size": 256, "intermediate_size": 512}
    # NOTE: not the 10000 that readers fall back to, so a llama.rope.freq_base that is not read shows
    model = tm.tiny_llama(len(spm["tokens"]), rope_theta=500000.0, **wide)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    stored = tm.write_llama_gguf(path, model, spm, qtype)

    # inferd reads exactly the stored values, with llama.cpp's q/k permutation undone (which changes them)
    assert not np.array_equal(tm.unpermute_qk(stored["blk.1.attn_q.weight"], 4), stored["blk.1.attn_q.weight"])
    checkpoint = load_checkpoint(path, torch.float32)
    assert torch.equal(
        checkpoint.tensors["layers.1.q"], torch.from_numpy(tm.unpermute_qk(stored["blk.1.attn_q.weight"], 4))
    )
    assert torch.equal(
        checkpoint.tensors["layers.1.k"], torch.from_numpy(tm.unpermute_qk(stored["blk.1.attn_k.weight"], 2))
    )
    assert torch.equal(checkpoint.tensors["layers.0.down"], torch.from_numpy(stored["blk.0.ffn_down.weight"]))
    if qtype != Q.F32:  # the weights really are quantized
        assert not torch.equal(checkpoint.tensors["layers.0.gate"], model.model.layers[0].mlp.gate_proj.weight)

    reference = tm.greedy_reference(reference_model(tmp_path, path.name), spm_prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)
    alone, batch = inferd_tokens(path, spm_prompts)
    assert alone == reference
    assert batch == reference


def test_gguf_spm_tokenizer_matches_transformers(spm: dict[str, Any], tmp_path: Path) -> None:
    """tokenizer.ggml.model "llama" rebuilt from pieces / scores / types tokenizes like the
    tokenizer.model it came from does in transformers."""
    from transformers import AutoTokenizer

    from inferd.text.tokenizer_loader import load_tokenizer

    path = tmp_path / "tok.gguf"
    tm.write_llama_gguf(path, tm.tiny_llama(len(spm["tokens"])), spm)
    ours, hf = load_tokenizer(path), AutoTokenizer.from_pretrained(spm["folder"])
    for text in [tm.MULTILINGUAL, *tm.PROMPTS]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_tied_embeddings_gpt2_tokenizer(tmp_path: Path) -> None:
    """No output.weight (the head is token_embd), and a byte-level BPE as tokenizer.ggml.model "gpt2"."""
    from transformers import AutoTokenizer

    tm.train_byte_level_bpe(tmp_path / "bpe")
    vocab = tm.byte_level_bpe_vocab(tmp_path / "bpe" / "tokenizer.json")
    model = tm.tiny_llama(len(vocab["tokens"]), seed=3, tie_word_embeddings=True)
    path = tmp_path / "tied.gguf"
    stored = tm.write_llama_gguf(path, model, vocab, Q.Q8_0)
    assert "output.weight" not in stored

    checkpoint = load_checkpoint(path, torch.float32)
    assert checkpoint.config.tie_word_embeddings and "lm_head" not in checkpoint.tensors

    from inferd.text.tokenizer_loader import load_tokenizer

    ours, hf = load_tokenizer(path), AutoTokenizer.from_pretrained(tmp_path / "bpe")
    for text in [tm.MULTILINGUAL.replace("e\u0301", "é"), *tm.PROMPTS]:  # GGUF BPE has no NFC step
        assert ours.encode(text) == hf.encode(text)
    prompts = [ours.encode(p) for p in tm.PROMPTS]

    reference = tm.greedy_reference(reference_model(tmp_path, path.name), prompts, NEW_TOKENS)
    tm.assert_not_trivial(reference, NEW_TOKENS)
    alone, batch = inferd_tokens(path, prompts)
    assert alone == reference
    assert batch == reference
