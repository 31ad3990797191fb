import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before eval.kernels defines its @triton.jit functions

import pytest  # noqa: E402

from eval import kernels, reference  # noqa: E402
from eval.trees import Tree, chain, stack_trees  # noqa: E402

HAND_PARENTS = [-1, 0, 0, 0, 1, 1, 3, 4]  # see tests/test_trees.py


def random_tree(n: int, gen: torch.Generator) -> Tree:
    return Tree.from_parents([-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)])


# -------------------------------------------------------------------------------------------------- tree attention


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("p,n", [(0, 1), (0, 7), (5, 7), (5, 20), (37, 1), (37, 20), (37, 40)])
def test_tree_attention_matches_twin(p, n, dtype, tol):
    gen = torch.Generator().manual_seed(p * 100 + n)
    b, h, hkv, d = 2, 4, 2, 16 if n % 2 else 32
    trees = stack_trees([random_tree(n, gen), random_tree(n, gen)])
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    q, kp, vp, kt, vt = rnd(b, h, n, d), rnd(b, hkv, p, d), rnd(b, hkv, p, d), rnd(b, hkv, n, d), rnd(b, hkv, n, d)
    want = reference.tree_attention(q, kp, vp, kt, vt, trees.mask_bits, d**-0.5)
    for splits in (None, 3):
        got = kernels.tree_attention(q, kp, vp, kt, vt, trees.mask_bits, d**-0.5, num_splits=splits)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_tree_attention_twin_is_per_path_attention():
    """The twin itself: tree query i equals plain attention over prefix + the nodes on its root path."""
    gen = torch.Generator().manual_seed(0)
    tree = Tree.from_parents(HAND_PARENTS)
    q, kp, vp = torch.randn(1, 2, 8, 16, generator=gen), torch.randn(1, 1, 5, 16, generator=gen), None
    vp = torch.randn(1, 1, 5, 16, generator=gen)
    kt, vt = torch.randn(1, 1, 8, 16, generator=gen), torch.randn(1, 1, 8, 16, generator=gen)
    out = reference.tree_attention(q, kp, vp, kt, vt, tree.mask_bits[None], 0.25)
    for i in range(8):
        path = tree.dense_mask()[i].nonzero().squeeze(-1)
        k = torch.cat([kp, kt[:, :, path]], 2).expand(1, 2, -1, -1)
        v = torch.cat([vp, vt[:, :, path]], 2).expand(1, 2, -1, -1)
        want = torch.softmax(q[:, :, i : i + 1] @ k.transpose(-1, -2) * 0.25, -1) @ v
        torch.testing.assert_close(out[:, :, i : i + 1], want)


# ---------------------------------------------------------------------------------------------------- verification


def logits_with_argmax(argmax: list[int], vocab: int = 16) -> torch.Tensor:
    logits = torch.zeros(1, len(argmax), vocab)
    logits[0, torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_greedy_hand_scripted(kind):
    ops = kernels.get_ops(kind)
    tree = chain(3)
    tokens = torch.tensor([[9, 1, 2, 3]])
    accept_len, nodes, bonus = ops.verify_greedy(tokens, logits_with_argmax([1, 2, 3, 7]), tree)
    assert (accept_len.tolist(), nodes.tolist(), bonus.tolist()) == ([3], [[0, 1, 2, 3]], [7])  # bonus at the leaf
    accept_len, nodes, bonus = ops.verify_greedy(tokens, logits_with_argmax([4, 2, 3, 7]), tree)
    assert (accept_len.tolist(), nodes.tolist(), bonus.tolist()) == ([0], [[0, -1, -1, -1]], [4])  # all rejected
    # branching: root's argmax 5 is node 2; node 2 has no children -> bonus = argmax at node 2
    tree = Tree.from_parents(HAND_PARENTS)
    tokens = torch.tensor([[0, 4, 5, 6, 1, 2, 3, 8]])
    accept_len, nodes, bonus = ops.verify_greedy(tokens, logits_with_argmax([5, 2, 11, 3, 8, 0, 0, 0]), tree)
    assert (accept_len.tolist(), nodes.tolist(), bonus.tolist()) == ([1], [[0, 2, -1, -1]], [11])
    # root -> node 1 (4) -> node 5 (2), then node 5's argmax as the bonus
    accept_len, nodes, bonus = ops.verify_greedy(tokens, logits_with_argmax([4, 2, 11, 3, 8, 13, 0, 0]), tree)
    assert (accept_len.tolist(), nodes.tolist(), bonus.tolist()) == ([2], [[0, 1, 5, -1]], [13])


@pytest.mark.parametrize("n", [1, 7, 20, 64])
def test_greedy_and_typical_kernels_match_twin(n):
    gen = torch.Generator().manual_seed(n)
    b, vocab = 3, 50
    tree = stack_trees([random_tree(n, gen) for _ in range(b)])
    logits = 3 * torch.randn(b, n, vocab, generator=gen)
    argmax = logits.argmax(-1)
    tokens = argmax.gather(1, tree.parents.clamp(min=0))  # mostly accepted, with random rejections
    tokens = torch.where(torch.rand(b, n, generator=gen) < 0.3, torch.randint(0, vocab, (b, n), generator=gen), tokens)
    for target in (logits, argmax):
        want = reference.verify_greedy(tokens, target, tree)
        for w, g in zip(want, kernels.verify_greedy(tokens, target, tree)):
            assert torch.equal(w, g)
    want = reference.verify_typical(tokens, logits, tree, temperature=0.7)
    for w, g in zip(want, kernels.verify_typical(tokens, logits, tree, temperature=0.7)):
        assert torch.equal(w, g)


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_typical_prefers_longest_then_likeliest(kind):
    tree = Tree.from_parents([-1, 0, 0, 1, 2])  # two depth-2 paths: 0-1-3 and 0-2-4
    logits = torch.full((1, 5, 8), -10.0)
    logits[0, 0, 1], logits[0, 0, 2] = 2.0, 1.0  # root: tokens 1 and 2 both typical, 1 more likely
    logits[0, 1, 3] = logits[0, 2, 4] = 3.0
    logits[0, 3, 6] = logits[0, 4, 7] = 3.0
    tokens = torch.tensor([[0, 1, 2, 3, 4]])
    accept_len, nodes, bonus = kernels.get_ops(kind).verify_typical(tokens, logits, tree)
    assert (accept_len.tolist(), nodes.tolist(), bonus.tolist()) == ([2], [[0, 1, 3]], [6])
    logits[0, 1, 3] = -10.0  # the likelier branch now stops at depth 1: the longer one wins
    accept_len, nodes, bonus = kernels.get_ops(kind).verify_typical(tokens, logits, tree)
    assert (accept_len.tolist(), nodes.tolist(), bonus.tolist()) == ([2], [[0, 2, 4]], [7])
