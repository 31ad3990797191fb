import math

import pytest
import torch

from eval.trees import (
    CALIBRATED_63,
    MC_SIM_7B_63,
    VICUNA_7B_HEAD_ACC,
    Tree,
    calibrated_paths,
    calibrated_tree,
    chain,
    dynamic_tree,
    dynamic_trees,
    medusa_rank_acc,
    medusa_tokens,
    medusa_tree,
    pack_mask,
    stack_trees,
)

#        0
#      / | \
#     1  2  3
#    / \     \
#   4   5     6
#   |
#   7
HAND_PARENTS = [-1, 0, 0, 0, 1, 1, 3, 4]


def test_hand_drawn_tables():
    tree = Tree.from_parents(HAND_PARENTS)
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert tree.first_child.tolist() == [1, 4, -1, 6, 7, -1, -1, -1]
    assert tree.next_sibling.tolist() == [-1, 2, 3, -1, 5, -1, -1, -1]
    assert tree.leaf_paths.tolist() == [[0, 2, -1, -1], [0, 1, 5, -1], [0, 3, 6, -1], [0, 1, 4, 7]]
    assert tree.max_depth == 3 and tree.num_nodes == 8
    assert tree.positions(10).tolist() == [10, 11, 11, 11, 12, 12, 12, 13]
    assert tree.mask_bits.shape == (8, 1) and tree.mask_bits.dtype == torch.int32
    assert tree.mask_bits[7, 0].item() == 1 + 2 + 16 + 128  # {0, 1, 4, 7}
    assert tree.mask_bits[6, 0].item() == 1 + 8 + 64  # {0, 3, 6}
    dense = tree.dense_mask()
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for i in range(8):
        j = i
        while j >= 0:
            expected[i, j] = True
            j = HAND_PARENTS[j]
    assert torch.equal(dense, expected)


def test_mask_words_past_32_nodes():
    tree = chain(39)  # 40 nodes: two words per row, bit 31 is the int32 sign bit
    assert tree.mask_bits.shape == (40, 2)
    assert torch.equal(tree.dense_mask(), torch.ones(40, 40, dtype=torch.bool).tril())
    assert tree.mask_bits[39].tolist() == [-1, 0xFF]
    assert torch.equal(pack_mask(tree.dense_mask()), tree.mask_bits)
    assert tree.leaf_paths.tolist() == [list(range(40))]


def test_from_parents_rejects_bad_order():
    with pytest.raises(ValueError):
        Tree.from_parents([-1, 2, 0])
    with pytest.raises(ValueError):
        Tree.from_parents([0, 0])


def test_medusa_tree_from_rank_paths():
    tree = medusa_tree([(1, 0), (0,), (1,), (0, 0), (0, 1)], num_heads=2)
    # nodes: root, (0,), (1,), (0,0), (0,1), (1,0)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.head_rank.tolist() == [-1, 0, 1, 0, 1, 0]
    head_topk = torch.tensor([[[10, 11, 12], [20, 21, 22]]])  # (B=1, K=2, top_k=3)
    tokens = medusa_tokens(tree, torch.tensor([5]), head_topk)
    assert tokens.tolist() == [[5, 10, 11, 20, 21, 20]]


def test_medusa_tree_validation():
    with pytest.raises(ValueError, match="exceeds the number of Medusa heads"):
        medusa_tree([(0,), (0, 0), (0, 0, 0)], num_heads=2)
    with pytest.raises(ValueError, match="budget"):
        medusa_tree([(0,), (1,), (2,)], num_heads=1, max_nodes=2)
    with pytest.raises(ValueError, match="no parent"):
        medusa_tree([(0,), (1, 0)], num_heads=2)
    with pytest.raises(ValueError, match="exceeds"):
        medusa_tree(MC_SIM_7B_63, num_heads=3)


def test_chain():
    tree = chain(3)
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.head_rank.tolist() == [-1, 0, 0, 0]


def test_calibrated_growth():
    rank_acc = torch.tensor([[0.6, 0.25], [0.5, 0.1]])
    assert calibrated_paths(rank_acc, 3) == [(0,), (0, 0), (1,)]  # values 0.6, 0.3, 0.25
    tree = calibrated_tree(rank_acc, 4)  # next: (1, 0) = 0.125
    assert tree.num_nodes == 5 and tree.max_depth == 2


def test_calibrated63_is_our_calibrated_tree():
    assert len(CALIBRATED_63) == 63
    assert calibrated_paths(medusa_rank_acc(VICUNA_7B_HEAD_ACC[:4]), 63) == CALIBRATED_63
    tree = medusa_tree(CALIBRATED_63, num_heads=4)
    assert tree.num_nodes == 64 and tree.max_depth == 4
    assert tree.mask_bits.shape == (64, 2)
    # the growth is greedy by path value, so every path's value is >= every value outside the tree
    acc = medusa_rank_acc(VICUNA_7B_HEAD_ACC[:4])
    value = lambda p: math.prod(acc[h, r].item() for h, r in enumerate(p))
    assert min(value(p) for p in CALIBRATED_63) >= value((8,)) and min(value(p) for p in CALIBRATED_63) >= value((0, 7))


def test_mc_sim_7b_63_is_medusas_published_tree():
    """Medusa's published tree: 63 distinct paths, 4 deep, each head's top 10, closed under prefixes; not ours."""
    paths = set(MC_SIM_7B_63)
    assert len(MC_SIM_7B_63) == len(paths) == 63
    assert max(map(len, paths)) == 4 and max(max(p) for p in paths) == 9
    assert all(p[:-1] in paths for p in paths if len(p) > 1)
    assert sum(len(p) == 1 for p in paths) == 10 and sum(len(p) == 4 for p in paths) == 2
    assert MC_SIM_7B_63[:6] == [(0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0)] and MC_SIM_7B_63[-1] == (0, 7, 0)
    assert paths != set(CALIBRATED_63)
    tree = medusa_tree(MC_SIM_7B_63, num_heads=4)
    assert tree.num_nodes == 64 and tree.max_depth == 4 and int(tree.head_rank.max()) == 9


