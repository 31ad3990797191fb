"""Cost-aware draft trees: pick the tree size that maximises expected accepted tokens per second, not a hand-tuned N.

Tested by `.venv/bin/pytest tests/test_cost_trees.py -q`. Pure Python (no torch): the numbers are a handful of
floats per round.

A speculative round costs `draft_steps` drafter forwards plus one target forward over the n tree tokens, and
yields on average 1 + (sum of the acceptance probabilities of the drafted nodes) tokens (the target's own token
always counts). As in EAGLE-2 (Li et al., 2024), a node's acceptance probability is approximated by its path
probability: the product of the draft probabilities along its root path. So the builder maximises

    ratio(tree) = (1 + sum of path probabilities of the drafted nodes) / (draft_steps * draft_cost + verify_cost(n))

over subtrees closed under parents. Path probabilities never increase along a path, so for a fixed n the best
subtree is the top n - 1 candidates (connected, with parents ranked first on ties); the search is over n only.

    costs = Costs.from_points([(1, 0.010), (32, 0.011), (64, 0.014), (128, 0.024)], draft_cost=0.002)
    pick = select_tree(parents, probs, costs, draft_steps=5)   # candidates: parent index (-1 = root), draft prob
    tree = Tree.from_parents(selection_parents(parents, pick.nodes))          # eval.trees.Tree, root + pick.nodes
    if not can_improve(pick, frontier_prob=0.3, new_per_step=100, costs=costs, max_extra_steps=3):
        ...                                                                   # stop drafting: no deeper tree pays

`eval.tree: cost` uses it: `eval.costs.measure_costs` times the target's verifying forward at a few tree sizes and
one draft step at start-up, and every round the EAGLE proposer drafts `tree_depth` steps of `tree_top_k` and keeps
the `batch_tree_size` best candidates (at most `tree_total_tokens`) instead of a fixed count, and stops drafting
before `tree_depth` steps when `batch_should_stop` (the `can_improve` bound) says no deeper tree can pay.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Costs",
    "Selection",
    "batch_should_stop",
    "batch_tree_size",
    "can_improve",
    "path_probs",
    "select_tree",
    "selection_parents",
]


@dataclass(frozen=True)
class Costs:
    """Seconds per round: `verify_points` are measured (tree size n, seconds of one verifying target forward) pairs,
    sizes strictly increasing and seconds positive and non-decreasing; `draft_cost` is the seconds of one draft step.

    Built from measurements only: measuring them on a real target and drafter is not part of this module yet.
    """

    verify_points: tuple[tuple[int, float], ...]
    draft_cost: float

    def __post_init__(self) -> None:
        if not self.verify_points:
            raise ValueError("verify_points: need at least one (size, seconds) point")
        for i, (n, t) in enumerate(self.verify_points):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"verify_points[{i}]: size must be a positive int, got {n!r}")
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"verify_points[{i}]: seconds must be positive and finite, got {t!r}")
        for i in range(1, len(self.verify_points)):
            (n0, t0), (n1, t1) = self.verify_points[i - 1], self.verify_points[i]
            if n1 <= n0:
                raise ValueError(f"verify_points: sizes must strictly increase, got {n0} then {n1}")
            if t1 < t0:
                # A bigger tree that verifies faster is measurement noise; a non-monotone model would let the
                # search pick a size only because of that noise.
                raise ValueError(f"verify_points: seconds must not decrease with size, got {t0} at {n0}, {t1} at {n1}")
        if not (math.isfinite(self.draft_cost) and self.draft_cost >= 0):
            raise ValueError(f"draft_cost must be non-negative and finite, got {self.draft_cost!r}")

    @classmethod
    def from_points(cls, verify_points: Sequence[tuple[int, float]], draft_cost: float) -> Costs:
        """Costs from measured (size, seconds) pairs in any order."""
        points = tuple(sorted((int(n), float(t)) for n, t in verify_points))
        return cls(verify_points=points, draft_cost=float(draft_cost))

    def verify_cost(self, n: int) -> float:
        """Seconds to verify n tree tokens: piecewise-linear through the points; below the first point its cost (a
        forward never gets cheaper than the smallest one measured), above the last the last segment's slope (a
        single point: constant). Monotone in n because the points are."""
        if n < 1:
            raise ValueError(f"n must be at least 1 (the root), got {n}")
        pts = self.verify_points
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        j = min(bisect.bisect_left([p[0] for p in pts], n), len(pts) - 1)  # segment end; past the last: last one
        (n0, t0), (n1, t1) = pts[j - 1], pts[j]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    def round_cost(self, n: int, draft_steps: int) -> float:
        """Seconds of one round: `draft_steps` drafter forwards plus verifying n tokens."""
        return draft_steps * self.draft_cost + self.verify_cost(n)


@dataclass(frozen=True)
class Selection:
    """The chosen subtree: `nodes` are candidate indices in creation order (root excluded), `size` = 1 + len(nodes)
    tree tokens, `expected_tokens` = 1 + their path probabilities, `cost` in seconds, `ratio` = tokens / second.
    `ranked` are the path probabilities of all candidates, best first (what `can_improve` extends)."""

    nodes: tuple[int, ...]
    size: int
    expected_tokens: float
    cost: float
    ratio: float
    draft_steps: int
    ranked: tuple[float, ...]


def _check_parents(parents: Sequence[int]) -> list[int]:
    par = [int(p) for p in parents]
    for i, p in enumerate(par):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: must be -1 (the root) or an earlier candidate")
    return par


def path_probs(parents: Sequence[int], probs: Sequence[float]) -> list[float]:
    """Path probability of each candidate: its draft probability times its parent's path probability.

    `parents[i]` is the index of candidate i's parent among the candidates (-1 = the root), parents before
    children; `probs[i]` in [0, 1] is the drafter's probability of candidate i's token given its parent.
    """
    par = _check_parents(parents)
    if len(probs) != len(par):
        raise ValueError(f"probs has {len(probs)} entries for {len(par)} parents")
    out: list[float] = []
    for i, (p, q) in enumerate(zip(par, probs)):
        q = float(q)
        if not 0.0 <= q <= 1.0:  # also rejects NaN
            raise ValueError(f"probs[{i}] = {q} is outside [0, 1]")
        out.append(q if p < 0 else out[p] * q)
    return out


def _check_steps(draft_steps: int) -> None:
    if isinstance(draft_steps, bool) or not isinstance(draft_steps, int) or draft_steps < 0:
        raise ValueError(f"draft_steps must be a non-negative int, got {draft_steps!r}")


def _best_size(ranked: Sequence[float], costs: Costs, draft_steps: int) -> tuple[int, float, float, float]:
    """(size, expected tokens, cost, ratio) of the best prefix of `ranked` (path probabilities, best first); ties go
    to the smaller tree (same tokens per second for less work)."""
    best = (1, 1.0, costs.round_cost(1, draft_steps), 1.0 / costs.round_cost(1, draft_steps))
    tokens = 1.0
    for k, p in enumerate(ranked, start=1):
        tokens += p
        cost = costs.round_cost(k + 1, draft_steps)
        if tokens / cost > best[3]:
            best = (k + 1, tokens, cost, tokens / cost)
    return best


def select_tree(
    parents: Sequence[int], probs: Sequence[float], costs: Costs, draft_steps: int, max_size: int | None = None
) -> Selection:
    """The subtree (root plus candidates, closed under parents) with the most expected tokens per second.

    Candidates as in `path_probs`. `draft_steps` is the number of drafter forwards the round spent; `max_size` caps
    the tree tokens (e.g. a kernel's or a CUDA graph's largest N).
    """
    _check_steps(draft_steps)
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be at least 1, got {max_size}")
    pp = path_probs(parents, probs)
    # Highest path probability first; equal ones by index, so a parent (earlier) precedes a child with the same
    # path probability (draft probability 1) and every prefix of this order is connected.
    order = sorted(range(len(pp)), key=lambda i: (-pp[i], i))
    ranked = [pp[i] for i in order]
    limit = len(ranked) if max_size is None else min(len(ranked), max_size - 1)
    size, tokens, cost, ratio = _best_size(ranked[:limit], costs, draft_steps)
    return Selection(
        nodes=tuple(sorted(order[: size - 1])),
        size=size,
        expected_tokens=tokens,
        cost=cost,
        ratio=ratio,
        draft_steps=draft_steps,
        ranked=tuple(ranked),
    )


def batch_tree_size(
    ranked_rows: Sequence[Sequence[float]], costs: Costs, draft_steps: int, max_size: int | None = None
) -> int:
    """One tree size for a batch whose trees are verified in the same forward (they must have the same size): the
    size with the most expected tokens per second for the batch's mean ranking. `ranked_rows`: per row, the path
    probabilities of its candidates, best first (each row's prefix of that length is connected)."""
    _check_steps(draft_steps)
    if not ranked_rows:
        raise ValueError("ranked_rows: need at least one row")
    return _best_size(_mean_ranking(ranked_rows, max_size), costs, draft_steps)[0]


def _mean_ranking(ranked_rows: Sequence[Sequence[float]], max_size: int | None) -> list[float]:
    """The rows' rankings averaged position by position (as long as the shortest), capped to `max_size - 1`
    candidates."""
    n = min(len(r) for r in ranked_rows)
    mean = [sum(float(r[i]) for r in ranked_rows) / len(ranked_rows) for i in range(n)]
    return mean if max_size is None else mean[: max(0, max_size - 1)]


def _optimistic(ranked: list[float], frontier_prob: float, count: int) -> list[float]:
    """`ranked` with `count` more candidates of path probability `frontier_prob`, slotted where it ranks: the best a
    deeper draft can add below a frontier of that probability."""
    pos = bisect.bisect_left([-p for p in ranked], -frontier_prob)
    return ranked[:pos] + [frontier_prob] * count + ranked[pos:]


def batch_should_stop(
    ranked_rows: Sequence[Sequence[float]],
    frontier_probs: Sequence[float],
    costs: Costs,
    draft_steps: int,
    new_per_step: int,
    steps_left: int,
    max_size: int | None = None,
) -> bool:
    """Early stop for a batch drafting in lockstep: True when no further draft step (up to `steps_left`) can raise
    the expected tokens per second of the batch's mean ranking. `can_improve`'s bound, row by row: each row's new
    candidates get its own best frontier path probability (`frontier_probs[b]`) and slot into its own ranking, and
    the mean of those bounds bounds the batch's mean ranking (a bound from the rows' mean frontier does not: a row
    whose frontier ranks high can gain more than the mean says)."""
    if steps_left <= 0:
        return True
    if new_per_step < 0:
        raise ValueError(f"new_per_step must be non-negative, got {new_per_step}")
    rows = [[float(p) for p in r] for r in ranked_rows]
    fronts = [min(float(f), 1.0) for f in frontier_probs]
    if new_per_step == 0 or not any(fronts):
        return True  # nothing new can be accepted, and more steps only cost
    current = _best_size(_mean_ranking(rows, max_size), costs, draft_steps)[3]
    for extra in range(1, steps_left + 1):
        bounds = [_optimistic(r, f, extra * new_per_step) for r, f in zip(rows, fronts)]
        if _best_size(_mean_ranking(bounds, max_size), costs, draft_steps + extra)[3] > current:
            return False
    return True


def selection_parents(parents: Sequence[int], nodes: Sequence[int]) -> list[int]:
    """Parent list for `eval.trees.Tree.from_parents` of the root plus the selected candidates (creation order):
    tree node 0 is the root, tree node j + 1 is `nodes[j]`."""
    par = _check_parents(parents)
    index = {c: j + 1 for j, c in enumerate(sorted(nodes))}
    out = [-1]
    for c in sorted(nodes):
        p = par[c]
        if p >= 0 and p not in index:
            raise ValueError(f"nodes: candidate {c} is selected without its parent {p}")
        out.append(0 if p < 0 else index[p])
    return out


def can_improve(
    current: Selection,
    frontier_prob: float,
    new_per_step: int,
    costs: Costs,
    max_extra_steps: int = 1,
    max_size: int | None = None,
) -> bool:
    """Whether drafting 1 … `max_extra_steps` more steps could beat `current.ratio`; False means stop drafting.

    An upper bound: each further step adds at most `new_per_step` candidates (EAGLE-2: top_k frontier nodes times
    top_k children), each a descendant of the current frontier, so its path probability is at most
    `frontier_prob` (the best path probability among the nodes the next step expands). Giving every new candidate
    exactly that probability, and the round the extra draft steps' cost, bounds any tree a deeper draft can build.
    Each depth is checked, not only the next: one more step can lose (its cost, few new nodes) while two win.
    """
    if not 0.0 <= frontier_prob <= 1.0:
        raise ValueError(f"frontier_prob = {frontier_prob} is outside [0, 1]")
    if new_per_step < 0:
        raise ValueError(f"new_per_step must be non-negative, got {new_per_step}")
    if max_extra_steps < 0:
        raise ValueError(f"max_extra_steps must be non-negative, got {max_extra_steps}")
    if new_per_step == 0 or frontier_prob == 0.0:
        return False  # nothing new can be accepted, and more steps only cost
    ranked = list(current.ranked)
    for extra in range(1, max_extra_steps + 1):
        bound = _optimistic(ranked, frontier_prob, extra * new_per_step)
        if max_size is not None:
            bound = bound[: max_size - 1]
        if _best_size(bound, costs, current.draft_steps + extra)[3] > current.ratio:
            return True
    return False
