"""Medusa-2: Medusa-1's heads trained jointly with a LoRA backbone on the target, distilled from the LoRA-off model
(online only); evaluation verifies with the LoRA-merged target."""

from __future__ import annotations

from methods.medusa2.config import Medusa2Config
from methods.method import STATIC_TREES, Layout, Method

METHOD = Method(
    "medusa2",
    Medusa2Config,
    "methods.medusa2.model:Medusa2Model",
    inputs="tokens",
    proposer="eval.static_proposers:build_medusa_proposer",
    trees=STATIC_TREES,
    formats={"native": Layout("export.gates:reload_gate")},
    calibration="eval.calibration:medusa_calibration",
    online_only=True,
    step_dependent=True,
    adapts_target=True,
    export_extra=True,
)
