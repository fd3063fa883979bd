"""The model families' tests: each family token for token against transformers (family_cases.py is
their harness); tests/model's builders of tiny checkpoints (tiny_models.py) are imported from the
folder above."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
