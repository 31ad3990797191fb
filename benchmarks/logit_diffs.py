"""What the consumer checks (`*_check.py consume`) share: logit comparisons and their goal line.

Imports only torch, so every consumer's own virtual environment can use it (the checks put this directory on
`sys.path` in their consume stage).
"""

from __future__ import annotations

import math

import torch


class LogitDiffs:
    """Max |logit difference| per named comparison, printed as each is made; `inf` marks a failed step."""

    def __init__(self, width: int = 28):
        self.results: dict[str, float] = {}
        self.width = width

    def compare(self, name: str, theirs: torch.Tensor, ours: torch.Tensor) -> None:
        """`theirs` against `ours` (..., V): the largest difference and how often the top-1 token agrees."""
        diff = (theirs.float() - ours).abs().max().item()
        same = (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item()
        positions = ours[..., 0].numel()
        print(f"{name:{self.width}s} max |logit diff| {diff:.2e}, same top-1 at {same:.3f} of {positions} positions")
        self.results[name] = diff if math.isfinite(diff) else math.inf  # nan logits fail

    def fail(self, name: str) -> None:
        self.results[name] = math.inf

    def goal_line(self, metric: str, goal: float) -> float:
        """Print `<metric>: <worst> (goal <= <goal>)` and return the worst difference (nothing compared: inf)."""
        worst = max(self.results.values()) if self.results else math.inf
        print(f"{metric}: {worst:.2e} (goal <= {goal})")
        return worst
