"""Errors raised while loading a model; the CLI prints them as one line and exits non-zero."""


class ModelLoadError(Exception):
    """A model path, file or tensor that inferd cannot load (the message names which)."""
