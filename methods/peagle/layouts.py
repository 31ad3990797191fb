"""P-EAGLE in the speculators layout (vLLM's `peagle`): EAGLE-3's writer with the mask token and `mask_hidden`."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from methods.eagle3.layouts import write_speculators_layout


def write_speculators_peagle(out: Path, recipe, target, drafter: nn.Module, include_target_weights: bool) -> None:
    """A P-EAGLE drafter in the speculators layout (vLLM's `peagle`: `mask_token_id`, `mask_hidden`)."""
    write_speculators_layout(out, recipe, target, drafter, parallel=True)
