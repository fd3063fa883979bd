"""Building a `Tokenizer` from a GGUF file's metadata or a Hugging Face-style model folder.

Sources `load_tokenizer` understands:

    GGUF, tokenizer.ggml.model == "gpt2"   byte-level BPE rebuilt from the vocab + merges;
                                           `tokenizer.ggml.pre` picks the split regex
    GGUF, tokenizer.ggml.model == "llama"  SentencePiece BPE rebuilt from tokens, scores, types
    folder with tokenizer.json             `tokenizers.Tokenizer.from_file`
    folder with tokenizer.model only       SentencePiece
    (folders: BOS / EOS / chat template from tokenizer_config.json, special_tokens_map.json,
     generation_config.json, config.json and chat_template.jinja)

Everything here runs once, at load time; the run-time classes live in `inferd.text.tokenizer`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.text.errors import ModelLoadError
from inferd.text.tokenizer import (
    HFBackend,
    SentencePieceBackend,
    Tokenizer,
    TokenizerBackend,
    byte_to_unicode,
)

logger = logging.getLogger(__name__)

# GGUF token types (the same numbers as SentencePiece's ModelProto.SentencePiece.Type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Control tokens that end a turn although the file does not name them EOS (llama.cpp's EOG list).
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<|eom_id|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
})

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



def load_tokenizer(path: str | Path, gguf_metadata: dict | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file or a Hugging Face-style model folder.

    `gguf_metadata`: the GGUF's metadata when the caller has already read it (saves a second open).
    """
    path = Path(path)
    if gguf_metadata is not None or path.is_file():
        if gguf_metadata is None:
            from inferd.text.gguf_file import GGUFFile

            gguf = GGUFFile(path)
            gguf_metadata = gguf.metadata
            gguf.close()
        return _from_gguf(gguf_metadata, str(path))
    if path.is_dir():
        return _from_folder(path)
    raise ModelLoadError(f"{path}: no such file or folder")


# ---------------------------------------------------------------------------------------------
# GGUF: the vocabulary is in the metadata, under tokenizer.ggml.*


