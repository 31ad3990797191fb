"""FasterDecoding Medusa heads imported as a native medusa1 drafter (`python -m export.imports --format medusa`),
checked against FasterDecoding's reading of them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from export.imports import _MEDUSA_NAME, check_close, check_tensors, int_field
from methods.medusa1.config import MedusaConfig
from methods.medusa1.gates import medusa_fd_logits, medusa_hidden
from methods.medusa1.model import MedusaHeads
from models.io import (
    ExportError,
)
from models.target import Target


def import_medusa(src: Path, config: dict, tensors: dict, weights: Path, target: Target) -> tuple[nn.Module, Callable]:
    """FasterDecoding Medusa heads -> (MedusaHeads, the check of its reloaded native export)."""
    where = src / "config.json"
    L = int_field(config, "medusa_num_layers", 1, where)
    heads_in_file = {int(m.group(1)) for m in map(_MEDUSA_NAME.match, tensors) if m}
    # FasterDecoding's loader builds its heads whatever `medusa_num_heads` says (its published configs say 2 beside
    # 5 heads' weights), so the file decides; the config only gets a note when it disagrees.
    K = max(heads_in_file, default=-1) + 1
    if K == 0:
        raise ExportError(f"{weights}: no Medusa head tensors ({{h}}.{{l}}.linear.weight, {{h}}.{{L}}.weight)")
    said = config.get("medusa_num_heads")
    if said is not None and said != K:
        print(f"note: {where}: medusa_num_heads is {said!r}, {weights.name} holds {K} heads: importing {K}",
              file=sys.stderr)  # fmt: skip
    cfg = MedusaConfig(num_heads=K, num_layers=L, share_lm_head=False)
    drafter = MedusaHeads(cfg, target.parts([-1]))
    ours = {name: tuple(t.shape) for name, t in drafter.trainable_state_dict().items()}
    names = {f"blocks.{h}.layers.{l}.{k}": f"{h}.{l}.linear.{k}" for h in range(K) for l in range(L) for k in
             ("weight", "bias")} | {f"lm_heads.{h}.weight": f"{h}.{L}.weight" for h in range(K)}  # fmt: skip
    layout = f"FasterDecoding Medusa heads with medusa_num_heads={K}, medusa_num_layers={L}"
    check_tensors(tensors, {theirs: ours[mine] for mine, theirs in names.items()}, weights, layout)
    # One ResBlock shared across a head's layers: the last one loaded is what every layer computes.
    state = {
        f"blocks.{h}.layers.{l}.{k}": tensors[f"{h}.{L - 1}.linear.{k}"]
        for h in range(K)
        for l in range(L)
        for k in ("weight", "bias")
    }
    state |= {f"lm_heads.{h}.weight": tensors[f"{h}.{L}.weight"] for h in range(K)}
    drafter.load_state_dict(state, strict=True)
    return drafter, lambda native: check_medusa(native, config, tensors, weights, target)


def check_medusa(native: nn.Module, config: dict, tensors: dict, weights: Path, target: Target) -> None:
    """The reloaded native heads' logits against FasterDecoding's loading of the checkpoint, on the same input."""
    notes: list[str] = []
    with torch.no_grad():
        hidden = medusa_hidden(native, target.config.hidden_size)
        vocab = target.config.vocab_size
        consumer = medusa_fd_logits(config, tensors, weights.name, hidden, vocab, notes, native.cfg.num_heads)
        reference = native.head_logits(hidden).float()
    check_close(consumer, reference, native, target, weights, "FasterDecoding's Medusa", notes)
