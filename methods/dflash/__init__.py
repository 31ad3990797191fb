"""DFlash: block diffusion drafting. Decoder layers attend from a block (the last verified token, then mask slots) to
the target's fused hidden states and to the whole block, and draft `block_size - 1` tokens in one forward; the
target's embedding and lm_head are shared. Evaluated as vLLM drafts it (a chain) or with static trees."""

from __future__ import annotations

from methods.dflash.config import DFlashConfig
from methods.method import STATIC_TREES, Layout, Method

_G = "methods.dflash.gates"
_SPECULATORS = Layout(f"{_G}:speculators_dflash_gate", "methods.dflash.layouts:write_speculators_dflash")

METHOD = Method(
    "dflash",
    DFlashConfig,
    "methods.dflash.model:DFlashDrafter",
    inputs="features",
    proposer="methods.dflash.proposer:build_dflash_proposer",
    trees=STATIC_TREES,
    formats={
        "native": Layout(f"{_G}:native_dflash_gate"),
        "speculators": _SPECULATORS,
        "vllm": _SPECULATORS,  # vLLM's `dflash` reads the speculators layout
    },
    calibration="methods.dflash.proposer:dflash_calibration",
)
