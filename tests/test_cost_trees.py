import itertools
import math
import random

import pytest

from eval.cost_trees import (
    Costs,
    batch_should_stop,
    batch_tree_size,
    can_improve,
    path_probs,
    select_tree,
    selection_parents,
)
from eval.trees import Tree

#          root
#        /  |  \
#       0   1   2
#      / \   \
#     3   4   5
#    / \       \
#   6   7       8
#   |
#   9
HAND_PARENTS = [-1, -1, -1, 0, 0, 1, 3, 3, 5, 6]
HAND_PROBS = [0.6, 0.25, 0.1, 0.7, 0.2, 0.9, 0.5, 0.3, 0.8, 0.95]
FLAT = Costs.from_points([(1, 1.0)], draft_cost=0.0)


def brute_force(parents, probs, costs, draft_steps):
    """Best (ratio, size, nodes) over every subset of candidates closed under parents; ties to the smaller tree."""
    pp = path_probs(parents, probs)
    best = None
    for r in range(len(parents) + 1):
        for nodes in itertools.combinations(range(len(parents)), r):
            chosen = set(nodes)
            if any(parents[c] >= 0 and parents[c] not in chosen for c in nodes):
                continue
            ratio = (1 + sum(pp[c] for c in nodes)) / costs.round_cost(len(nodes) + 1, draft_steps)
            if best is None or ratio > best[0] * (1 + 1e-12):
                best = (ratio, len(nodes) + 1, nodes)
    return best


def random_candidates(rng, n):
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    return parents, [rng.random() for _ in range(n)]


def random_costs(rng):
    sizes = sorted(rng.sample(range(1, 16), 4))
    seconds = sorted(rng.uniform(0.5, 3.0) for _ in sizes)
    return Costs.from_points(list(zip(sizes, seconds)), draft_cost=rng.uniform(0.0, 0.5))


def test_path_probs_multiply_along_paths():
    pp = path_probs(HAND_PARENTS, HAND_PROBS)
    assert pp[9] == pytest.approx(0.6 * 0.7 * 0.5 * 0.95)
    assert pp[8] == pytest.approx(0.25 * 0.9 * 0.8)
    assert all(pp[c] <= pp[p] for c, p in enumerate(HAND_PARENTS) if p >= 0)


def test_verify_cost_interpolates_monotonically():
    costs = Costs.from_points([(32, 2.0), (1, 1.0), (64, 4.0)], draft_cost=0.1)  # any order
    assert costs.verify_points == ((1, 1.0), (32, 2.0), (64, 4.0))
    assert costs.verify_cost(1) == 1.0 and costs.verify_cost(32) == 2.0 and costs.verify_cost(64) == 4.0
    assert costs.verify_cost(48) == pytest.approx(3.0)
    assert costs.verify_cost(96) == pytest.approx(6.0)  # past the last point: the last slope
    values = [costs.verify_cost(n) for n in range(1, 200)]
    assert values == sorted(values)
    one_point = Costs.from_points([(16, 1.5)], 0.0)
    assert one_point.verify_cost(4) == 1.5 == one_point.verify_cost(99)  # a single point: constant
    assert Costs.from_points([(8, 1.0), (16, 2.0)], 0.0).verify_cost(2) == 1.0  # below the first: its cost
    assert costs.round_cost(48, draft_steps=3) == pytest.approx(3.3)


@pytest.mark.parametrize("draft_steps", [0, 1, 4])
@pytest.mark.parametrize(
    "points,draft_cost",
    [
        ([(1, 1.0), (11, 1.0)], 0.1),  # flat: verification is free, take everything
        ([(1, 1.0), (4, 1.1), (8, 1.8), (11, 3.0)], 0.2),
        ([(1, 1.0), (2, 2.0)], 0.0),  # steep: only the surest nodes pay
        ([(1, 1.0), (3, 1.05), (11, 5.0)], 1.0),
    ],
)
def test_hand_tree_matches_brute_force(points, draft_cost, draft_steps):
    costs = Costs.from_points(points, draft_cost)
    pick = select_tree(HAND_PARENTS, HAND_PROBS, costs, draft_steps)
    ratio, size, nodes = brute_force(HAND_PARENTS, HAND_PROBS, costs, draft_steps)
    assert (pick.size, pick.nodes) == (size, nodes)
    assert pick.ratio == pytest.approx(ratio)
    assert pick.expected_tokens / pick.cost == pytest.approx(pick.ratio)


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_match_brute_force(seed):
    rng = random.Random(seed)
    parents, probs = random_candidates(rng, rng.randrange(1, 11))
    costs, steps = random_costs(rng), rng.randrange(0, 5)
    pick = select_tree(parents, probs, costs, steps)
    ratio, size, nodes = brute_force(parents, probs, costs, steps)
    assert (pick.size, pick.nodes) == (size, nodes)
    assert pick.ratio == pytest.approx(ratio)


