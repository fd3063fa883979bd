"""Sampler: greedy, filters, distribution, penalties, seeded determinism, logprobs (CPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from inferd.model.sampler import Sampler, apply_token_mask
from inferd.text.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def sample(logits: torch.Tensor, params: list[SamplingParams], outputs=None, generators=None):
    B = logits.shape[0]
    return Sampler()(logits, params, outputs or [[] for _ in range(B)], generators or [None] * B)


def many(logits_row: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    """n independent draws of one row, as one batch; returns the [V] histogram."""
    out = sample(logits_row.expand(n, -1).clone(), [p] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[-1])


# probabilities 0.4, 0.3, 0.15, 0.1, 0.05, listed out of order so ids != ranks
CRAFTED_P = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
CRAFTED = CRAFTED_P.log()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---- greedy ----

def test_greedy_is_argmax_any_dtype() -> None:
    logits = torch.randn(8, 100)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        out = sample(x, [GREEDY] * 8)
        assert out.token_ids == x.float().argmax(-1).tolist()
        assert out.logprobs is None and out.top_logprobs is None


def test_greedy_tie_breaks_to_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]])
    assert sample(logits, [GREEDY] * 2).token_ids == [1, 0]


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(64, 50)
    out = sample(logits, [SamplingParams(temperature=1.3, top_k=1)] * 64)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_inside_a_sampling_batch() -> None:
    logits = torch.randn(6, 40)
    params = [GREEDY, SamplingParams(), GREEDY, SamplingParams(top_p=0.5), GREEDY,
              SamplingParams(temperature=3)]
    out = sample(logits, params)
    for i in (0, 2, 4):
        assert out.token_ids[i] == logits[i].argmax().item()


# ---- filters ----

@pytest.mark.parametrize(
    ("p", "allowed"),
    [
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(top_p=0.75), {1, 3, 4}),  # 0.4 + 0.3 < 0.75 <= 0.4 + 0.3 + 0.15
        (SamplingParams(top_p=0.35), {1}),
        (SamplingParams(min_p=0.3), {1, 3, 4}),  # threshold 0.12
        (SamplingParams(top_k=3, top_p=0.6), {1, 3}),  # renormalised: 0.47 + 0.35 >= 0.6
        (SamplingParams(top_k=4, min_p=0.5), {1, 3}),  # threshold 0.2
    ],
)
def test_filters_never_leave_the_allowed_set(p: SamplingParams, allowed: set[int]) -> None:
    counts = many(CRAFTED, p, 4000)
    seen = {i for i in range(5) if counts[i] > 0}
    assert seen == allowed  # nothing outside, and every allowed token does occur
    # and the kept tokens keep their relative odds
    kept = torch.tensor(sorted(allowed))
    expected = CRAFTED_P[kept] / CRAFTED_P[kept].sum()
    assert torch.allclose(counts[kept].float() / 4000, expected, atol=0.04)


def test_mixed_filters_apply_per_row() -> None:
    """One batch, one sort: each row obeys its own top-k / top-p / min-p, not a neighbour's."""
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(min_p=0.5),
              SamplingParams(), SamplingParams(top_k=1, temperature=0.5)]
    allowed = [{1, 3}, {1, 3, 4}, {1, 3}, {0, 1, 2, 3, 4}, {1}]
    reps = 1500
    out = sample(CRAFTED.expand(reps * 5, -1).clone(), params * reps)
    for r, ok in enumerate(allowed):
        seen = set(out.token_ids[r::5])
        assert seen == ok, (r, seen)


# ---- distribution ----

@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0])
    n = 40_000
    counts = many(logits, SamplingParams(temperature=temperature), n)
    expected = (logits / temperature).softmax(-1)
    # 5 sigma of the worst cell is < 0.013
    assert torch.allclose(counts.float() / n, expected, atol=0.013), (counts / n, expected)


def test_low_temperature_is_nearly_greedy_and_high_is_flatter() -> None:
    logits = torch.tensor([1.0, 0.0, 2.0, 0.5])
    cold = many(logits, SamplingParams(temperature=0.01), 2000)
    assert cold[2] == 2000
    hot = many(logits, SamplingParams(temperature=100.0), 8000)
    assert (hot.float() / 8000 - 0.25).abs().max() < 0.03


# ---- penalties ----

def test_penalties_follow_openai_formula() -> None:
    V = 6
    logits = torch.randn(4, V)
    outputs = [[1, 1, 3], [], [5, 5, 5, 5, 0], [2, 2]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=1.0, frequency_penalty=1.0),  # nothing generated yet
        SamplingParams(presence_penalty=-0.5, frequency_penalty=0.1),
        SamplingParams(),  # no penalty: untouched although it has output
    ]
    got = Sampler().process(logits, params, outputs)
    expected = logits.clone()
    for i, (p, ids) in enumerate(zip(params, outputs)):
        for j in set(ids):
            expected[i, j] -= p.frequency_penalty * ids.count(j) + p.presence_penalty
    assert torch.allclose(got, expected, atol=1e-6)
    assert torch.equal(got[3], logits[3]) and torch.equal(got[1], logits[1])


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]] * 3)
    outputs = [[1], [1, 1, 1], [2]]
    params = [
        SamplingParams(temperature=0, presence_penalty=0.6),  # 2.4 < 2.5 -> token 2
        SamplingParams(temperature=0, frequency_penalty=0.1),  # 2.7 > 2.5 -> still token 1
        SamplingParams(temperature=0, frequency_penalty=-1.0),  # boosts 2 -> 3.5
    ]
    assert sample(logits, params, outputs).token_ids == [2, 1, 2]
    assert sample(logits, [GREEDY] * 3, outputs).token_ids == [1, 1, 1]


