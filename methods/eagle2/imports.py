"""A SafeAILab EAGLE-1/2 checkpoint imported as a native eagle2 drafter (`python -m export.imports --format eagle`),
checked against SafeAILab's reading of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from export.imports import check_close, check_tensors, int_field
from methods.eagle2.config import EagleConfig
from methods.eagle2.gates import SAFEAILAB, eagle_consumer_logits, eagle_inputs, rope_hints
from methods.eagle2.model import EagleDrafter
from models.io import (
    ExportError,
)
from models.target import Target


def import_eagle(src: Path, config: dict, tensors: dict, weights: Path, target: Target) -> tuple[nn.Module, Callable]:
    """A SafeAILab EAGLE-1/2 checkpoint -> (EagleDrafter, the check of its reloaded native export)."""
    where = src / "config.json"
    tc = target.config
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if config.get(key) != getattr(tc, key):
            raise ExportError(f"{where}: {key} is {config.get(key)!r}, the target's is {getattr(tc, key)!r}")
    kv, target_kv = config.get("num_key_value_heads"), getattr(tc, "num_key_value_heads", None)
    if (kv or config["num_attention_heads"]) != (target_kv or tc.num_attention_heads):
        raise ExportError(f"{where}: num_key_value_heads is {kv!r}, the target's is {target_kv!r}")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if head_dim != tc.hidden_size // tc.num_attention_heads:
        raise ExportError(
            f"{where}: SafeAILab's layers use hidden_size // num_attention_heads as head_dim, the target's {head_dim}"
        )
    hints = rope_hints(config, tc)
    if hints:  # our drafter runs with the target's RoPE
        raise ExportError(f"{where}: {'; '.join(hints)} (SafeAILab's default rope_theta is 10000)")
    layers = int_field(config, "num_hidden_layers", 1, where)
    fc_bias = config.get("bias", True)
    if not isinstance(fc_bias, bool):
        raise ExportError(f"{where}: bias: expected true or false, got {fc_bias!r}")
    cfg = EagleConfig(feature_layers=[-1], num_layers=layers, fc_norm=False, post_norm=False, fc_bias=fc_bias)
    drafter = EagleDrafter(cfg, target.parts([-1]))
    expected = {name: tuple(t.shape) for name, t in drafter.trainable_state_dict().items()}
    layout = f"a SafeAILab EAGLE-1/2 drafter with num_hidden_layers={layers}, bias={str(fc_bias).lower()}"
    check_tensors(tensors, expected, weights, layout, optional=("embed_tokens.weight",))
    if "embed_tokens.weight" in tensors:
        embed = target.embed_tokens.weight
        theirs = tensors["embed_tokens.weight"]
        # in the checkpoint's dtype: a trainer that saves in bf16 holds the target's embedding rounded to it
        if theirs.shape != embed.shape or not torch.equal(theirs.to(embed.device), embed.to(theirs.dtype)):
            raise ExportError(f"{weights}: embed_tokens.weight differs from the target's embedding (another target?)")
    drafter.load_state_dict({k: tensors[k] for k in expected}, strict=False)
    return drafter, lambda native: check_eagle(native, config, tensors, weights, target)


def check_eagle(native: nn.Module, config: dict, tensors: dict, weights: Path, target: Target) -> None:
    """The reloaded native drafter's draft logits against SafeAILab's loading of the checkpoint, on the same input."""
    notes: list[str] = []
    with torch.no_grad():
        batch, features, next_ids = eagle_inputs(native, target.config.vocab_size)
        consumer = eagle_consumer_logits(
            config, tensors, weights.name, SAFEAILAB, target, features, next_ids, batch["position_ids"], notes
        )
        reference = native.logits(native.predict_features(batch))
    check_close(consumer, reference, native, target, weights, "SafeAILab's EAGLE", notes)
