"""A gpt-oss tokenizer folder made here (o200k_harmony, as `tokenizers` writes one), and a tiny
scripted gpt-oss model beside it, for the harmony tests (tests/api/conversation/test_harmony*.py).

    the o200k ranks (the file `make setup` made: inferd/text/o200k.py)
      -> byte-level BPE: each token's bytes in GPT-2's alphabet, its merges found as transformers'
         TikTokenConverter finds them (every split of a token into two tokens, by the token's rank)
      -> o200k's split pattern, and harmony's special tokens at ids 199998..201087
      -> tokenizer.json, tokenizer_config.json, generation_config.json (EOS: <|return|>,
         <|endoftext|>, <|call|>, as the gpt-oss checkpoints' own)

Building takes a few seconds (200k tokens, 450k merges): a test session makes it once.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

from inferd.text.o200k import FILE_NAME, vocab_dir

# openai_harmony's own (src/tiktoken_ext/public_encodings.rs), the pieces of the pattern joined by "|"
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
         200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
FIRST_SPECIAL, VOCAB_SIZE = 199998, 201088
EOS_IDS = [200002, 199999, 200012]  # <|return|>, <|endoftext|>, <|call|>: generation_config.json's


def ranks() -> dict[bytes, int]:
    """o200k_base: token bytes -> rank."""
    out = {}
    for line in (vocab_dir() / FILE_NAME).read_bytes().splitlines():
        token, rank = line.split()
        out[base64.b64decode(token)] = int(rank)
    return out


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes -> unicode table (byte-level BPE spells every byte as one printable character)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


def bpe(ranked: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary and merges of byte-level BPE that tokenizes as tiktoken's ranks do."""
    alphabet = _byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranked.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranked and right in ranked:
                merges.append((rank, ranked[left], ranked[right], left, right))
    merges.sort()
    return {spell(t): r for t, r in ranked.items()}, [(spell(m[3]), spell(m[4])) for m in merges]


def special_tokens() -> dict[int, str]:
    return {i: NAMED.get(i, f"<|reserved_{i}|>") for i in range(FIRST_SPECIAL, VOCAB_SIZE)}


def write_tokenizer(folder: Path) -> Path:
    """`folder` with gpt-oss's tokenizer files (the module's docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = bpe(ranks())
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)
                                  for _, text in sorted(special_tokens().items())])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                                                   "pad_token": "<|endoftext|>", "add_bos_token": False})
    _write_json(folder / "generation_config.json", {"bos_token_id": 199998, "eos_token_id": EOS_IDS,
                                                    "pad_token_id": 199999})
    return folder


# A tiny gpt-oss whose greedy answer is scripted: a bigram table written into its embeddings and
# head (each source token's embedding a direction of its own, its successor's head row along it),
# loud enough that the random layers between do not change the choice. The prompt ends with
# "<|start|>assistant", so it answers <|channel|>final<|message|>Hello world<|return|>; where
# <|return|> is not allowed (a forced call's reasoning, under the grammar) " world" goes on to <|end|>.
SCRIPT = {"assistant": "<|channel|>", "<|channel|>": "final", "final": "<|message|>", "<|message|>": "Hello",
          "Hello": " world", " world": "<|return|>"}
SECOND = {" world": "<|end|>"}
SCRIPTED_ANSWER = "Hello world"
# the same model answering with a call nothing forces (tools under "auto"), and with reasoning only:
# a bigram table cannot say both in one answer (<|channel|> would need two successors)
CALL_ANSWER = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>"
THINK_ANSWER = "<|channel|>analysis<|message|>Think<|end|><|return|>"


def write_tiny_gpt_oss(folder: Path, seed: int = 0, answer: str | None = None,
                       tokenizer_from: Path | None = None) -> Path:
    """A tiny scripted gpt-oss (transformers' GptOssForCausalLM, float32) saved beside the tokenizer
    (`answer`: another greedy answer, every token of it distinct; `tokenizer_from`: a folder whose
    tokenizer files are copied rather than built again)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from inferd.text.o200k import harmony_encoding

    torch.manual_seed(seed)
    config = GptOssConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=12, max_position_embeddings=4096,
                          layer_types=["sliding_attention", "full_attention"], eos_token_id=EOS_IDS,
                          pad_token_id=199999, bos_token_id=199998, tie_word_embeddings=False)
    model = GptOssForCausalLM(config).eval()
    encoding = harmony_encoding()

    def token(text: str) -> int:
        [one] = encoding.encode(text, allowed_special="all")
        return one

    with torch.no_grad():
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight  # [vocab, hidden] each
        if answer is None:
            bigrams = [(token(source), token(target)) for source, target in SCRIPT.items()]
        else:
            ids = [token("assistant"), *encoding.encode(answer, allowed_special="all")]
            bigrams = list(zip(ids, ids[1:]))
        for k, (source, target) in enumerate(bigrams):
            embed[source] = torch.nn.functional.one_hot(torch.tensor(k), config.hidden_size).float()
            head[target] += 20 * embed[source]
        for source_text, target_text in SECOND.items() if answer is None else ():
            head[token(target_text)] += 10 * embed[token(source_text)]
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer_from is None:
        write_tokenizer(folder)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2))
