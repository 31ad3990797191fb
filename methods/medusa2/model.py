"""Medusa-2: Medusa heads trained jointly with a LoRA-adapted target, online (the target runs in the step).

    python -m train recipes/tiny/medusa1.yaml train.online=true                  # stage 1: heads alone
    python -m train recipes/tiny/medusa2.yaml drafter.stage1_heads=runs/tiny-medusa1/export   # stage 2
    python -m export runs/tiny-medusa2 [--merge-lora]                      # heads/ + adapter/ (+ merged/)

`Medusa2Model(cfg, target.parts(...))(batch)` takes token batches (its method declares `inputs="tokens"`) and returns
`L_base + α(step)·head_loss_coef·Σ_k λ_k CE_k` with metrics; `set_step(step)` tells it the optimizer step
(the α warm-up). For evaluation, `drafter.adapt_target(target)` merges the LoRA into the target and returns
the heads, used exactly like Medusa-1 heads on it (`load_medusa2(export_dir, target)` does both).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from methods.medusa1.model import MedusaHeads
from methods.medusa2.config import Medusa2Config, stage1_form
from models.common import (
    DraftBatch,
    DrafterInputError,
    DrafterOutput,
    TargetParts,
    num_loss_tokens,
    packed_additive_mask,
    shifted_valid,
)

ADAPTER_DIR, HEADS_DIR, MERGED_DIR = "adapter", "heads", "merged"


class Medusa2Model(nn.Module):
    """Medusa-2 (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
    Decoding Heads", §2.3.2) with the backbone fine-tuned through LoRA (Hu et al., 2021).

    Medusa-1 heads (methods/medusa1/model.py) sit on the last hidden state of the target, whose decoder now carries
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

    def __init__(self, cfg: Medusa2Config, target: TargetParts):
        super().__init__()
        if target.model is None:
            raise ValueError("Medusa2Model needs the live target model (TargetParts.model, from Target.parts)")
        from peft import LoraConfig, get_peft_model  # here: recipe validation imports Medusa2Config, not peft

        tied = {"lm_head", "embed_tokens"} & set(cfg.lora_target_modules)
        if tied and getattr(target.model.config, "tie_word_embeddings", False):
            raise DrafterInputError(
                f"drafter.lora_target_modules: {sorted(tied)} of a target with tied embeddings: merging the adapter "
                "would change the one shared matrix, so both the input embedding and the lm_head; leave it out"
            )
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
        self.cfg = cfg.without_inputs()
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
        from models.io import add_legacy_rope, save_native, share_safetensors

        out = Path(out_dir)
        save_native(out / HEADS_DIR, self.heads, target)
        self.peft_model.save_pretrained(str(out / ADAPTER_DIR), safe_serialization=True)
        if merge_lora:
            merged = self.merged_model()
            merged.save_pretrained(str(out / MERGED_DIR), safe_serialization=True)
            add_legacy_rope(out / MERGED_DIR)  # for serving stacks on transformers 4
            if target.tokenizer is not None:
                target.tokenizer.save_pretrained(str(out / MERGED_DIR))
        share_safetensors(out)  # peft and transformers write them readable by their owner only

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
    from models.io import load_drafter

    drafter = load_drafter(export_dir, target)
    if not isinstance(drafter, Medusa2Model):
        raise ValueError(f"{export_dir}: a {type(drafter).__name__} export, not Medusa-2")
    if not merge:
        return drafter.adapted.eval(), drafter.heads
    return target.model, drafter.adapt_target(target)
