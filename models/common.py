"""Contracts shared by every drafter: the batch it trains on and the frozen target parts it borrows; and the file
mode of the safetensors files the project writes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch
from torch import nn


class DrafterInputError(ValueError):
    """A file a drafter config names (Medusa-2's `stage1_heads`) that cannot be used; the message names the key."""


class DraftBatch(TypedDict, total=False):
    """One micro-batch as the training loop hands it to `drafter(batch)`.

    Offline batches come from feature shards; online batches get `hidden` from the target inside
    the step (or, for drafters with `consumes == "tokens"`, carry tokens only).
    """

    input_ids: torch.Tensor  # (B, T) int64
    loss_mask: torch.Tensor  # (B, T) float32, 1 on assistant tokens (the tokens to be predicted)
    attention_mask: torch.Tensor  # (B, T) int64, 1 on real tokens, 0 on padding
    position_ids: torch.Tensor  # (B, T) int64, restarts at 0 at every packed sample
    hidden: torch.Tensor  # (B, T, n_stored, d) target hidden states at the stored layers
    # offline, when the feature set stores them (data.target_stats): the target's top-1 id and the logsumexp of its
    # logits at every loss position, so that a drafter with a draft vocabulary applies only those rows of its head
    target_top1: torch.Tensor  # (B, T) int64, -1 where not stored
    target_lse: torch.Tensor  # (B, T) float32, NaN where not stored


@dataclass
class TargetParts:
    """The frozen pieces of the target a drafter reuses (never trained, never exported by default).

    Drafters hold `embed_tokens` / `lm_head` through `FrozenRef`, never as registered submodules, so that
    checkpoints, `.to()`, optimizers, DDP and ZeRO-3 only ever see the drafter's own tensors.

    `config` is the target's transformers config (hidden_size, vocab_size, rope, heads...);
    `stored_layers` lists the hidden-state indices present in `DraftBatch.hidden`, in order;
    `model` is the whole frozen HF model, for drafters that run the target themselves (Medusa-2);
    `vocab_ids` is set when `lm_head` covers a subset of the vocabulary (training with `train.loss_vocab`):
    row i of `lm_head` scores target token `vocab_ids[i]`.
    """

    config: object
    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    stored_layers: list[int]
    model: nn.Module | None = None
    vocab_ids: torch.Tensor | None = None

    def restricted(self, vocab_ids: torch.Tensor) -> TargetParts:
        """The same parts with an lm_head that scores only the tokens `vocab_ids` (K,): a frozen (K, d) copy."""
        head = self.lm_head
        sub = nn.Linear(head.in_features, len(vocab_ids), bias=head.bias is not None)
        sub = sub.to(device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            sub.weight.copy_(head.weight[vocab_ids.to(head.weight.device)])
            if head.bias is not None:
                sub.bias.copy_(head.bias[vocab_ids.to(head.weight.device)])
        return TargetParts(
            self.config, self.embed_tokens, sub.requires_grad_(False), self.stored_layers, self.model, vocab_ids
        )


class FrozenRef:
    """A module borrowed from the frozen target, hidden from nn.Module registration: not in state_dict(),
    parameters(), .to(), .train(), DDP/ZeRO partitioning or checkpoints. The target owns (and places) it.

    A drafter stores it as `self._name = FrozenRef(module)` (with a `name` property returning `.module`);
    `borrowed_state_dict` then names its tensors `name.*`, as if it were registered.
    """

    def __init__(self, module: nn.Module):
        self.module = module.requires_grad_(False)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def borrowed_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of every FrozenRef held in `module`'s tree, under the names they would have if registered
    (attribute `_lm_head` of submodule `heads` -> `heads.lm_head.weight`): exports that include target weights."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for attr, ref in vars(sub).items():
            if isinstance(ref, FrozenRef):
                name = f"{prefix}.{attr.lstrip('_')}" if prefix else attr.lstrip("_")
                out.update({f"{name}.{k}": v for k, v in ref.module.state_dict().items()})
    return out


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) id of the packed sample each token belongs to (a new sample starts at position 0)."""
    return torch.cumsum((position_ids == 0).long(), dim=-1)


def packed_causal_mask(batch: DraftBatch) -> torch.Tensor:
    """(B, T, T) bool, [b, q, k] = query q may attend to key k: causal within each packed sample, never to padding.

    Samples are found from `position_ids` restarting at 0 (`segment_ids`), padding from `attention_mask`. The
    diagonal is always allowed, padding included, so that no softmax row is all masked (NaN); padding outputs are
    never used.
    """
    seg = segment_ids(batch["position_ids"])  # (B, T)
    real = batch["attention_mask"].bool()  # (B, T)
    T = seg.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()  # (T, T)
    allowed = causal & (seg[:, :, None] == seg[:, None, :]) & real[:, None, :]  # (B, T, T)
    return allowed | torch.eye(T, dtype=torch.bool, device=seg.device)


def packed_additive_mask(batch: DraftBatch, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, T) `packed_causal_mask` as the additive mask HF decoders take: 0 where allowed, else dtype's minimum.

    A 4D mask keeps packed samples apart (from a 2D padding mask the model would build one causal mask per row).
    """
    allowed = packed_causal_mask(batch)  # (B, T, T)
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def shifted_valid(batch: DraftBatch, shift: int) -> torch.Tensor:
    """(B, T) bool: position t has a target token at t+shift in the same sample, and it is a loss token.

    This is the mask every drafter loss uses: predicting token t+shift from position t.
    """
    mask = batch["loss_mask"]
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.bool, device=mask.device)
    if shift >= T:
        return out
    seg = segment_ids(batch["position_ids"])
    real = batch["attention_mask"].bool()
    same = (seg[:, shift:] == seg[:, :-shift]) & real[:, shift:] & real[:, :-shift]
    out[:, :-shift] = same & (mask[:, shift:] > 0)
    return out


DrafterOutput = dict[str, torch.Tensor]
"""What `drafter(batch)` returns: `"loss"` (scalar; per-token losses summed over the batch and divided
by the batch's number of loss tokens, `loss_mask.sum()`, so the loop can renormalise exactly across
micro-batches and processes) plus scalar metrics (means over the batch), e.g. `"acc@1/head1"`."""


def num_loss_tokens(batch: DraftBatch) -> torch.Tensor:
    """The normaliser every drafter loss uses: number of loss (assistant) tokens in the batch, at least 1."""
    return batch["loss_mask"].sum().clamp_min(1.0)


def share_safetensors(path: str | Path) -> None:
    """Give a safetensors file (or every one under a directory) the mode any new file gets under the umask (0644
    under the usual 022). safetensors creates its files readable by their owner only (0600), so a serving engine
    running as another user could not read an export."""
    path = Path(path)
    mask = os.umask(0)
    os.umask(mask)
    for file in [path] if path.is_file() else sorted(path.rglob("*.safetensors")):
        file.chmod(0o666 & ~mask)
