"""What the Triton launch wrappers of `eval.kernels` share: whether the kernels run under the interpreter, which GPU a
launch goes to, and block sizes.

    from eval.kernels.launch import INTERPRET, on_device, on_first_device, pow2

    @on_first_device               # launch on the GPU that holds the first argument
    def op(x, ...): ...
    block_d = pow2(head_dim, 16, 128)

`INTERPRET` is read once, when this module is imported, as triton reads TRITON_INTERPRET when the kernels are
defined: set it before `eval.kernels` is imported (`python -m eval` does when there is no GPU; this package never
does).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether the kernels of `eval.kernels` were defined for the Triton interpreter (TRITON_INTERPRET=1 at import)."""


def on_device(t: torch.Tensor) -> AbstractContextManager:
    """Triton launches on the *current* CUDA device: make it the one holding `t` (layers of a `device_map` target
    live on several GPUs, and a launch with another GPU's pointers faults)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


def on_first_device(fn: Callable) -> Callable:
    """Run `fn` (whose first argument is a tensor) with that tensor's GPU current, see `on_device`."""

    @functools.wraps(fn)
    def wrapper(first: torch.Tensor, *args, **kwargs):
        with on_device(first):
            return fn(first, *args, **kwargs)

    return wrapper


def pow2(x: int, lo: int, hi: int) -> int:
    """The power of two >= x, kept within [lo, hi]: block sizes are powers of two, and `lo` = 16 keeps tl.dot tiles at
    the size NVIDIA codegen needs."""
    return max(lo, min(hi, triton.next_power_of_2(max(x, 1))))
