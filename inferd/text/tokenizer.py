"""Tokenizers at run time: one `Tokenizer` interface over byte-level BPE and SentencePiece.

    Tokenizer              what the engine and the API use: encode / decode / chat template,
                           BOS / EOS insertion, special-token ids, raw pieces for logprobs
    TokenizerBackend       text <-> ids, nothing else; two of them:
      HFBackend            a `tokenizers.Tokenizer` (byte-level BPE, or any tokenizer.json)
      SentencePieceBackend a SentencePiece model, with added / control tokens matched first

Building one from a GGUF file or a Hugging Face folder is `inferd.text.tokenizer_loader`'s job.
Backends only turn text into ids and back; BOS / EOS insertion and the hiding of special tokens
happen in `Tokenizer`, once, so every backend behaves the same way for the engine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
import functools
from functools import lru_cache
from typing import Any, Protocol

from inferd.text.chat_template import render_chat_template

LONG_TEXT = 16_384  # characters: past this, HFBackend encodes in its GIL-releasing batch call

# Token types: GGUF's tokenizer.ggml.token_type uses the same numbers as SentencePiece's
# ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Control tokens that end a turn although the file does not name them EOS (llama.cpp's EOG list).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<|eom_id|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
})

@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
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


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


# ---------------------------------------------------------------------------------------------
# backends: text <-> ids, nothing else


class TokenizerBackend(Protocol):
    """Text <-> ids for one vocabulary; it adds no BOS / EOS (unless HFBackend is asked for its
    post-processor's) and hides no special tokens."""

    normalizes: bool  # whether the text is normalized (NFKC, ...) before it is split

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class HFBackend:
    """A `tokenizers.Tokenizer` (byte-level BPE from a GGUF, or any tokenizer.json)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.normalizes = tok.normalizer is not None  # (a GGUF's byte-level BPE does not)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: with those the tokenizer's post-processor adds (a tokenizer.json's
        TemplateProcessing: Tokenizer.encode_document)."""
        if len(text) < LONG_TEXT:
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        # NOTE: the batch call releases the GIL while it works (the single one does not), so a
        # long text encoded on a worker thread leaves the server's event loop running
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


class SentencePieceBackend:
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

    normalizes = True  # (SentencePiece's own normalization rules, nmt_nfkc by default)

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
        backend: TokenizerBackend,
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
        post_processor: bool = False,
    ) -> None:
        """`post_processor`: a lone text's special tokens are those of the backend's post-processor
        (an HFBackend's), not add_bos / add_eos (encode_document)."""
        assert not post_processor or isinstance(backend, HFBackend)
        self._backend = backend
        self._post_processor = post_processor
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

    @property
    def eos_token_id(self) -> int | None:
        """The model's own end-of-sequence id (eos_token's); eos_token_ids may hold more."""
        return self._eos_token_id

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

    def encode_document(self, text: str) -> list[int]:
        """Ids of a text an embedding or reranking model reads alone, with the special tokens its
        tokenizer adds to one (transformers' `tokenizer(text)["input_ids"]`): a tokenizer.json's
        post-processor's where there is a tokenizer.json (Qwen3-Embedding's appends <|endoftext|>,
        EmbeddingGemma's wraps the text in <bos> ... <eos>), else BOS and EOS as add_bos / add_eos
        say (a tokenizer.model's tokenizer_config.json, a GGUF's add_bos_token / add_eos_token)."""
        if self._post_processor:
            assert isinstance(self._backend, HFBackend)
            return self._backend.encode(text, add_special_tokens=True)
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._backend.decode(ids)

    @functools.cached_property
    def bytes_per_token_bound(self) -> int:
        """A text of B bytes has at least B // bytes_per_token_bound tokens (what a size check
        before tokenizing relies on): the most bytes one token stands for, times 4 where the
        tokenizer normalizes the text first (NFKC can make a 3-byte character one byte)."""
        specials, alphabet = self.special_ids, _unicode_to_byte()
        if self._byte_level:  # a piece in GPT-2's alphabet has a byte per character; others: their UTF-8
            most = max((len(p) if i not in specials and all(c in alphabet for c in p) else len(p.encode())
                        for i, p in enumerate(self._pieces)), default=1)
        else:  # (UTF-8 of the spelling: never fewer bytes than the text's, "▁" being 3 for a space)
            most = max(map(len, (p.encode("utf-8", "surrogatepass") for p in self._pieces)), default=1)
        return max(1, most) * (4 if self._backend.normalizes else 1)

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
