"""Medusa-2's recipe section (`drafter`, `method: medusa2`): Medusa-1's head fields and the LoRA backbone's, and where
its stage-1 heads are read from (`stage1_form`). No torch."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from methods.limits import LLAMA_LINEAR_LAYERS, MAX_RANK, at_most
from methods.medusa1.config import MedusaConfig


@dataclass
class Medusa2Config(MedusaConfig):
    """Medusa-2 (recipe section `drafter`, `method: medusa2`): Medusa-1's head fields (with `share_lm_head` matching
    the stage-1 heads) plus the LoRA backbone's; runs online only."""

    method: Literal["medusa2"] = "medusa2"
    lora_r: int = 32
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: list(LLAMA_LINEAR_LAYERS))
    """Module names that get LoRA adapters (defaults: every linear layer of a Llama-style decoder)."""
    self_distill: bool = False
    """L_base = KL(p_target ‖ p_adapted) (teacher = the same weights with adapters off) instead of next-token CE:
    for self-distilled data, where the paper finds hard-label CE degrades the model; the KL keeps its distribution."""
    head_loss_coef: float = 0.2
    """Weight of the head losses against L_base. The Medusa paper uses 0.2, and 0.01 under self-distillation
    (the KL term is much smaller than a CE, so the heads would otherwise dominate the backbone's updates)."""
    alpha_schedule: Literal["constant", "linear", "sine"] = "constant"
    """Warm-up of the head-loss weight α(step) from 0 to 1 over alpha_warmup_steps (constant: always 1)."""
    alpha_warmup_steps: int = 0
    stage1_heads: str | None = None
    """Stage 2 starts from these Medusa-1 heads: a native export directory (config.json + model.safetensors),
    a checkpoint directory (drafter.safetensors) or a .safetensors file; null = fresh heads."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in backward (large targets, long sequences)."""

    def heads_config(self) -> MedusaConfig:
        return MedusaConfig(
            num_heads=self.num_heads, num_layers=self.num_layers, decay=self.decay, share_lm_head=self.share_lm_head
        )

    def alpha(self, step: int) -> float:
        """α(step) ∈ [0, 1] after `step` optimizer steps (the head-loss warm-up of the Medusa-2 trainer)."""
        if self.alpha_schedule == "constant" or self.alpha_warmup_steps == 0:
            return 1.0
        x = min(1.0, step / self.alpha_warmup_steps)
        return x if self.alpha_schedule == "linear" else math.sin(0.5 * math.pi * x)

    def validate(self, err) -> None:
        super().validate(err)
        if self.lora_r < 1:
            err("drafter.lora_r", f"must be >= 1, got {self.lora_r}")
        if self.lora_alpha < 1:
            err("drafter.lora_alpha", f"must be >= 1, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            err("drafter.lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_target_modules:
            err("drafter.lora_target_modules", "must name at least one module (e.g. q_proj)")
        if self.head_loss_coef < 0:
            err("drafter.head_loss_coef", f"must be >= 0, got {self.head_loss_coef}")
        if self.alpha_warmup_steps < 0:
            err("drafter.alpha_warmup_steps", f"must be >= 0, got {self.alpha_warmup_steps}")
        at_most(err, "drafter.lora_r", self.lora_r, MAX_RANK)

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`): Medusa-1's and the LoRA rank."""
        return {**super().target_sized(), "lora_r": self.lora_r}

    def without_inputs(self) -> Medusa2Config:
        """Without its stage-1 heads: what rebuilds a drafter whose trained tensors come from elsewhere (a checkpoint,
        an export), which hold the heads trained on from them."""
        return dataclasses.replace(self, stage1_heads=None)

    def check_inputs(self, err) -> None:
        """Before training: the stage-1 heads exist in one of the forms `load_stage1_heads` reads."""
        if self.stage1_heads is not None:
            stage1_form(Path(self.stage1_heads), lambda msg: err("drafter.stage1_heads", msg))


def stage1_form(path: Path, fail) -> Path:
    """The safetensors file of stage-1 heads at `path` (export, checkpoint or file); else `fail(message)`."""
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            fail(f"{path / 'config.json'}: not valid JSON ({exc})")
        if not isinstance(config, dict) or config.get("method") != "medusa1":
            method = config.get("method") if isinstance(config, dict) else None
            fail(f"{path}: an export of method {method!r}, expected medusa1 heads")
        return path / "model.safetensors"
    if (path / "drafter.safetensors").is_file():
        return path / "drafter.safetensors"
    if path.is_file() and path.suffix == ".safetensors":
        return path
    if not path.exists():
        fail(f"{path}: not a Medusa-1 export: no such file or directory (train stage 1 and export it first)")
    fail(
        f"{path}: not a Medusa-1 export (config.json + model.safetensors), checkpoint (drafter.safetensors) "
        "or .safetensors file"
    )
