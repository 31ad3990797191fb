"""How a CPU process allocates memory: freed blocks kept for reuse instead of handed back to the operating system.

    keep_freed_memory(device)   # training, evaluation and extraction call it once they know their device

glibc's malloc serves blocks above its mmap threshold (at most 32 MiB) with fresh mappings and unmaps them when
freed, so every large temporary of a step (a (2,000 × 8,000) float32 tensor is 64 MB) comes back as new pages the
kernel must fault in and zero. On the SmolLM2 EAGLE-3 step that cost 19% of the process's CPU time in the kernel
(21.6M page faults in 4 minutes); served from the heap and kept (glibc's `M_MMAP_MAX` 0, `M_TRIM_THRESHOLD` 2 GiB)
the same steps ran 1.27× faster with the same results (docs/benchmarks.md). The price is memory the process keeps at
its peak. Only on a CPU device, only with glibc (elsewhere nothing changes); `SPECDRAFT_MALLOC=default` keeps
glibc's own settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import torch

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: hand back only a free top of heap over 2 GiB
_done = False


def keep_freed_memory(device: torch.device | str) -> bool:
    """On a CPU device with glibc, keep freed memory for reuse (once per process); returns whether it is kept."""
    global _done
    if _done:
        return True
    if torch.device(device).type != "cpu" or os.environ.get("SPECDRAFT_MALLOC") == "default":
        return False
    if platform.libc_ver()[0] != "glibc":  # other C libraries have other mallopt parameters
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    _done = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _done
