"""Medusa-1's recipe section (`drafter`, `method: medusa1`): plain fields, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from methods import named_trees
from methods.limits import MAX_HEADS, MAX_LAYERS, at_most, check_target_sizes


@dataclass
class MedusaConfig:
    """Medusa-1 heads (recipe section `drafter`, `method: medusa1`)."""

    method: Literal["medusa1"] = "medusa1"
    num_heads: int = 5
    """K: head k (1-based) predicts token t+k+1 from the hidden state at t."""
    num_layers: int = 1
    """L: residual blocks `h + SiLU(W1 h + b1)` per head, each with its own parameters."""
    decay: float = 0.8
    """λ_k = decay**k for head k = 1..K (head 1 weighs 0.8, head 2 0.64, ...)."""
    share_lm_head: bool = False
    """True: all heads project with the frozen target lm_head; False: each head trains its own copy."""

    @property
    def feature_layers(self) -> list[int]:
        """Hidden-state indices the heads read: the target's last hidden state (after the final norm)."""
        return [-1]

    def validate(self, err) -> None:
        if self.num_heads < 1:
            err("drafter.num_heads", f"must be >= 1, got {self.num_heads}")
        if self.num_layers < 1:
            err("drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        if not 0.0 < self.decay <= 1.0:
            err("drafter.decay", f"must be in (0, 1], got {self.decay}")
        at_most(err, "drafter.num_heads", self.num_heads, MAX_HEADS)
        at_most(err, "drafter.num_layers", self.num_layers, MAX_LAYERS)

    @property
    def borrows_lm_head(self) -> bool:
        """Its heads project through the target's frozen lm_head (`share_lm_head`), not copies of their own."""
        return self.share_lm_head

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`)."""
        return {"num_layers": self.num_layers}

    def without_inputs(self) -> MedusaConfig:
        """No input files of its own: itself."""
        return self

    def check_inputs(self, err) -> None:
        """No input files of its own."""

    def check_recipe(self, recipe, err) -> None:
        check_target_sizes(self.target_sized(), recipe, err)
        tree = recipe.eval.tree
        if tree in ("chain", "calibrated") and recipe.eval.tree_depth > self.num_heads:
            err("eval.tree_depth", f"{recipe.eval.tree_depth} exceeds the number of Medusa heads ({self.num_heads})")
        if tree in named_trees.NAMED_TREES:
            depth, top_k = named_trees.depth(tree), named_trees.top_k(tree)
            if self.num_heads < depth:
                err(
                    "eval.tree",
                    f"{tree} is {depth} deep and needs >= {depth} heads, drafter.num_heads is {self.num_heads}",
                )
            if 0 < recipe.eval.draft_vocab < top_k:
                err("eval.draft_vocab", f"{tree} drafts each head's top {top_k} tokens, got {recipe.eval.draft_vocab}")
        if recipe.train.loss_vocab and not self.share_lm_head:
            err("train.loss_vocab", "needs drafter.share_lm_head: heads with their own lm_head train every row of it")
