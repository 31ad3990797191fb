"""What the method configs (`methods/<name>/config.py`, recipe section `drafter`) share: the bounds on a drafter's
sizes, checked at load time and against the target where its config is readable without loading it; the objectives
of drafters with their own head; the LoRA target modules of Llama-family layers. No torch: the recipe schema
(`schema.recipe`) reads the configs to load and check a recipe without importing torch, transformers or peft.

Each config validates its own fields (`validate`), its recipe context (`check_recipe`: the method-specific limits on
trees, vocabularies, online training) and, before a run, its input files (`check_inputs`). It also declares, so that
no caller probes it: which of its fields the target's sizes bound (`target_sized`), whether its drafter borrows the
target's lm_head (`borrows_lm_head`), and itself without its input files (`without_inputs`: what rebuilds a drafter
whose tensors a checkpoint holds). Which tree shapes a method drafts at all is declared in its entry.
"""

from __future__ import annotations

from typing import Literal

DraftLoss = Literal["kl", "hass", "tv", "nla", "lk_hybrid"]
"""The objectives of drafters with their own head (models/losses.py)."""

LLAMA_LINEAR_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Upper bounds on the drafter's sizes, checked at load time (the recipe schema's other bounds: `schema.recipe`). Always
# these; and against the target where its config is readable without loading it (`TargetConfig.size`): layers
# within its num_hidden_layers, vocabularies within its vocab_size, LoRA rank within its hidden_size.
MAX_LAYERS = 64
"""drafter.num_layers (EAGLE decoder layers; Medusa residual blocks per head)."""
MAX_HEADS = 64
"""drafter.num_heads (Medusa; the papers use 3-5)."""
MAX_TTT_STEPS = 64
"""drafter.ttt_steps (EAGLE-3 unrolled steps; the paper uses 7)."""
MAX_VOCAB = 1 << 22
"""drafter.draft_vocab, drafter.topk_metric."""
MAX_RANK = 1 << 16
"""drafter.lora_r (Medusa-2's adapters; its recipes use 32)."""


def at_most(err, key: str, value: int, limit: int | None, what: str = "the upper bound") -> None:
    """err(key, ...) when `limit` is known and value > limit."""
    if limit is not None and value > limit:
        err(key, f"{value} is more than {what} ({limit})")


TARGET_SIZES = {
    "num_layers": "num_hidden_layers",
    "draft_vocab": "vocab_size",
    "topk_metric": "vocab_size",
    "lora_r": "hidden_size",
}
"""Drafter fields a size of the target bounds -> that size (a field of the target's transformers config)."""


def check_target_sizes(sized: dict[str, int], recipe, err) -> None:
    """A drafter's layers within the target's (a drafter deeper than its target is never what was meant), its
    vocabularies within the target's vocabulary, its LoRA rank within the hidden size: `sized` is what a config
    declares (`target_sized()`: {field: value}, each a key of `TARGET_SIZES`), checked in its order."""
    for key, value in sized.items():
        size = TARGET_SIZES[key]
        at_most(err, f"drafter.{key}", value, recipe.target.size(size), f"the target's {size}")

    # check_recipe: Medusa-1's (the heads draft the same trees)


def resolved_layers(feature_layers: list[int], num_layers: int) -> list[int]:
    """`feature_layers`, or low / mid / high of a `num_layers`-layer target, `[2, L // 2, L - 3]` (the fused inputs of
    EAGLE-3, P-EAGLE and DFlash); ValueError when it has none."""
    if feature_layers:
        return list(feature_layers)
    low_mid_high = [2, num_layers // 2, num_layers - 3]
    if len(set(low_mid_high)) < 3 or num_layers < 8:
        raise ValueError(
            f"drafter.feature_layers: a {num_layers}-layer target has no distinct low/mid/high layers "
            f"{low_mid_high}; list the hidden-state indices to fuse"
        )
    return low_mid_high
