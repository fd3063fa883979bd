"""Tiny random Llama / Qwen2 checkpoints written inside the tests, and transformers as their reference.

A plain module (not a conftest): the model tests import it. Everything here is built in a few
hundred milliseconds from a seed, so a test can afford its own folder or GGUF file:

    train_sentencepiece(folder)      tokenizer.model + tokenizer_config.json (Llama style)
    train_byte_level_bpe(folder)     tokenizer.json + tokenizer_config.json (Qwen2 / ChatML style)
    tiny_llama(...) / tiny_qwen2(...) a transformers model with well-separated random weights
    write_llama_gguf(path, ...)      the same model as llama.cpp's converter would write it
    random_kquant(shape, qtype, rng) K-quant blocks (Q2_K..Q6_K) of random bits, for what
                                     gguf.quants cannot quantize
    greedy_reference(model, prompts) transformers' greedy continuation of each prompt

NOTE: random tiny models with the default initializer (std 0.02) produce near-ties between
logits, where float32 summation order decides the argmax; weights drawn with std 0.2 (norms
around 1) keep the top two logits well apart, so token-exact comparisons are meaningful.
`greedy_reference` checks it: every chosen token leads the runner-up by >= 1e-4 (inferd's and
transformers' float32 log-probs differ by ~3e-6).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Training text for the tokenizers and source of the prompts: several scripts, so the vocabulary
# has multi-byte pieces and byte fallback is exercised by what it leaves out.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2024, and we're testing tokenizers!\n"
    "Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Äpfel.\n"
    "Le renard brun rapide saute par-dessus le chien paresseux. Où est l'hôtel ? Ça va très bien.\n"
    "敏捷的棕色狐狸跳过了懒狗。你好，世界！日本語のテキストも少し。한국어 문장입니다.\n"
    "Быстрая коричневая лиса прыгает через ленивую собаку. Ελληνικά κείμενα εδώ.\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # code\n"
    "Numbers: 3.14159, 1,000,000 and 42 — café, naïve, résumé, Zürich, São Paulo.\n"
)
# Encoded and decoded by both tokenizers; has characters the training text lacks (byte fallback).
MULTILINGUAL = (
    "Hello, world! Grüße aus München — ça coûte 3,50 €.\n"
    "你好，世界！日本語のテキスト。한국어 문장입니다. Привет, мир! Γειά σου κόσμε.\n"
    "Emoji 😀 👍🏽, cafe\u0301, Arabic مرحبا, Hebrew שלום, Hindi नमस्ते, tabs\tand  double  spaces.\n"
)
PROMPTS = [
    "The quick brown fox",
    "def fib(n):\n    return",
    "Der Hund schläft. 你好，世界！Привет, мир 😀",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ------------------------------------------------------------------------------------ tokenizers


def train_sentencepiece(folder: Path, vocab_size: int = 400, text: str = CORPUS) -> int:
    """A SentencePiece BPE (byte fallback) in a Llama-style folder; returns its vocabulary size."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    # NOTE: identity normalization and kept whitespace, as Llama's own tokenizer.model has them
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines() * 20),
        model_prefix=str(folder / "m"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.98,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    (folder / "m.model").rename(folder / "tokenizer.model")
    (folder / "m.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
    }))
    return vocab_size


