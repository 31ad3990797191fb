"""AdamW with parameter groups, and the linear warm-up + cosine learning-rate schedule.

    optimizer = build_optimizer(drafter, recipe.train)
    scheduler = build_scheduler(optimizer, recipe.train)  # step it once per optimizer step

Groups: matrices get weight decay, vectors (norm weights, biases) do not; parameters the drafter
marks as heads (`is_head_param(name)`) get `lr * head_lr_mult` (Medusa-2 trains its heads 4x
faster than the LoRA backbone). Frozen parameters are left out.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from schema.sections import TrainConfig


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """AdamW groups keyed by (weight decay?, head?); empty groups are dropped, order is stable."""
    buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = param.ndim >= 2
        buckets.setdefault((decay, model.is_head_param(name)), []).append(param)
    groups = []
    for (decay, head), params in sorted(buckets.items()):
        lr = cfg.lr * (cfg.head_lr_mult if head else 1.0)
        groups.append({"params": params, "weight_decay": cfg.weight_decay if decay else 0.0, "lr": lr})
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    return groups


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


class WarmupCosine:
    """LR factor after `step` optimizer steps: linear warm-up to 1 over `warmup` steps, then cosine to 0 at `total`."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(cfg.warmup_steps, cfg.max_steps))


def reschedule(scheduler: LambdaLR, warmup: int, total: int) -> bool:
    """Point a restored schedule at these warm-up / total steps (a resumed run whose recipe changed
    `train.warmup_steps` or `train.max_steps`, e.g. to train longer): the learning rate continues from the saved step
    on the new curve. Returns whether anything changed."""
    changed = False
    for schedule in scheduler.lr_lambdas:
        if (schedule.warmup, schedule.total) != (warmup, total):
            schedule.warmup, schedule.total = warmup, total
            changed = True
    if changed:
        step = scheduler.last_epoch
        groups = scheduler.optimizer.param_groups
        for group, base, schedule in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * schedule(step)
        scheduler._last_lr = [group["lr"] for group in groups]
    return changed