def test_selection_builds_a_tree_and_respects_max_size():
    costs = Costs.from_points([(1, 1.0), (11, 1.0)], 0.0)
    pick = select_tree(HAND_PARENTS, HAND_PROBS, costs, draft_steps=4)
    assert pick.size == 11 and pick.nodes == tuple(range(10))
    tree = Tree.from_parents(selection_parents(HAND_PARENTS, pick.nodes))
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6, 7]
    capped = select_tree(HAND_PARENTS, HAND_PROBS, costs, draft_steps=4, max_size=4)
    pp = path_probs(HAND_PARENTS, HAND_PROBS)
    assert capped.size == 4 and set(capped.nodes) == set(sorted(range(10), key=lambda i: -pp[i])[:3])
    Tree.from_parents(selection_parents(HAND_PARENTS, capped.nodes))
    with pytest.raises(ValueError, match="nodes"):
        selection_parents(HAND_PARENTS, [3])  # without its parent 0


def test_ties_keep_parents_first():
    # Draft probability 1: the child's path probability equals its parent's; a cap of 2 must take the parent.
    pick = select_tree([-1, 0, 1], [0.5, 1.0, 1.0], Costs.from_points([(1, 1.0), (4, 1.0)], 0.0), 1, max_size=2)
    assert pick.nodes == (0,)


def test_size_shrinks_as_verification_grows_faster():
    rng = random.Random(7)
    parents, probs = random_candidates(rng, 60)
    sizes = []
    for slope in [0.0, 0.002, 0.01, 0.03, 0.1, 0.3, 1.0]:
        costs = Costs.from_points([(1, 1.0), (61, 1.0 + 60 * slope)], draft_cost=0.05)
        sizes.append(select_tree(parents, probs, costs, draft_steps=5).size)
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == 61 and sizes[-1] < 5


def test_size_shrinks_with_a_steeper_knee():
    # Same cost up to 16 tokens, then a steeper and steeper rise (the forward turning compute-bound).
    parents = [-1] * 8 + [i for i in range(8) for _ in range(4)]
    probs = [0.4, 0.2, 0.1, 0.08, 0.06, 0.05, 0.04, 0.03] + [0.5, 0.2, 0.1, 0.05] * 8
    sizes = []
    for rise in [0.0, 0.5, 2.0, 8.0]:
        costs = Costs.from_points([(1, 1.0), (16, 1.0), (41, 1.0 + rise)], draft_cost=0.1)
        sizes.append(select_tree(parents, probs, costs, draft_steps=2).size)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 41 and sizes[-1] <= 16


def eagle_draft(rng, top_k, depth):
    """EAGLE-2-style drafting on scripted probabilities: per step, (parents, probs, frontier path probabilities)
    of all candidates so far. Each frontier node gets top_k children; the next frontier is the top_k of them."""
    parents, probs, pp = [], [], []
    frontier = [-1]
    steps = []
    for _ in range(depth):
        children = []
        for f in frontier:
            raw = sorted((rng.random() ** 2 for _ in range(top_k)), reverse=True)
            scale = rng.uniform(0.3, 1.0) / max(sum(raw), 1e-9)  # the top_k share at most all of the mass
            for q in raw:
                parents.append(f)
                probs.append(q * scale)
                pp.append((1.0 if f < 0 else pp[f]) * q * scale)
                children.append(len(pp) - 1)
        frontier = sorted(children, key=lambda c: (-pp[c], c))[:top_k]
        steps.append((list(parents), list(probs), max(pp[c] for c in frontier)))
    return steps


