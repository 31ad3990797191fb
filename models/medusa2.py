"""Medusa-2: Medusa heads trained jointly with a LoRA-adapted target, online (the target runs in the step).

    python -m train recipes/tiny/medusa1.yaml train.online=true                  # stage 1: heads alone
    python -m train recipes/tiny/medusa2.yaml drafter.stage1_heads=runs/tiny-medusa1/export   # stage 2
    python -m train.export runs/tiny-medusa2 [--merge-lora]                      # heads/ + adapter/ (+ merged/)

`Medusa2Model(cfg, target.parts(...))(batch)` takes token batches (`consumes = "tokens"`) and returns
`L_base + α(step)·head_loss_coef·Σ_k λ_k CE_k` with metrics; `set_step(step)` tells it the optimizer step
(the α warm-up). For evaluation, `drafter.adapt_target(target)` merges the LoRA into the target and returns
the heads, used exactly like Medusa-1 heads on it (`load_medusa2(export_dir, target)` does both).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from models.common import (
    DraftBatch,
    DrafterInputError,
    DrafterOutput,
    TargetParts,
    num_loss_tokens,
    packed_additive_mask,
    shifted_valid,
)
from models.medusa import MedusaConfig, MedusaHeads

LLAMA_LINEAR_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_DIR, HEADS_DIR, MERGED_DIR = "adapter", "heads", "merged"


@dataclass
class Medusa2Config:
    """Medusa-2 (recipe section `drafter`, `method: medusa2`); needs `train.online: true`."""

    method: Literal["medusa2"] = "medusa2"
    num_heads: int = 5
    """K: head k (1-based) predicts token t+k+1 (as Medusa-1)."""
    num_layers: int = 1
    """L: residual blocks per head (as Medusa-1)."""
    decay: float = 0.8
    """λ_k = decay**k for head k = 1..K (as Medusa-1)."""
    share_lm_head: bool = False
    """True: the heads project with the target's frozen lm_head (as Medusa-1; must match the stage-1 heads)."""
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

    @property
    def feature_layers(self) -> list[int]:
        """The heads read the (adapted) target's last hidden state, computed inside the step."""
        return [-1]

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
        self.heads_config().validate(err)
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

    def check_inputs(self, err) -> None:
        """Before training: the stage-1 heads exist in one of the forms `load_stage1_heads` reads."""
        if self.stage1_heads is not None:
            stage1_form(Path(self.stage1_heads), lambda msg: err("drafter.stage1_heads", msg))

    def check_recipe(self, recipe, err) -> None:
        if not recipe.train.online:
            err("train.online", "medusa2 trains the backbone, so it runs online: set train.online: true")
        self.heads_config().check_recipe(recipe, err)


