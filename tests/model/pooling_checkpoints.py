"""Tiny pooling models written inside the tests, with sentence-transformers as their reference.

A plain module (not a conftest), like tiny_models.py, whose tokenizers and random weights it reuses:

    qwen3_embedding(folder)    a Qwen3 trunk saved alone (Qwen3Model), a byte-level BPE whose
                               post-processor appends <|endoftext|>; Pooling lasttoken, Normalize
    embedding_gemma(folder)    a Gemma 3 trunk (Gemma3TextModel) with bidirectional attention and a
                               window shorter than the prompts; a SentencePiece vocabulary adding
                               BOS and EOS; Pooling mean, Dense 64 -> 128 -> 64, Normalize
    embed(folder, texts)       inferd's vectors: our loader, tokenizer, decoder over a fresh paged
                               cache (as the engine runs a bidirectional prompt: one chunk from 0),
                               pooled here, then Pooler.project
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tiny_models as tm
import torch

from inferd.model.decoder import DecoderModel, LayerAttention, StepAttention
from inferd.model.loading.loader import load_checkpoint
from inferd.model.models import decoder_for
from inferd.model.pooling import Pooler, load_pooler
from inferd.text.tokenizer import Tokenizer
from inferd.text.tokenizer_loader import load_tokenizer

HIDDEN = 64
# config.json's window: transformers reads it as |q - k| < 8 // 2 + 1 under bidirectional attention
GEMMA_WINDOW = 8
SMALL = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Der Hund schläft. 你好，世界！",
         "def fib(n):\n    return n"]


def qwen3_embedding(folder: Path) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import Qwen3Config, Qwen3Model

    vocab = tm.train_byte_level_bpe(folder)
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))  # Qwen3-Embedding's: a text, then <|endoftext|>
    end = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", end)])
    tok.save(str(folder / "tokenizer.json"))
    _drop_chat_template(folder)
    torch.manual_seed(0)
    tm.randomize(Qwen3Model(Qwen3Config(vocab_size=vocab, **SMALL)), seed=0).save_pretrained(folder)
    modules = [Transformer(str(folder)), Pooling(HIDDEN, pooling_mode="lasttoken"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def embedding_gemma(folder: Path) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import Gemma3TextConfig, Gemma3TextModel

    vocab = tm.train_sentencepiece(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # <bos> text <eos>; a pad token, which sentence-transformers' batches need
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"add_eos_token": True, "pad_token": "<unk>"}))
    torch.manual_seed(1)
    model = Gemma3TextModel(Gemma3TextConfig(
        vocab_size=vocab, query_pre_attn_scalar=16, sliding_window=GEMMA_WINDOW, use_bidirectional_attention=True,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2, pad_token_id=0, **SMALL))
    tm.randomize(model, seed=1, norm_centre=0.0).save_pretrained(folder)  # (Gemma's norms: x̂·(1 + w))
    modules = [Transformer(str(folder)), Pooling(HIDDEN, pooling_mode="mean"),
               Dense(HIDDEN, 2 * HIDDEN, bias=False, activation_function=torch.nn.Identity()),
               Dense(2 * HIDDEN, HIDDEN, bias=False, activation_function=torch.nn.Identity()), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def _drop_chat_template(folder: Path) -> None:
    """NOTE: sentence-transformers 6 renders a text through the tokenizer's chat template when it has
    one (its "message" modality); inferd, like transformers' tokenizer(text), reads the text alone."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def reference_vectors(folder: Path, texts: list[str]) -> torch.Tensor:  # [len(texts), dimensions]
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)


def load(folder: Path) -> tuple[DecoderModel, Tokenizer, Pooler]:
    checkpoint = load_checkpoint(folder, torch.float32)
    model = decoder_for(checkpoint.config, checkpoint.tensors, torch.float32)
    return model, load_tokenizer(folder), load_pooler(str(folder), checkpoint.config.hidden_size)


def hidden_states(model: DecoderModel, ids: list[int], block_size: int = 16) -> torch.Tensor:  # [T, hidden]
    """The final norm's output at every position of one prompt, prefilled from position 0 into the
    first blocks of a fresh cache, every layer with its own window."""
    cfg, n, cpu = model.cfg, len(ids), torch.device("cpu")
    table = list(range(-(-n // block_size)))  # blocks 0, 1, ... in order: slot p is position p
    positions = torch.arange(n)
    shapes = [(len(table), block_size, *cfg.kv_shape(i)) for i in range(cfg.num_layers)]  # [blocks, block_size, KV, D]
    kv = [(torch.zeros(shape), torch.zeros(shape)) for shape in shapes]  # keys, values per layer
    layers = []
    for i in range(cfg.num_layers):
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        plan = model.attention.plan_prefill([table], [n], [n], block_size, cpu, window, bidirectional=cfg.bidirectional)
        layers.append(LayerAttention(positions, plan, None))
    x = model.trunk(torch.tensor(ids), positions, kv, StepAttention(layers, num_prefill_tokens=n))
    return model.hidden(x, positions)


def embed(folder: Path, texts: list[str]) -> torch.Tensor:  # [len(texts), dimensions]
    model, tokenizer, pooler = load(folder)
    pooled = []
    for text in texts:
        h = hidden_states(model, tokenizer.encode_document(text))
        pooled.append({"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooler.method])
    return pooler.project(torch.stack(pooled))


def dense_folder(folder: Path, layers: list[Any]) -> Path:
    """Sentence-transformers modules alone (no trunk): mean Pooling over HIDDEN, then `layers`
    (Dense modules), each saved as sentence-transformers saves it."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}]
    (folder / "1_Pooling").mkdir(parents=True)
    pooling = {"embedding_dimension": HIDDEN, "pooling_mode": "mean"}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    for i, layer in enumerate(layers, start=2):
        (folder / f"{i}_Dense").mkdir()
        layer.save(str(folder / f"{i}_Dense"))
        modules.append({"idx": i, "name": str(i), "path": f"{i}_Dense",
                        "type": "sentence_transformers.base.modules.dense.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder
