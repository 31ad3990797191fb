"""DFlash at evaluation: one drafter forward per round drafts every depth of a static tree (a chain by default, as
vLLM drafts it), and the calibration of its trees."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eval.proposal import DecodeState, Proposer
from eval.static_proposers import StaticTreeProposer, static_tree
from eval.trees import Tree


class DFlashProposer(StaticTreeProposer):
    """Each round, per row: the target features of the positions verified since the last round become every layer's
    context keys and values (appended to the row's own), then one block after the root (the last verified token)
    drafts; slot k's top-k tokens fill depth k of the tree. The block always has all `block_size - 1` mask slots, as
    in training (slots attend to each other), whatever the tree's depth."""

    def __init__(self, drafter: torch.nn.Module, tree: Tree, total_tokens: int | None = None):
        if tree.max_depth > drafter.cfg.block_size - 1:
            raise ValueError(
                f"tree depth {tree.max_depth} exceeds the tokens one drafter forward drafts "
                f"(drafter.block_size - 1: {drafter.cfg.block_size - 1})"
            )
        super().__init__(tree, total_tokens)
        self.drafter = drafter
        self.feature_layers = list(drafter.stored_layers)
        self.reset(1)

    def reset(self, batch_size: int) -> None:
        self.context: list[list | None] = [None] * batch_size  # per row: every layer's (k, v) of its verified prefix

    def keep_rows(self, rows: list[int]) -> None:
        self.context = [self.context[r] for r in rows]

    @torch.inference_mode()
    def depth_topk(self, states: Sequence[DecodeState]) -> tuple[torch.Tensor, torch.Tensor]:
        D, ids, logp = self.tree.max_depth, [], []
        for b, state in enumerate(states):
            n, p = state.new_hidden.shape[1], state.prefix_len
            positions = torch.arange(p - n, p, device=state.new_hidden.device)[None]
            new = self.drafter.context_kv(self.drafter.context(state.new_hidden), positions)
            old = self.context[b]
            if old is not None:
                new = [(torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2)) for (k0, v0), (k, v) in zip(old, new)]
            self.context[b] = new
            root = state.tokens[0, -1:].to(state.new_hidden.device)
            normed = self.drafter.draft_block(root, p, new)[0, :D]  # (D, d)
            logits = self.drafter.lm_head(normed.to(self.drafter.lm_head.weight.dtype)).float()  # (D, V)
            top = logits.topk(self.top_k, dim=-1)
            ids.append(top.indices)
            logp.append(top.values - logits.logsumexp(dim=-1, keepdim=True))
        return torch.stack(ids), torch.stack(logp)


def build_dflash_proposer(
    method, drafter: torch.nn.Module, ev, calibrate, draft_vocab=None, window=None
) -> tuple[Proposer, str]:
    """DFlash's static tree over the depths of one forward (`eval.tree`: chain by default, as vLLM drafts; calibrated,
    named or cost-aware trees from the per-slot top-k). The recipe schema refuses a draft vocabulary for it; a
    sliding window is not applied (the drafter attends to its whole context)."""
    static, desc = static_tree(ev, drafter.cfg.block_size - 1, calibrate)
    return DFlashProposer(drafter, static, ev.tree_total_tokens), f"{desc}, block {drafter.cfg.block_size}"


@torch.inference_mode()
def dflash_calibration(drafter: torch.nn.Module, target, samples, top_k: int) -> torch.Tensor:
    """(K, top_k) measured P(slot k's rank-r token is right), teacher-forced on the target's features at every anchor
    of the calibration samples ((ids, scored) pairs): the calibration of its static trees."""
    K = drafter.cfg.block_size - 1
    hits, counts = torch.zeros(K, top_k), torch.zeros(K)
    for ids, scored in samples:
        device = target.device
        T = len(ids)
        hidden = target.hidden_states(ids[None].to(device), layers=list(drafter.stored_layers))[0]
        batch = {
            "input_ids": ids[None].to(device),
            "loss_mask": scored[None].float().to(device),
            "attention_mask": torch.ones(1, T, dtype=torch.long, device=device),
            "position_ids": torch.arange(T, device=device)[None],
            "hidden": hidden[None],
        }
        anchors, valid, _ = drafter.anchors(batch, limit=T)
        normed, labels, labelled = drafter.blocks(batch, anchors, valid)
        for k in range(1, K + 1):
            rows = labelled[0, :, k]
            if not rows.any():
                continue
            logits = drafter.lm_head(normed[0, rows, k].to(drafter.lm_head.weight.dtype))
            top = logits.topk(top_k, dim=-1).indices
            hits[k - 1] += (top == labels[0, rows, k, None]).sum(0).float().cpu()
            counts[k - 1] += rows.sum().item()
    return hits / counts.clamp(min=1)[:, None]
