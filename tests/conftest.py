"""Test-suite setup shared by every test file."""

import os

import torch

# The Triton kernels run under the interpreter when there is no GPU; it has to be chosen before `eval.kernels` is
# imported, and nothing in the package chooses it on import (`python -m eval` does, for its own process).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
