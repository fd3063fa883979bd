"""A `Tokenizer` rebuilt from a GGUF file's metadata (tokenizer.ggml.*), at load time:

    tokenizer.ggml.model == "gpt2"   byte-level BPE rebuilt from the vocab + merges;
                                     `tokenizer.ggml.pre` picks the split regex
    tokenizer.ggml.model == "llama"  SentencePiece BPE rebuilt from tokens, scores, types
"""

from __future__ import annotations

import logging
from typing import Any

from inferd.text.errors import ModelLoadError
from inferd.text.tokenizer import (
    BYTE,
    CONTROL,
    END_OF_GENERATION_TEXTS,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    HFBackend,
    SentencePieceBackend,
    Tokenizer,
    TokenizerBackend,
    byte_to_unicode,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# byte-level BPE pre-tokenizers, keyed by llama.cpp's `tokenizer.ggml.pre`

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre type -> ("gpt2" | "digits" | a split regex); "gpt2" is the GPT-2 regex built into ByteLevel
_PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(["default", "gpt2", "mpt", "olmo", "jais", "trillion", "gpt-2"], "gpt2"),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"], "digits"
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"], _QWEN2_SPLIT),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# NOTE: llama.cpp sets ignore_merges for these (Llama-3's tokenizer.json does too): a pre-token
# that is itself in the vocabulary is taken whole instead of being merged up from bytes.
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"})


# ---------------------------------------------------------------------------------------------
# GGUF: the vocabulary is in the metadata, under tokenizer.ggml.*


# the tokenizer.ggml.* keys read below -> (what each must be, the test): a file is untrusted, and
# a value of another type is a ModelLoadError naming its key, not a TypeError deep in tokenizers
_KEY_TYPES: dict[str, tuple[str, Any]] = {
    **dict.fromkeys(("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"),
                    ("a string", lambda v: isinstance(v, str))),
    **dict.fromkeys(("tokenizer.ggml.tokens", "tokenizer.ggml.merges"),
                    ("an array of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))),
    "tokenizer.ggml.token_type": ("an array of integers",
                                  lambda v: isinstance(v, list) and all(type(x) is int for x in v)),
    "tokenizer.ggml.scores": ("an array of numbers",
                              lambda v: isinstance(v, list) and all(type(x) in (int, float) for x in v)),
    **dict.fromkeys((f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot", "eom", "padding")),
                    ("an integer", lambda v: type(v) is int)),
    **dict.fromkeys((f"tokenizer.ggml.{k}" for k in ("add_bos_token", "add_eos_token", "add_space_prefix")),
                    ("a boolean", lambda v: type(v) in (bool, int))),
}


def _check_types(md: dict, where: str) -> None:
    for key, (what, fits) in _KEY_TYPES.items():
        if key in md and not fits(md[key]):
            raise ModelLoadError(f"{where}: GGUF metadata {key} must be {what}, got {type(md[key]).__name__}")


def from_gguf(md: dict, where: str) -> Tokenizer:
    """A GGUF's tokenizer; `where` names the file in error messages."""
    _check_types(md, where)
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] | None = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{where}: GGUF has no tokenizer.ggml.tokens")
    types: list[int] = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{where}: GGUF has {len(tokens)} tokens but {len(types)} token types")

    if kind == "gpt2":
        backend: TokenizerBackend = HFBackend(_gguf_byte_level_bpe(md, tokens, types, where))
        default_add_bos = False
    elif kind == "llama":
        backend = SentencePieceBackend(
            _gguf_spm_proto(md, tokens, types, where),
            {i: t for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED, UNKNOWN)},
            "llama.cpp" if md.get("tokenizer.ggml.add_space_prefix", True) else "never",
        )
        default_add_bos = True
    else:
        raise ModelLoadError(f"{where}: unsupported tokenizer.ggml.model {kind!r} (supported: gpt2, llama)")

    def token_id(key: str) -> int | None:
        value = md.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    eos = token_id("eos_token_id")
    end_ids = {i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
    end_ids |= {i for i, t in enumerate(tokens) if types[i] == CONTROL and t in END_OF_GENERATION_TEXTS}
    return Tokenizer(
        backend,
        list(tokens),
        vocab_size=len(tokens),
        bos_token_id=token_id("bos_token_id"),
        eos_token_ids=frozenset(end_ids),
        eos_token_id=eos,
        pad_token_id=token_id("padding_token_id"),
        add_bos=bool(md.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
        special_ids=frozenset(i for i, t in enumerate(types) if t == CONTROL),
        chat_template=md.get("tokenizer.chat_template"),
        byte_level=kind == "gpt2",
    )


def _gguf_byte_level_bpe(md: dict, tokens: list[str], types: list[int], where: str) -> Any:
    """A `tokenizers.Tokenizer` rebuilt from a "gpt2"-kind GGUF vocabulary and merges."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    merges = _parse_merges(md.get("tokenizer.ggml.merges") or [], where)
    pre = md.get("tokenizer.ggml.pre", "default")
    pre_tokenizer = _byte_level_pre_tokenizer(pre, where)
    try:
        bpe = models.BPE(vocab=_byte_level_vocab(tokens, types), merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    except Exception as e:  # (tokenizers raises a bare Exception: a merge of a token not in the vocabulary)
        raise ModelLoadError(f"{where}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from None
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for i, t in enumerate(tokens) if types[i] == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False, special=False) for i, t in enumerate(tokens) if types[i] == USER_DEFINED]
    )
    return tok


def _parse_merges(merges: list[str], where: str) -> list[tuple[str, str]]:
    """GGUF's "a b" merge strings as (a, b) pairs."""
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"{where}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    return pairs


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Piece -> id in the byte alphabet that BPE merges over; the lowest id wins for a duplicate."""
    b2u = byte_to_unicode()
    alphabet = set(b2u.values())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        # NOTE: added tokens keep their raw text (llama.cpp's converter stores them so); a normal
        # token outside the byte alphabet is respelled in it, as transformers' GGUF loader does.
        if types[i] not in (CONTROL, USER_DEFINED) and not set(t) <= alphabet:
            t = "".join(b2u[b] for b in t.encode())
        vocab.setdefault(t, i)
    return vocab


def _byte_level_pre_tokenizer(pre: str, where: str) -> Any:
    """The pre-tokenizer that `tokenizer.ggml.pre` names; GPT-2's when the name is unknown."""
    from tokenizers import Regex, pre_tokenizers

    split = _PRE_TOKENIZERS.get(pre)
    if split is None:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; using the GPT-2 pre-tokenizer", where, pre)
        split = "gpt2"
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _gguf_spm_proto(md: dict, tokens: list[str], types: list[int], where: str) -> Any:
    """A SentencePiece BPE model proto rebuilt from a "llama"-kind GGUF vocabulary."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    scores: list[float] = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    byte_pieces = {t for i, t in enumerate(tokens) if types[i] == BYTE}
    proto.trainer_spec.byte_fallback = len(byte_pieces) == 256
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False  # SentencePieceBackend adds the prefix itself
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    unk = [i for i, t in enumerate(types) if t == UNKNOWN]
    if len(unk) != 1:
        raise ModelLoadError(f"{where}: SentencePiece vocabulary needs one unknown token, found {len(unk)}")
    proto.trainer_spec.unk_id = unk[0]
    proto.trainer_spec.bos_id = int(md.get("tokenizer.ggml.bos_token_id", -1))
    proto.trainer_spec.eos_id = int(md.get("tokenizer.ggml.eos_token_id", -1))
    proto.trainer_spec.pad_id = -1
    for t, s, ty in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score = t, float(s)
        piece.type = ty if ty in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    return proto



