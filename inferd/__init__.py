"""inferd: an LLM inference serving daemon."""

__version__ = "0.1.0"
