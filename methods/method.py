"""What a method declares: one `Method` entry per method folder (`methods/<name>/__init__.py`), read by train, export
and eval; none of them probes a drafter or branches on a method's name.

    method = METHODS[recipe.drafter.method]
    drafter = method.module()(recipe.drafter, target.parts(recipe.data.layers))   # imports torch on first use
    proposer, desc = resolve(method.proposer)(method, drafter, recipe.eval, calibrate, draft_vocab, window)

An entry declares:
- `config`: its recipe section's dataclass (the folder's `config.py`, no torch), and `module_path`: the nn.Module
  built from (config, TargetParts), as "package.module:Class", imported only when a drafter is built;
- `inputs`: what its training forward reads: "features" (target hidden states, stored by `data.extract` or computed
  online) or "tokens" (token batches: it runs the target itself, e.g. through a LoRA backbone); `online_only`: it
  cannot train from stored features;
- `proposer`: the function that builds its evaluation proposer for `eval.tree` ("package.module:function", called as
  above and returning (`eval.proposal.Proposer`, a description of the tree)), and `trees`: the `eval.tree` values it
  drafts; `calibration`: the function that measures its per-depth rank accuracy for calibrated trees, called as
  (drafter, target, samples, top_k) with `eval.calibration.calibration_samples`' samples (None: no calibrated tree);
- `formats`: the export formats that can hold it, each a `Layout`: the function that writes it and the load gate that
  reloads it as the format's consumer does, imported only when an export runs; `native` has the project's own writer
  and a gate of the method's; `imports`: the other projects' checkpoint layouts `python -m export.imports` reads into
  it, each the "package.module:function" called as (src, config, tensors, weights, target) and returning the drafter
  and the check that its reloaded native export computes what the checkpoint's consumer computes;
- `step_dependent`: its loss depends on the optimizer step (the loop calls `set_step(step)` before each step);
  `adapts_target`: it trains the target's own layers (LoRA; training refuses a split target), and evaluation verifies
  with `drafter.adapt_target(target)` (a LoRA-merged target) and drafts with what that returns; `export_extra`: the
  native export calls `drafter.export_extra(out, target, merge_lora=...)`; `own_vocab`: it drafts over its own trained
  draft vocabulary (`drafter.draft_vocab` tokens): training picks the data's most frequent loss tokens and calls
  `drafter.set_draft_vocab(ids, init_head=True)`, and evaluation maps its logits to target ids with
  `drafter.draft_ids`; `target_statistics`: its training forward reads the target's stored top-1 and logsumexp
  (`data.target_stats`) when the feature set has them for its target's head (batch keys `target_top1`, `target_lse`);
  `later_fields`: config fields added after runs of it existed, each with the value that keeps the earlier drafter:
  recipe hashes leave a field out while it has that value, so checkpoints made before it still resume and export.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Literal

STATIC_TREES = ("auto", "chain", "calibrated", "mc_sim_7b_63", "calibrated63", "cost")
"""Trees filled from per-depth top-k lists (Medusa heads, P-EAGLE mask slots): a chain, calibrated or named, or
cost-aware (every round the candidates with the best path probabilities, as many as pay for themselves)."""
EAGLE_TREES = ("auto", "dynamic", "chain", "cost")


@dataclass(frozen=True)
class Layout:
    """How one export format holds a method's drafter."""

    gate: str
    """(out_dir, recipe, target, drafter) -> `export.gate_parts.GateResult`: the export reloaded as the format's
    consumer reads it, and the trained drafter, on the same input."""
    writer: str | None = None
    """(out_dir, recipe, target, drafter, include_target_weights) -> None: writes the format's files (None: the native
    export, `export.write.write_native`)."""


@dataclass(frozen=True)
class Method:
    name: str
    config: type
    module_path: str
    inputs: Literal["features", "tokens"]
    proposer: str
    trees: tuple[str, ...]
    formats: dict[str, Layout]
    imports: dict[str, str] = field(default_factory=dict)
    calibration: str | None = None
    online_only: bool = False
    step_dependent: bool = False
    adapts_target: bool = False
    export_extra: bool = False
    own_vocab: bool = False
    target_statistics: bool = False
    later_fields: dict[str, object] = field(default_factory=dict)

    def module(self) -> type:
        """The drafter's nn.Module class (imports torch and the model file on first use)."""
        return resolve(self.module_path)


def resolve(path: str):
    """The object a "package.module:name" path names, its module imported on first use."""
    package, name = path.split(":")
    return getattr(importlib.import_module(package), name)
