"""Draft trees for tree-based speculative decoding: one `Tree` for Medusa static trees and EAGLE-2 dynamic trees.

Tested by `TRITON_INTERPRET=1 .venv/bin/pytest tests/test_trees.py -q`.

A `Tree` describes the N tokens verified in one target forward for one request. Node 0 is the root (the last
verified token, whose KV is not cached yet); nodes are in topological order (parents before children, siblings
contiguous in drafting order). The target runs the N tree tokens at `tree.positions(prefix_len)` under the ancestor
mask `tree.mask_bits` (packed; `tree.dense_mask()` for a bool view), on top of a KV cache of `prefix_len` tokens.

    tree = medusa_tree(MC_SIM_7B_63, num_heads=4)                   # static, shared by all requests
    tokens = medusa_tokens(tree, root_tokens, head_topk)            # (B, N) per-round candidates
    tree = dynamic_tree(expand_fn, root_token, depth=5, top_k=10, total_tokens=60)  # EAGLE-2, one request
    trees = dynamic_trees(batch_expand_fn, root_tokens, depth=5, top_k=10, total_tokens=60)  # B requests at once
    batch = stack_trees([tree_a, tree_b])                           # same N: fields get a leading batch dim

Verification, tree attention and KV commit live in `eval.reference` (semantics) and `eval.kernels` (Triton).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from methods.named_trees import CALIBRATED_63, MC_SIM_7B_63, NAMED_TREES

__all__ = [
    "CALIBRATED_63",
    "MC_SIM_7B_63",
    "NAMED_TREES",
    "VICUNA_7B_HEAD_ACC",
    "Tree",
    "calibrated_paths",
    "calibrated_tree",
    "chain",
    "dynamic_tree",
    "dynamic_trees",
    "medusa_rank_acc",
    "medusa_tokens",
    "medusa_tree",
    "pack_mask",
    "stack_trees",
    "unpack_mask",
]

# Top-1 accuracy of the 5 Medusa heads of Vicuna-7B (Medusa paper); deeper ranks decay geometrically.
VICUNA_7B_HEAD_ACC = (0.56, 0.32, 0.20, 0.15, 0.12)


@dataclass(frozen=True)
class Tree:
    """Tensors of one draft tree (or of B stacked trees: every field then has a leading batch dimension).

    parents      (N,) int64   parent node, -1 for the root
    depth        (N,) int64   root 0
    mask_bits    (N, W) int32 W = ceil(N/32); bit j of row i (little-endian in word j // 32) is set iff j is i or
                              an ancestor of i
    first_child  (N,) int64   first child in sibling order, -1 if none
    next_sibling (N,) int64   next sibling, -1 if none
    leaf_paths   (L, D+1) int64 root-to-leaf node paths, -1 padded (D = max depth)
    tokens       (N,) int64   drafted token per node (-1 where unknown, e.g. static trees before filling)
    head_rank    (N,) int64   Medusa: top-k rank of the node's token in head depth-1; -1 for root / dynamic trees
    """

    parents: torch.Tensor
    depth: torch.Tensor
    mask_bits: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    leaf_paths: torch.Tensor
    tokens: torch.Tensor
    head_rank: torch.Tensor

    @classmethod
    def from_parents(
        cls,
        parents: Sequence[int] | torch.Tensor,
        tokens: Sequence[int] | torch.Tensor | None = None,
        head_rank: Sequence[int] | None = None,
    ) -> Tree:
        """Build every table from the parent list (topological order, node 0 the only root). Runs on the host in
        O(N * depth); move the tree with `.to(device)`."""
        par = [int(p) for p in parents]
        n = len(par)
        if n == 0 or par[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if any(not 0 <= p < i for i, p in enumerate(par) if i > 0):
            raise ValueError(f"parents must come before children and only node 0 is a root: {par}")
        depth = [0] * n
        row_bits = [1] * n  # ancestor-or-self set of node i as a Python int bitmask
        first_child, next_sibling, last_child = [-1] * n, [-1] * n, [-1] * n
        for i in range(1, n):
            p = par[i]
            depth[i] = depth[p] + 1
            row_bits[i] = row_bits[p] | (1 << i)
            if first_child[p] < 0:
                first_child[p] = i
            else:
                next_sibling[last_child[p]] = i
            last_child[p] = i
        words = torch.tensor([[(bits >> (32 * w)) & 0xFFFFFFFF for w in range((n + 31) // 32)] for bits in row_bits])
        leaf_paths = torch.full((n - sum(c >= 0 for c in first_child), max(depth) + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(i for i in range(n) if first_child[i] < 0):
            node = leaf
            while node >= 0:
                leaf_paths[row, depth[node]] = node
                node = par[node]
        as_long = lambda x: torch.as_tensor(x, dtype=torch.long)
        return cls(
            parents=as_long(par),
            depth=as_long(depth),
            mask_bits=torch.where(words >= 2**31, words - 2**32, words).to(torch.int32),
            first_child=as_long(first_child),
            next_sibling=as_long(next_sibling),
            leaf_paths=leaf_paths,
            tokens=as_long(tokens) if tokens is not None else torch.full((n,), -1, dtype=torch.long),
            head_rank=as_long(head_rank) if head_rank is not None else torch.full((n,), -1, dtype=torch.long),
        )

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.leaf_paths.shape[-1] - 1

    @property
    def is_batched(self) -> bool:
        return self.parents.dim() == 2

    def positions(self, prefix_len: int | torch.Tensor) -> torch.Tensor:
        """Position ids of the tree tokens: prefix_len + depth. A (B,) prefix_len gives (B, N)."""
        if isinstance(prefix_len, torch.Tensor) and prefix_len.dim() == 1:
            return prefix_len[:, None].to(self.depth.device) + self.depth
        return prefix_len + self.depth

    def dense_mask(self) -> torch.Tensor:
        """(…, N, N) bool ancestor-or-self mask unpacked from `mask_bits`."""
        return unpack_mask(self.mask_bits, self.num_nodes)

    def batched(self, batch_size: int) -> Tree:
        """This tree with a leading batch dimension (a view for an unbatched tree)."""
        if self.is_batched:
            if self.parents.shape[0] != batch_size:
                raise ValueError(f"tree batch {self.parents.shape[0]} != {batch_size}")
            return self
        return Tree(
            **{f.name: getattr(self, f.name).expand(batch_size, *getattr(self, f.name).shape) for f in fields(self)}
        )

    def to(self, device: torch.device | str) -> Tree:
        return Tree(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pack_mask(dense: torch.Tensor) -> torch.Tensor:
    """Pack a (…, N, N) bool mask into (…, N, ceil(N/32)) int32 words, little-endian bit order."""
    n = dense.shape[-1]
    w = (n + 31) // 32
    padded = torch.zeros(*dense.shape[:-1], w * 32, dtype=torch.int64, device=dense.device)
    padded[..., :n] = dense.long()
    weights = torch.ones(32, dtype=torch.int64, device=dense.device) << torch.arange(32, device=dense.device)
    words = (padded.view(*dense.shape[:-1], w, 32) * weights).sum(-1)  # (…, N, W) in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_mask(mask_bits: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_mask`: (…, N, W) int32 words -> (…, N, n) bool."""
    j = torch.arange(n, device=mask_bits.device)
    words = mask_bits[..., j // 32]  # (…, N, n)
    return ((words >> (j % 32)) & 1).bool()


def stack_trees(trees: Sequence[Tree]) -> Tree:
    """Stack B unbatched trees with the same node count; leaf paths are padded with -1 (one tree: a view)."""
    if len({t.num_nodes for t in trees}) != 1:
        raise ValueError(f"trees to stack need the same node count, got {[t.num_nodes for t in trees]}")
    if len(trees) == 1:
        return trees[0].batched(1)
    n_leaves = max(t.leaf_paths.shape[0] for t in trees)
    width = max(t.leaf_paths.shape[1] for t in trees)
    leaf_paths = torch.full((len(trees), n_leaves, width), -1, dtype=torch.long, device=trees[0].parents.device)
    for b, t in enumerate(trees):
        leaf_paths[b, : t.leaf_paths.shape[0], : t.leaf_paths.shape[1]] = t.leaf_paths
    stacked = {f.name: torch.stack([getattr(t, f.name) for t in trees]) for f in fields(Tree) if f.name != "leaf_paths"}
    return Tree(leaf_paths=leaf_paths, **stacked)


# ---------------------------------------------------------------------------------------------- Medusa static trees


def medusa_tree(paths: Sequence[Sequence[int]], num_heads: int, max_nodes: int | None = None) -> Tree:
    """Static tree from per-head top-k rank paths: path (r1, r2, …) = rank r1 of head 0, then rank r2 of head 1, ….

    The root (empty path) is added; every prefix of a path must be in the list. Nodes are ordered by depth, then by
    path, so siblings are sorted by rank. `max_nodes` bounds the drafted nodes (root excluded).
    """
    keys = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if () in keys:
        keys.remove(())
    if max_nodes is not None and len(keys) > max_nodes:
        raise ValueError(f"tree has {len(keys)} drafted nodes, more than the budget of {max_nodes}")
    deepest = max((len(p) for p in keys), default=0)
    if deepest > num_heads:
        raise ValueError(f"tree depth {deepest} exceeds the number of Medusa heads ({num_heads})")
    index = {(): 0}
    parents, ranks = [-1], [-1]
    for p in keys:
        if min(p) < 0:
            raise ValueError(f"negative rank in path {p}")
        if p[:-1] not in index:
            raise ValueError(f"path {p} has no parent path {p[:-1]} in the tree")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return Tree.from_parents(parents, head_rank=ranks)


def chain(depth: int) -> Tree:
    """A chain of `depth` drafted tokens (top-1 of each head)."""
    return medusa_tree([(0,) * d for d in range(1, depth + 1)], num_heads=depth)


def medusa_tokens(tree: Tree, root_tokens: torch.Tensor, head_topk: torch.Tensor) -> torch.Tensor:
    """Fill a static tree: root_tokens (B,), head_topk (B, K heads, top_k) token ids -> tree tokens (B, N)."""
    head = (tree.depth - 1).clamp(min=0)  # (N,)
    rank = tree.head_rank.clamp(min=0)  # (N,)
    tokens = head_topk[:, head, rank]  # (B, N)
    tokens[:, 0] = root_tokens
    return tokens


def medusa_rank_acc(
    head_top1: Sequence[float] = VICUNA_7B_HEAD_ACC, top_k: int = 10, decay: float = 0.5
) -> torch.Tensor:
    """Modelled accuracy of rank r of head k: head_top1[k] * decay**r, shape (K, top_k)."""
    top1 = torch.tensor(head_top1, dtype=torch.float64)[:, None]
    return top1 * decay ** torch.arange(top_k, dtype=torch.float64)[None, :]


def calibrated_paths(rank_acc: torch.Tensor, num_nodes: int) -> list[tuple[int, ...]]:
    """Greedy growth by expected acceptance: start from the root, repeatedly add the frontier child (one more head,
    any rank) whose path value — the product of `rank_acc[head, rank]` along it — is highest. Ties go to the child
    found first (shallower, lower rank)."""
    k_heads, top_k = rank_acc.shape
    acc = rank_acc.tolist()
    value = {(): 1.0}
    candidates = {(r,): acc[0][r] for r in range(top_k)}
    paths: list[tuple[int, ...]] = []
    while len(paths) < num_nodes and candidates:
        best = max(candidates, key=lambda p: (candidates[p], -len(p), tuple(-r for r in p)))
        value[best] = candidates.pop(best)
        paths.append(best)
        if len(best) < k_heads:
            for r in range(top_k):
                candidates[best + (r,)] = value[best] * acc[len(best)][r]
    return paths


def calibrated_tree(rank_acc: torch.Tensor, num_nodes: int) -> Tree:
    """Static Medusa tree of `num_nodes` drafted nodes grown from calibrated rank accuracies (K heads, top_k)."""
    return medusa_tree(calibrated_paths(rank_acc, num_nodes), num_heads=rank_acc.shape[0])


# ---------------------------------------------------------------------------------------------- EAGLE-2 dynamic tree

ExpandFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def dynamic_tree(expand_fn: ExpandFn, root_token: int, depth: int, top_k: int, total_tokens: int) -> Tree:
    """EAGLE-2 dynamic tree for one request: `dynamic_trees` with a batch of one, where
    `expand_fn(tokens (F,), parent_rows (F,), step) -> log_probs (F, V)`."""
    batch_fn = lambda tokens, parent_rows, step: expand_fn(tokens[0], parent_rows[0], step)[None]  # noqa: E731
    return dynamic_trees(batch_fn, torch.tensor([root_token]), depth, top_k, total_tokens)[0]


def dynamic_trees(
    expand_fn: ExpandFn,
    root_tokens: torch.Tensor,
    depth: int,
    top_k: int,
    total_tokens: int,
    size_fn: Callable[[torch.Tensor], int] | None = None,
    stop_fn: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], bool] | None = None,
    scores_out: list[torch.Tensor] | None = None,
) -> list[Tree]:
    """EAGLE-2 dynamic trees (Li et al., 2024) for a batch of B requests, one tree each, grown in lockstep.

    `expand_fn(tokens (B, F), parent_rows (B, F), step) -> log_probs (B, F, V)` runs the drafter on the F frontier
    nodes of every request in round `step` (0 … depth-1); `parent_rows[b, f]` is the row of the node's parent in the
    previous call (-1 for the root in round 0), so a drafter can keep its per-row hidden states. Inputs are CPU
    tensors; the log-probs may live on any device (only their top_k per row comes back to the host). Each round
    expands the top_k children of every frontier node (score = cumulative draft log-probability) and the next
    frontier is the top_k of those children. Finally the global top (total_tokens - 1) candidates of each request
    are kept with its root; since scores never increase along a path (and ties rank parents first) the kept set is
    connected. Nodes are returned in creation order; every tree has the same node count.
    `size_fn(scores)`: the scores (B, n_candidates) float64 -> the tree size to keep instead of `total_tokens`
    (cost-aware trees, `eval.cost_trees`); clamped to 1 + n_candidates. `stop_fn(scores, frontier_scores (B, k),
    steps_done, tokens, parents) -> True` ends the drafting before `depth` steps (`tokens`, `parents`: (B,
    n_candidates), the candidates' tokens and their parents' candidate indices, -1 for the root). `scores_out`, a
    list, receives each tree's node scores (N,) float64 (cumulative draft log-probabilities, the root's 0).
    """
    if total_tokens < 1 or top_k < 1 or depth < 1:
        raise ValueError("depth, top_k and total_tokens must be positive")
    bsz = root_tokens.shape[0]
    root_tokens = root_tokens.cpu()
    cand_tokens: list[torch.Tensor] = []  # per round (B, F*k)
    cand_parents: list[torch.Tensor] = []  # candidate index of the parent, -1 = root
    cand_scores: list[torch.Tensor] = []
    frontier_tokens = root_tokens.reshape(bsz, 1)
    frontier_cand = torch.full((bsz, 1), -1)  # candidate index of each frontier node
    frontier_scores = torch.zeros(bsz, 1, dtype=torch.float64)
    parent_rows = torch.full((bsz, 1), -1)
    n_cand = 0
    for step in range(depth):
        child_logp, child_tok = expand_fn(frontier_tokens, parent_rows, step).topk(top_k, dim=-1)  # (B, F, k)
        child_logp, child_tok = child_logp.double().cpu(), child_tok.cpu()
        scores = (frontier_scores[:, :, None] + child_logp).reshape(bsz, -1)  # (B, F*k)
        cand_tokens.append(child_tok.reshape(bsz, -1))
        cand_parents.append(frontier_cand.repeat_interleave(top_k, dim=1))
        cand_scores.append(scores)
        new_idx = torch.arange(n_cand, n_cand + scores.shape[1])
        n_cand += scores.shape[1]
        keep = torch.sort(-scores, dim=-1, stable=True).indices[:, :top_k]  # (B, k) next frontier, best first
        frontier_tokens, frontier_cand = cand_tokens[-1].gather(1, keep), new_idx[keep]
        frontier_scores, parent_rows = scores.gather(1, keep), keep // top_k
        if stop_fn is not None and step + 1 < depth:
            so_far = torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1)
            if stop_fn(so_far[0], frontier_scores, step + 1, *so_far[1:]):
                break
    tokens, parents, scores = torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1), torch.cat(cand_scores, 1)
    if size_fn is not None:
        total_tokens = max(1, min(int(size_fn(scores)), n_cand + 1))
    trees = []
    for row in range(bsz):
        kept = torch.sort(-scores[row], stable=True).indices[: total_tokens - 1].sort().values  # creation order
        node_of = torch.full((n_cand,), -1, dtype=torch.long)
        node_of[kept] = torch.arange(1, kept.numel() + 1)
        kept_parents = parents[row, kept]
        tree_parents = torch.where(kept_parents < 0, 0, node_of[kept_parents.clamp(min=0)])
        assert bool((tree_parents >= 0).all()), "EAGLE-2 re-ranking kept a node without its parent"
        node_tokens = torch.cat([root_tokens[row : row + 1], tokens[row, kept]])
        trees.append(Tree.from_parents(torch.cat([torch.tensor([-1]), tree_parents]), tokens=node_tokens))
        if scores_out is not None:
            scores_out.append(torch.cat([scores.new_zeros(1), scores[row, kept]]))
    return trees