def _from_gguf(md: dict, where: str) -> Tokenizer:
    """A GGUF's tokenizer; `where` names the file in error messages."""
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
    end_ids |= {i for i, t in enumerate(tokens) if types[i] == CONTROL and t in _END_OF_GENERATION_TEXTS}
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
    tok = HFTokenizer(
        models.BPE(vocab=_byte_level_vocab(tokens, types), merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    )
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



# ---------------------------------------------------------------------------------------------
# Hugging Face folder: tokenizer.json or tokenizer.model, plus the JSON files around it


@dataclass(frozen=True)
class _FolderConfigs:
    """The JSON files that say which tokens are special; a missing file reads as {}."""

    tokenizer: dict  # tokenizer_config.json
    special_tokens: dict  # special_tokens_map.json
    generation: dict  # generation_config.json
    model: dict  # config.json


@dataclass
class _FolderVocab:
    """What the tokenizer file itself gives: the backend and the id -> piece table."""

    backend: TokenizerBackend
    pieces: list[str]  # id -> raw piece; "" for an id the file leaves out
    special_ids: set[int]
    byte_level: bool
    hf_tokenizer: Any | None  # the `tokenizers.Tokenizer` behind a tokenizer.json, else None


def _from_folder(folder: Path) -> Tokenizer:
    """A Hugging Face folder: the tokenizer file gives the vocabulary, the JSON around it the rest."""
    configs = _FolderConfigs(
        tokenizer=_read_json(folder / "tokenizer_config.json"),
        special_tokens=_read_json(folder / "special_tokens_map.json"),
        generation=_read_json(folder / "generation_config.json"),
        model=_read_json(folder / "config.json"),
    )
    if (folder / "tokenizer.json").is_file():
        vocab = _load_tokenizer_json(folder / "tokenizer.json")
    elif (folder / "tokenizer.model").is_file():
        vocab = _load_sentencepiece_model(folder / "tokenizer.model", configs.tokenizer)
    else:
        raise ModelLoadError(f"{folder}: no tokenizer.json or tokenizer.model in the folder")

    index = {p: i for i, p in reversed(list(enumerate(vocab.pieces)))}  # piece -> lowest id
    bos, eos, pad = (_configured_token_id(key, configs, index) for key in ("bos_token", "eos_token", "pad_token"))
    return Tokenizer(
        vocab.backend,
        vocab.pieces,
        vocab_size=len(vocab.pieces),
        bos_token_id=bos,
        eos_token_ids=frozenset(_end_of_generation_ids(eos, configs)),
        eos_token_id=eos,
        pad_token_id=pad,
        add_bos=_adds_bos(configs.tokenizer, vocab, bos),
        add_eos=bool(configs.tokenizer.get("add_eos_token", False)),
        special_ids=frozenset(vocab.special_ids),
        chat_template=_folder_chat_template(folder, configs.tokenizer),
        byte_level=vocab.byte_level,
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None


def _load_tokenizer_json(path: Path) -> _FolderVocab:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
        raise ModelLoadError(f"{path}: cannot load ({e})") from None
    added = tok.get_added_tokens_decoder()
    return _FolderVocab(
        backend=HFBackend(tok),
        pieces=[tok.id_to_token(i) or "" for i in range(tok.get_vocab_size(with_added_tokens=True))],
        special_ids={i for i, t in added.items() if t.special},
        byte_level="ByteLevel" in repr(tok.decoder),
        hf_tokenizer=tok,
    )


def _load_sentencepiece_model(path: Path, config: dict) -> _FolderVocab:
    """tokenizer.model, with the added tokens that tokenizer_config.json declares on top."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
        raise ModelLoadError(f"{path}: not a SentencePiece model ({e})") from None
    prefix_space = _sentencepiece_prefix_space(proto, config)
    pieces = [p.piece for p in proto.pieces]
    added = {i: p.piece for i, p in enumerate(proto.pieces) if p.type in (CONTROL, USER_DEFINED, UNKNOWN)}
    special_ids = {i for i, p in enumerate(proto.pieces) if p.type in (CONTROL, UNKNOWN)}
    # NOTE: added_tokens_decoder wins over the proto, and may name ids past the proto's end.
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        i, text = int(key), entry.get("content", "")
        added[i] = text
        if entry.get("special", False):
            special_ids.add(i)
        if i >= len(pieces):
            pieces += [""] * (i + 1 - len(pieces))
        pieces[i] = text
    return _FolderVocab(
        backend=SentencePieceBackend(proto, added, prefix_space),
        pieces=pieces,
        special_ids=special_ids,
        byte_level=False,
        hf_tokenizer=None,
    )


def _sentencepiece_prefix_space(proto: Any, config: dict) -> str:
    """The `SentencePieceBackend` prefix_space mode for this proto and tokenizer_config.json.

    Switches the proto's own add_dummy_prefix off when the backend takes the prefixing over.
    """
    if proto.normalizer_spec.remove_extra_whitespaces:
        return "never"  # spm collapses the spaces itself; leave its own prefixing on
    wants_prefix = proto.normalizer_spec.add_dummy_prefix and config.get("add_prefix_space", True) is not False
    proto.normalizer_spec.add_dummy_prefix = False
    if not wants_prefix:
        return "never"
    return "always" if config.get("legacy", False) else "first"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _configured_token_id(key: str, configs: _FolderConfigs, index: dict[str, int]) -> int | None:
    """The id of `key` ("bos_token", ...): its text looked up in the vocabulary, else `{key}_id`.

    The text comes from tokenizer_config.json or special_tokens_map.json; the id from
    generation_config.json or config.json (the first one when either holds a list).
    """
    text = _token_text(configs.tokenizer.get(key)) or _token_text(configs.special_tokens.get(key))
    if text is not None and text in index:
        return index[text]
    for source in (configs.generation, configs.model):
        value = source.get(f"{key}_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return None


def _end_of_generation_ids(eos: int | None, configs: _FolderConfigs) -> set[int]:
    """EOS plus every eos_token_id in generation_config.json / config.json (e.g. Llama-3's <|eot_id|>)."""
    ids = {eos} if eos is not None else set()
    for source in (configs.generation, configs.model):
        value = source.get("eos_token_id")
        ids |= set(value) if isinstance(value, list) else {value} if isinstance(value, int) else set()
    return ids


def _adds_bos(config: dict, vocab: _FolderVocab, bos: int | None) -> bool:
    """Whether encode() prepends BOS: tokenizer_config.json's add_bos_token, else the file's own habit."""
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        if vocab.hf_tokenizer is None:
            add_bos = True  # tokenizer.model: the Llama convention
        else:
            # a tokenizer.json says so through its post-processor (e.g. Llama-3's TemplateProcessing)
            tok = vocab.hf_tokenizer
            with_special = tok.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and with_special[:1] == [bos] != tok.encode("a", add_special_tokens=False).ids[:1]
    return bool(add_bos and bos is not None)


def _folder_chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (the "default" one of a list)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return None
