"""`models.host.keep_freed_memory`: on a CPU with glibc, large temporaries stop costing fresh pages every time."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import resource, sys, torch
from models.host import keep_freed_memory
kept = keep_freed_memory(sys.argv[1]) if sys.argv[1] != "none" else False
x = torch.ones(2000, 8000)
for _ in range(10):  # warm up: the heap grows to what a step needs
    (x * 2).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # 64 MB temporaries, as a training step makes them
    (x * 2).sum()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(device: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, device], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", **(env or {})})  # fmt: skip
    kept, count = out.stdout.split()
    return kept, int(count)


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")
def test_freed_memory_is_kept_on_a_cpu_and_left_alone_elsewhere_or_when_asked():
    kept, with_it = faults("cpu")
    assert kept == "True"
    kept, without = faults("none")
    assert kept == "False" and without > 20 * 15000  # each temporary faults in its 64 MB (16k pages of 4 kB)
    assert with_it < without / 10  # the temporaries reuse the heap's pages
    assert faults("cuda:0")[0] == "False"  # another device: glibc's own settings
    assert faults("cpu", {"SPECDRAFT_MALLOC": "default"})[0] == "False"
