"""gates."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from export.gate_parts import (
    GateResult,
)
from methods.eagle3.gates import VLLM_PEAGLE, _native, eagle3_gate


def peagle_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """vLLM's reading of a P-EAGLE speculators export (`speculators_model_type: peagle`, parallel drafting)."""
    return eagle3_gate(out_dir, target, drafter, VLLM_PEAGLE)


def native_peagle_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """A native P-EAGLE export, strictly reloaded: its one forward with its mask slots."""
    return _native(out_dir, target, drafter, parallel=True)
