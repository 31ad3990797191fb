"""Medusa heads in FasterDecoding's layout (`medusa`: `medusa_lm_head.safetensors` / `.pt`) and vLLM's (`vllm`)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from export.gate_parts import ENGINE_WEIGHTS, FASTERDECODING_HEADS, MEDUSA_PT
from export.gate_parts import MEDUSA_SAFETENSORS as MEDUSA_WEIGHTS
from export.write import write_pt
from methods.medusa1.model import MedusaHeads
from models.io import (
    ExportError,
    write_safetensors,
)
from models.target import Target
from schema.recipe import Recipe


def medusa_names(drafter: MedusaHeads) -> dict[str, str]:
    """Our MedusaHeads tensor names -> FasterDecoding Medusa names (head h, block l, projection L)."""
    K, L = drafter.cfg.num_heads, drafter.cfg.num_layers
    names = {}
    for h in range(K):
        for l in range(L):
            names[f"blocks.{h}.layers.{l}.weight"] = f"{h}.{l}.linear.weight"
            names[f"blocks.{h}.layers.{l}.bias"] = f"{h}.{l}.linear.bias"
        names[f"lm_heads.{h}.weight"] = f"{h}.{L}.weight"
    return names


def check_fasterdecoding(drafter: MedusaHeads) -> None:
    """Refuse heads FasterDecoding's legacy loader cannot hold (it builds 5 heads of one shared ResBlock each)."""
    if drafter.cfg.num_heads != FASTERDECODING_HEADS:
        raise ExportError(
            f"drafter.num_heads: FasterDecoding Medusa's loader builds {FASTERDECODING_HEADS} heads whatever "
            f"medusa_num_heads says and loads with strict=False, so {drafter.cfg.num_heads} trained heads would run "
            f"beside random ones; train with drafter.num_heads={FASTERDECODING_HEADS}, or export --format vllm"
        )
    if drafter.cfg.num_layers != 1:
        raise ExportError(
            f"drafter.num_layers: FasterDecoding Medusa shares one ResBlock across a head's layers "
            f"([ResBlock] * medusa_num_layers), so {drafter.cfg.num_layers} trained layers would load as the last one "
            "repeated; train with drafter.num_layers=1, or export --format vllm"
        )


def write_medusa(out: Path, recipe: Recipe, target: Target, drafter: nn.Module, include_target_weights: bool) -> None:
    check_fasterdecoding(drafter)
    write_medusa_files(out, recipe, target, drafter)


def write_medusa_files(out: Path, recipe: Recipe, target: Target, drafter: MedusaHeads) -> None:
    """The FasterDecoding files, unchecked (`write_medusa` refuses what its loader cannot hold first)."""
    state = drafter.state_dict()
    shared = drafter.lm_head.weight if drafter.lm_heads is None else None  # share_lm_head: every head gets a copy
    tensors = {theirs: state.get(ours, shared) for ours, theirs in medusa_names(drafter).items()}
    write_safetensors(tensors, out / MEDUSA_WEIGHTS)
    write_pt(tensors, out / MEDUSA_PT)
    config = {
        "medusa_num_heads": drafter.cfg.num_heads,
        "medusa_num_layers": drafter.cfg.num_layers,
        "base_model_name_or_path": recipe.target.path or target.name,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_vllm_medusa(
    out: Path, recipe: Recipe, target: Target, drafter: nn.Module, include_target_weights: bool = False
) -> None:
    """vLLM's `MedusaModel`: our tensor names (`blocks.{h}.layers.{l}.weight|bias`, `lm_heads.{h}.weight`) and a
    `model_type: medusa` config. vLLM builds the blocks without bias unless `medusa_fc_bias` is set, so it is always
    written; shared-lm_head heads export one `lm_heads.0.weight` (the target's) with `original_lm_head: true`."""
    state = drafter.state_dict()
    tensors = {k: v for k, v in state.items() if k.startswith(("blocks.", "lm_heads."))}
    shared = drafter.lm_heads is None
    if shared:
        tensors["lm_heads.0.weight"] = drafter.lm_head.weight
    write_safetensors(tensors, out / ENGINE_WEIGHTS)
    vocab = target.config.vocab_size
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": target.config.hidden_size,
        "vocab_size": vocab,
        "truncated_vocab_size": vocab,
        "num_heads": drafter.cfg.num_heads,
        "num_hidden_layers": drafter.cfg.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": shared,
        "base_model_name_or_path": recipe.target.path or target.name,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