def test_early_stop_never_misses_a_better_deeper_tree():
    top_k, depth = 2, 4  # 2 + 4 + 4 + 4 = 14 candidates at the deepest step: brute force stays cheap
    decisions = set()
    for seed in range(40):
        rng = random.Random(seed)
        steps = eagle_draft(rng, top_k, depth)
        costs = Costs.from_points(
            [(1, 1.0), (4, 1.0 + rng.uniform(0, 0.5)), (15, 2.0 + rng.uniform(0, 4))], draft_cost=rng.uniform(0, 0.6)
        )
        best = [brute_force(parents, probs, costs, d + 1)[0] for d, (parents, probs, _) in enumerate(steps)]
        for d, (parents, probs, frontier_prob) in enumerate(steps[:-1]):
            pick = select_tree(parents, probs, costs, draft_steps=d + 1)
            assert pick.ratio == pytest.approx(best[d])
            go_on = can_improve(pick, frontier_prob, top_k * top_k, costs, max_extra_steps=depth - d - 1)
            decisions.add(go_on)
            if not go_on:
                assert max(best[d + 1 :]) <= pick.ratio * (1 + 1e-9), (seed, d, best)
    assert decisions == {True, False}  # the scripted cases exercise both answers


def test_early_stop_decides_both_ways():
    rng = random.Random(3)
    steps = eagle_draft(rng, 2, 4)
    parents, probs, frontier_prob = steps[0]
    cheap = Costs.from_points([(1, 1.0), (15, 1.0)], draft_cost=0.0)
    assert can_improve(select_tree(parents, probs, cheap, 1), frontier_prob, 4, cheap, max_extra_steps=3)
    dear = Costs.from_points([(1, 1.0), (15, 1.0)], draft_cost=5.0)  # a draft step costs 5 verifications
    assert not can_improve(select_tree(parents, probs, dear, 1), 0.05, 4, dear, max_extra_steps=3)
    assert not can_improve(select_tree(parents, probs, cheap, 1), 0.0, 4, cheap)  # nothing new can be accepted
    assert not can_improve(select_tree(parents, probs, cheap, 1), frontier_prob, 4, cheap, max_extra_steps=0)


def test_early_stop_looks_past_one_step():
    # One more step (2 new nodes) cannot pay for itself, two (4 new nodes) can: stopping after one look is wrong.
    costs = Costs.from_points([(1, 1.0), (2, 1.0), (3, 1.6), (5, 1.6)], draft_cost=0.05)
    pick = select_tree([-1], [0.5], costs, draft_steps=1)
    assert pick.size == 2
    assert not can_improve(pick, 0.5, 1, costs, max_extra_steps=1)
    assert can_improve(pick, 0.5, 1, costs, max_extra_steps=3)


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: Costs.from_points([(1, 2.0), (8, 1.0)], 0.1), "verify_points"),  # faster for more tokens
        (lambda: Costs.from_points([(4, 1.0), (4, 2.0)], 0.1), "verify_points"),  # repeated size
        (lambda: Costs.from_points([(1, -1.0), (8, 1.0)], 0.1), "verify_points"),
        (lambda: Costs.from_points([(0, 1.0)], 0.1), "verify_points"),
        (lambda: Costs.from_points([(1, math.nan)], 0.1), "verify_points"),
        (lambda: Costs.from_points([], 0.1), "verify_points"),
        (lambda: Costs.from_points([(1, 1.0)], -0.1), "draft_cost"),
        (lambda: Costs.from_points([(1, 1.0)], 0.1).verify_cost(0), "n"),
        (lambda: path_probs([-1, 0], [0.5, 1.5]), "probs"),
        (lambda: path_probs([-1, 0], [-0.1, 0.5]), "probs"),
        (lambda: path_probs([-1], [math.nan]), "probs"),
        (lambda: path_probs([-1, 0], [0.5]), "probs"),
        (lambda: path_probs([-1, 1], [0.5, 0.5]), "parents"),  # child before its parent
        (lambda: select_tree([-1], [0.5], FLAT, -1), "draft_steps"),
        (lambda: select_tree([-1], [0.5], FLAT, 1, max_size=0), "max_size"),
        (lambda: can_improve(select_tree([-1], [0.5], FLAT, 1), 1.5, 4, FLAT), "frontier_prob"),
        (lambda: can_improve(select_tree([-1], [0.5], FLAT, 1), 0.5, -1, FLAT), "new_per_step"),
        (lambda: can_improve(select_tree([-1], [0.5], FLAT, 1), 0.5, 4, FLAT, max_extra_steps=-1), "max_extra_steps"),
    ],
)
def test_bad_inputs_name_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_batch_tree_size_is_the_best_size_for_the_mean_ranking():
    costs = Costs.from_points([(1, 1.0), (4, 1.2), (8, 2.0)], draft_cost=0.1)
    rows = [[0.9, 0.8, 0.1, 0.05], [0.7, 0.6, 0.2, 0.0]]
    mean = [0.8, 0.7, 0.15, 0.025]
    best = max(range(1, 6), key=lambda n: ((1 + sum(mean[: n - 1])) / costs.round_cost(n, 3), -n))
    assert batch_tree_size(rows, costs, draft_steps=3) == best == 4
    assert batch_tree_size(rows, costs, draft_steps=3, max_size=2) == 2


