"""A `Tokenizer` from a Hugging Face-style model folder, at load time: tokenizer.json
(`tokenizers.Tokenizer.from_file`) or tokenizer.model (SentencePiece), with BOS / EOS / chat
template from tokenizer_config.json, special_tokens_map.json, generation_config.json,
config.json and chat_template.jinja.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd.text.errors import ModelLoadError
from inferd.text.tokenizer import (
    CONTROL,
    UNKNOWN,
    USER_DEFINED,
    HFBackend,
    SentencePieceBackend,
    Tokenizer,
    TokenizerBackend,
)

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


def from_folder(folder: Path) -> Tokenizer:
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
        # NOTE: a lone text's special tokens are the tokenizer.json post-processor's (none without
        # one): transformers 5 drops tokenizer_config.json's add_bos_token / add_eos_token then
        post_processor=vocab.hf_tokenizer is not None,
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
