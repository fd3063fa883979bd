"""Model files to fuzz, where their header fields lie, and the property every load must keep.

- `write_tiny_gguf`: a whole llama GGUF of 22 kB (one layer, a byte-level BPE vocabulary, F32,
  F16, Q8_0, Q4_0 and Q4_1 tensors) written by the `gguf` package's GGUFWriter, which
  `inferd serve` loads in ~5 ms: cheap enough for thousands of mutants.
- `write_tiny_folder`: the same model as a Hugging Face folder (config.json, tokenizer.json,
  model.safetensors written by safetensors.torch.save_file).
- `gguf_layout`: every structural field of a GGUF header (counts, lengths, value types, array
  counts, dims, GGML types, tensor offsets) as (offset, size, kind), and each key's entry,
  found by walking the layout independently of inferd's reader, so a mutant can aim at them;
  `with_entry` gives a key another value of any type, or leaves it out.
- `loads_or_refuses`: the property. Loading either succeeds or raises ModelLoadError with a
  one-line message naming the file; never another exception, never past a time limit, never an
  allocation past a bound on the address space.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferd.text.errors import ModelLoadError
from inferd.text.tokenizer import byte_to_unicode

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB_EXTRA = 32, 2, 1, 64, ("Ġt", "he", "<|end|>")
# NOTE: the costliest header a load must accept is one declaring the largest RoPE table inferd
# allows (families/config.py MAX_ROPE_ENTRIES, 2^28: a bit flip of the tiny file's context_length
# finds it): ~5 GB and ~12 s on a 2-core machine. The limits leave room for it and nothing more.
TIME_LIMIT = 40.0  # seconds a load may take (the tiny files load in ~5 ms, the SmolLM2 header in ~0.3 s)
MEMORY_LIMIT = 7 * 2**30  # bytes of address space a load may add


# ------------------------------------------------------------------------------ the files


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges): the 256 bytes, two merges and an end-of-turn control token."""
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)] + list(VOCAB_EXTRA)
    return tokens, [1] * (len(tokens) - 1) + [3], ["Ġ t", "h e"]


