"""EAGLE-3 / EAGLE-3.1: the target's low / mid / high layers fused into one decoder layer, a head over a trained
draft vocabulary, training-time test (the drafter unrolled on its own outputs); drafts dynamic trees."""

from __future__ import annotations

from methods.eagle3.config import Eagle3Config
from methods.method import EAGLE_TREES, Layout, Method

_G, _W = "methods.eagle3.gates", "methods.eagle3.layouts"
_SPECULATORS = Layout(f"{_G}:speculators_gate", f"{_W}:write_speculators")

METHOD = Method(
    "eagle3",
    Eagle3Config,
    "methods.eagle3.model:Eagle3Drafter",
    inputs="features",
    proposer="eval.eagle_proposer:build_eagle_proposer",
    trees=EAGLE_TREES,
    formats={
        "native": Layout(f"{_G}:native_eagle3_gate"),
        "speculators": _SPECULATORS,
        "vllm": _SPECULATORS,  # vLLM reads the speculators layout
        "sglang": Layout(f"{_G}:sglang_eagle3_gate", f"{_W}:write_sglang_eagle3"),
    },
    imports={
        "eagle3": "methods.eagle3.imports:import_safeailab",
        "speculators": "methods.eagle3.imports:import_speculators",
    },
    own_vocab=True,
    target_statistics=True,
    later_fields={"num_layers": 1},  # one decoder layer before drafter.num_layers existed
)
