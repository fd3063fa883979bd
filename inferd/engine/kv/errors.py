"""The allocator's one exception, in a module of its own: every kv module raises it, and none
has to import another for it (no import cycle)."""


class BlockError(RuntimeError):
    """A misuse of the allocator (double free, unknown sequence) or a broken invariant."""
