"""Named static Medusa trees, as data (no torch): each path lists, per head, the rank of that head's drafted token.

    MC_SIM_7B_63      Medusa's published sparse tree (`mc_sim_7b_63`), found by the Medusa authors for Vicuna-7B:
                      63 nodes, up to 4 deep, ranks up to 9 (each head's top 10 tokens). In their order.
    CALIBRATED_63     this project's 63-node tree grown greedily by path value from the Medusa paper's Vicuna-7B
                      head accuracies (`eval.trees.calibrated_paths(medusa_rank_acc(VICUNA_7B_HEAD_ACC[:4]), 63)`):
                      4 deep, ranks up to 7. Not the published tree.

`eval.tree: mc_sim_7b_63` / `calibrated63` select them; `eval.trees.medusa_tree(paths, num_heads)` builds a `Tree`.
"""

from __future__ import annotations

# fmt: off
MC_SIM_7B_63: list[tuple[int, ...]] = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1),
    (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0),
    (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
]

CALIBRATED_63: list[tuple[int, ...]] = [
    (0,), (1,), (0, 0), (2,), (0, 1), (1, 0), (3,), (0, 2), (1, 1), (2, 0), (0, 0, 0), (4,), (0, 3), (1, 2), (2, 1),
    (3, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (5,), (0, 4), (1, 3), (2, 2), (3, 1), (4, 0), (0, 0, 2), (0, 1, 1),
    (0, 2, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0), (6,), (0, 5), (1, 4), (2, 3), (3, 2), (4, 1), (5, 0), (0, 0, 0, 0),
    (0, 0, 3), (0, 1, 2), (0, 2, 1), (0, 3, 0), (1, 0, 2), (1, 1, 1), (1, 2, 0), (2, 0, 1), (2, 1, 0), (3, 0, 0),
    (7,), (0, 6), (1, 5), (2, 4), (3, 3), (4, 2), (5, 1), (6, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
    (1, 0, 0, 0), (0, 0, 4), (0, 1, 3),
]
# fmt: on

NAMED_TREES: dict[str, list[tuple[int, ...]]] = {"mc_sim_7b_63": MC_SIM_7B_63, "calibrated63": CALIBRATED_63}


def depth(name: str) -> int:
    """Heads a named tree needs (its longest path)."""
    return max(map(len, NAMED_TREES[name]))


def top_k(name: str) -> int:
    """Tokens a named tree drafts per head (its highest rank + 1)."""
    return max(max(path) for path in NAMED_TREES[name]) + 1