def test_cost_aware_eagle_trees_follow_the_costs_and_keep_greedy_output():
    """eval.tree=cost: start-up timing gives a cost point per size; the EAGLE proposer keeps the batch_tree_size best
    candidates each round (all of them when verifying is free, none when it is steep, and then it stops drafting after
    the first step), and speculative greedy output still equals plain greedy output."""
    import torch
    from tiny import tiny_llama

    from eval.baselines import plain_generate
    from eval.costs import measure_costs
    from eval.decode import DecodeSettings, speculative_generate
    from eval.eagle_proposer import EagleProposer
    from methods.eagle2.config import EagleConfig
    from methods.eagle2.model import EagleDrafter
    from models.common import TargetParts

    model = tiny_llama()
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig(), TargetParts(model.config, model.model.embed_tokens, model.lm_head, [-1]))
    proposer = EagleProposer(drafter.eval(), depth=3, top_k=3, total_tokens=10)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    measured = measure_costs(model, proposer, prompt, max_size=10)
    assert [n for n, _ in measured.verify_points] == [1, 2, 4, 8, 10] and measured.draft_cost > 0
    settings = DecodeSettings(max_new_tokens=20)
    plain = plain_generate(model, prompt, settings).tokens
    propose = proposer.propose
    # scripted costs: a flat verify cost makes every drafted node worth keeping (up to total_tokens); a steep one
    # makes none worth it (a random drafter's path probabilities are small)
    flat, steep = Costs.from_points([(1, 1.0), (64, 1.0)], 0.0), Costs.from_points([(1, 1.0), (2, 100.0)], 0.0)
    steps = []
    step = drafter.step
    drafter.step = lambda *args, **kw: steps.append(kw.get("from_target", True)) or step(*args, **kw)
    for costs, want, tree_steps in ((flat, 10, 2), (steep, 1, 0)):
        proposer.costs = costs
        sizes = []
        steps.clear()

        def counting(states, sizes=sizes):
            trees = propose(states)
            sizes.extend(len(t.tokens) for t in trees)
            return trees

        proposer.propose = counting
        out = speculative_generate(model, proposer, prompt, settings)
        assert out.tokens == plain and out.tree_nodes == sizes
        assert len(out.round_s) == len(out.accepted) and all(t > 0 for t in out.round_s)
        assert sizes and set(sizes) == {want}
        # each round: one catch-up step, then tree steps until depth 3 or until no deeper tree can pay (steep)
        assert steps.count(False) == tree_steps * steps.count(True)


