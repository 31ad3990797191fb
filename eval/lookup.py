"""Prompt-lookup candidates inside a drafter's tree (`eval.lookup_tokens`).

    proposer = LookupProposer(build_proposer(...)[0], max_tokens=10, max_ngram=3)   # EAGLE or Medusa proposer
    trees = proposer.propose(states)    # each row's drafter tree, with an n-gram continuation merged in

Prompt lookup (Saxena, 2023) drafts by copying: the last n tokens of a row (n = max_ngram down to 1) are looked up
earlier in the row (prompt and generated text), and the tokens that followed the most recent match are the draft.
It wins on copy-heavy requests (summarise, fix this code) where a drafter hesitates; a drafter wins elsewhere. Here
both compete for the same verification budget:

- the continuation is merged into the drafter's tree as a branch: walk from the root along children whose tokens
  match it, then hang its remaining tokens there as a chain (siblings stay distinct, so verification is unchanged
  and lossless: greedy, rejection sampling and typical acceptance treat every node as a deterministic draft);
- every node gets a score, the log of its estimated acceptance probability: a drafter node its path probability
  (the product of its draft probabilities along the path, as EAGLE-2 ranks), the j-th lookup token r^j, where r is
  this row's measured rate of accepting a lookup token whose predecessor was accepted (Beta(1, 1) prior: 1/2 before
  the first round). A node on both paths takes the larger score;
- the tree keeps the best-scored nodes (parents rank before children: scores never increase down a path), and the
  continuation's first token whatever its score (a rate is only learnt from tokens that are tried), as many
  as the drafter's tree had, so that every row of a batch keeps the same size; with `eval.tree: cost` the size
  itself is chosen again on the merged scores (`eval.cost_trees.batch_tree_size`, at most `eval.tree_total_tokens`),
  so lookup tokens that are likely enough grow the tree, and unlikely ones are left out; an EAGLE drafter's early
  stop then also weighs its deeper drafts against the merged candidates (`merged_ranking`), so a round whose
  continuation fills the tree with better estimates than a deeper draft could add costs one drafter forward.

The inner proposer sees only its own nodes: `commit` passes it the accepted path up to the first lookup node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from eval.cost_trees import batch_tree_size
from eval.trees import Tree

PRIOR = (1.0, 1.0)
"""Beta prior (accepted, rejected) of a row's lookup acceptance rate: 1/2 before any evidence."""


def ngram_continuation(tokens: Sequence[int] | torch.Tensor, max_ngram: int, max_tokens: int) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the row's last n tokens, for the longest n in
    max_ngram … 1 that occurs, at most `max_tokens` of them; [] when no suffix recurs."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    length = ids.numel()
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = ids[-n:]
        windows = ids[: length - 1].unfold(0, n, 1)  # windows ending before the last token: a match has a successor
        hits = (windows == tail).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return ids[start : start + max_tokens].tolist()
    return []


def merge(
    tree: Tree, scores: torch.Tensor, continuation: Sequence[int], rate: float
) -> tuple[list[int], list[int], list[float], list[int], list[int]]:
    """Candidates of `tree` (unbatched, node 0 the root) plus the continuation as a branch.

    -> (parents, tokens, log scores, inner index of each candidate or -1 for a lookup token), root first, parents
    before children, and the nodes spelling the continuation (shared or new), in order."""
    return _merge(tree.parents.tolist(), tree.tokens.tolist(), scores.double().tolist(), continuation, rate)


def merged_ranking(
    tokens: torch.Tensor, parents: torch.Tensor, log_scores: torch.Tensor, continuation: Sequence[int], rate: float
) -> list[float]:
    """Acceptance estimates, best first, of a drafter's candidates so far (`dynamic_trees`' (n,) tokens, parent
    candidate indices with -1 for the root, log path probabilities) once the continuation is merged in: what a
    cost-aware drafter weighs deeper drafting against (`propose_scored`'s `rank_fn`)."""
    merged = _merge([-1, *(parents + 1).tolist()], [-1, *tokens.tolist()], [0.0, *log_scores.double().tolist()],
                    continuation, rate)  # fmt: skip
    return _ranking(merged[2])


def _ranking(log_scores: list[float]) -> list[float]:
    """Root-first log scores -> the candidates' estimates (the root left out), best first."""
    return sorted((math.exp(s) for s in log_scores[1:]), reverse=True)


def _merge(
    parents: list[int], tokens: list[int], log_scores: list[float], continuation: Sequence[int], rate: float
) -> tuple[list[int], list[int], list[float], list[int], list[int]]:
    inner = list(range(len(parents)))
    children: dict[int, dict[int, int]] = {}
    for i, p in enumerate(parents[1:], 1):
        children.setdefault(p, {})[tokens[i]] = i
    log_rate = math.log(max(rate, 1e-12))
    node, path = 0, []
    for j, token in enumerate(continuation, 1):
        lookup_score = j * log_rate
        child = children.get(node, {}).get(token)
        if child is None:  # the rest of the continuation hangs here, a new chain
            parents.append(node)
            tokens.append(token)
            log_scores.append(lookup_score)
            inner.append(-1)
            child = len(parents) - 1
            children.setdefault(node, {})[token] = child
        else:
            log_scores[child] = max(log_scores[child], lookup_score)
        node = child
        path.append(child)
    return parents, tokens, log_scores, inner, path


