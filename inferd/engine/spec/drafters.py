"""Drafters without extra weights: the tokens a request is likely to write next, read from what it
has already seen (its prompt and its output so far) or, opted in per tenant, from that tenant's
recent outputs. Pure Python, no tensors; the engine thread calls them once per step per request.

The index is a set of hash chains, as in zlib's deflate. For a gram length n, `head` maps the key
of an n-gram (the hash of its n tokens) to the last position where it ends, and `prev[i]` is the
position before i where the same key ended (-1: none). Walking head, prev, prev... visits the
earlier occurrences of the last n tokens, most recent first:

    position   0 1 2 3 4 5 6 7 8 9 10
    tokens     x a b c y a b c z a b        the last 2 tokens are "a b"
    head["a b"] = 6, prev[6] = 2, prev[2] = -1

An n-gram is indexed once the token after it is known (above: "a b" at 10 is not yet), so every
position a chain gives has a continuation. A candidate is then extended backwards by comparing
tokens (up to `max_match`), which also checks away hash collisions.

SuffixIndex keeps two chains, of `min_match`-grams and of `long_gram`-grams (8), and searches the
long one first: its candidates all match at least 8 tokens, so a copy source stays in reach when
a short gram (a newline and an indent, in code) has occurred hundreds of times since. Only the
`max_candidates` (16) most recent candidates of a chain are examined, so a proposal costs a bounded
amount however repetitive the text is (at most 16 backward extensions of 32 tokens per chain).
To those it adds where the last draft was read from, moved on by the tokens since, if they are
the ones that followed it: a copy keeps to its source even where every gram of the suffix recurs
more recently (records of a JSON tool result, told apart only by an id a few tokens back; in one
measured rewrite, 5.8k tokens at k = 8, that took the steps from 900 to 734). Among the candidates
the longest match wins; between equally long ones the most frequent next token, then the one whose
continuation fills the draft (in a repeated run the newest occurrence has one token after it),
then the most recent (a file being rewritten again copies its newest version).

Draft length (suffix decoding, arXiv 2411.04975): from a match of m tokens, at most
min(max_tokens, ceil(spec_factor * m)) tokens, none when m < min_match, and never a token past
the end of what is stored (a match near the end proposes only what exists).

Memory, measured with tracemalloc (6,000 tokens of code, or random ones over a 50k vocabulary; the
token ints themselves are the caller's and not counted):
    SuffixIndex    ~190-250 bytes per token: the tokens (8), two prev arrays (16), the two head
                   dicts the rest (a dict entry, its key and its position int)
    NgramIndex     ~230-350 bytes per token: three dicts (n = 2..4)
    TenantHistory  ~160 bytes per slot, at most `max_tokens` slots (~10 MB at the default 65,536):
                   its oldest outputs are dropped, with their head entries, before a new one is stored
A request's index grows with its tokens and is dropped with the request.

Not thread-safe: one owner (the engine thread) calls extend, propose and add. SuffixIndex.propose
remembers where its draft was read from, for the next call; nothing else changes outside extend/add.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat

SEPARATOR = -1  # between two outputs in TenantHistory: no token equals it, so no match or draft crosses it


@dataclass(slots=True)
class Draft:
    tokens: list[int]  # proposed continuation, in order (empty: nothing to propose)
    match_len: int  # how many trailing tokens of the context matched where `tokens` were read from


def _gram_keys(tokens: list[int], n: int, start: int, stop: int) -> Iterable[int]:
    """The keys of the n-grams ending at tokens[start:stop] (start >= n - 1)."""
    if stop - start <= 4:  # NOTE: a step's few tokens; n column slices would cost 5x more
        return [hash(tuple(tokens[end - n + 1:end + 1])) for end in range(start, stop)]
    return map(hash, zip(*(tokens[start - n + 1 + j:stop - n + 1 + j] for j in range(n))))  # (a prompt: in C)


def _key(tokens: list[int]) -> int:
    return hash(tuple(tokens))


class _Chains:
    """Hash chains of the n-grams of one token list (see the module docstring)."""

    __slots__ = ("n", "head", "prev")

    def __init__(self, n: int) -> None:
        self.n = n
        self.head: dict[int, int] = {}  # key of an n-gram -> the last position where it ends
        self.prev = array("q")  # [positions held] the previous position with the same key; -1: none

    def skip(self, count: int) -> None:
        """Positions that end no indexed n-gram."""
        self.prev.extend(repeat(-1, count))

    def add(self, tokens: list[int], start: int, stop: int, base: int = 0) -> None:
        """Index the n-grams ending at tokens[start:stop]; tokens[0] is position `base`."""
        head, append = self.head, self.prev.append
        get = head.get
        for pos, key in enumerate(_gram_keys(tokens, self.n, start, stop), start + base):
            append(get(key, -1))
            head[key] = pos

    def ends(self, key: int, limit: int, base: int = 0) -> list[int]:
        """The list indexes where `key` ended, most recent first, at most `limit`; a position
        older than `base` (dropped) ends the chain."""
        ends, pos, prev = [], self.head.get(key, -1), self.prev
        while pos >= base and len(ends) < limit:
            ends.append(pos - base)
            pos = prev[pos - base]
        return ends


def _match_len(text: list[int], end: int, suffix: list[int]) -> int:
    """How many trailing tokens of `suffix` also end at text[end] (at most len(suffix) and end + 1)."""
    limit = min(len(suffix), end + 1)
    # NOTE: a copy matches in full; one slice compare in C settles it
    if text[end + 1 - limit:end + 1] == suffix[len(suffix) - limit:]:
        return limit
    m = 0
    while m < limit and text[end - m] == suffix[-1 - m]:
        m += 1
    return m


def _continuation(text: list[int], end: int, want: int) -> list[int]:
    tokens = text[end + 1:end + 1 + want]  # (a slice: never past the end of text)
    if SEPARATOR in tokens:
        del tokens[tokens.index(SEPARATOR):]
    return tokens


def _draft(text: list[int], suffix: list[int], ends: list[int], max_tokens: int, spec_factor: float,
           min_match: int) -> tuple[Draft, int]:
    """The draft read after the best of `ends` (list indexes in `text`, most recent first) for
    `suffix`, and that end (-1: none)."""
    lengths = [_match_len(text, end, suffix) for end in ends]
    best = max(lengths, default=0)
    want = min(max_tokens, math.ceil(spec_factor * best))
    if best < min_match or want <= 0:
        return Draft([], 0), -1
    ties = [end for end, m in zip(ends, lengths) if m == best]
    if len(ties) > 1:  # the most frequent next token
        nexts = [text[end + 1] for end in ties]
        if nexts.count(nexts[0]) < len(nexts):
            counts = Counter(nexts)
            top = max(counts.values())
            ties = [end for end, t in zip(ties, nexts) if counts[t] == top]
    # then the most recent whose continuation fills the draft, else the longest continuation
    draft, chosen = [], -1
    for end in ties:
        tokens = _continuation(text, end, want)
        if len(tokens) > len(draft):
            draft, chosen = tokens, end
            if len(draft) == want:
                break
    return Draft(draft, best), chosen


def _check(name: str, value: float, low: float, high: float = math.inf) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


class SuffixIndex:
    """One request's tokens (prompt, then output), indexed for the longest earlier occurrence of
    their suffix; the draft is what followed that occurrence (suffix decoding)."""

    def __init__(self, max_match: int = 32, min_match: int = 2, spec_factor: float = 1.0, *,
                 long_gram: int = 8, max_candidates: int = 16) -> None:
        _check("min_match", min_match, 1)
        _check("max_match", max_match, min_match)
        _check("spec_factor", spec_factor, 0)
        _check("max_candidates", max_candidates, 1)
        self.max_match, self.min_match, self.spec_factor = max_match, min_match, spec_factor
        self.max_candidates = max_candidates
        self._tokens: list[int] = []
        self._source: tuple[int, int] | None = None  # (end, len(tokens)) of the last draft's source
        lengths = [min_match] + ([long_gram] if min_match < long_gram <= max_match else [])
        self._chains = [_Chains(n) for n in lengths]  # shortest gram first

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (the prompt once, then each step's accepted output)."""
        self._tokens.extend(tokens)
        stop = len(self._tokens) - 1  # the last token's n-grams wait for the token after it
        for chains in self._chains:
            start = len(chains.prev)
            if stop > start:
                first = min(max(start, chains.n - 1), stop)
                chains.skip(first - start)
                chains.add(self._tokens, first, stop)

    def propose(self, max_tokens: int) -> Draft:
        """Up to `max_tokens` tokens to follow the last one; fewer where the match is short."""
        tokens, size = self._tokens, len(self._tokens)
        suffix = tokens[-self.max_match:]
        follow = self._followed(size)
        self._source = None
        for chains in reversed(self._chains):  # the longest gram first
            ends = chains.ends(_key(suffix[-chains.n:]), self.max_candidates) if size > chains.n else []
            if follow >= 0 and follow not in ends:
                ends = sorted(ends + [follow], reverse=True)
            if not ends:
                continue
            draft, end = _draft(tokens, suffix, ends, max_tokens, self.spec_factor, self.min_match)
            if draft.match_len >= chains.n:  # (else nothing, or a hash collision: try the shorter gram)
                self._source = (end, size)
                return draft
        return Draft([], 0)

    def _followed(self, size: int) -> int:
        """Where the last draft's source has got to, if the tokens since are the ones that followed
        it (a copy going on); else -1."""
        if self._source is None:
            return -1
        end, then = self._source
        ahead = end + size - then
        if ahead < size - 1 and self._tokens[end + 1:ahead + 1] == self._tokens[then:size]:
            return ahead
        return -1


