"""The switch between the Triton tree ops and their PyTorch twins in `eval.reference`.

    ops = get_ops("triton")            # or "reference": the same functions in plain PyTorch
    accept_len, accepted_nodes, bonus = ops.verify_greedy(tree_tokens, target_logits, tree)

Every field of a `TreeOps` has the signature of its `eval.reference` twin, so callers (`eval.decode`) switch backends
with `eval.kernels: triton | reference` and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eval import reference
from eval.kernels.attention import tree_attention
from eval.kernels.commit import kv_commit
from eval.kernels.launch import INTERPRET
from eval.kernels.verify import verify_greedy, verify_sampled, verify_typical


@dataclass(frozen=True)
class TreeOps:
    """The tree-decoding ops of one backend; every field has the signature of its `eval.reference` twin."""

    tree_attention: Callable[..., torch.Tensor]
    verify_greedy: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    verify_typical: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    verify_sampled: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    kv_commit: Callable[..., torch.Tensor]
    draw_coins: Callable[..., torch.Tensor]


_OPS = {
    "triton": TreeOps(tree_attention, verify_greedy, verify_typical, verify_sampled, kv_commit, reference.draw_coins),
    "reference": TreeOps(
        reference.tree_attention,
        reference.verify_greedy,
        reference.verify_typical,
        reference.verify_sampled,
        reference.kv_commit,
        reference.draw_coins,
    ),
}


def get_ops(kind: str = "triton") -> TreeOps:
    """`"triton"` (fused kernels: on the GPU, or under the Triton interpreter) or `"reference"` (plain PyTorch)."""
    if kind not in _OPS:
        raise ValueError(f"unknown ops kind {kind!r}; expected one of {sorted(_OPS)}")
    if kind == "triton" and not INTERPRET and not torch.cuda.is_available():
        raise RuntimeError(
            "the Triton kernels need a GPU, or the Triton interpreter: set TRITON_INTERPRET=1 before eval.kernels is "
            "imported (`python -m eval` does when there is no GPU), or use the reference kernels"
        )
    return _OPS[kind]
