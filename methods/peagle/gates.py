"""P-EAGLE's load gates: the native export strictly reloaded, and the speculators layout as vLLM's `peagle` reads it
(EAGLE-3's reader with mask slots)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from export.gate_parts import (
    GateResult,
)
from methods.eagle3.gates import VLLM_PEAGLE, eagle3_gate, native_gate


def peagle_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """vLLM's reading of a P-EAGLE speculators export (`speculators_model_type: peagle`, parallel drafting)."""
    return eagle3_gate(out_dir, target, drafter, VLLM_PEAGLE)


def native_peagle_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """A native P-EAGLE export, strictly reloaded: its one forward with its mask slots."""
    return native_gate(out_dir, target, drafter, parallel=True)
