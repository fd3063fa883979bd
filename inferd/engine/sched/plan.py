"""One step's plan, as the scheduler hands it to the runner: ids, positions, token counts and
block ids only, never a tensor (the runner builds those).

    request's tokens   [ computed ........ | this chunk (num_tokens) | not yet ]
                       0                 start                 start + num_tokens
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.engine.sched.request import Request


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # position of the first new token
    num_tokens: int  # new tokens computed this step
    block_tables: list[list[int]]  # the request's blocks, one table per KV group (read-only for the runner)
    # a hybrid model's: the state slot the chunk's linear layers read and write, and the block ends
    # (in tokens) after which its state is also written to a checkpoint slot: (block end, slot)
    state_slot: int = -1
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding: the draft tokens this decode verifies after its last sampled token
    # (num_tokens = 1 + len(drafts); every row's logits are sampled and compared with the drafts)
    drafts: list[int] = field(default_factory=list)

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table (the only one of a model without sliding layers)."""
        return self.block_tables[0]

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token (drafts aside), so a next token is sampled."""
        return self.start + self.num_tokens - len(self.drafts) == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """One generated token, and any drafts after it. A prompt's tokens always take the prefill
        path, even one at a time (the last one after a prefix-cache hit, a chunk's remainder):
        which arithmetic a token meets must not depend on how its prompt was cut (batch invariance)."""
        return self.num_tokens == 1 + len(self.drafts) and self.start >= len(self.request.prompt_ids)


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledChunk] = field(default_factory=list)  # prompt tokens (and recomputed output)
    decodes: list[ScheduledChunk] = field(default_factory=list)  # one generated token each, and its drafts (is_decode)
    # KV copies the runner makes before the forward: swap-out, offloads, swap-in, onloads, copy-on-
    # write (a block that swap-out frees or eviction offloads may be reused by the later ones)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # the prefix cache's host tier (kv/host_tier.py): evicted blocks out, hits back in
    offloads: list[tuple[int, int]] = field(default_factory=list)  # (device block, host tier block)
    onloads: list[tuple[int, int]] = field(default_factory=list)  # (host tier block, device block)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # state-slot moves, in the order given (kv/state_slots.py): ("copy", src, dst),
    # ("out", slot, host slot), ("in", host slot, slot)
    state_ops: list[tuple[str, int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)  # scheduled for the first time
    timed_out: list[Request] = field(default_factory=list)  # ended this step (timeout_kind says why)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + sum(c.num_tokens for c in self.decodes)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills)
