"""EAGLE-3's recipe section (`drafter`, `method: eagle3`), and what it shares with P-EAGLE's (`FusedOwnVocab`): plain
fields, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from methods.limits import MAX_LAYERS, MAX_TTT_STEPS, MAX_VOCAB, DraftLoss, at_most, check_target_sizes, resolved_layers


class FusedOwnVocab:
    """What the EAGLE-3 and P-EAGLE configs share: the target's fused low / mid / high features and the drafter's own
    head over a draft vocabulary (fields `method`, `feature_layers`, `num_layers`, `draft_vocab`, `step_decay`,
    `input_noise`, `topk_metric`, `loss`, `loss_topk`, `loss_topk_weight`, `loss_eta`: each config declares them)."""

    def validate_fused(self, err) -> None:
        if len(set(self.feature_layers)) != len(self.feature_layers):
            err("drafter.feature_layers", f"has duplicates: {self.feature_layers}")
        if self.num_layers < 1:
            err("drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        if self.draft_vocab < 1:
            err("drafter.draft_vocab", f"must be >= 1, got {self.draft_vocab}")
        if not 0.0 < self.step_decay <= 1.0:
            err("drafter.step_decay", f"must be in (0, 1], got {self.step_decay}")
        if self.input_noise < 0:
            err("drafter.input_noise", f"must be >= 0, got {self.input_noise}")
        if self.topk_metric < 1:
            err("drafter.topk_metric", f"must be >= 1, got {self.topk_metric}")
        if self.loss_topk < 1:
            err("drafter.loss_topk", f"must be >= 1, got {self.loss_topk}")
        if not (self.loss_topk_weight >= 0 and math.isfinite(self.loss_topk_weight)):
            err("drafter.loss_topk_weight", f"must be a finite number >= 0, got {self.loss_topk_weight}")
        if not (self.loss_eta >= 0 and math.isfinite(self.loss_eta)):
            err("drafter.loss_eta", f"must be a finite number >= 0, got {self.loss_eta}")
        at_most(err, "drafter.num_layers", self.num_layers, MAX_LAYERS)
        at_most(err, "drafter.draft_vocab", self.draft_vocab, MAX_VOCAB)
        at_most(err, "drafter.topk_metric", self.topk_metric, MAX_VOCAB)

    def resolved_layers(self, num_layers: int) -> list[int]:
        """`feature_layers`, or low / mid / high of a `num_layers`-layer target (`methods.limits.resolved_layers`)."""
        return resolved_layers(self.feature_layers, num_layers)

    @property
    def borrows_lm_head(self) -> bool:
        """It drafts through its own head over the draft vocabulary, not the target's lm_head."""
        return False

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`)."""
        return {"num_layers": self.num_layers, "draft_vocab": self.draft_vocab, "topk_metric": self.topk_metric}

    def without_inputs(self):
        """No input files of its own: itself."""
        return self

    def check_inputs(self, err) -> None:
        """No input files of its own."""

    def check_recipe(self, recipe, err) -> None:
        check_target_sizes(self.target_sized(), recipe, err)
        if -1 not in recipe.data.layers:
            err(
                "data.layers",
                f"{self.method} learns the last hidden state's distribution: -1 must be stored, got "
                f"{recipe.data.layers}",
            )
        if recipe.eval.draft_vocab > self.draft_vocab:  # a smaller draft vocabulary keeps rows of its own head
            err(
                "eval.draft_vocab",
                f"{recipe.eval.draft_vocab} is more than the drafter's own draft vocabulary (drafter.draft_vocab: "
                f"{self.draft_vocab})",
            )
        if recipe.train.loss_vocab:
            err(
                "train.loss_vocab",
                f"{self.method} learns over its own draft vocabulary (drafter.draft_vocab); set it to 0",
            )
        n_layers = recipe.target.num_layers
        if n_layers is None:
            return
        try:
            layers = self.resolved_layers(n_layers)
        except ValueError as exc:
            err("drafter.feature_layers", str(exc).split(": ", 1)[1])
            return
        missing = [layer for layer in [*layers, -1] if layer not in recipe.data.layers]
        if missing:
            err("data.layers", f"must store the drafter's layers {layers} and -1; missing {missing}")


@dataclass
class Eagle3Config(FusedOwnVocab):
    """EAGLE-3 / EAGLE-3.1 drafter (recipe section `drafter`, `method: eagle3`)."""

    method: Literal["eagle3"] = "eagle3"
    feature_layers: list[int] = field(default_factory=list)
    """Target hidden-state indices fused by `fc` (HF `output_hidden_states` indexing: i = the input of decoder layer
    i). Empty = low / mid / high, `[2, L // 2, L - 3]` for an L-layer target (needs L >= 8). `data.layers` must
    store them and -1 (the last hidden state, whose distribution the drafter learns)."""
    num_layers: int = 1
    """Decoder layers: the first attends over [embedding; fused feature] (EAGLE-3's layer), the others are plain
    pre-norm Llama layers over the stream before them (vLLM's multi-layer EAGLE-3 drafter; SGLang reads one)."""
    draft_vocab: int = 32000
    """K: the drafter's own LM head covers the K most frequent loss tokens of the training data (`d2t` / `t2d`)."""
    ttt_steps: int = 7
    """Training-time test: the drafter is unrolled this many steps, each fed its own output of the step before."""
    step_decay: float = 0.8
    """Weight of unrolled step j (0-based) in the loss: step_decay ** j."""
    fc_norm: bool = False
    """EAGLE-3.1 FC-Norm: an RMSNorm on each target feature before `fc`."""
    norm_output: bool = False
    """EAGLE-3.1 post-norm: the next draft step reads the output after the final norm (EAGLE-3: before it)."""
    norm_before_residual: bool = False
    """The decoder layer's residual is the normed input feature (`hidden_norm(g)`) instead of g itself."""
    input_noise: float = 0.0
    """Training-only noise U(-a, a) added to the target features."""
    topk_metric: int = 5
    """k of the `acc@k` metric."""
    loss: DraftLoss = "kl"
    """What each unrolled step learns at a position (models/losses.py): `kl` (EAGLE-3's soft cross-entropy against the
    target's distribution), `hass` (plus HASS's top-K distillation), `tv`, `nla` or `lk_hybrid` (LK losses: the
    acceptance rate itself)."""
    loss_topk: int = 10
    """hass: the target's K most likely tokens whose log-probabilities the extra term weighs."""
    loss_topk_weight: float = 1.0
    """hass: weight of the top-K term beside the soft cross-entropy."""
    loss_eta: float = 3.0
    """lk_hybrid: λ = exp(-loss_eta · α), the share of KL beside total variation at a position."""

    def validate(self, err) -> None:
        self.validate_fused(err)
        if self.ttt_steps < 1:
            err("drafter.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
        at_most(err, "drafter.ttt_steps", self.ttt_steps, MAX_TTT_STEPS)
