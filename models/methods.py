"""The drafter contract: what each method declares, in one place. Train, export and eval ask it; none probes a module.

    method = METHODS[recipe.drafter.method]
    drafter = method.module()(recipe.drafter, target.parts(recipe.data.layers))   # imports torch on first use
    method.trees, method.formats, method.inputs, method.proposer, ...

A method declares:
- `config`: its recipe section's dataclass (`models.configs`, no torch), and `module`: the nn.Module built from
  (config, TargetParts), named as "package.module:Class" and imported only when a drafter is built;
- `inputs`: what its training forward reads: "features" (target hidden states, stored by `data.extract` or
  computed online) or "tokens" (token batches: it runs the target itself, e.g. through a LoRA backbone);
  `online_only`: it cannot train from stored features;
- `proposer`: how it drafts at evaluation ("eagle": a dynamic tree or a chain from the drafter's own feature
  recurrence; "medusa": a static tree filled from per-head top-k; "parallel": a static tree filled from the per-depth
  top-k of one drafter forward with mask slots, P-EAGLE), and `trees`: the `eval.tree` values it drafts;
- `formats`: the export formats that can hold it, each a `Layout`: the function that writes it and the load gate
  that reloads it as the format's consumer does (`export.write`, `export.gates`), named as "package.module:function"
  and imported only when an export runs; `native` has the project's own writer and a gate of the method's;
- `step_dependent`: its loss depends on the optimizer step (the loop calls `set_step(step)` before each step);
  `adapts_target`: it trains the target's own layers (LoRA; training refuses a split target), and evaluation
  verifies with `drafter.adapt_target(target)` (a LoRA-merged target) and drafts with what that returns;
  `export_extra`: the native export calls `drafter.export_extra(out, target, merge_lora=...)`;
  `own_vocab`: it drafts over its own trained draft vocabulary (`drafter.draft_vocab` tokens): training picks the
  data's most frequent loss tokens and calls `drafter.set_draft_vocab(ids, init_head=True)`, and evaluation maps its
  logits to target ids with `drafter.draft_ids`.

Adding a method: one model file (config in `models.configs`, module beside it), its export layouts (a writer and a
load gate per format, named in its entry's `formats`), one entry below, recipes, one test.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from models.configs import Eagle3Config, EagleConfig, Medusa2Config, MedusaConfig, PeagleConfig

STATIC_TREES = ("auto", "chain", "calibrated", "mc_sim_7b_63", "calibrated63", "cost")
"""Trees filled from per-depth top-k lists (Medusa heads, P-EAGLE mask slots): a chain, calibrated or named, or
cost-aware (every round the candidates with the best path probabilities, as many as pay for themselves)."""
EAGLE_TREES = ("auto", "dynamic", "chain", "cost")


@dataclass(frozen=True)
class Method:
    name: str
    config: type
    module_path: str
    inputs: Literal["features", "tokens"]
    proposer: Literal["eagle", "medusa", "parallel"]
    trees: tuple[str, ...]
    formats: dict[str, Layout]
    online_only: bool = False
    step_dependent: bool = False
    adapts_target: bool = False
    export_extra: bool = False
    own_vocab: bool = False

    def module(self) -> type:
        """The drafter's nn.Module class (imports torch and the model file on first use)."""
        return resolve(self.module_path)


@dataclass(frozen=True)
class Layout:
    """How one export format holds a method's drafter."""

    gate: str
    """(out_dir, recipe, target, drafter) -> `export.gate_parts.GateResult`: the export reloaded as the format's
    consumer reads it, and the trained drafter, on the same input."""
    writer: str | None = None
    """(out_dir, recipe, target, drafter, include_target_weights) -> None: writes the format's files (None: the native
    export, `export.write.write_native`)."""


def resolve(path: str):
    """The object a "package.module:name" path names, its module imported on first use."""
    package, name = path.split(":")
    return getattr(importlib.import_module(package), name)


def eagle_layouts() -> dict[str, Layout]:
    g, w = "export.eagle_gates", "export.write"
    return {"native": Layout(f"{g}:native_eagle_gate"), "eagle": Layout(f"{g}:safeailab_gate", f"{w}:write_eagle"),
            "sglang": Layout(f"{g}:sglang_gate", f"{w}:write_sglang"),
            "vllm": Layout(f"{g}:vllm_eagle_gate", f"{w}:write_vllm_eagle")}  # fmt: skip


def medusa_layouts() -> dict[str, Layout]:
    g, w = "export.medusa_gates", "export.write"
    return {"native": Layout(f"{g}:native_medusa_gate"), "medusa": Layout(f"{g}:medusa_gate", f"{w}:write_medusa"),
            "vllm": Layout(f"{g}:vllm_medusa_gate", f"{w}:write_vllm_medusa")}  # fmt: skip


def eagle3_layouts(parallel: bool) -> dict[str, Layout]:
    """EAGLE-3's (vLLM reads the speculators layout natively) or P-EAGLE's (`parallel`: no SGLang layout)."""
    g, w = "export.eagle3_gates", "export.eagle3_layouts"
    if parallel:
        speculators = Layout(f"{g}:peagle_gate", f"{w}:write_speculators_peagle")
        return {"native": Layout(f"{g}:native_peagle_gate"), "speculators": speculators, "vllm": speculators}
    speculators = Layout(f"{g}:speculators_gate", f"{w}:write_speculators")
    return {"native": Layout(f"{g}:native_eagle3_gate"), "speculators": speculators, "vllm": speculators,
            "sglang": Layout(f"{g}:sglang_eagle3_gate", f"{w}:write_sglang_eagle3")}  # fmt: skip


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("eagle2", EagleConfig, "models.eagle:EagleDrafter", "features", "eagle", EAGLE_TREES,
               formats=eagle_layouts()),
        Method("eagle3", Eagle3Config, "models.eagle3:Eagle3Drafter", "features", "eagle", EAGLE_TREES,
               formats=eagle3_layouts(parallel=False), own_vocab=True),
        Method("peagle", PeagleConfig, "models.peagle:PeagleDrafter", "features", "parallel", STATIC_TREES,
               formats=eagle3_layouts(parallel=True), own_vocab=True),
        Method("medusa1", MedusaConfig, "models.medusa:MedusaHeads", "features", "medusa", STATIC_TREES,
               formats=medusa_layouts()),
        Method("medusa2", Medusa2Config, "models.medusa2:Medusa2Model", "tokens", "medusa", STATIC_TREES,
               formats={"native": Layout("export.gates:reload_gate")}, online_only=True, step_dependent=True,
               adapts_target=True, export_extra=True),
    )
}  # fmt: skip

FORMATS: tuple[str, ...] = tuple(dict.fromkeys(fmt for method in METHODS.values() for fmt in method.formats))
"""Every export format some method declares, native first: what `export.format` and `python -m export` accept."""
