"""Load gates: reload an engine export the way its consumer does and compare draft logits with the trained drafter.

    diff = check("sglang", out_dir, recipe, target, drafter)   # raises ExportError when the consumer would differ

Each gate is a small, independent re-implementation of one consumer's loading path, built only from the exported
directory (the `config.json` fields the consumer reads, with the consumer's defaults when absent; the tensor names
it reads, with its strictness: a parameter it builds but the file lacks keeps a random initialisation, a tensor it
does not know is ignored, a shape it does not build is an error) plus the frozen target (embedding when the file
has none, lm_head). It computes draft logits on a fixed random input (features, token ids, positions, causal) and
`check` compares them with the trained drafter's (`drafter.logits(drafter.predict_features(batch))` for EAGLE,
`drafter.head_logits(hidden)` for Medusa). What the consumer fell back on (a default, a random tensor, a head count)
is named in the error, so the message points at the field.

Consumers reproduced (transformers-4 conventions: `rope_theta` / `rope_scaling`, never `rope_parameters`):
- `medusa`: FasterDecoding Medusa's legacy `MedusaModel.from_pretrained`: `medusa_lm_head.pt` through `torch.load`
  (read here with `weights_only=True`), 5 heads whatever `medusa_num_heads` says, `medusa_num_layers` (default 1)
  copies of ONE shared ResBlock per head (the last `{h}.{l}.linear.*` loaded wins), `load_state_dict(strict=False)`.
- `eagle`: SafeAILab EAGLE-1/2 (`cnets1.py`, `use_eagle3=False`; `pytorch_model.bin` must hold the safetensors
  file's tensors, for the PyPI release that reads only it): fc bias from `bias` (default True), q/k/v biases
  only with a true `qkv_bias`, head_dim = hidden_size // num_attention_heads; its `EConfig` refuses a `rope_scaling`
  other than exactly {type: linear | dynamic, factor: float > 1}, and it builds scaled RoPE on base 10000.
- `sglang`: `LlamaForCausalLMEagle`: fc always with a bias (not checked for presence), `attention_bias` or `bias`
  (default False) as the q/k/v/o attention biases, `head_dim` when given.
- `vllm`: EAGLE drafters as `EagleLlamaForCausalLM` (fc without bias, an `fc.bias` dropped; `attention_bias` or
  `bias` as attention biases, a `qkv_bias` key overriding q/k/v's); Medusa heads as `MedusaModel` (`num_heads`
  default 5, `num_hidden_layers` default 1, block bias only with `medusa_fc_bias`, `lm_heads.0` for every head with
  `original_lm_head`).
All EAGLE layouts: `layers.{i}.*` for `num_hidden_layers` layers, layer 0 without input_layernorm, no final norm,
logits through the target's lm_head; RoPE from `rope_theta` (default 10000) and `rope_scaling` (default, linear and
llama3 are reproduced; another type is refused by the gate rather than guessed).

`native`: `models.io.load_drafter` (eval's strict loader), then the same logits (each method's own native gate).

No table here: each method declares, per format, the writer and the gate (`methods.Layout`), and `gate(fmt,
method)` finds it; the consumers live in `methods.eagle2.gates` (EAGLE-1/2), `methods.medusa1.gates` and
`methods.eagle3.gates` (EAGLE-3, P-EAGLE); what all build on (the gate input, `GateResult`, `Params`, RoPE, the files'
names) is `export.gate_parts`. A new format for a method: write `def gate(out_dir, recipe, target, drafter) ->
GateResult` and a writer, and name both in the method's `formats`; `export.write` runs `check` on every export.
The functional consumers (`eagle_consumer_logits`, `medusa_fd_logits`, `vllm_medusa_logits`) take a config dict and
a tensor dict, so `export.imports` verifies imported checkpoints with the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from export.gate_parts import GateResult
from methods import METHODS, resolve
from models.io import ExportError, load_drafter

Gate = Callable[[Path, Any, Any, nn.Module], GateResult]
"""A load gate: (export directory, recipe, target, trained drafter) -> the consumer's and the drafter's logits."""


def tolerance(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """Max abs difference allowed: 1e-4 of the logits' scale in float32, 2e-2 when the drafter or the lm_head it
    projects through is 16-bit (`compute_dtype`; the gate computes in float32 up to the lm_head, which rounds its
    input as the drafter does). Layout errors move logits by far more than either."""
    scale = max(1.0, reference.abs().max().item())
    return (1e-4 if dtype == torch.float32 else 2e-2) * scale


def compute_dtype(drafter: nn.Module, target) -> torch.dtype:
    """float32 when the drafter and the vocabulary projection it drafts through compute in float32, else the 16-bit
    dtype: a float32 EAGLE-1/2 or shared-head Medusa drafter of a bf16 target projects through the target's bf16
    lm_head (its config says so: `borrows_lm_head`); an EAGLE-3 drafter, or Medusa heads with `lm_heads` of their
    own, through their own (among its parameters). The target's embedding only gives rows (exact in any dtype)."""
    borrowed = {target.lm_head.weight.dtype} if drafter.cfg.borrows_lm_head else set()  # not among its parameters
    dtypes = {p.dtype for p in drafter.parameters()} | borrowed
    return next((dt for dt in dtypes if dt != torch.float32), torch.float32)


def check(fmt: str, out_dir: str | Path, recipe, target, drafter: nn.Module) -> float:
    """Run `fmt`'s gate on the export at `out_dir`; return the max abs logit difference, or raise ExportError."""
    run_gate = gate(fmt, drafter.cfg.method)
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            result = run_gate(Path(out_dir), recipe, target, drafter)
    finally:
        drafter.train(was_training)
    why = "; ".join(result.notes) if result.notes else "no field fell back on a default: check the tensors' values"
    if result.consumer.shape != result.reference.shape:
        raise ExportError(
            f"{fmt} load gate: the consumer computes logits of shape {tuple(result.consumer.shape)}, the trained "
            f"drafter {tuple(result.reference.shape)} ({why})"
        )
    if result.reference.numel() == 0:  # a gate that only reloads (no logits to compare for this method)
        return 0.0
    diff = (result.consumer - result.reference).abs().max().item()
    if not diff <= tolerance(result.reference, compute_dtype(drafter, target)):  # also catches NaN
        raise ExportError(
            f"{fmt} load gate: draft logits of the export as its consumer loads it and of the trained drafter differ "
            f"by {diff:.3g} ({why})"
        )
    return diff


def reload_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """`models.io.load_drafter` only (strict names, shapes, frozen tensors): for a method with no logit comparison of
    its own (Medusa-2, whose heads and adapter `export_extra` writes beside)."""
    load_drafter(out_dir, target)
    return GateResult(torch.zeros(0), torch.zeros(0), ["no logit comparison for this method: strict reload only"])


def gate(fmt: str, method: str) -> Gate:
    """The load gate of `method`'s drafters in format `fmt`, as its `methods` entry declares."""
    formats = METHODS[method].formats
    if fmt not in formats:
        raise ExportError(f"export.format: {fmt} is not a format of {method} drafters (theirs: {', '.join(formats)})")
    return resolve(formats[fmt].gate)
