"""Medusa-1: residual heads on the frozen target's last hidden state, head k predicting the token k + 1 ahead
(loss weights 0.8^k); drafts static trees from the heads' top-k."""

from __future__ import annotations

from methods.medusa1.config import MedusaConfig
from methods.method import STATIC_TREES, Layout, Method

_G, _W = "methods.medusa1.gates", "methods.medusa1.layouts"

METHOD = Method(
    "medusa1",
    MedusaConfig,
    "methods.medusa1.model:MedusaHeads",
    inputs="features",
    proposer="eval.static_proposers:build_medusa_proposer",
    trees=STATIC_TREES,
    formats={
        "native": Layout(f"{_G}:native_medusa_gate"),
        "medusa": Layout(f"{_G}:medusa_gate", f"{_W}:write_medusa"),
        "vllm": Layout(f"{_G}:vllm_medusa_gate", f"{_W}:write_vllm_medusa"),
    },
    imports={"medusa": "methods.medusa1.imports:import_medusa"},
    calibration="eval.calibration:medusa_calibration",
)
