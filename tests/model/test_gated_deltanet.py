"""Gated DeltaNet and the hybrid decoder of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE against
transformers, on inferd's model alone (no engine): a tiny random checkpoint of each family written
by transformers, read by inferd's loader, and run step by step by a hand-made loop over paged K/V
blocks (the full-attention layers) and state slots (the linear ones), as the engine's runner
would. Greedy tokens are compared with transformers' float32 `generate`, prompts alone and in
one ragged batch, prefilled whole or in chunks of 5 beside decode rows, and resumed from a
state saved mid-prompt; the logits with transformers' own.

The linear layers are shown to matter: with their states zeroed before every step, the tokens differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import tiny_models as tm  # noqa: E402 - after the skip

from inferd.kernels.linear_attention import StatePlan  # noqa: E402
from inferd.model.decoder import DecoderModel, LayerAttention, StepAttention  # noqa: E402
from inferd.model.loading.loader import load_checkpoint  # noqa: E402
from inferd.model.models import decoder_for  # noqa: E402

VOCAB, NEW_TOKENS, BLOCK = 160, 16, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# (the last one longer than the delta rule's chunks of 64 tokens)
PROMPTS = [[5, 17, 99, 3, 42, 8, 120, 77, 31], [64, 2, 150, 13], [(37 * i + 11) % VOCAB for i in range(70)]]


# ------------------------------------------------------------------------------ the tiny checkpoints


def qwen3_5(vocab: int = VOCAB, **overrides: Any) -> Any:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL | {"vocab_size": vocab, "intermediate_size": 128} | overrides))


def qwen3_5_moe(vocab: int = VOCAB, **overrides: Any) -> Any:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**SMALL | EXPERTS | {"vocab_size": vocab} | overrides))


def qwen3_next(vocab: int = VOCAB, **overrides: Any) -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # (layer 1 keeps a dense MLP; the rest are sparse)
    return Qwen3NextForCausalLM(Qwen3NextConfig(**SMALL | EXPERTS | {
        "vocab_size": vocab, "intermediate_size": 128, "mlp_only_layers": [1]} | overrides))


FAMILIES: dict[str, Callable[..., Any]] = {"qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "qwen3_next": qwen3_next}


def randomized(model: Any, seed: int = 0) -> Any:
    """Well-separated random weights (tiny_models.randomize): the x̂·(1 + w) norms around 0, the
    gated norms (x̂·w) around 1, the decays' A_log and dt_bias spread so that the states forget
    at rates from fast to slow."""
    model = tm.randomize(model, seed, norm_centre=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


@dataclass
class Checkpoint:
    folder: Path
    reference: Any  # transformers' model
    tokens: list[list[int]]  # its greedy continuation of each of PROMPTS


def write(folder: Path, family: str, seed: int = 0) -> Checkpoint:
    torch.manual_seed(seed)
    model = randomized(FAMILIES[family](), seed)
    model.save_pretrained(folder, safe_serialization=True)
    tokens = tm.greedy_reference(model, PROMPTS, NEW_TOKENS)
    tm.assert_not_trivial(tokens, NEW_TOKENS)
    return Checkpoint(folder, model, tokens)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with tm.torch_threads(1):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    built: dict[str, Checkpoint] = {}

    def get(family: str) -> Checkpoint:
        if family not in built:
            built[family] = write(tmp_path_factory.mktemp(family), family)
        return built[family]

    return get


def inferd_model(checkpoint: Checkpoint) -> DecoderModel:
    loaded = load_checkpoint(checkpoint.folder, torch.float32)
    return decoder_for(loaded.config, loaded.tensors, torch.float32)


# ------------------------------------------------------------------------------ a step loop


@dataclass
class Seq:
    prompt: list[int]
    slot: int  # its state slot
    tokens: list[int] = field(default_factory=list)  # generated
    done: int = 0  # tokens of prompt + generated whose K/V and state are computed
    blocks: list[int] = field(default_factory=list)
    resumed: bool = False  # its slot holds the state after `done` tokens already (not fresh)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.tokens


class Steps:
    """The model over hand-made caches: K/V blocks of 4 for the full layers, 8 state slots for the
    linear ones (kv_caches[i] = (conv states [S, K-1, C], states [S, Hv, dk, dv] float32))."""

    def __init__(self, model: DecoderModel, num_blocks: int = 96, num_slots: int = 8) -> None:
        cfg, self.model = model.cfg, model
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            if cfg.is_linear(i):
                assert cfg.linear_attention is not None
                conv, state = cfg.linear_attention.state_shapes
                self.caches.append((torch.zeros(num_slots, *conv), torch.zeros(num_slots, *state)))
            else:
                shape = (num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
                self.caches.append((torch.zeros(shape), torch.zeros(shape)))
        self.free_blocks = list(range(num_blocks))
        self.zero_states = False  # (the control: every linear layer forgets before each step)

    def step(self, chunks: list[tuple[Seq, int]], saves: list[tuple[int, int]] = ()) -> torch.Tensor:
        """One forward over `chunks` (sequence, new tokens), prefill chunks first, then decode rows
        (one token each); `saves`: (row, slot) state checkpoints. Returns each chunk's last logits."""
        model, attention = self.model, self.model.attention
        ids, positions, slots = [], [], []
        for seq, n in chunks:
            while len(seq.blocks) * BLOCK < seq.done + n:
                seq.blocks.append(self.free_blocks.pop(0))
            for p in range(seq.done, seq.done + n):
                ids.append(seq.ids[p])
                positions.append(p)
                slots.append(seq.blocks[p // BLOCK] * BLOCK + p % BLOCK)
        num_decode = next((len(chunks) - i for i in range(len(chunks)) if all(n == 1 and s.done >= len(s.prompt)
                                                                              for s, n in chunks[i:])), 0)
        prefill, decode = chunks[:len(chunks) - num_decode], chunks[len(chunks) - num_decode:]
        cpu, width = torch.device("cpu"), max(len(s.blocks) for s, _ in chunks)

        def tables(group: list[tuple[Seq, int]]) -> list[list[int]]:
            return [s.blocks + [0] * (width - len(s.blocks)) for s, _ in group]

        plans = [attention.plan_prefill(tables(prefill), [s.done + n for s, n in prefill], [n for _, n in prefill],
                                        BLOCK, cpu) if prefill else None,
                 attention.plan_decode(tables(decode), [s.done + 1 for s, _ in decode], BLOCK, cpu) if decode else None]
        state = StatePlan.build([n for _, n in chunks], [s.slot for s, _ in chunks],
                                [s.done == 0 and not s.resumed for s, _ in chunks], list(saves), num_decode, cpu)
        layer = LayerAttention(torch.tensor(slots), *plans)
        attn = StepAttention([layer] * model.cfg.num_layers, sum(n for _, n in prefill), state=state)
        if self.zero_states:
            for i, (conv, states) in enumerate(self.caches):
                if model.cfg.is_linear(i):
                    conv.zero_(), states.zero_()
        last = torch.tensor([sum(n for _, n in chunks[:i + 1]) - 1 for i in range(len(chunks))])
        logits = model.forward(torch.tensor(ids), torch.tensor(positions), self.caches, attn, last)
        for seq, n in chunks:
            seq.done += n
        return logits

    def generate(self, seqs: list[Seq], max_new: int = NEW_TOKENS, chunk: int | None = None) -> list[list[int]]:
        """Greedy: each step prefills every unfinished prompt by up to `chunk` tokens (all of it:
        None) and decodes the rest, in one forward."""
        while any(len(s.tokens) < max_new for s in seqs):
            active = [s for s in seqs if len(s.tokens) < max_new]
            prefill = [(s, min(chunk or 10**9, len(s.prompt) - s.done)) for s in active if s.done < len(s.prompt)]
            decode = [(s, 1) for s in active if s.done >= len(s.prompt)]
            logits = self.step(prefill + decode)
            for (seq, _), row in zip(prefill + decode, logits):
                if seq.done == len(seq.ids):  # (a chunk that ends the prompt, or a decode row)
                    seq.tokens.append(int(row.argmax()))
        return [s.tokens for s in seqs]


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_alone_and_in_a_ragged_batch_match_transformers(family: str,
                                                                checkpoints: Callable[[str], Checkpoint]) -> None:
    checkpoint = checkpoints(family)
    model = inferd_model(checkpoint)
    assert model.cfg.architecture == family and model.cfg.has_linear_layers
    assert [model.cfg.is_linear(i) for i in range(4)] == [True, True, True, False]
    for slot, (prompt, expected) in enumerate(zip(PROMPTS, checkpoint.tokens)):
        assert Steps(model).generate([Seq(list(prompt), slot=slot + 2)]) == [expected]
    batch = [Seq(list(p), slot=7 - i) for i, p in enumerate(PROMPTS)]
    assert Steps(model).generate(batch) == checkpoint.tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_chunks_beside_decode_rows_match_transformers(family: str,
                                                             checkpoints: Callable[[str], Checkpoint]) -> None:
    checkpoint = checkpoints(family)
    steps = Steps(inferd_model(checkpoint))
    assert steps.generate([Seq(list(p), slot=i) for i, p in enumerate(PROMPTS)], chunk=5) == checkpoint.tokens


def test_logits_are_transformers_logits(checkpoints: Callable[[str], Checkpoint]) -> None:
    checkpoint = checkpoints("qwen3_next")
    steps = Steps(inferd_model(checkpoint))
    prompt = PROMPTS[2]
    ours = steps.step([(Seq(list(prompt), slot=0), len(prompt))])[0]
    with torch.inference_mode():
        theirs = checkpoint.reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_state_saved_mid_prompt_resumes_it(checkpoints: Callable[[str], Checkpoint]) -> None:
    """A save after row r leaves the state of the first r + 1 tokens in another slot: a second
    sequence starting from that slot (and the same K/V blocks) continues the prompt as transformers does."""
    checkpoint = checkpoints("qwen3_5")
    steps = Steps(inferd_model(checkpoint))
    prompt, cut = PROMPTS[0], 2 * BLOCK
    first = Seq(list(prompt), slot=0)
    steps.step([(first, len(prompt))], saves=[(cut - 1, 5)])
    second = Seq(list(prompt), slot=5, done=cut, blocks=first.blocks[:cut // BLOCK], resumed=True)
    steps.free_blocks = [b for b in steps.free_blocks if b not in first.blocks]
    assert steps.generate([second]) == [checkpoint.tokens[0]]


def test_without_the_linear_layers_state_the_tokens_differ(checkpoints: Callable[[str], Checkpoint]) -> None:
    checkpoint = checkpoints("qwen3_5")
    steps = Steps(inferd_model(checkpoint))
    steps.zero_states = True
    assert steps.generate([Seq(list(PROMPTS[2]), slot=0)]) != [checkpoint.tokens[2]]


def test_the_state_shapes_are_the_layers() -> None:
    from inferd.model.layers.gated_deltanet import LinearAttention

    spec = LinearAttention(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=8, conv_kernel=4)
    assert spec.conv_dim == 2 * 2 * 16 + 4 * 8
    assert spec.state_shapes == ((3, 96), (4, 16, 8))