def keep_best(parents: list[int], log_scores: list[float], size: int, first: int | None = None) -> list[int]:
    """The root and the `size - 1` best-scored candidates, in index order (a set closed under parents: scores never
    increase down a path, and ties rank shallower nodes, then earlier ones, first). `first`, a child of the root, is
    kept whatever its score (when size >= 2)."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], 1):
        depth[i] = depth[p] + 1
    order = sorted(range(1, len(parents)), key=lambda i: (-log_scores[i], depth[i], i))
    if first is not None:
        if parents[first] != 0:
            raise ValueError(f"node {first} is not a child of the root")
        order = [first] + [i for i in order if i != first]
    kept = sorted([0, *order[: size - 1]])
    seen = set(kept)
    assert all(parents[i] in seen for i in kept[1:]), "a kept lookup candidate lost its parent"
    return kept


class LookupProposer:
    """An EAGLE or Medusa proposer whose trees also hold each row's prompt-lookup continuation (module docstring)."""

    def __init__(self, inner, max_tokens: int, max_ngram: int = 3, max_size: int | None = None):
        """`max_tokens`: continuation tokens merged per round; `max_ngram`: the longest suffix looked up; `max_size`:
        the largest merged tree with cost-aware sizing (`inner.costs` set), else the inner tree's size is kept."""
        if max_tokens < 1 or max_ngram < 1:
            raise ValueError("max_tokens and max_ngram must be positive")
        self.inner, self.max_tokens, self.max_ngram, self.max_size = inner, max_tokens, max_ngram, max_size
        self.feature_layers = inner.feature_layers
        self.tried = self.accepted = 0  # lookup tokens verification reached / accepted, over every row and prompt
        self.reset(1)

    @property
    def costs(self):
        return self.inner.costs

    def reset(self, batch_size: int) -> None:
        self.inner.reset(batch_size)
        self.counts = [list(PRIOR) for _ in range(batch_size)]  # per row: lookup tokens accepted, rejected
        self.proposed: list[tuple[list[int], list[int]]] = []  # per row: inner index of each node, lookup path nodes

    def rate(self, row: int) -> float:
        accepted, rejected = self.counts[row]
        return accepted / (accepted + rejected)

    def propose(self, states) -> list[Tree]:
        continuations = [ngram_continuation(state.tokens[0], self.max_ngram, self.max_tokens) for state in states]
        rates = [self.rate(b) for b in range(len(states))]
        # a cost-aware drafter stops drafting early once the continuation fills the tree
        trees, scores = self.inner.propose_scored(
            states, lambda b, tokens, parents, log_scores: merged_ranking(
                tokens, parents, log_scores, continuations[b], rates[b]
            )
        )  # fmt: skip
        merged = []
        for tree, score, continuation, rate in zip(trees, scores, continuations, rates):
            merged.append(merge(tree.to("cpu"), score.cpu(), continuation, rate))
        size = trees[0].num_nodes
        if self.costs is not None:  # cost-aware: the size that pays on the merged scores
            ranked = [_ranking(m[2]) for m in merged]
            size = batch_tree_size(ranked, self.costs, self.inner.draft_steps, self.max_size)
        size = min(size, min(len(m[0]) for m in merged))  # every row keeps the same size
        out, self.proposed = [], []
        device = trees[0].tokens.device
        for parents, tokens, log_scores, inner, path in merged:
            # the continuation's first token always has a place: its acceptance rate can only be learnt when tried
            kept = keep_best(parents, log_scores, size, path[0] if path else None)
            index = {node: i for i, node in enumerate(kept)}
            out.append(
                Tree.from_parents([-1] + [index[parents[i]] for i in kept[1:]], tokens=[tokens[i] for i in kept]).to(
                    device
                )
            )
            self.proposed.append(([inner[i] for i in kept], [index[i] for i in path if i in index]))
        return out

    def commit(self, paths: Sequence[list[int]]) -> None:
        inner_paths = []
        for b, (path, (inner, lookup)) in enumerate(zip(paths, self.proposed)):
            own = []
            for node in path:
                if inner[node] < 0:
                    break
                own.append(inner[node])
            inner_paths.append(own)
            accepted = set(path)  # the lookup chain's tokens verification reached: the first one, and each after
            reached = [n for k, n in enumerate(lookup) if k == 0 or lookup[k - 1] in accepted]
            hits = sum(n in accepted for n in reached)
            self.counts[b][0] += hits
            self.counts[b][1] += len(reached) - hits
            self.tried += len(reached)
            self.accepted += hits
        self.inner.commit(inner_paths)

    def keep_rows(self, rows: list[int]) -> None:
        self.inner.keep_rows(rows)
        self.counts = [self.counts[r] for r in rows]
