"""Medusa heads: K extra decoding heads on the frozen target's last hidden state.

    python -m train recipes/tiny/medusa1.yaml      # trains MedusaHeads from feature shards

`MedusaHeads(cfg, target)(batch)` returns the λ-weighted multi-head loss and per-head metrics;
`MedusaHeads.head_logits(hidden)` is the evaluation / Medusa-2 entry point (any hidden states,
e.g. from a live LoRA backbone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from methods.medusa1.config import MedusaConfig
from models.common import DraftBatch, DrafterOutput, FrozenRef, TargetParts, num_loss_tokens, shifted_valid
from models.lm_head import FACTORS_NAME, DraftHead, unbiased_weight


class ResidualStack(nn.Module):
    """L residual blocks `h <- h + SiLU(W1 h + b1)`; W1 starts at zero so a fresh head is the identity."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        # One nn.Linear per block (upstream Medusa's `[ResBlock(d)] * L` shares one block L times).
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + F.silu(layer(h))  # (..., d)
        return h


class MedusaHeads(nn.Module):
    """Medusa-1 (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
    Decoding Heads").

    K heads sit on the frozen target's last hidden state h_t (the input of its lm_head). Head k
    (1-based) is a stack of L residual SiLU blocks followed by a vocabulary projection initialised
    from the target's lm_head, and predicts token x_{t+k+1}: the target itself already predicts
    x_{t+1}, so head 1 guesses one token further. Training is cross-entropy per head, weighted
    λ_k = decay^k (k = 1..K) because later heads are less accurate and matter less for acceptance:
    `loss = Σ_k λ_k Σ_{t valid for k} CE(head_k(h_t), x_{t+k+1}) / num_loss_tokens`, where t is valid
    for head k when x_{t+k+1} is an assistant token of the same sample. Zero-initialised W1 makes
    each head start as the target's next-token head applied to h_t + SiLU(b1) (a constant shift), which
    then learns to look further ahead.
    At evaluation the heads' top-k choices form a static tree verified by the target.
    """

    def __init__(self, cfg: MedusaConfig, target: TargetParts):
        super().__init__()
        self.cfg = cfg
        self.stored_layers = list(target.stored_layers)
        d = target.config.hidden_size
        self.blocks = nn.ModuleList(ResidualStack(d, cfg.num_layers) for _ in range(cfg.num_heads))
        if cfg.share_lm_head:
            # The target's frozen lm_head, borrowed by reference and not registered (not in state_dict, .to(), ZeRO).
            self._lm_head = FrozenRef(target.lm_head)
            self.lm_heads = None
        else:
            self._lm_head = None
            self.lm_heads = nn.ModuleList(_copy_linear(target.lm_head) for _ in range(cfg.num_heads))
        # Training over a vocabulary subset (train.loss_vocab): token id -> row of the projection, -1 outside.
        rows = None
        if target.vocab_ids is not None:
            rows = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
            rows[target.vocab_ids.cpu()] = torch.arange(len(target.vocab_ids))
        self.register_buffer("label_rows", rows, persistent=False)

    # ---------------------------------------------------------------------------------------
    # Heads on any hidden states (evaluation, Medusa-2 on a live backbone)

    def head(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of head k (1-based) for hidden states (..., d) -> (..., V), on hidden's device (a shared lm_head of a
        `device_map` target can sit on another GPU)."""
        projection = self.projection(k)
        return projection(self.head_state(k, hidden).to(projection.weight.dtype)).to(hidden.device)  # (..., V)

    def head_state(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head k's residual blocks on hidden states (..., d) -> (..., d): what its vocabulary projection reads."""
        return self.blocks[k - 1](hidden.to(self.compute_dtype))

    def projection(self, k: int) -> nn.Linear:
        """Head k's vocabulary projection: its own lm_head copy, or the shared frozen target lm_head."""
        return self.lm_heads[k - 1] if self.lm_heads is not None else self.lm_head

    def head_logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Heads 1..num_heads (default: all K) on last hidden states (B, T, d) -> (num_heads, B, T, V); head k predicts
        token t+k+1. Decoding asks only for the heads its tree reaches: each head ends in a vocabulary projection."""
        num_heads = self.cfg.num_heads if num_heads is None else num_heads
        return torch.stack([self.head(k, hidden) for k in range(1, num_heads + 1)])

    @property
    def lm_head(self) -> nn.Linear | None:
        """share_lm_head: the target's frozen lm_head (borrowed, not a submodule); else None."""
        return None if self._lm_head is None else self._lm_head.module

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.blocks[0].layers[0].weight.dtype

    # ---------------------------------------------------------------------------------------
    # Training on a feature batch

    def forward(self, batch: DraftBatch) -> DrafterOutput:
        hidden = batch["hidden"][:, :, self.stored_layers.index(-1)]  # (B, T, d)
        ids = batch["input_ids"]  # (B, T)
        n_loss = num_loss_tokens(batch)
        loss = hidden.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        for k in range(1, self.cfg.num_heads + 1):
            shift = k + 1
            valid = shifted_valid(batch, shift)[:, :-shift]  # (B, T - shift): x_{t+k+1} is a loss token
            labels = ids[:, shift:]  # (B, T - shift)
            if self.label_rows is not None:
                labels = self.label_rows[labels]
                valid = valid & (labels >= 0)  # a label outside the loss vocabulary teaches nothing here
            # Only valid positions go through the head: the (N, V) logits dominate memory.
            logits = self.head(k, hidden[:, :-shift][valid]).float()  # (N, V)
            labels = labels[valid]  # (N,)
            ce = F.cross_entropy(logits, labels, reduction="sum")
            loss = loss + self.cfg.decay**k * ce
            with torch.no_grad():
                n_valid = labels.numel() or 1
                top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # (N, 5)
                hit = top == labels[:, None]
                metrics[f"loss/head{k}"] = ce.detach() / n_loss
                metrics[f"acc@1/head{k}"] = hit[:, 0].sum() / n_valid
                metrics[f"acc@5/head{k}"] = hit.any(-1).sum() / n_valid
        return {"loss": loss / n_loss, **metrics}

    # ---------------------------------------------------------------------------------------
    # What the training loop needs

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Trained tensors only (the shared frozen lm_head is the target's and is never saved here)."""
        return {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}

    def is_head_param(self, name: str) -> bool:
        """Every trainable Medusa parameter belongs to a head (Medusa-2 gives heads an LR multiplier)."""
        return name.startswith(("blocks.", "lm_heads."))

    def draft_heads(self) -> list[DraftHead]:
        """Each head's vocabulary projection, for the two-stage head: head k's fitted to its residual blocks' output
        on the last hidden states where its loss is taken (what that projection reads)."""
        slot = self.stored_layers.index(-1)

        def head(k: int) -> DraftHead:
            @torch.no_grad()
            def inputs(sample: dict) -> torch.Tensor:
                scored = sample["loss_mask"][k + 1 :] > 0  # head k at t predicts token t+k+1
                last = sample["hidden"][: -k - 1, slot][scored]  # (N, d)
                return self.head_state(k, last.to(self.blocks[0].layers[0].weight.device)).float().cpu()

            weight = unbiased_weight(self.projection(k), f"head {k}'s lm_head")
            return DraftHead(f"{FACTORS_NAME}-head{k}", weight, None, inputs)

        return [head(k) for k in range(1, self.cfg.num_heads + 1)]


def _copy_linear(src: nn.Linear) -> nn.Linear:
    """A trainable float copy of a (frozen) linear layer."""
    dst = nn.Linear(src.in_features, src.out_features, bias=src.bias is not None)
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        if src.bias is not None:
            dst.bias.copy_(src.bias)
    return dst
