"""EAGLE-2's recipe section (`drafter`, `method: eagle2`): plain fields, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from methods.limits import MAX_LAYERS, MAX_VOCAB, at_most, check_target_sizes


@dataclass
class EagleConfig:
    """EAGLE-2 drafter (recipe section `drafter`, `method: eagle2`)."""

    method: Literal["eagle2"] = "eagle2"
    feature_layers: list[int] = field(default_factory=lambda: [-1])
    """Target hidden-state indices fed to the drafter: [-1] = EAGLE-1/2. Several = a fusion trained for the first
    draft step only (later steps would read the drafter's own output, which training never shows it): evaluation
    takes such drafters at eval.tree_depth 1 only; method eagle3 trains fused layers over several steps."""
    num_layers: int = 1
    """Llama decoder layers in the drafter (layer 0 has no input_layernorm, as in EAGLE-1/2)."""
    fc_norm: bool = True
    """EAGLE-3.1 FC-Norm: RMSNorm on each target feature before it enters fc."""
    post_norm: bool = True
    """EAGLE-3.1 post-norm: an output RMSNorm gives f̂ (loss, logits, next draft step); False = plain EAGLE-2."""
    input_noise: float = 0.0
    """Training-only noise U(-a, a) added to the target features, `a` in absolute units (not scaled by length)."""
    w_feat: float = 1.0
    """Weight of SmoothL1(f̂_{t+1}, f_{t+1})."""
    w_ce: float = 0.1
    """Weight of the soft cross-entropy against the target's next-token distribution."""
    fc_bias: bool = True
    topk_metric: int = 5
    """k of the `acc@k` metric."""

    def validate(self, err) -> None:
        if not self.feature_layers:
            err("drafter.feature_layers", "must list at least one hidden-state index")
        if len(set(self.feature_layers)) != len(self.feature_layers):
            err("drafter.feature_layers", f"has duplicates: {self.feature_layers}")
        if self.num_layers < 1:
            err("drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        if self.input_noise < 0:
            err("drafter.input_noise", f"must be >= 0, got {self.input_noise}")
        if self.w_feat < 0 or self.w_ce < 0 or self.w_feat + self.w_ce == 0:
            err("drafter.w_feat", f"w_feat and w_ce must be >= 0 and not both 0, got {self.w_feat}, {self.w_ce}")
        if self.topk_metric < 1:
            err("drafter.topk_metric", f"must be >= 1, got {self.topk_metric}")
        at_most(err, "drafter.num_layers", self.num_layers, MAX_LAYERS)
        at_most(err, "drafter.topk_metric", self.topk_metric, MAX_VOCAB)

    @property
    def borrows_lm_head(self) -> bool:
        """It drafts through the target's frozen lm_head (borrowed: not one of its parameters)."""
        return True

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`)."""
        return {"num_layers": self.num_layers, "topk_metric": self.topk_metric}

    def without_inputs(self) -> EagleConfig:
        """No input files of its own: itself."""
        return self

    def check_inputs(self, err) -> None:
        """No input files of its own."""

    def check_recipe(self, recipe, err) -> None:
        check_target_sizes(self.target_sized(), recipe, err)
        if -1 not in recipe.data.layers:
            err("data.layers", f"EAGLE regresses the last hidden state: -1 must be stored, got {recipe.data.layers}")
