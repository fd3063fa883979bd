"""Tokenizers: one `Tokenizer` interface over byte-level BPE (`tokenizers`) and SentencePiece.

Sources `load_tokenizer` understands:

    GGUF, tokenizer.ggml.model == "gpt2"   byte-level BPE rebuilt from the vocab + merges;
                                           `tokenizer.ggml.pre` picks the split regex
    GGUF, tokenizer.ggml.model == "llama"  SentencePiece BPE rebuilt from tokens, scores, types
    folder with tokenizer.json             `tokenizers.Tokenizer.from_file`
    folder with tokenizer.model only       SentencePiece
    (folders: BOS / EOS / chat template from tokenizer_config.json, special_tokens_map.json,
     generation_config.json, config.json and chat_template.jinja)

Both backends only turn text into ids and back; BOS / EOS insertion and the hiding of special
tokens happen here, once, so every backend behaves the same way for the engine.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from inferd.model.chat_template import render_chat_template
from inferd.model.errors import ModelLoadError

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


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (the alphabet of byte-level vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


# ---------------------------------------------------------------------------------------------
# backends: text <-> ids, nothing else


class _Backend(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class _HFBackend:
    """A `tokenizers.Tokenizer` (byte-level BPE from a GGUF, or any tokenizer.json)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


class _SPMBackend:
    """SentencePiece, with added / control tokens matched in the text first (as HF and llama.cpp do).

    `prefix_space`: where a "▁" is prepended to a run of plain text --
        "llama.cpp": at the start and after every special token (llama.cpp's SPM rule);
        "first":     only at the start of the text, and not if it already starts with a space
                     (transformers' Metaspace with prepend_scheme="first");
        "always":    every run, unless it starts with a space (Metaspace "always", legacy HF);
        "never".
    NOTE: the proto's own add_dummy_prefix is switched off so that this choice is ours; spm would
    otherwise prefix every run we hand it.
    """

    def __init__(self, proto: Any, added: dict[int, str], prefix_space: str) -> None:
        import sentencepiece as spm

        self.strip_one_space = prefix_space != "never"
        self.prefix_space = prefix_space
        self.sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        self.added = added  # id -> text of tokens matched whole and decoded as their text
        self.added_ids: dict[str, int] = {}  # text -> id; the lowest id wins for a duplicated text
        for i, t in sorted(added.items()):
            if t:
                self.added_ids.setdefault(t, i)
        # longest first, so that "<|im_start|>" is not cut into a shorter added token
        texts = sorted(self.added_ids, key=len, reverse=True)
        self.split_re = re.compile("|".join(map(re.escape, texts))) if texts else None

    def _encode_run(self, text: str, prefix: bool) -> list[int]:
        if prefix and not (self.prefix_space != "llama.cpp" and text.startswith(" ")):
            text = " " + text
        return self.sp.encode(text) if text else []

    def encode(self, text: str) -> list[int]:
        if self.split_re is None:
            return self._encode_run(text, self.prefix_space != "never")
        ids: list[int] = []
        pos = 0
        prev_special = True  # the start of the text counts as "after a special token"
        for m in self.split_re.finditer(text):
            if m.start() > pos:
                ids += self._encode_run(text[pos : m.start()], self._prefix(pos, prev_special))
            ids.append(self.added_ids[m.group()])
            pos, prev_special = m.end(), True
        if pos < len(text):
            ids += self._encode_run(text[pos:], self._prefix(pos, prev_special))
        return ids

    def _prefix(self, pos: int, prev_special: bool) -> bool:
        mode = self.prefix_space
        return mode == "always" or (mode == "first" and pos == 0) or (mode == "llama.cpp" and prev_special)

    def decode(self, ids: Sequence[int]) -> str:
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.added:
                if run:
                    parts.append(self.sp.decode(run))
                    run = []
                parts.append(self.added[i])
            else:
                run.append(i)
        if run:
            parts.append(self.sp.decode(run))
        text = "".join(parts)
        if self.strip_one_space and text.startswith(" "):
            text = text[1:]
        return text


