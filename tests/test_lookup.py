"""Prompt-lookup candidates inside a drafter's tree (`eval.lookup`): the n-gram search, the merge and its scores,
the size the cost-aware tree keeps, and greedy / sampled decoding through it equal to plain decoding.

TRITON_INTERPRET=1 .venv/bin/pytest tests/test_lookup.py -q
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_generate import BATCH_PROMPTS, _eagle, _medusa, one_thread, tiny_target  # noqa: F401 (autouse fixture)

from eval.baselines import plain_generate
from eval.cost_trees import Costs
from eval.decode import DecodeSettings, speculative_generate, speculative_generate_batch
from eval.eagle_proposer import EagleProposer
from eval.lookup import LookupProposer, keep_best, merge, merged_ranking, ngram_continuation
from eval.proposal import DecodeState
from eval.static_proposers import MedusaProposer
from eval.trees import Tree, medusa_tree


def test_ngram_continuation_takes_the_longest_suffix_and_its_most_recent_match():
    assert ngram_continuation([1, 2, 3, 4, 1, 2], max_ngram=3, max_tokens=3) == [3, 4, 1]
    # [7, 1, 2] recurs: the 3-gram wins over the more recent 2-gram [1, 2] at position 4
    assert ngram_continuation([7, 1, 2, 9, 9, 1, 2, 5, 7, 1, 2], max_ngram=3, max_tokens=2) == [9, 9]
    assert ngram_continuation([7, 1, 2, 9, 9, 1, 2, 5, 7, 1, 2], max_ngram=2, max_tokens=2) == [5, 7]  # most recent
    assert ngram_continuation([5, 6, 7, 8], max_ngram=3, max_tokens=4) == []  # nothing recurs
    assert ngram_continuation([4, 4], max_ngram=3, max_tokens=5) == [4]  # a match needs a successor
    assert ngram_continuation([3], max_ngram=3, max_tokens=5) == []


def _tree():
    """root 10 -> 11 (p .6) -> 13 (p .5); root -> 12 (p .3)."""
    tree = Tree.from_parents([-1, 0, 0, 1], tokens=[10, 11, 12, 13])
    return tree, torch.tensor([0.0, math.log(0.6), math.log(0.3), math.log(0.6 * 0.5)], dtype=torch.float64)


def test_merge_walks_shared_tokens_then_hangs_the_rest_as_a_chain():
    tree, scores = _tree()
    parents, tokens, log_scores, inner, path = merge(tree, scores, [11, 14, 15], rate=0.5)
    assert parents == [-1, 0, 0, 1, 1, 4] and tokens == [10, 11, 12, 13, 14, 15]
    assert inner == [0, 1, 2, 3, -1, -1]
    assert log_scores[1] == pytest.approx(math.log(0.6))  # shared: max(.6, .5)
    assert log_scores[4:] == pytest.approx([2 * math.log(0.5), 3 * math.log(0.5)])
    siblings = [tokens[i] for i in range(1, 6) if parents[i] == 1]
    assert sorted(siblings) == [13, 14]  # distinct: verification sees one deterministic draft per token
    # a continuation the tree already holds adds nothing, and raises the scores along it
    parents, _, log_scores, _, _ = merge(tree, scores, [11, 13], rate=0.9)
    assert len(parents) == 4 and log_scores[3] == pytest.approx(2 * math.log(0.9))


def test_keep_best_keeps_a_set_closed_under_parents_with_ties():
    parents = [-1, 0, 1, 2, 0]
    assert keep_best(parents, [0.0, -1.0, -1.0, -1.0, -1.0], 3) == [0, 1, 4]  # ties: shallower first
    assert keep_best(parents, [0.0, -0.1, -0.2, -0.3, -2.0], 4) == [0, 1, 2, 3]
    assert keep_best(parents, [0.0, -0.1, -0.2, -0.3, -2.0], 4, first=4) == [0, 1, 2, 4]  # kept whatever its score
    assert keep_best(parents, [0.0, -0.1, -0.2, -0.3, -2.0], 4, first=1) == [0, 1, 2, 3]


class Fixed:
    """An inner proposer with a fixed scored tree (the merge policy alone, without a drafter)."""

    feature_layers = [-1]
    draft_steps = 1

    def __init__(self, costs=None):
        self.costs, self.committed = costs, []

    def reset(self, batch_size):
        pass

    def propose_scored(self, states, rank_fn=None):  # a fixed tree: no early stop for rank_fn to inform
        tree, scores = _tree()
        return [tree] * len(states), [scores] * len(states)

    def commit(self, paths):
        self.committed.append([list(p) for p in paths])

    def keep_rows(self, rows):
        pass


def _state(tokens):
    return DecodeState(tokens=torch.tensor([tokens]), new_hidden=None)


def test_lookup_tokens_compete_with_the_drafters_for_a_fixed_size():
    inner = Fixed()
    proposer = LookupProposer(inner, max_tokens=3)
    proposer.reset(1)
    # the row ends in 10 and earlier "10 12 16 17" -> continuation [12, 16, 17]: 12 is the drafter's (.3 -> .5)
    (tree,) = proposer.propose([_state([10, 12, 16, 17, 5, 10])])
    assert tree.num_nodes == 4  # the drafter's size
    # scores: 11 .6, 12 max(.3, .5), 16 .25, 13 .3: the best three are 11, 12, 13
    assert sorted(tree.tokens.tolist()) == [10, 11, 12, 13]
    proposer.commit([[0, 2]])  # 12 accepted (a lookup-path node shared with the drafter), then stopped
    assert inner.committed[-1] == [[0, 2]] and proposer.counts[0] == [2.0, 1.0]  # prior (1, 1) + one accepted
    assert proposer.tried == 1 and proposer.accepted == 1
    (tree,) = proposer.propose([_state([10, 12, 16, 17, 5, 10])])  # rate 2/3: 16 scores .44 and beats 13 (.3)
    assert sorted(tree.tokens.tolist()) == [10, 11, 12, 16]
    path = [0, tree.tokens.tolist().index(12), tree.tokens.tolist().index(16)]
    proposer.commit([path])
    assert inner.committed[-1] == [[0, 2]]  # the inner proposer sees its own nodes only
    assert proposer.counts[0] == [4.0, 1.0]


def test_cost_aware_size_grows_for_likely_lookup_tokens_and_not_for_unlikely_ones():
    cheap = Costs.from_points([(1, 1.0), (64, 1.0)], draft_cost=0.0)  # verifying more costs nothing: keep all
    proposer = LookupProposer(Fixed(cheap), max_tokens=4, max_size=16)
    proposer.reset(1)
    (tree,) = proposer.propose([_state([10, 20, 21, 22, 23, 10])])
    assert tree.num_nodes == 8 and {20, 21, 22, 23} <= set(tree.tokens.tolist())
    dear = Costs.from_points([(1, 1.0), (4, 1.0), (5, 3.0), (64, 100.0)], draft_cost=0.0)  # a 5th node triples it
    proposer = LookupProposer(Fixed(dear), max_tokens=4, max_size=16)
    proposer.reset(1)
    (tree,) = proposer.propose([_state([10, 20, 21, 22, 23, 10])])
    assert tree.num_nodes == 4


def test_merged_ranking_takes_the_larger_estimate_of_a_shared_token():
    tokens, parents = torch.tensor([5, 6, 9]), torch.tensor([-1, -1, 0])  # 5 and 6 under the root, 9 under 5
    log_scores = torch.tensor([0.6, 0.3, 0.6 * 0.2]).log()
    # the continuation walks 6 (shared: max(.3, .5)) and hangs 7 under it (.5 ** 2)
    ranked = merged_ranking(tokens, parents, log_scores, [6, 7], rate=0.5)
    assert ranked == pytest.approx([0.6, 0.5, 0.25, 0.12])
    assert merged_ranking(tokens, parents, log_scores, [], rate=0.5) == pytest.approx([0.6, 0.3, 0.12])


@pytest.fixture(scope="module")
def looping():
    """A flatter random target whose greedy continuations fall into loops: lookup finds its n-grams."""
    return tiny_target("llama", init_range=0.05)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_greedy_with_lookup_equals_plain_and_accepts_lookup_tokens(looping, kind):
    target, settings, prompts = looping, DecodeSettings(max_new_tokens=24), BATCH_PROMPTS

    def inner():
        if kind == "eagle":
            return EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6)
        return MedusaProposer(_medusa(target), medusa_tree([(0,), (1,), (0, 0), (0, 1), (1, 0)], 3))

    proposer = LookupProposer(inner(), max_tokens=5)
    batch = speculative_generate_batch(target.model, proposer, prompts, settings)
    for row, (out, p) in enumerate(zip(batch, prompts)):
        assert out.tokens == plain_generate(target.model, p[None], settings).tokens, row
        assert set(out.tree_nodes) == {6}  # the drafter's size: lookup tokens replace its weakest nodes
    assert proposer.accepted > 0 and proposer.tried >= proposer.accepted
    alone = LookupProposer(inner(), max_tokens=5)
    single = speculative_generate(target.model, alone, prompts[-1][None], settings)
    assert single.tokens == batch[-1].tokens and single.accepted == batch[-1].accepted  # rows draft as alone


def test_sampled_with_lookup_decodes_what_each_row_decodes_alone(looping):
    """Rejection sampling treats lookup tokens as deterministic drafts (target-only acceptance): lossless, and a
    row's outputs do not depend on its neighbours (every row keeps the drafter's size)."""
    settings = DecodeSettings(max_new_tokens=16, temperature=0.8)
    target, prompts = looping, BATCH_PROMPTS
    make = lambda: LookupProposer(EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=6), max_tokens=4)  # noqa: E731
    proposer = make()
    batch = speculative_generate_batch(target.model, proposer, prompts, settings, seeds=[5, 6, 7])
    assert proposer.tried > 0
    for p, seed, out in zip(prompts, [5, 6, 7], batch):
        alone = speculative_generate(target.model, make(), p[None], dataclasses.replace(settings, seed=seed))
        assert out.tokens == alone.tokens and out.accepted == alone.accepted


def test_cost_aware_drafter_stops_early_where_lookup_fills_the_tree(looping):
    """With `eval.tree: cost` the drafter's early stop weighs deeper drafting against the merged candidates: where
    the row's continuation fills the tree with better estimates than a deeper draft could add, one draft step is
    enough; where nothing recurs the drafter's own candidates decide. Greedy output stays plain decoding's."""
    target, settings = looping, DecodeSettings(max_new_tokens=24)
    free = Costs.from_points([(1, 1.0), (64, 1.0)], draft_cost=0.0)  # a deeper draft always pays while there is room
    inner = EagleProposer(_eagle(target), depth=3, top_k=2, total_tokens=4)
    inner.costs = free
    proposer = LookupProposer(inner, max_tokens=5, max_size=4)
    rounds = []
    propose = proposer.propose

    def recording(states):
        trees = propose(states)
        rounds.append((len(ngram_continuation(states[0].tokens[0], 3, 5)), inner.draft_steps))
        return trees

    proposer.propose = recording
    for p in BATCH_PROMPTS:
        out = speculative_generate(target.model, proposer, p[None], settings)
        assert out.tokens == plain_generate(target.model, p[None], settings).tokens
    # a random drafter's path probabilities are far below 1/2 (the rate's prior): three lookup tokens fill the tree
    assert {steps for n, steps in rounds if n >= 3} == {1}
    assert {steps for n, steps in rounds if n == 0} == {2}  # alone, a second step still pays (a third never does)
