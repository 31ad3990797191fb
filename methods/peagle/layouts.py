"""layouts."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from methods.eagle3.layouts import _write_speculators


def write_speculators_peagle(out: Path, recipe, target, drafter: nn.Module, include_target_weights: bool) -> None:
    """A P-EAGLE drafter in the speculators layout (vLLM's `peagle`: `mask_token_id`, `mask_hidden`)."""
    _write_speculators(out, recipe, target, drafter, parallel=True)