# ---------------------------------------------------------------------------------------------
# the interface the engine and the API use


class Tokenizer:
    """Text <-> token ids for one model, plus what generation needs to know about special tokens."""

    def __init__(
        self,
        backend: _Backend,
        pieces: list[str],
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        eos_token_id: int | None,
        pad_token_id: int | None,
        add_bos: bool,
        add_eos: bool,
        special_ids: frozenset[int],
        chat_template: str | None,
        byte_level: bool,
    ) -> None:
        self._backend = backend
        self._pieces = pieces  # id -> raw piece as the vocabulary spells it
        self._byte_level = byte_level
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.special_ids = special_ids
        self.chat_template = chat_template
        self._eos_token_id = eos_token_id
        self.bos_token = self._piece_or_none(bos_token_id)
        self.eos_token = self._piece_or_none(eos_token_id)

    def _piece_or_none(self, token_id: int | None) -> str | None:
        return self._pieces[token_id] if token_id is not None and 0 <= token_id < len(self._pieces) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; special-token text in it (e.g. `<|im_start|>`) becomes the single id.

        NOTE: a prompt rendered from a chat template usually carries its BOS already; encode it
        with add_special_tokens=False (as vLLM does) to avoid a second BOS.
        """
        ids = self._backend.encode(text)
        if add_special_tokens:
            if self.add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos and self._eos_token_id is not None:
                ids.append(self._eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._backend.decode(ids)

    def id_to_token(self, token_id: int) -> str:
        """The raw piece (e.g. "Ġthe", "▁the", "<0x0A>"), for logprobs display."""
        return self._pieces[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token contributes to the text (OpenAI's logprobs `bytes` field)."""
        piece = self._pieces[token_id]
        if token_id in self.special_ids:
            return piece.encode()
        if self._byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_to_unicode().items()}


# ---------------------------------------------------------------------------------------------
# loading