def sentencepiece_vocab(model_file: Path) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and types of a tokenizer.model (what llama.cpp's converter stores in a GGUF)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    return [p.piece for p in proto.pieces], [p.score for p in proto.pieces], [int(p.type) for p in proto.pieces]


QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_byte_level_bpe(folder: Path, vocab_size: int = 500, text: str = CORPUS) -> int:
    """A byte-level BPE tokenizer.json (Qwen2 style: ChatML specials after the merges); returns
    the vocabulary size including the special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    # NOTE: Qwen2's own tokenizer.json pipeline; transformers 5's Qwen2Tokenizer imposes it
    # whatever the file says, so a plain ByteLevel pre-tokenizer would differ on digits.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHATML_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines() * 20, trainer)
    tok.add_special_tokens(CHATML_SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_prefix_space": False,
        "chat_template": CHATML_TEMPLATE,
    }))
    return tok.get_vocab_size(with_added_tokens=True)


# ---------------------------------------------------------------------------------------- models


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """NOTE: one thread for models this small: with another process busy on the 2 cores, two
    OpenMP threads made transformers' decode steps ~20x slower (spin-waiting for each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def randomize(model: torch.nn.Module, seed: int, std: float = 0.2, norm_centre: float = 1.0) -> torch.nn.Module:
    """Well-separated random weights (see the module's NOTE): matrices N(0, std), norms
    `norm_centre` +- 0.1 (0 for Gemma's x̂·(1 + w) norms, so that they scale by about 1), biases N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(norm_centre + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
    return model.eval()


def tiny_llama(vocab_size: int, seed: int = 0, **overrides: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return randomize(LlamaForCausalLM(LlamaConfig(**settings)), seed)


def tiny_qwen2(vocab_size: int, seed: int = 0, **overrides: Any) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = randomize(Qwen2ForCausalLM(Qwen2Config(**settings)), seed)
    if settings["tie_word_embeddings"]:
        model.tie_weights()
    return model


def greedy_reference(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, min_margin: float = 1e-4
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, never stopping at EOS.

    Fails if any chosen token beat the runner-up by less than `min_margin` (a near-tie that
    float32 rounding could flip: pick another seed rather than a flaky test)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out_ids = []
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
            )
        logits = torch.cat(out.logits).float()  # [new tokens, vocab]
        top2 = logits.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        assert margin >= min_margin, f"near-tie in the reference logits (margin {margin:.2e})"
        out_ids.append(out.sequences[0, len(ids):].tolist())
    return out_ids


def assert_not_trivial(outputs: Sequence[Sequence[int]], length: int) -> None:
    """The reference is long and varied, so an equality against it cannot pass by accident."""
    for tokens in outputs:
        assert len(tokens) == length
        assert len(set(tokens)) >= 4, f"degenerate reference output {tokens}"
    assert len({tuple(t) for t in outputs}) == len(outputs), "different prompts gave the same output"


# ------------------------------------------------------------------------------------------ GGUF


def byte_level_bpe_vocab(tokenizer_json: Path) -> dict[str, Any]:
    """A tokenizer.json's vocabulary as llama.cpp's converter stores a "gpt2" tokenizer."""
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    specials = {t["content"] for t in spec["added_tokens"]}
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == len(vocab) and vocab[tokens[-1]] == len(tokens) - 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in specials else 1 for t in tokens]  # CONTROL / NORMAL
    return {"model": "gpt2", "tokens": tokens, "merges": merges, "types": types}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: interleave the two rotary halves of every head (`DecoderModel.permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's float32 weights under llama.cpp's names, q/k rows permuted as its converter does;
    no `output.weight` when the embeddings are tied."""
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        w = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"
            if rest == "self_attn.q_proj.weight":
                w = permute_qk(w, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                w = permute_qk(w, cfg.num_key_value_heads)
            out[gname] = w
    return out


# Byte offsets of the fp16 super-block scale d and of dmin (None: the type has none) in one block of
# each K-quant, as ggml lays them out (`dequantize_blocks` of gguf.quants' classes), and the dmin / d
# ratio that centres random weights: dmin * mean(6-bit m) against d * mean(sc) * mean(q).
_KQUANT_SCALES: dict[str, tuple[int, int | None, float]] = {
    "Q2_K": (80, 82, 1.5),  # scales[16] (4-bit sc | 4-bit m << 4), qs[64], d, dmin: x = d*sc*q - dmin*m, q 0..3
    "Q3_K": (108, None, 0.0),  # hmask[32], qs[64], scales[12] (6-bit, signed), d: q -4..3
    "Q4_K": (0, 2, 7.5),  # d, dmin, scales[12] (6-bit sc, m), qs[128]: q 0..15
    "Q5_K": (0, 2, 15.5),  # d, dmin, scales[12], qh[32], qs[128]: q 0..31
    "Q6_K": (208, None, 0.0),  # ql[128], qh[64], int8 scales[16], d: q -32..31
}
KQUANT_NAMES = tuple(_KQUANT_SCALES)


def random_kquant(shape: tuple[int, int], qtype: Any, rng: np.random.Generator, std: float = 0.2) -> np.ndarray:
    """A K-quant tensor ([rows, row bytes] uint8) of random bits whose dequantized values have about
    `std` spread and mean 0: gguf (0.19) dequantizes K-quants but cannot quantize to them.

    Every quant and sub-block scale byte is random; each super-block's fp16 d (and dmin) is set to a
    random factor in [0.5, 1.5] of the scale that gives `std`, so blocks differ in range and nothing
    is NaN or inf. Not a quantization of any weights: a random model, read the same by every reader."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    d_at, dmin_at, centre = _KQUANT_SCALES[qtype.name]
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    assert cols % block == 0, f"{qtype.name} rows must be a multiple of {block} values"
    blocks = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)

    def set_scales(d: np.ndarray) -> None:
        blocks[:, d_at:d_at + 2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
        if dmin_at is not None:
            blocks[:, dmin_at:dmin_at + 2] = (centre * d).astype(np.float16).reshape(-1, 1).view(np.uint8)

    set_scales(np.ones(len(blocks)))  # unit scales: measure the spread the random bits give
    unit = float(dequantize(blocks.reshape(rows, -1), qtype).std())
    set_scales(std / unit * rng.uniform(0.5, 1.5, len(blocks)))
    out = blocks.reshape(rows, -1)
    assert np.isfinite(dequantize(out, qtype)).all()
    return out


def gguf_writer(path: Path, arch: str, cfg: Any, head_dim: int, rope_theta: float, extra_blocks: int = 0) -> Any:
    """A GGUFWriter for `arch` with the hyper-parameters every converter writes, from a
    transformers config (`extra_blocks`: blocks after the model's own, as multi-token prediction's)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-random-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers + extra_blocks)
    if getattr(cfg, "intermediate_size", None):  # (not in a config whose every layer has experts)
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope_theta)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    return w


