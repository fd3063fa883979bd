"""The model-free drafters on hand-made token lists: exact drafts for copying, the longest-match,
frequency and recency rules, the draft-length rule, the n-gram baseline's order, the tenant
history's bound; and a property test that every draft is what followed an earlier match."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engine.spec.drafters import Draft, NgramIndex, SuffixIndex, TenantHistory

PASSAGE = list(range(100, 140))  # 40 distinct tokens


def suffix_index(tokens: list[int], **keys: float) -> SuffixIndex:
    index = SuffixIndex(**keys)
    index.extend(tokens)
    return index


def ngram_index(tokens: list[int], **keys: int) -> NgramIndex:
    index = NgramIndex(**keys)
    index.extend(tokens)
    return index


# SuffixIndex

def test_a_copy_drafts_the_rest_of_the_passage() -> None:
    tokens = [1, 2, 3] + PASSAGE + [7, 8] + PASSAGE[:5]  # the second copy has begun
    assert suffix_index(tokens, spec_factor=8).propose(35) == Draft(PASSAGE[5:], 5)
    # as the copy goes on, the match grows and so do the drafts (spec_factor 1: as long as the match)
    index = suffix_index(tokens)
    assert index.propose(64) == Draft(PASSAGE[5:10], 5)
    index.extend(PASSAGE[5:20])
    assert index.propose(64) == Draft(PASSAGE[20:40], 20)


def test_the_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    tokens = [1, 2, 3, 4, 50, 9, 9, 3, 4, 60, 1, 2, 3, 4]
    assert suffix_index(tokens).propose(8) == Draft([50, 9, 9, 3], 4)


def test_equally_long_matches_the_most_frequent_next_token_then_the_most_recent() -> None:
    # "5 6" ends 3 times, each after a different token: next 7, 7, then 8 (the most recent)
    tokens = [20, 5, 6, 7, 10, 21, 5, 6, 7, 11, 22, 5, 6, 8, 12, 23, 5, 6]
    assert suffix_index(tokens).propose(8) == Draft([7, 11], 2)
    # all different: the most recent
    assert suffix_index([20, 5, 6, 7, 21, 5, 6, 8, 23, 5, 6]).propose(8) == Draft([8, 23], 2)


def test_equally_long_matches_prefer_a_continuation_that_fills_the_draft() -> None:
    # a run longer than max_match: every occurrence matches in full, the newest has one token after it
    draft = suffix_index([7] * 100, max_match=16).propose(8)
    assert draft == Draft([7] * 8, 16)


def test_a_copy_source_stays_in_reach_when_its_last_tokens_recur_often_since() -> None:
    # "9 10" recurs 40 times after the source: more than the 16 candidates a short gram's chain gives
    source = list(range(1, 12))
    tokens = source + [t for i in range(40) for t in (50 + i, 9, 10)] + source[:10]
    assert suffix_index(tokens).propose(4) == Draft([11, 50, 9, 10], 10)
    assert suffix_index(tokens, long_gram=0).propose(4) == Draft([1, 2], 2)  # the short chain alone


def test_min_match() -> None:
    tokens = [1, 2, 9, 5, 1, 2]
    assert suffix_index(tokens).propose(8) == Draft([9, 5], 2)
    assert suffix_index(tokens, min_match=3).propose(8) == Draft([], 0)
    assert suffix_index([1, 2, 3]).propose(8) == Draft([], 0)
    assert suffix_index([]).propose(8) == Draft([], 0)


def test_spec_factor_and_max_tokens_cap_the_length() -> None:
    tokens = [1] + PASSAGE + [2] + PASSAGE[:3]
    assert suffix_index(tokens).propose(10) == Draft(PASSAGE[3:6], 3)  # ceil(1.0 * 3)
    assert suffix_index(tokens, spec_factor=0.5).propose(10) == Draft(PASSAGE[3:5], 3)  # ceil(1.5)
    assert suffix_index(tokens, spec_factor=4).propose(10) == Draft(PASSAGE[3:13], 3)  # max_tokens
    assert suffix_index(tokens, spec_factor=4).propose(0) == Draft([], 0)


def test_max_match_caps_the_match() -> None:
    tokens = PASSAGE + [1] + PASSAGE[:30]
    assert suffix_index(tokens, max_match=12).propose(4) == Draft(PASSAGE[30:34], 12)


def test_nothing_past_the_end() -> None:
    # the continuation of the match at the start runs into the current suffix, and stops where it ends
    assert suffix_index([1, 2, 3, 1, 2], spec_factor=5).propose(10) == Draft([3, 1, 2], 2)
    assert suffix_index([4, 4, 4], spec_factor=5).propose(10) == Draft([4], 2)


def test_a_sequence_of_one_repeated_token() -> None:
    index = suffix_index([7] * 20_000)
    for _ in range(200):
        assert index.propose(16) == Draft([7] * 16, 32)
        index.extend([7])


def test_extending_in_pieces_is_extending_at_once() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)] + PASSAGE + [rng.randrange(6) for _ in range(50)] + PASSAGE
    for make in (SuffixIndex, NgramIndex):
        for cut in range(0, len(tokens) + 1, 7):
            whole, pieces = make(), make()
            whole.extend(tokens[:cut])
            start = 0
            while start < cut:
                stop = min(cut, start + rng.choice([1, 1, 2, 3, 5, 17, 60]))
                pieces.extend(tokens[start:stop])
                start = stop
            assert len(pieces) == len(whole) == cut
            for k in (1, 4, 16):
                assert pieces.propose(k) == whole.propose(k)


def test_a_copy_keeps_to_its_source() -> None:
    # the source is found by its first tokens (900 901); the block F after them then recurs 20
    # times, more recently and each as long a match as the candidates of its grams can show
    block = list(range(1, 11))
    tokens = [900, 901] + block + [950, 951, 952] + [t for i in range(20) for t in [50 + i] + block + [70 + i]]
    tokens += [900, 901]
    index = suffix_index(tokens)
    assert index.propose(4) == Draft([1, 2], 2)
    index.extend(block[:9])  # the draft was accepted and the copy goes on
    assert index.propose(4) == Draft([10, 950, 951, 952], 11)
    # without the last draft to follow: the most recent of the 9-token matches
    assert suffix_index(tokens + block[:9]).propose(4) == Draft([10, 89, 900, 901], 9)


def test_invalid_settings_name_their_key() -> None:
    with pytest.raises(ValueError, match="max_match"):
        SuffixIndex(max_match=2, min_match=3)
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(min_n=0)
    with pytest.raises(ValueError, match="max_tokens"):
        TenantHistory(max_tokens=4)


# NgramIndex

def test_ngram_the_most_recent_occurrence() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert ngram_index(tokens).propose(3) == Draft([8, 5, 1], 3)
    assert ngram_index(tokens).propose(10) == Draft([8, 5, 1, 2, 3], 3)  # (never past the end)


def test_ngram_the_longest_n_first() -> None:
    tokens = [4, 1, 2, 3, 9, 7, 2, 3, 8, 0, 4, 1, 2, 3]
    assert ngram_index(tokens).propose(2) == Draft([9, 7], 4)
    assert ngram_index(tokens, max_n=3).propose(2) == Draft([9, 7], 3)
    assert ngram_index(tokens, max_n=2).propose(2) == Draft([8, 0], 2)
    assert ngram_index([1, 2, 5, 1, 2], min_n=3).propose(4) == Draft([], 0)
    assert ngram_index([1, 2, 5, 1, 2]).propose(4) == Draft([5, 1, 2], 2)


# TenantHistory

def test_tenant_history_drafts_within_one_output() -> None:
    history = TenantHistory(max_tokens=100)
    history.add(list(range(1, 11)))
    history.add(list(range(100, 111)))
    assert history.propose([99, 3, 4, 5, 6], 3) == Draft([7, 8, 9], 4)
    assert history.propose([99, 6, 7, 8, 9], 8) == Draft([10], 4)  # the output's end, not the next one's start
    # a match stops at the start of an output too
    assert history.propose([9, 10, 100, 101, 102, 103], 8) == Draft([104, 105, 106, 107], 4)
    assert history.propose([6, 7, 8], 8) == Draft([], 0)  # shorter than min_match
    assert history.propose([50, 51, 52, 53], 8) == Draft([], 0)


def test_tenant_history_is_bounded_and_forgets_the_oldest() -> None:
    history = TenantHistory(max_tokens=1000)
    outputs = [list(range(i * 1000, i * 1000 + 37)) for i in range(300)]  # distinct tokens
    for output in outputs:
        history.add(output)
        assert history.num_tokens <= 1000
        assert len(history._chains.head) <= 1000  # its index entries go with the outputs
    assert history.propose(outputs[0][:10], 4) == Draft([], 0)
    assert history.propose(outputs[150][:10], 4) == Draft([], 0)
    assert history.propose(outputs[-1][:10], 4) == Draft(outputs[-1][10:14], 10)
    assert history.propose(outputs[-20][:10], 4) == Draft(outputs[-20][10:14], 10)
    # an output longer than the whole history keeps its end
    history.add(list(range(5000)))
    assert history.num_tokens <= 1000
    assert history.propose(outputs[-1][:10], 4) == Draft([], 0)
    assert history.propose([4500, 4501, 4502, 4503], 2) == Draft([4504, 4505], 4)


# every draft follows an earlier occurrence of the matched tokens

def follows_a_match(tokens: list[int], draft: Draft) -> bool:
    """Some end e before the last token has the last match_len tokens ending at it and the draft after it."""
    m, size = draft.match_len, len(tokens)
    return any(e + 1 >= m and tokens[e + 1 - m:e + 1] == tokens[size - m:]
               and tokens[e + 1:e + 1 + len(draft.tokens)] == draft.tokens for e in range(size - 1))


def longest_earlier_match(tokens: list[int], limit: int) -> int:
    best = 0
    for e in range(len(tokens) - 1):
        m = 0
        while m < min(limit, e + 1) and tokens[e - m] == tokens[-1 - m]:
            m += 1
        best = max(best, m)
    return best


def check_suffix_draft(tokens: list[int], draft: Draft, min_match: int, max_match: int, max_tokens: int,
                       spec_factor: float) -> None:
    longest = longest_earlier_match(tokens, max_match)
    if longest < min_match:
        assert draft == Draft([], 0)
        return
    assert draft.match_len == longest
    assert 1 <= len(draft.tokens) <= min(max_tokens, math.ceil(spec_factor * longest))
    assert follows_a_match(tokens, draft)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80), st.integers(0, 80), st.integers(1, 3), st.integers(0, 6),
       st.integers(1, 12), st.sampled_from([0.5, 1.0, 2.5]))
def test_suffix_drafts_follow_the_longest_earlier_match(tokens: list[int], cut: int, min_match: int, extra: int,
                                                         max_tokens: int, spec_factor: float) -> None:
    max_match = min_match + extra
    index = SuffixIndex(min_match=min_match, max_match=max_match, spec_factor=spec_factor,
                        long_gram=min_match + 1, max_candidates=1000)
    index.extend(tokens[:cut])  # a draft in between: the next may come from where it was read
    check_suffix_draft(tokens[:cut], index.propose(max_tokens), min_match, max_match, max_tokens, spec_factor)
    index.extend(tokens[cut:])
    check_suffix_draft(tokens, index.propose(max_tokens), min_match, max_match, max_tokens, spec_factor)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80), st.integers(1, 3), st.integers(0, 3), st.integers(1, 12))
def test_ngram_drafts_follow_the_most_recent_match_of_the_longest_n(tokens: list[int], min_n: int, extra: int,
                                                                    max_tokens: int) -> None:
    draft = ngram_index(tokens, min_n=min_n, max_n=min_n + extra).propose(max_tokens)
    size = len(tokens)
    for n in range(min_n + extra, min_n - 1, -1):
        ends = [e for e in range(n - 1, size - 1) if size > n and tokens[e + 1 - n:e + 1] == tokens[size - n:]]
        if ends:
            assert draft == Draft(tokens[ends[-1] + 1:ends[-1] + 1 + max_tokens], n)
            assert follows_a_match(tokens, draft)
            return
    assert draft == Draft([], 0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=20), max_size=12), st.lists(st.integers(0, 3), max_size=10),
       st.integers(1, 8))
def test_tenant_drafts_follow_a_match_inside_one_output(outputs: list[list[int]], context: list[int],
                                                        max_tokens: int) -> None:
    history = TenantHistory(max_tokens=40, min_match=2, max_match=6)
    for output in outputs:
        history.add(output)
        assert history.num_tokens <= 40
    draft = history.propose(context, max_tokens)
    if draft.tokens:
        m = draft.match_len
        assert 2 <= m <= 6 and len(draft.tokens) <= min(max_tokens, m)
        assert any(output[e + 1 - m:e + 1] == context[-m:] and output[e + 1:e + 1 + len(draft.tokens)] == draft.tokens
                   for output in outputs for e in range(m - 1, len(output) - 1))
    else:
        assert draft.match_len == 0