# ---- seeded determinism ----

def _run_seeded(target: SamplingParams, seed: int, steps: list[torch.Tensor], position: int,
                batch_size: int, rng: torch.Generator) -> list[int]:
    """Generate len(steps) tokens for a seeded target row sitting at `position` in a batch."""
    others = [SamplingParams(), GREEDY, SamplingParams(seed=1, top_k=5),
              SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05),
              SamplingParams(seed=2, presence_penalty=1.0)]
    g = torch.Generator().manual_seed(seed)
    other_gens = [torch.Generator().manual_seed(100 + j) for j in range(batch_size)]
    tokens: list[int] = []
    for row in steps:
        V = row.shape[0]
        logits = torch.randn(batch_size, V, generator=rng)
        logits[position] = row
        params = [others[(j + position) % len(others)] for j in range(batch_size)]
        params[position] = target
        gens = [other_gens[j] if params[j].seed is not None else None for j in range(batch_size)]
        gens[position] = g
        outputs = [[7, 8] for _ in range(batch_size)]
        outputs[position] = list(tokens)
        tokens.append(sample(logits, params, outputs, gens).token_ids[position])
    return tokens


@pytest.mark.parametrize("target", [
    SamplingParams(seed=1234),
    SamplingParams(seed=1234, temperature=0.8, top_k=20, top_p=0.9, frequency_penalty=0.5),
])
def test_same_seed_same_tokens_alone_or_in_any_batch(target: SamplingParams) -> None:
    steps = [torch.randn(64) for _ in range(12)]
    rng = torch.Generator().manual_seed(7)
    alone = _run_seeded(target, 1234, steps, 0, 1, rng)
    assert len(set(alone)) > 3  # really sampling
    for position, batch_size in [(0, 4), (3, 4), (5, 9), (2, 3)]:
        assert _run_seeded(target, 1234, steps, position, batch_size, rng) == alone
    assert _run_seeded(target, 4321, steps, 0, 1, rng) != alone


# ---- logprobs ----

def test_logprobs_are_raw_log_softmax_topk_descending() -> None:
    V = 300
    logits = (torch.randn(5, V) * 3).to(torch.bfloat16)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, presence_penalty=2.0, top_k=3),
        SamplingParams(),
        SamplingParams(logprobs=20, temperature=0),
        SamplingParams(logprobs=0, top_p=0.5),
        SamplingParams(logprobs=1, frequency_penalty=-2.0),
    ]
    outputs = [list(range(50)), [], [1, 2], [], [3] * 10]
    out = sample(logits, params, outputs)
    ref = logits.float().log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, p in enumerate(params):
        tok = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        k = p.logprobs or 0
        top = out.top_logprobs[i]
        assert len(top) == k
        ref_vals, _ = ref[i].topk(k) if k else (torch.empty(0), None)
        assert [v for _, v in top] == pytest.approx(ref_vals.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
        for j, v in top:
            assert v == pytest.approx(ref[i, j].item(), abs=1e-5)
    assert out.token_ids[2] == logits[2].float().argmax().item()
    assert math.isclose(out.top_logprobs[2][0][1], ref[2].max().item(), abs_tol=1e-5)


def test_a_token_mask_binds_greedy_and_sampled_rows_alike() -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0)]
    generators = [None, torch.Generator().manual_seed(1), None]
    mask = torch.zeros(3, 2, dtype=torch.int32)  # [B, ceil(50 / 32)]
    mask[0, 0] = (1 << 7) | (1 << 9)
    mask[1, 0] = 1 << 3
    mask[2] = -1  # an unconstrained row: every bit set
    for _ in range(20):
        out = Sampler()(logits, params, [[], [], []], generators, mask)
        assert out.token_ids[0] == (7 if logits[0, 7] > logits[0, 9] else 9)
        assert out.token_ids[1] == 3
        assert out.token_ids[2] == int(logits[2].argmax())  # an unconstrained row is untouched
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_the_token_mask_reads_every_bit_of_every_word() -> None:
    V = 70  # three words, the last one partial
    wanted = [0, 31, 32, 63, 64, 69]
    mask = torch.zeros(len(wanted), 3, dtype=torch.int32)
    for row, token in enumerate(wanted):
        mask[row, token // 32] = int(np.uint32(1 << (token % 32)).view(np.int32))  # bit 31: the sign bit
    masked = apply_token_mask(torch.zeros(len(wanted), V), mask)
    for row, token in enumerate(wanted):
        assert torch.isfinite(masked[row]).nonzero().flatten().tolist() == [token]
