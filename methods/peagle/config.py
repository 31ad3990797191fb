"""P-EAGLE's recipe section (`drafter`, `method: peagle`): plain fields, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from methods import named_trees
from methods.eagle3.config import FusedOwnVocab
from methods.limits import MAX_TTT_STEPS, DraftLoss, at_most


@dataclass
class PeagleConfig(FusedOwnVocab):
    """P-EAGLE drafter (recipe section `drafter`, `method: peagle`): EAGLE-3's drafter that drafts
    `parallel_tokens` tokens in one forward, through mask slots appended after the real positions."""

    method: Literal["peagle"] = "peagle"
    feature_layers: list[int] = field(default_factory=list)
    """As EAGLE-3's: the fused hidden-state indices (empty = low / mid / high)."""
    num_layers: int = 1
    """Decoder layers, as EAGLE-3's: one forward drafts every depth, so a deeper drafter costs once per round
    (published P-EAGLE drafters have 2 to 4)."""
    draft_vocab: int = 32000
    """K: its own LM head covers the K most frequent loss tokens of the training data (`d2t` / `t2d`)."""
    parallel_tokens: int = 4
    """Tokens drafted per forward: the real last position drafts the first, `parallel_tokens - 1` mask slots the
    others. Training unrolls as many steps (step j >= 1 reads the mask slot's inputs, not its own outputs)."""
    mask_token_id: int = 0
    """A token of the target's vocabulary whose (frozen) embedding every mask slot reads, beside the learned
    `mask_hidden` features; any token will do, the learned features carry the slot."""
    step_decay: float = 0.8
    """Weight of unrolled step j (0-based, = mask slot j) in the loss: step_decay ** j."""
    fc_norm: bool = False
    """EAGLE-3.1 FC-Norm: an RMSNorm on each target feature (and on each chunk of `mask_hidden`) before `fc`."""
    norm_before_residual: bool = False
    """The decoder layer's residual is the normed input feature (`hidden_norm(g)`) instead of g itself."""
    input_noise: float = 0.0
    """Training-only noise U(-a, a) added to the target features."""
    topk_metric: int = 5
    """k of the `acc@k` metric."""
    loss: DraftLoss = "kl"
    """As EAGLE-3's: `kl`, `hass`, `tv`, `nla` or `lk_hybrid` (models/losses.py)."""
    loss_topk: int = 10
    """hass: the target's K most likely tokens whose log-probabilities the extra term weighs."""
    loss_topk_weight: float = 1.0
    """hass: weight of the top-K term beside the soft cross-entropy."""
    loss_eta: float = 3.0
    """lk_hybrid: λ = exp(-loss_eta · α)."""

    @property
    def ttt_steps(self) -> int:
        """Unrolled training steps: one per drafted token."""
        return self.parallel_tokens

    @property
    def norm_output(self) -> bool:
        """No draft step reads another's output (mask slots read `mask_hidden`): no post-norm switch."""
        return False

    def validate(self, err) -> None:
        self.validate_fused(err)
        if self.parallel_tokens < 1:
            err("drafter.parallel_tokens", f"must be >= 1, got {self.parallel_tokens}")
        if self.mask_token_id < 0:
            err("drafter.mask_token_id", f"must be >= 0, got {self.mask_token_id}")
        at_most(err, "drafter.parallel_tokens", self.parallel_tokens, MAX_TTT_STEPS)

    def check_recipe(self, recipe, err) -> None:
        super().check_recipe(recipe, err)
        vocab = recipe.target.size("vocab_size")
        if vocab is not None and self.mask_token_id >= vocab:
            err("drafter.mask_token_id", f"{self.mask_token_id} is not below the target's vocab_size ({vocab})")
        tree, K = recipe.eval.tree, self.parallel_tokens
        if tree in ("chain", "calibrated") and recipe.eval.tree_depth > K:
            err("eval.tree_depth", f"{recipe.eval.tree_depth} exceeds the tokens one forward drafts ({K})")
        if tree in named_trees.NAMED_TREES:
            depth, top_k = named_trees.depth(tree), named_trees.top_k(tree)
            if K < depth:
                err("eval.tree", f"{tree} is {depth} deep and needs drafter.parallel_tokens >= {depth}, got {K}")
            if min(self.draft_vocab, recipe.eval.draft_vocab or self.draft_vocab) < top_k:
                err("eval.tree", f"{tree} drafts each depth's top {top_k} tokens, more than the draft vocabulary")
