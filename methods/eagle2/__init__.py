"""EAGLE-2: one decoder layer over the target's last hidden state (or fused layers) and the next token's embedding,
trained with a Smooth-L1 feature loss plus the target head's cross-entropy; drafts dynamic trees."""

from __future__ import annotations

from methods.eagle2.config import EagleConfig
from methods.method import EAGLE_TREES, Layout, Method

_G, _W = "methods.eagle2.gates", "methods.eagle2.layouts"

METHOD = Method(
    "eagle2",
    EagleConfig,
    "methods.eagle2.model:EagleDrafter",
    inputs="features",
    proposer="eval.eagle_proposer:build_eagle_proposer",
    trees=EAGLE_TREES,
    formats={
        "native": Layout(f"{_G}:native_eagle_gate"),
        "eagle": Layout(f"{_G}:safeailab_gate", f"{_W}:write_eagle"),
        "sglang": Layout(f"{_G}:sglang_gate", f"{_W}:write_sglang"),
        "vllm": Layout(f"{_G}:vllm_eagle_gate", f"{_W}:write_vllm_eagle"),
    },
    imports={"eagle": "methods.eagle2.imports:import_eagle"},
)
