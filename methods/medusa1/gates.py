"""The load gates of Medusa exports: FasterDecoding's legacy `MedusaModel` (5 heads whatever the config says, one
shared ResBlock per head, `strict=False`) and vLLM's `MedusaModel`, each rebuilding the heads from the exported
files with that consumer's defaults. `export.gates` lists them; `export.imports` verifies with the same functions."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from export.gate_parts import (
    ENGINE_WEIGHTS,
    FASTERDECODING_HEADS,
    GATE_BATCH,
    GATE_LEN,
    GATE_SEED,
    MEDUSA_PT,
    MEDUSA_SAFETENSORS,
    GateResult,
    Params,
    config_value,
    same_tensors,
)
from models.io import ExportError, load_drafter, read_json, read_safetensors


def medusa_hidden(drafter: nn.Module, d: int) -> torch.Tensor:
    """(B, T, d) float32 last hidden states (the heads cast them to their compute dtype)."""
    dev = next(drafter.parameters()).device
    gen = torch.Generator().manual_seed(GATE_SEED)
    return torch.randn(GATE_BATCH, GATE_LEN, d, generator=gen).to(dev)


def medusa_fd_logits(
    config: dict,
    tensors: dict[str, torch.Tensor],
    where: str,
    hidden: torch.Tensor,
    vocab: int,
    notes: list[str],
    num_heads: int = FASTERDECODING_HEADS,
) -> torch.Tensor:
    """(num_heads, B, T, V) as FasterDecoding's legacy loader builds the heads: per head `[ResBlock] * L` (one
    shared block: of `{h}.{l}.linear.*` the last one loaded wins) and `{h}.{L}.weight`; strict=False."""
    d = hidden.shape[-1]
    L = int(config_value(config, "medusa_num_layers", 1, notes))
    p = Params(tensors, where, hidden.device, notes)
    x0 = hidden.float()
    out = []
    for h in range(num_heads):
        w = b = None
        for layer in range(L):  # the same module under L names: each load overwrites the previous
            if f"{h}.{layer}.linear.weight" in tensors:
                w = p.get(f"{h}.{layer}.linear.weight", (d, d))
            if f"{h}.{layer}.linear.bias" in tensors:
                b = p.get(f"{h}.{layer}.linear.bias", (d,))
        if w is None:
            w = p.get(f"{h}.0.linear.weight", (d, d), "zeros")  # ResBlock zero-initialises its weight
        if b is None:
            b = p.get(f"{h}.0.linear.bias", (d,))
        x = x0
        for _ in range(L):
            x = x + F.silu(F.linear(x, w, b))
        out.append(F.linear(x, p.get(f"{h}.{L}.weight", (vocab, d))))
    return torch.stack(out)


def medusa_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    config = read_json(out_dir / "config.json")
    tensors = same_tensors(out_dir, MEDUSA_SAFETENSORS, MEDUSA_PT, "medusa")  # the loader reads the .pt
    notes: list[str] = []
    if drafter.cfg.num_heads != FASTERDECODING_HEADS:
        notes.append(
            f"medusa_num_heads: the consumer builds {FASTERDECODING_HEADS} heads, "
            f"the drafter has {drafter.cfg.num_heads}"
        )
    if config.get("medusa_num_layers", 1) > 1:
        notes.append("medusa_num_layers: the consumer shares one ResBlock across a head's layers")
    hidden = medusa_hidden(drafter, target.config.hidden_size)
    consumer = medusa_fd_logits(config, tensors, MEDUSA_PT, hidden, target.config.vocab_size, notes)
    return GateResult(consumer, drafter.head_logits(hidden).float(), notes)


def vllm_medusa_logits(
    config: dict, tensors: dict[str, torch.Tensor], where: str, hidden: torch.Tensor, notes: list[str]
) -> torch.Tensor:
    """(K, B, T, V) as vLLM's `MedusaModel` builds the heads from its config fields (defaults when absent)."""
    d = int(config_value(config, "hidden_size", 4096, notes))
    vocab = int(config_value(config, "vocab_size", 32001, notes))
    truncated = config.get("truncated_vocab_size") or vocab
    if truncated != vocab:
        raise ExportError(f"{where}: truncated_vocab_size {truncated} != vocab_size {vocab}: no token_map is written")
    K = int(config_value(config, "num_heads", 5, notes))
    L = int(config_value(config, "num_hidden_layers", 1, notes))
    bias = bool(config.get("medusa_fc_bias", False))
    shared = bool(config.get("original_lm_head", False))
    p = Params(tensors, where, hidden.device, notes)
    out = []
    for h in range(K):
        x = hidden.float()
        for layer in range(L):
            w = p.get(f"blocks.{h}.layers.{layer}.weight", (d, d))
            b = p.get(f"blocks.{h}.layers.{layer}.bias", (d,)) if bias else None
            x = x + F.silu(F.linear(x, w, b))
        out.append(F.linear(x, p.get(f"lm_heads.{0 if shared else h}.weight", (vocab, d))))
    return torch.stack(out)


def vllm_medusa_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """vLLM's `MedusaModel` reading `--format vllm` of Medusa heads."""
    config = read_json(out_dir / "config.json")
    tensors = read_safetensors(out_dir / ENGINE_WEIGHTS)
    hidden = medusa_hidden(drafter, target.config.hidden_size)
    notes: list[str] = []
    consumer = vllm_medusa_logits(config, tensors, ENGINE_WEIGHTS, hidden, notes)
    return GateResult(consumer, drafter.head_logits(hidden).float(), notes)


def native_medusa_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """`models.io.load_drafter` (what eval runs: strict names, shapes and frozen tensors), then the same heads' logits
    on the gate's input."""
    reloaded = load_drafter(out_dir, target)
    hidden = medusa_hidden(drafter, target.config.hidden_size)
    return GateResult(reloaded.head_logits(hidden).float(), drafter.head_logits(hidden).float())