def tiny_weights(vocab: int) -> dict[str, np.ndarray]:
    """One llama layer under llama.cpp's names, float32."""
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (head_dim * KV_HEADS, HIDDEN),
              "blk.0.attn_v.weight": (head_dim * KV_HEADS, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    return {name: (rng.standard_normal(shape) * 0.1).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_gguf(path: Path) -> Path:
    import gguf
    from gguf import GGMLQuantizationType as Q

    tokens, types, merges = tiny_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    qtypes = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.F16,
              "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1}
    for name, array in tiny_weights(len(tokens)).items():
        qtype = qtypes.get(name.split(".")[-2], Q.F32)
        w.add_tensor(name, array if qtype == Q.F32 else gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_HF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def write_tiny_folder(folder: Path) -> Path:
    """The tiny model as a Hugging Face folder; its weights file is folder / "model.safetensors"."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = tiny_vocab()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, array in tiny_weights(len(tokens)).items():
        parts = name.split(".")
        short = _HF_NAMES[parts[-2]]
        hf = f"{short}.weight" if parts[0] != "blk" else f"model.layers.{parts[1]}.{short}.weight"
        tensors[hf] = torch.from_numpy(array).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": 1, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "vocab_size": len(tokens), "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "eos_token_id": len(tokens) - 1}
    (folder / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder


# ----------------------------------------------------------------------- a GGUF's fields


@dataclass(frozen=True)
class Field:
    offset: int
    size: int  # bytes: 4 (u32) or 8 (u64)
    kind: str  # "count" (tensors, keys), "length" (a string's), "type" (a value's or array's),
    #            "array" (an array's count), "dims" (a tensor's n_dims), "dim", "ggml" (its type), "offset"


@dataclass
class Layout:
    """Where a valid GGUF's parts lie: its structural fields, each key's entry, the tensor index."""

    fields: list[Field]
    entries: dict[str, tuple[int, int]]  # key -> (start, end) of its whole entry: key, type, value
    index: tuple[int, int]  # the tensor index's (start, end): the header ends there
    data_start: int  # its tensor data (general.alignment: the default, 32)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


def gguf_layout(data: bytes) -> Layout:
    """The layout of a valid GGUF (walked here, independently of inferd's reader)."""
    fields = [Field(4, 4, "version"), Field(8, 8, "count"), Field(16, 8, "count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string() -> None:
        nonlocal pos
        fields.append(Field(pos, 8, "length"))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == STRING:
            string()
        elif vtype == ARRAY:
            fields.extend([Field(pos, 4, "type"), Field(pos + 4, 8, "array")])
            elem, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                value(elem)
        else:
            pos += struct.calcsize(_SCALARS[vtype])

    entries = {}
    for _ in range(n_kv):
        start = pos
        key = data[pos + 8:pos + 8 + struct.unpack_from("<Q", data, pos)[0]].decode()
        string()
        fields.append(Field(pos, 4, "type"))
        pos += 4
        value(struct.unpack_from("<I", data, pos - 4)[0])
        entries[key] = (start, pos)
    index_start = pos
    for _ in range(n_tensors):
        string()
        fields.append(Field(pos, 4, "dims"))
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields.extend(Field(pos + 4 + 8 * i, 8, "dim") for i in range(n_dims))
        pos += 4 + 8 * n_dims
        fields.extend([Field(pos, 4, "ggml"), Field(pos + 4, 8, "offset")])
        pos += 12
    return Layout(fields, entries, (index_start, pos), (pos + 31) // 32 * 32)


def encode(vtype: int, value: Any, elem: int | None = None) -> bytes:
    """A GGUF value of type `vtype` (an array's elements of type `elem`)."""
    if vtype == STRING:
        raw = value.encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(raw)) + raw
    if vtype == ARRAY:
        assert elem is not None
        return struct.pack("<IQ", elem, len(value)) + b"".join(encode(elem, v) for v in value)
    return struct.pack(_SCALARS[vtype], value)


def typed(vtype: int, value: Any, elem: int | None = None) -> bytes:
    """A key's value as its entry holds it: its type, then the value."""
    return struct.pack("<I", vtype) + encode(vtype, value, elem)


def with_entry(data: bytes, layout: Layout, key: str, value: bytes | None) -> tuple[bytes, Layout]:
    """`data` with `key`'s value replaced by `value` (`typed`), or with `key` left out (None),
    and its layout; the tensor data moved to its new aligned start, its offsets unchanged. (The
    new entry's own fields are not listed: it is no field mutations' target.)"""
    start, end = layout.entries[key]
    if value is None:
        entry, n_kv = b"", struct.unpack_from("<Q", data, 16)[0] - 1
    else:
        entry, n_kv = encode(STRING, key) + value, struct.unpack_from("<Q", data, 16)[0]
    header = data[:16] + struct.pack("<Q", n_kv) + data[24:start] + entry + data[end:layout.index[1]]
    shift = len(entry) - (end - start)
    fields = ([f for f in layout.fields if f.offset < start]
              + [Field(f.offset + shift, f.size, f.kind) for f in layout.fields if f.offset >= end])
    entries = {k: (a + shift, b + shift) if a >= end else (a, b) for k, (a, b) in layout.entries.items() if k != key}
    if value is not None:
        entries[key] = (start, start + len(entry))
    new = Layout(fields, entries, (layout.index[0] + shift, len(header)), (len(header) + 31) // 32 * 32)
    return header + bytes(-len(header) % 32) + data[layout.data_start:], new


# --------------------------------------------------------------------------- the property


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """TimeoutError in the main thread once `seconds` have passed (SIGALRM: a hang fails the
    example instead of the run)."""
    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"a load ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@contextlib.contextmanager
def memory_limit(extra: int) -> Iterator[None]:
    """The address space capped at what it is now plus `extra` bytes (Linux): an allocation past
    it raises MemoryError instead of taking the machine's memory."""
    if not sys.platform.startswith("linux"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + extra
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def loads_or_refuses(load: Callable[[Path], Any], path: Path) -> str | None:
    """None if `load(path)` succeeded; else the ModelLoadError's message, checked to be one line
    that names the file. Any other exception (a MemoryError, a TimeoutError included) fails."""
    try:
        with memory_limit(MEMORY_LIMIT), time_limit(TIME_LIMIT):
            load(path)
    except ModelLoadError as e:
        message = str(e)
        assert message and "\n" not in message, repr(message)
        assert str(path) in message or str(path.parent) in message, message
        return message
    return None