@pytest.mark.parametrize("method", ["medusa1", "peagle"])
def test_cost_aware_static_trees_keep_the_best_paths_and_greedy_output(method):
    """eval.tree=cost for drafters that fill static trees (Medusa heads, P-EAGLE's one forward): the envelope is every
    rank path; each round keeps the batch's best size of each row's most probable paths (the whole envelope when
    verifying is free, the root alone when it is steep, a connected subtree in between), the start-up timing measures
    their one drafting forward, and speculative greedy output equals plain greedy output."""
    import torch
    from test_peagle import drafter_for as peagle_drafter
    from tiny import tiny_llama

    from eval.baselines import plain_generate
    from eval.costs import measure_costs
    from eval.decode import DecodeSettings, speculative_generate
    from eval.proposers import build_proposer
    from methods import METHODS
    from methods.medusa1.config import MedusaConfig
    from methods.medusa1.model import MedusaHeads
    from models.common import TargetParts
    from schema.evaluation import EvalConfig

    model = tiny_llama()
    torch.manual_seed(0)
    if method == "medusa1":
        drafter = MedusaHeads(MedusaConfig(num_heads=3), TargetParts(model.config, model.model.embed_tokens,
                                                                     model.lm_head, [-1])).eval()  # fmt: skip
        with torch.no_grad():
            for p in drafter.blocks.parameters():
                p.normal_(0, 0.1)
    else:
        drafter = peagle_drafter(model, parallel_tokens=3)
    ev = EvalConfig(tree="cost", tree_depth=3, tree_top_k=3, tree_total_tokens=12)
    proposer, desc = build_proposer(METHODS[method], drafter, ev, calibrate=None)
    assert desc.startswith("cost-aware d3 k3 n12") and proposer.tree.num_nodes == 1 + 3 + 9 + 27
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    measured = measure_costs(model, proposer, prompt, max_size=12)
    assert measured.draft_cost > 0 and [n for n, _ in measured.verify_points] == [1, 2, 4, 8, 12]
    settings = DecodeSettings(max_new_tokens=20)
    plain = plain_generate(model, prompt, settings).tokens
    flat, steep = Costs.from_points([(1, 1.0), (64, 1.0)], 0.0), Costs.from_points([(1, 1.0), (2, 100.0)], 0.0)
    middle = Costs.from_points([(1, 1.0), (4, 1.0), (8, 3.0)], 0.0)
    for costs, sizes_wanted in ((flat, {12}), (steep, {1}), (middle, None)):
        proposer.costs = costs
        seen = []
        scored = proposer.propose_scored

        def spy(states, rank_fn=None, scored=scored, seen=seen):
            trees, scores = scored(states, rank_fn)
            for tree, score in zip(trees, scores):
                seen.append(tree.num_nodes)
                par = tree.parents.tolist()
                assert all(score[i] <= score[par[i]] + 1e-9 for i in range(1, len(par)))  # children score lower
            return trees, scores

        proposer.propose_scored = spy
        out = speculative_generate(model, proposer, prompt, settings)
        del proposer.propose_scored
        assert out.tokens == plain and out.tree_nodes == seen
        assert sizes_wanted is None or set(seen) == sizes_wanted
    assert 1 < min(seen) and max(seen) <= 12  # the middle costs: some drafting pays, not all of it


def test_a_batch_stops_drafting_only_when_no_row_can_make_it_pay():
    """`batch_should_stop` bounds each row by its own frontier: when one row's frontier ranks high in its ranking and
    another's low, a bound from their mean frontier stopped a batch that one more step would have improved."""
    costs = Costs.from_points([(1, 1.0), (3, 1.0), (4, 10.0), (5, 20.0)], draft_cost=0.01)
    rows, fronts = [[0.9, 0.8, 0.7], [0.5, 0.4, 0.3]], [0.9, 0.3]
    assert not batch_should_stop(rows, fronts, costs, draft_steps=1, new_per_step=1, steps_left=1)

    def mean(lists):
        return [sum(r[i] for r in lists) / len(lists) for i in range(min(map(len, lists)))]

    stops = set()
    for seed in range(300):  # whenever it stops, no next step whose new candidates respect the frontiers pays more
        rng = random.Random(seed)
        rows = [sorted((rng.random() ** 2 for _ in range(4)), reverse=True) for _ in range(rng.randint(1, 3))]
        fronts = [rng.uniform(0, r[0]) for r in rows]
        costs = Costs.from_points([(1, 1.0), (3, 1.0 + rng.uniform(0, 1)), (9, 2 + rng.uniform(0, 4))], draft_cost=0.1)
        stop = batch_should_stop(rows, fronts, costs, draft_steps=1, new_per_step=2, steps_left=1)
        stops.add(stop)
        if stop:
            now = batch_tree_size_ratio(mean(rows), costs, 1)
            for _ in range(20):
                deeper = [sorted(r + [rng.uniform(0, f) for _ in range(2)], reverse=True) for r, f in zip(rows, fronts)]
                assert batch_tree_size_ratio(mean(deeper), costs, 2) <= now * (1 + 1e-9), seed
    assert stops == {True, False}


def batch_tree_size_ratio(ranked: list[float], costs: Costs, steps: int) -> float:
    """Expected tokens per second of the best prefix of a (mean) ranking: the quantity the early stop bounds."""
    best, tokens = 1.0 / costs.round_cost(1, steps), 1.0
    for k, p in enumerate(ranked, start=1):
        tokens += p
        best = max(best, tokens / costs.round_cost(k + 1, steps))
    return best
