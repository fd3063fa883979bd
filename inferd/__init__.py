"""inferd: an LLM inference serving daemon."""

from inferd.settings.environment import cap_onednn_isa

__version__ = "0.1.0"

# NOTE: on CPUs with AMX, oneDNN's bfloat16 products take a tile path from ~33 rows whose rows
# differ in the last bits from the path fewer rows take, so a row's result would depend on its
# batch and break `[model] deterministic` (tests/engine/test_batch_invariance.py). Capping the
# ISA keeps AVX-512 BF16 (AMX's prefill GEMMs are ~3x faster, but not batch-invariant). oneDNN
# reads the cap once, at its first product: importing inferd sets it before any. An operator's
# own ONEDNN_MAX_CPU_ISA wins.
cap_onednn_isa()