class Medusa2Model(nn.Module):
    """Medusa-2 (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
    Decoding Heads", §2.3.2) with the backbone fine-tuned through LoRA (Hu et al., 2021).

    Medusa-1 heads (models/medusa.py) sit on the last hidden state of the target, whose decoder now carries
    trainable LoRA adapters; heads and adapters train together on
    `loss = L_base + α(step)·head_loss_coef·Σ_k λ_k CE_k`, all sums over loss tokens divided by their number.
    L_base keeps the backbone a good next-token model: CE on the next token, or under self-distillation
    `KL(p_teacher ‖ p_student)` of the base head, the teacher being the same weights with adapters disabled
    (one extra no-grad forward, no second copy of the model). Two stages: heads alone (Medusa-1), then joint
    training starting from them (`stage1_heads`); α warms up so that the heads' large early losses do not
    disturb the backbone, and the heads' learning rate is multiplied (`train.head_lr_mult`, 4 in the Medusa-2
    trainer) so that they keep learning while the backbone moves slowly.

    The target's weights are shared, never copied: the adapters go into a copy of the target's module tree
    whose parameters are the target's own tensors, so the loop's target stays the original model (until
    `adapt_target` merges the adapters into it for evaluation).
    """

    consumes = "tokens"

    def __init__(self, cfg: Medusa2Config, target: TargetParts):
        super().__init__()
        if target.model is None:
            raise ValueError("Medusa2Model needs the live target model (TargetParts.model, from Target.parts)")
        from peft import LoraConfig, get_peft_model  # here: recipe validation imports Medusa2Config, not peft

        backbone = _shared_weights_copy(target.model)
        if cfg.gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.peft_model = get_peft_model(backbone, lora)
        self.stored_layers = [-1]
        heads_parts = dataclasses.replace(target, stored_layers=[-1], model=None)
        self.heads = MedusaHeads(cfg.heads_config(), heads_parts)
        if cfg.stage1_heads is not None:
            load_stage1_heads(self.heads, cfg.stage1_heads)
        # The loaded heads are now this module's own weights: exports record a config that rebuilds it without them.
        self.cfg = dataclasses.replace(cfg, stage1_heads=None)
        self.step = 0
        self.train()  # the target arrives in eval mode; LoRA dropout follows the module's mode from here on

    # ---------------------------------------------------------------------------------------
    # The adapted target

    @property
    def adapted(self) -> nn.Module:
        """The HF causal LM with LoRA layers injected (adapters active unless inside `disable_adapter`)."""
        return self.peft_model.get_base_model()

    def last_hidden(self, batch: DraftBatch) -> torch.Tensor:
        """(B, T, d) last hidden state (after the final norm) of the adapted target on a (packed) token batch."""
        model = self.adapted
        mask = packed_additive_mask(batch, model.dtype)  # (B, 1, T, T)
        out = model.base_model(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"], use_cache=False
        )
        return out.last_hidden_state

    def head_logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Heads 1..num_heads (default all): (B, T, d) -> (num_heads, B, T, V), as `MedusaHeads.head_logits`."""
        return self.heads.head_logits(hidden, num_heads)

    def set_step(self, step: int) -> None:
        """Number of optimizer steps done so far; sets the head-loss weight α(step). Called by the loop."""
        self.step = step

    # ---------------------------------------------------------------------------------------
    # Training on a token batch

    def forward(self, batch: DraftBatch) -> DrafterOutput:
        ids = batch["input_ids"]  # (B, T)
        n_loss = num_loss_tokens(batch)
        lm_head = self.adapted.get_output_embeddings()
        hidden = self.last_hidden(batch)  # (B, T, d)
        valid = shifted_valid(batch, 1)[:, :-1]  # (B, T-1): x_{t+1} is a loss token of the same sample
        logits = lm_head(hidden[:, :-1][valid]).float()  # (N, V): only loss positions reach the vocab projection
        labels = ids[:, 1:][valid]  # (N,)
        metrics: dict[str, torch.Tensor] = {}
        if self.cfg.self_distill:
            with torch.no_grad(), self.peft_model.disable_adapter():
                teacher = lm_head(self.last_hidden(batch)[:, :-1][valid]).float()  # (N, V)
            base = F.kl_div(logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="sum")
            metrics["kl/base"] = base.detach() / n_loss
        else:
            base = F.cross_entropy(logits, labels, reduction="sum")
            metrics["loss/base"] = base.detach() / n_loss
        heads = self.heads({**batch, "hidden": hidden[:, :, None]})  # per-head metrics
        heads_loss = heads.pop("loss")  # Σ_k λ_k CE_k / n_loss
        alpha = self.cfg.alpha(self.step)
        loss = base / n_loss + alpha * self.cfg.head_loss_coef * heads_loss
        with torch.no_grad():
            metrics["acc@1/base"] = (logits.argmax(-1) == labels).sum() / max(labels.numel(), 1)
            metrics["loss/heads"] = heads_loss.detach()
            metrics["alpha"] = torch.tensor(alpha, device=loss.device)
        return {"loss": loss, **metrics, **heads}

    # ---------------------------------------------------------------------------------------
    # What the training loop and exports need

    def trainable_parameter_names(self) -> list[str]:
        return [name for name, p in self.named_parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """LoRA adapters and heads (the frozen backbone is the target's and is never saved here)."""
        return {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}

    def is_head_param(self, name: str) -> bool:
        """Heads get `train.head_lr_mult` times the LoRA learning rate."""
        return name.startswith("heads.")

    def export_extra(self, out_dir: str | Path, target, merge_lora: bool = False) -> None:
        """Interoperable files next to the native export: `heads/` (a Medusa-1 native export, loadable with
        `models.io.load_drafter`), `adapter/` (peft: adapter_config.json + adapter_model.safetensors) and,
        with `merge_lora`, `merged/` (the target with the adapters merged in, HF safetensors)."""
        from models.io import save_native  # models.io imports DRAFTERS, which imports this module

        out = Path(out_dir)
        save_native(out / HEADS_DIR, self.heads, target)
        self.peft_model.save_pretrained(str(out / ADAPTER_DIR), safe_serialization=True)
        if merge_lora:
            merged = self.merged_model()
            merged.save_pretrained(str(out / MERGED_DIR), safe_serialization=True)
            if target.tokenizer is not None:
                target.tokenizer.save_pretrained(str(out / MERGED_DIR))

    def adapt_target(self, target) -> MedusaHeads:
        """For evaluation: merge the adapters into `target.model`'s own weights (in place) and return the heads.

        Everything that then runs `target` (verification, tree calibration, plain-decoding baselines) runs the
        Medusa-2 model, on which the heads are used exactly like Medusa-1 heads. This module is spent afterwards.
        """
        if self.adapted.get_input_embeddings().weight is not target.model.get_input_embeddings().weight:
            raise ValueError("adapt_target: this Medusa2Model was not built on this target")
        self.peft_model.merge_and_unload()  # writes W + BA·scale into the shared tensors: target.model's
        return self.heads.eval()

    def merged_model(self) -> nn.Module:
        """A standalone HF model with the adapters merged into (a full copy of) the weights."""
        return copy.deepcopy(self.peft_model).merge_and_unload().eval()


# --------------------------------------------------------------------------------------------
# Helpers


def _shared_weights_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the original tensors (no weight memory).

    peft replaces adapted Linear modules in place; doing that on this copy leaves the original model intact.
    """
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


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


def load_stage1_heads(heads: MedusaHeads, path: str | Path) -> None:
    """Load Medusa-1 heads (stage 1) into `heads` exactly: same tensor names and shapes, else DrafterInputError."""
    path = Path(path)
    where = f"drafter.stage1_heads: {path}"

    def fail(msg: str) -> typing.NoReturn:
        raise DrafterInputError(f"drafter.stage1_heads: {msg}")

    file = stage1_form(path, fail)
    try:
        state = load_file(str(file))
    except Exception as exc:  # safetensors' own error: a truncated or foreign file
        raise DrafterInputError(f"{where}: {file} is not a readable safetensors file ({exc})") from None
    want = heads.state_dict()
    missing, unexpected = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    cfg = heads.cfg
    shape = f"num_heads={cfg.num_heads}, num_layers={cfg.num_layers}, share_lm_head={str(cfg.share_lm_head).lower()}"
    if missing or unexpected:
        raise DrafterInputError(
            f"{where}: {file.name} does not hold Medusa-1 heads with {shape}: "
            f"missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for name, tensor in state.items():
        if tensor.shape != want[name].shape:
            raise DrafterInputError(
                f"{where}: {file.name}: {name} has shape {tuple(tensor.shape)}, expected {tuple(want[name].shape)}"
            )
    heads.load_state_dict(state, strict=True)


def load_medusa2(export_dir: str | Path, target, merge: bool = True) -> tuple[nn.Module, MedusaHeads]:
    """(verifying model, heads) of a Medusa-2 native export, for evaluation: Medusa-1 heads on the adapted target.

    `merge`: the adapters are merged into `target.model` in place (`Medusa2Model.adapt_target`) and the verifier
    is `target.model`; else the verifier is a weight-sharing copy with the adapters attached, `target` untouched.
    """
    from models.io import load_drafter  # models.io imports DRAFTERS, which imports this module

    drafter = load_drafter(export_dir, target)
    if not isinstance(drafter, Medusa2Model):
        raise ValueError(f"{export_dir}: a {type(drafter).__name__} export, not Medusa-2")
    if not merge:
        return drafter.adapted.eval(), drafter.heads
    return target.model, drafter.adapt_target(target)
