"""DFlash's recipe section (`drafter`, `method: dflash`): plain fields, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from methods import named_trees
from methods.limits import MAX_LAYERS, MAX_TTT_STEPS, at_most, check_target_sizes, resolved_layers

MAX_ANCHORS = 1 << 12
"""drafter.max_anchors: blocks trained per sequence (the paper samples 512 in sequences of thousands of tokens)."""


@dataclass
class DFlashConfig:
    """DFlash (block diffusion drafting): `num_layers` decoder layers that draft `block_size - 1` tokens in one
    forward, from the target's fused hidden states (`feature_layers`) injected as keys and values of every layer; the
    target's embedding and lm_head, shared."""

    method: Literal["dflash"] = "dflash"
    feature_layers: list[int] = field(default_factory=list)
    """Target hidden-state indices fused by `fc` (HF `output_hidden_states` indexing: i = the input of decoder layer
    i, the engines' aux layer id i), in ascending order. Empty = low / mid / high, `[2, L // 2, L - 3]` for an
    L-layer target (needs L >= 8). The last hidden state (-1) is not one: the engines capture it before the final
    norm, transformers after. `data.layers` must store them."""
    num_layers: int = 1
    """Decoder layers (Qwen3-shaped: per-head q / k norms, the target's heads, head size and MLP width)."""
    block_size: int = 8
    """Tokens in a block: the last verified token and `block_size - 1` mask slots, each drafting the token at its
    own position (vLLM's `num_speculative_tokens` is `block_size - 1`)."""
    mask_token_id: int = 0
    """A token of the target's vocabulary whose (frozen) embedding every mask slot reads."""
    max_anchors: int = 64
    """Blocks trained per sequence: anchors drawn uniformly among its assistant tokens (fewer when it has fewer)."""
    decay_gamma: float = 4.0
    """Weight of slot k (1-based) in the loss: exp(-(k - 1) / decay_gamma); the paper uses 4 at block size 8 (7 at
    16)."""
    tie_k_norm: bool = True
    """One key RMSNorm shared by every layer (exported as a copy per layer). vLLM's CPU backend normalises the
    context keys of every layer with layer 0's key norm; tied, the drafter computes the same on every backend."""

    def validate(self, err) -> None:
        if len(set(self.feature_layers)) != len(self.feature_layers):
            err("drafter.feature_layers", f"has duplicates: {self.feature_layers}")
        if self.feature_layers != sorted(self.feature_layers) or any(i < 0 for i in self.feature_layers):
            err("drafter.feature_layers", f"must be hidden-state indices >= 0 in ascending order, got "
                f"{self.feature_layers} (the engines fuse their aux layers in layer order)")  # fmt: skip
        if self.num_layers < 1:
            err("drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            err("drafter.block_size", f"must be >= 2 (the verified token and at least one mask slot), got "
                f"{self.block_size}")  # fmt: skip
        if self.mask_token_id < 0:
            err("drafter.mask_token_id", f"must be >= 0, got {self.mask_token_id}")
        if self.max_anchors < 1:
            err("drafter.max_anchors", f"must be >= 1, got {self.max_anchors}")
        if not (self.decay_gamma > 0 and math.isfinite(self.decay_gamma)):
            err("drafter.decay_gamma", f"must be a finite number > 0, got {self.decay_gamma}")
        at_most(err, "drafter.num_layers", self.num_layers, MAX_LAYERS)
        at_most(err, "drafter.block_size", self.block_size, MAX_TTT_STEPS + 1)
        at_most(err, "drafter.max_anchors", self.max_anchors, MAX_ANCHORS)

    def resolved_layers(self, num_layers: int) -> list[int]:
        """`feature_layers`, or low / mid / high of a `num_layers`-layer target (`methods.limits.resolved_layers`)."""
        return resolved_layers(self.feature_layers, num_layers)

    @property
    def borrows_lm_head(self) -> bool:
        """It drafts through the target's lm_head over the whole vocabulary."""
        return True

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`)."""
        return {"num_layers": self.num_layers}

    def without_inputs(self):
        """No input files of its own: itself."""
        return self

    def check_inputs(self, err) -> None:
        """No input files of its own."""

    def check_recipe(self, recipe, err) -> None:
        check_target_sizes(self.target_sized(), recipe, err)
        L = recipe.target.size("num_hidden_layers")
        vocab = recipe.target.size("vocab_size")
        if vocab is not None and self.mask_token_id >= vocab:
            err("drafter.mask_token_id", f"{self.mask_token_id} is not below the target's vocab_size ({vocab})")
        if L is not None:
            try:
                layers = self.resolved_layers(L)
            except ValueError as exc:
                err("drafter.feature_layers", str(exc).split(": ", 1)[1])
            if any(i >= L for i in layers):
                err("drafter.feature_layers", f"{layers}: the engines capture hidden states 0..{L - 1} of a {L}-layer "
                    "target (the last one, L, is normed differently by transformers)")  # fmt: skip
            missing = [i for i in layers if i not in recipe.data.layers]
            if missing and not self.feature_layers:  # listed layers: the schema checks them
                err("data.layers", f"must store the drafter's low / mid / high layers {layers}; missing {missing}")
        depth = self.block_size - 1
        if recipe.eval.tree in ("chain", "calibrated", "cost") and recipe.eval.tree_depth > depth:
            err("eval.tree_depth", f"{recipe.eval.tree_depth} exceeds the tokens one forward drafts "
                f"(drafter.block_size - 1 = {depth})")  # fmt: skip
        if recipe.eval.tree in named_trees.NAMED_TREES and named_trees.depth(recipe.eval.tree) > depth:
            need = named_trees.depth(recipe.eval.tree)
            err("eval.tree", f"{recipe.eval.tree} is {need} deep and needs drafter.block_size >= {need + 1}, got "
                f"{self.block_size}")  # fmt: skip
        if recipe.eval.draft_vocab:
            err("eval.draft_vocab", "a dflash drafter drafts over the target's whole vocabulary (its lm_head)")
        if recipe.eval.head != "full":
            err("eval.head", f"{recipe.eval.head}: a dflash drafter drafts through the target's own lm_head")
        if recipe.train.loss_vocab:
            err("train.loss_vocab", "a dflash drafter is trained through the target's whole lm_head")