def load_tokenizer(path: str | Path, gguf_metadata: dict | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file or a Hugging Face-style model folder."""
    path = Path(path)
    if gguf_metadata is not None or path.is_file():
        if gguf_metadata is None:
            from inferd.model.gguf_file import GGUFFile

            gguf = GGUFFile(path)
            gguf_metadata = gguf.metadata
            gguf.close()
        return _from_gguf(gguf_metadata, str(path))
    if path.is_dir():
        return _from_folder(path)
    raise ModelLoadError(f"{path}: no such file or folder")


def _from_gguf(md: dict, where: str) -> Tokenizer:
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] | None = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{where}: GGUF has no tokenizer.ggml.tokens")
    types: list[int] = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{where}: GGUF has {len(tokens)} tokens but {len(types)} token types")

    if kind == "gpt2":
        backend: _Backend = _HFBackend(_gguf_byte_level_bpe(md, tokens, types, where))
        default_add_bos = False
    elif kind == "llama":
        backend = _SPMBackend(
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
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    merges_raw: list[str] = md.get("tokenizer.ggml.merges") or []
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"{where}: malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((a, b))
    alphabet = set(_byte_to_unicode().values())
    b2u = _byte_to_unicode()
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        # NOTE: added tokens keep their raw text (llama.cpp's converter stores them so); a normal
        # token outside the byte alphabet is respelled in it, as transformers' GGUF loader does.
        if types[i] not in (CONTROL, USER_DEFINED) and not set(t) <= alphabet:
            t = "".join(b2u[b] for b in t.encode())
        vocab.setdefault(t, i)

    pre = md.get("tokenizer.ggml.pre", "default")
    split = _PRE_TOKENIZERS.get(pre)
    if split is None:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; using the GPT-2 pre-tokenizer", where, pre)
        split = "gpt2"
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for i, t in enumerate(tokens) if types[i] == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False, special=False) for i, t in enumerate(tokens) if types[i] == USER_DEFINED]
    )
    return tok


def _gguf_spm_proto(md: dict, tokens: list[str], types: list[int], where: str) -> Any:
    from sentencepiece import sentencepiece_model_pb2 as pb

    scores: list[float] = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    byte_pieces = {t for i, t in enumerate(tokens) if types[i] == BYTE}
    proto.trainer_spec.byte_fallback = len(byte_pieces) == 256
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False  # the backend adds the prefix itself
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


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_folder(folder: Path) -> Tokenizer:
    config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    gen_config = _read_json(folder / "generation_config.json")
    model_config = _read_json(folder / "config.json")

    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
            raise ModelLoadError(f"{folder / 'tokenizer.json'}: cannot load ({e})") from None
        backend: _Backend = _HFBackend(tok)
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        pieces = [tok.id_to_token(i) or "" for i in range(vocab_size)]
        added = tok.get_added_tokens_decoder()
        special_ids = {i for i, t in added.items() if t.special}
        byte_level = "ByteLevel" in repr(tok.decoder)
        default_add_bos = None  # decided below from the post-processor
    elif (folder / "tokenizer.model").is_file():
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        try:
            proto.ParseFromString((folder / "tokenizer.model").read_bytes())
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
            raise ModelLoadError(f"{folder / 'tokenizer.model'}: not a SentencePiece model ({e})") from None
        prefix = proto.normalizer_spec.add_dummy_prefix and config.get("add_prefix_space", True) is not False
        if proto.normalizer_spec.remove_extra_whitespaces:
            prefix = False  # spm collapses the spaces itself; leave its own prefixing on
        else:
            proto.normalizer_spec.add_dummy_prefix = False
        pieces = [p.piece for p in proto.pieces]
        added = {i: p.piece for i, p in enumerate(proto.pieces) if p.type in (CONTROL, USER_DEFINED, UNKNOWN)}
        special_ids = {i for i, p in enumerate(proto.pieces) if p.type in (CONTROL, UNKNOWN)}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            i, text = int(key), entry.get("content", "")
            added[i] = text
            if entry.get("special", False):
                special_ids.add(i)
            if i >= len(pieces):
                pieces += [""] * (i + 1 - len(pieces))
            pieces[i] = text
        mode = "never" if not prefix else ("always" if config.get("legacy", False) else "first")
        backend = _SPMBackend(proto, added, mode)
        vocab_size = len(pieces)
        byte_level = False
        default_add_bos = True  # the Llama convention
    else:
        raise ModelLoadError(f"{folder}: no tokenizer.json or tokenizer.model in the folder")

    index = {p: i for i, p in reversed(list(enumerate(pieces)))}

    def id_of(key: str) -> int | None:
        text = _token_text(config.get(key)) or _token_text(special_map.get(key))
        if text is not None and text in index:
            return index[text]
        for source in (gen_config, model_config):
            value = source.get(f"{key}_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int):
                return value
        return None

    bos, eos, pad = id_of("bos_token"), id_of("eos_token"), id_of("pad_token")
    eos_ids = {eos} if eos is not None else set()
    for source in (gen_config, model_config):
        value = source.get("eos_token_id")
        eos_ids |= set(value) if isinstance(value, list) else {value} if isinstance(value, int) else set()

    add_bos = config.get("add_bos_token", default_add_bos)
    if add_bos is None:
        # a tokenizer.json says so through its post-processor (e.g. Llama-3's TemplateProcessing)
        with_special = tok.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and with_special[:1] == [bos] != tok.encode("a", add_special_tokens=False).ids[:1]

    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):
        named = {t.get("name"): t.get("template") for t in config["chat_template"]}
        template = named.get("default") or next(iter(named.values()), None)

    return Tokenizer(
        backend,
        pieces,
        vocab_size=vocab_size,
        bos_token_id=bos,
        eos_token_ids=frozenset(eos_ids),
        eos_token_id=eos,
        pad_token_id=pad,
        add_bos=bool(add_bos and bos is not None),
        add_eos=bool(config.get("add_eos_token", False)),
        special_ids=frozenset(special_ids),
        chat_template=template,
        byte_level=byte_level,
    )