def write_spm_vocab(w: Any, spm: dict[str, Any]) -> None:
    """A SentencePiece vocabulary ({"tokens", "scores", "types"}) into a GGUFWriter, as llama.cpp's
    converter writes one (tokenizer model "llama")."""
    w.add_tokenizer_model("llama")
    w.add_token_list(spm["tokens"])
    w.add_token_types(spm["types"])
    w.add_token_scores(spm["scores"])


def write_tensors(w: Any, tensors: dict[str, np.ndarray], qtype_of: Any) -> dict[str, np.ndarray]:
    """Each tensor in the type `qtype_of(name, array)` gives, then the file written and closed;
    returns what the file holds, each tensor dequantized back to float32."""
    import gguf

    held = {}
    for name, array in tensors.items():
        t = qtype_of(name, array)
        data = array.astype(np.float32) if t == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(array, t)
        w.add_tensor(name, data, raw_dtype=t)
        held[name] = gguf.quants.dequantize(data, t).reshape(array.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def write_llama_gguf(
    path: Path,
    model: Any,
    tokenizer: dict[str, Any],
    qtype: Any = None,
    raw: dict[str, tuple[np.ndarray, Any]] | None = None,
    skip: Collection[str] = (),
) -> dict[str, np.ndarray]:
    """Write `model` as a llama.cpp-style GGUF: 2-D weights quantized to `qtype` (None: F32), norms
    F32 (K-quants, which gguf cannot quantize to: `random_kquant` blocks in place of the model's
    2-D weights, so the file is a different random model of the same shape); `raw` replaces named
    tensors by (bytes, GGMLQuantizationType) as given; `skip` leaves named tensors out. `tokenizer`:
    {"model": "llama", "tokens", "scores", "types"} or {"model": "gpt2", "tokens", "merges",
    "types"}. Returns the float32 tensors as stored (quantized ones dequantized back)."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = qtype or gguf.GGMLQuantizationType.F32
    cfg = model.config
    w = gguf_writer(path, "llama", cfg, cfg.hidden_size // cfg.num_attention_heads,
                    float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_file_type(int(qtype))

    w.add_tokenizer_model(tokenizer["model"])
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    if tokenizer["model"] == "llama":
        w.add_token_scores(tokenizer["scores"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(True)
    else:
        w.add_tokenizer_pre("qwen2")
        w.add_token_merges(tokenizer["merges"])
        w.add_eos_token_id(tokenizer["tokens"].index("<|im_end|>"))
        w.add_add_bos_token(False)

    stored: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(0)
    for name, array in gguf_tensors(model).items():
        if name in skip:
            continue
        if name in (raw or {}):
            data, dtype = raw[name]  # type: ignore[index]
            w.add_tensor(name, data, raw_dtype=dtype)
            continue
        dtype = qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        if dtype.name in KQUANT_NAMES:
            data = random_kquant(array.shape, dtype, rng)
        else:
            data = quantize(array, dtype)  # F32 / F16: plain arrays; others: uint8 [rows, row bytes]
        w.add_tensor(name, data, raw_dtype=dtype)
        stored[name] = dequantize(data, dtype).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