def test_dynamic_tree_matches_brute_force():
    vocab, top_k, depth, total = 6, 2, 2, 5
    table = torch.log_softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)), -1)
    calls = []

    def expand(tokens, parent_rows, step):
        calls.append((tokens.tolist(), parent_rows.tolist(), step))
        return table[tokens]

    tree = dynamic_tree(expand, root_token=3, depth=depth, top_k=top_k, total_tokens=total)
    # brute force: both depth-1 children are expanded (top_k of 2 = 2), 2 + 4 candidates, keep the best 4
    lp1, t1 = table[3].topk(top_k)
    cands = [(lp1[i].item(), (t1[i].item(),)) for i in range(top_k)]
    for i in range(top_k):
        lp2, t2 = table[t1[i]].topk(top_k)
        cands += [(lp1[i].item() + lp2[j].item(), (t1[i].item(), t2[j].item())) for j in range(top_k)]
    best = sorted(cands, key=lambda c: -c[0])[: total - 1]
    got_paths = []
    for i in range(1, tree.num_nodes):
        path, j = [], i
        while j > 0:
            path.append(tree.tokens[j].item())
            j = tree.parents[j].item()
        got_paths.append(tuple(reversed(path)))
    assert sorted(got_paths) == sorted(p for _, p in best)
    assert tree.num_nodes == total and tree.tokens[0].item() == 3
    assert (tree.parents[1:] < torch.arange(1, total)).all()
    # the depth-1 frontier rows were both produced by row 0 (the root) of the first call
    assert calls[0] == ([3], [-1], 0) and calls[1][1] == [0, 0] and calls[1][2] == 1


def test_dynamic_tree_cuts_the_frontier_like_brute_force_eagle2():
    """Deeper than the test above: from depth 2 on only the top_k best of the top_k × top_k new candidates are
    expanded (the frontier cut), with a drafter whose distribution depends on the depth; the kept nodes, their
    ancestor masks and depths match a brute-force EAGLE-2 over 60 random cases."""
    vocab, top_k, depth = 7, 3, 4
    for seed in range(60):
        gen = torch.Generator().manual_seed(seed)
        total = int(torch.randint(2, 30, (), generator=gen))
        table = torch.log_softmax(torch.randn(vocab, vocab, generator=gen) * 2, -1).double()

        def log_probs(token: int, step: int, table: torch.Tensor = table) -> torch.Tensor:
            return table[(token + step) % vocab]

        tree = dynamic_tree(
            lambda tokens, rows, step: torch.stack([log_probs(int(t), step) for t in tokens]), 2, depth, top_k, total
        )
        frontier, candidates = [((2,), 0.0)], []
        for step in range(depth):
            new = []
            for path, score in frontier:
                values, tokens = log_probs(path[-1], step).topk(top_k)
                new += [(path + (int(t),), score + float(v)) for v, t in zip(values, tokens)]
            candidates += new
            frontier = sorted(new, key=lambda c: -c[1])[:top_k]
        want = sorted(path for path, _ in sorted(candidates, key=lambda c: -c[1])[: total - 1])
        got, dense = [], tree.dense_mask()
        for i in range(1, tree.num_nodes):
            path, j = [], i
            while j >= 0:
                path.append(int(tree.tokens[j]))
                j = int(tree.parents[j])
            got.append(tuple(reversed(path)))
        assert sorted(got) == want, seed
        for i in range(tree.num_nodes):
            ancestors, j = set(), i
            while j >= 0:
                ancestors.add(j)
                j = int(tree.parents[j])
            assert set(dense[i].nonzero().flatten().tolist()) == ancestors and int(tree.depth[i]) == len(ancestors) - 1


def test_stack_trees_and_batched_positions():
    a, b = Tree.from_parents(HAND_PARENTS), Tree.from_parents([-1, 0, 1, 2, 3, 4, 5, 6])
    stacked = stack_trees([a, b])
    assert stacked.is_batched and stacked.parents.shape == (2, 8)
    assert stacked.leaf_paths.shape == (2, 4, 8)
    assert stacked.leaf_paths[1, 0].tolist() == list(range(8))
    assert stacked.leaf_paths[1, 1].tolist() == [-1] * 8
    assert stacked.positions(torch.tensor([3, 7]))[:, 3].tolist() == [4, 10]
    assert a.batched(3).parents.shape == (3, 8)


def test_dynamic_trees_batch_equals_one_request_at_a_time():
    """Requests grown in lockstep get the trees they get alone, and the drafter sees each request's own frontier."""
    vocab, top_k, depth, total = 9, 3, 4, 11
    gen = torch.Generator().manual_seed(1)
    tables = torch.log_softmax(torch.randn(3, vocab, vocab, generator=gen), -1)  # a different drafter per request
    roots = torch.tensor([3, 0, 7])

    def expand(tokens, parent_rows, step):  # (B, F) -> (B, F, V)
        assert tokens.shape[0] == 3 and parent_rows.shape == tokens.shape
        return tables[torch.arange(3)[:, None], tokens]

    batch = dynamic_trees(expand, roots, depth=depth, top_k=top_k, total_tokens=total)
    for row in range(3):
        alone = dynamic_tree(lambda t, p, s, row=row: tables[row][t], int(roots[row]), depth, top_k, total)
        assert torch.equal(batch[row].parents, alone.parents) and torch.equal(batch[row].tokens, alone.tokens)
    assert len({t.num_nodes for t in batch}) == 1
