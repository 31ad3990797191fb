"""P-EAGLE: EAGLE-3's drafter drafting `parallel_tokens` tokens in one forward through mask slots; drafts static trees
from the per-depth top-k of that forward."""

from __future__ import annotations

from methods.method import STATIC_TREES, Layout, Method
from methods.peagle.config import PeagleConfig

_SPECULATORS = Layout("methods.peagle.gates:peagle_gate", "methods.peagle.layouts:write_speculators_peagle")

METHOD = Method(
    "peagle",
    PeagleConfig,
    "methods.peagle.model:PeagleDrafter",
    inputs="features",
    proposer="eval.static_proposers:build_parallel_proposer",
    trees=STATIC_TREES,
    formats={
        "native": Layout("methods.peagle.gates:native_peagle_gate"),
        "speculators": _SPECULATORS,
        "vllm": _SPECULATORS,  # vLLM's `peagle` reads the speculators layout; SGLang has none
    },
    calibration="eval.static_proposers:parallel_calibration",
    own_vocab=True,
    target_statistics=True,
    later_fields={"num_layers": 1},  # one decoder layer before drafter.num_layers existed
)