class NgramIndex:
    """The simple baseline (prompt lookup): the most recent earlier occurrence of the last n
    tokens, n from max_n down to min_n; the draft is what followed it."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        _check("min_n", min_n, 1)
        _check("max_n", max_n, min_n)
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        self._indexed = 0  # positions whose n-grams are in `_last` (all but the last token)
        # n -> key of an n-gram -> the last position where it ends
        self._last: dict[int, dict[int, int]] = {n: {} for n in range(max_n, min_n - 1, -1)}

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)
        stop = len(self._tokens) - 1  # the last token's n-grams wait for the token after it
        for n, last in self._last.items():
            first = max(self._indexed, n - 1)
            if stop > first:  # a later occurrence overwrites an earlier one: the most recent stays
                last.update(zip(_gram_keys(self._tokens, n, first, stop), range(first, stop)))
        self._indexed = max(self._indexed, stop)

    def propose(self, max_tokens: int) -> Draft:
        tokens, size = self._tokens, len(self._tokens)
        if max_tokens <= 0:
            return Draft([], 0)
        for n, last in self._last.items():  # max_n first
            if size <= n:
                continue
            suffix = tokens[size - n:]
            end = last.get(_key(suffix))
            if end is not None and tokens[end + 1 - n:end + 1] == suffix:  # (a hash collision fails here)
                return Draft(tokens[end + 1:end + 1 + max_tokens], n)
        return Draft([], 0)


class TenantHistory:
    """One tenant's recent outputs (bounded: `max_tokens` tokens in all, the oldest dropped
    first), for drafting a request's continuation from what the tenant's earlier requests wrote."""

    def __init__(self, max_tokens: int = 1 << 16, max_match: int = 32, min_match: int = 4, *,
                 spec_factor: float = 1.0, max_candidates: int = 16) -> None:
        _check("min_match", min_match, 1)
        _check("max_match", max_match, min_match)
        _check("max_tokens", max_tokens, min_match + 2)
        _check("spec_factor", spec_factor, 0)
        _check("max_candidates", max_candidates, 1)
        self.max_tokens, self.max_match, self.min_match = max_tokens, max_match, min_match
        self.spec_factor, self.max_candidates = spec_factor, max_candidates
        # the outputs held, each followed by SEPARATOR (which takes a slot); _tokens[0] is position _base
        self._tokens: list[int] = []
        self._base = 0
        self._sizes: deque[int] = deque()  # the slots of each output held, oldest first
        self._chains = _Chains(min_match)

    @property
    def num_tokens(self) -> int:
        """Slots held (tokens and separators), never more than max_tokens."""
        return len(self._tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """A finished output of one of the tenant's requests."""
        output = list(tokens)[-(self.max_tokens - 1):]  # (its end, if it alone is too long)
        n = self._chains.n
        if len(output) <= n:
            return  # too short to hold a match with a token after it
        self._evict(len(self._tokens) + len(output) + 1 - self.max_tokens)
        start = len(self._tokens)
        self._tokens += output
        self._tokens.append(SEPARATOR)
        self._chains.skip(n - 1)
        self._chains.add(self._tokens, start + n - 1, start + len(output) - 1, self._base)
        self._chains.skip(2)  # the output's last token (nothing follows it) and the separator
        self._sizes.append(len(output) + 1)

    def _evict(self, slots: int) -> None:
        """Drop the oldest outputs until `slots` slots are free, and their head entries."""
        drop = 0
        while drop < slots:
            drop += self._sizes.popleft()
        if drop == 0:
            return
        new_base, head = self._base + drop, self._chains.head
        # a key whose last occurrence is dropped is one of the dropped n-grams' keys
        for key in _gram_keys(self._tokens, self._chains.n, self._chains.n - 1, drop):
            if head.get(key, new_base) < new_base:
                del head[key]
        del self._tokens[:drop]
        del self._chains.prev[:drop]
        self._base = new_base

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        """A draft to follow `context` (a request's last tokens, up to max_match of them)."""
        tail = list(context[-self.max_match:])
        n = self._chains.n
        if len(tail) < n:
            return Draft([], 0)
        ends = self._chains.ends(_key(tail[-n:]), self.max_candidates, self._base)
        return _draft(self._tokens, tail, ends, max_tokens, self.spec_factor, self.min_match)[0]
