"""`python -m inferd.kernels.cpu [--force]`: build the CPU kernels for this machine (make runs it)."""

import sys

from inferd.kernels.cpu.build import KernelBuildError, build

try:
    print(build(force="--force" in sys.argv))
except KernelBuildError as e:
    sys.exit(str(e))
