import os

import pytest
import torch

from eval import kernels, reference  # under the Triton interpreter without a GPU: tests/conftest.py
from eval.trees import Tree, chain, stack_trees

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


@pytest.mark.parametrize("d,dk,dv", [(80, 80, 80), (96, 96, 96), (300, 300, 300), (64, 64, 32)])
def test_tree_attention_takes_one_head_dim_up_to_256(d, dk, dv):
    """Head dims that are not powers of two are masked (80, 96); a wider head than one tile (300) or values narrower
    than keys (MLA-style) are refused with a line saying so, never computed from part of the head."""
    gen = torch.Generator().manual_seed(d)
    tree = random_tree(5, gen)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)
    q, kp, vp, kt, vt = rnd(1, 2, 5, d), rnd(1, 1, 7, dk), rnd(1, 1, 7, dv), rnd(1, 1, 5, dk), rnd(1, 1, 5, dv)
    if d <= 256 and dk == dv == d:
        want = reference.tree_attention(q, kp, vp, kt, vt, tree.mask_bits[None], d**-0.5)
        got = kernels.tree_attention(q, kp, vp, kt, vt, tree.mask_bits[None], d**-0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        with pytest.raises(ValueError, match="one head dim up to 256"):
            kernels.tree_attention(q, kp, vp, kt, vt, tree.mask_bits[None], d**-0.5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_tree_attention_ragged_prefix_matches_twin_and_ignores_stale_rows(dtype, tol):
    """Row b sees only its first prefix_lens[b] prefix keys: the kernel equals the twin (with and without split-KV,
    splits past a row's end included), and both equal attention over that row's prefix alone."""
    gen = torch.Generator().manual_seed(7)
    b, h, hkv, p, n, d = 3, 4, 2, 37, 9, 16
    trees = stack_trees([random_tree(n, gen) for _ in range(b)])
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    q, kp, vp, kt, vt = rnd(b, h, n, d), rnd(b, hkv, p, d), rnd(b, hkv, p, d), rnd(b, hkv, n, d), rnd(b, hkv, n, d)
    lens = torch.tensor([39, 5, 0])  # past the prefix end (39 > P) means the whole prefix
    want = reference.tree_attention(q, kp, vp, kt, vt, trees.mask_bits, d**-0.5, prefix_lens=lens)
    for row in range(b):
        alone = reference.tree_attention(
            q[row : row + 1],
            kp[row : row + 1, :, : lens[row]],
            vp[row : row + 1, :, : lens[row]],
            kt[row : row + 1],
            vt[row : row + 1],
            trees.mask_bits[row : row + 1],
            d**-0.5,
        )
        torch.testing.assert_close(want[row : row + 1], alone)
    for splits in (None, 3):
        got = kernels.tree_attention(q, kp, vp, kt, vt, trees.mask_bits, d**-0.5, prefix_lens=lens, num_splits=splits)
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
    logits[..., -3:] = float("-inf")  # masked vocabulary entries must not turn the entropy into nan
    argmax = logits.argmax(-1)
    # siblings carry distinct tokens (argmax at the parent + sibling rank + a per-parent shift, 0 for 70% of parents)
    # so that accepted paths never tie exactly
    parents = tree.parents.clamp(min=0)
    earlier_sibling = (tree.parents[:, None, :] == tree.parents[:, :, None]) & torch.ones(n, n, dtype=torch.bool).tril(
        -1
    )
    shift = torch.where(torch.rand(b, n, generator=gen) < 0.7, 0, torch.randint(1, vocab, (b, n), generator=gen))
    tokens = (argmax.gather(1, parents) + earlier_sibling.sum(-1) + shift.gather(1, parents)) % vocab
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


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_typical_ranks_paths_the_same_beside_a_masked_token(kind):
    """A drafted token whose target logit is -inf (a masked vocabulary entry) is rejected and must not touch the
    scores of the paths beside it (0 · -inf is nan, which would make every path tie)."""
    tree = Tree.from_parents([-1, 0, 0, 0, 1, 2])  # depth-2 paths 0-1-4 and 0-2-5; node 3 drafts a masked token
    logits = torch.full((1, 6, 8), -10.0)
    logits[0, 0, 1], logits[0, 0, 2], logits[0, 0, 7] = 1.0, 2.0, float("-inf")
    logits[0, 1, 4] = logits[0, 2, 5] = 3.0
    tokens = torch.tensor([[0, 1, 2, 7, 4, 5]])
    accept_len, nodes, _ = kernels.get_ops(kind).verify_typical(tokens, logits, tree)
    assert (accept_len.tolist(), nodes.tolist()) == ([2], [[0, 2, 5]])


def emitted(tokens, logits, tree, draft_probs, gen, depth=1):
    """Token emitted at `depth` (1 = first) in each of the independent trials (rows), the first drafted token
    accepted (-1 if none) and which rows emitted at that depth."""
    coins = reference.draw_coins(tree, tokens.shape[0], gen)
    accept_len, nodes, bonus = reference.verify_sampled(tokens, logits, tree, coins, draft_probs=draft_probs)
    drafted = torch.where(nodes >= 0, tokens.gather(1, nodes.clamp(min=0)), -1)  # (T, D+1)
    return torch.where(accept_len >= depth, drafted[:, depth], bonus), drafted[:, 1], accept_len >= depth - 1


def emitted_histogram(tokens, logits, tree, draft_probs, gen):
    first, _, _ = emitted(tokens, logits, tree, draft_probs, gen)
    return histogram(first, logits.shape[-1])


def histogram(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


TRIALS, VOCAB, KIDS = 20000, 6, 3
P_LOGITS = torch.tensor([2.0, 1.5, 0.5, 0.0, -0.5, 1.0])
Q = torch.softmax(torch.tensor([0.0, 2.0, 1.0, 1.5, 0.0, -1.0]), -1)  # the drafter disagrees with the target


def total_variation(hist: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (hist - p.double()).abs().sum().item()


@pytest.fixture
def no_residual(monkeypatch):
    """A broken verifier: after a rejection the target distribution is not replaced by the residual."""
    monkeypatch.setattr(reference, "_residual", lambda p, q: p)


def sampled_children_case(gen):
    tree = Tree.from_parents([-1] + [0] * KIDS)
    kids = torch.multinomial(Q.expand(TRIALS, VOCAB), KIDS, replacement=True, generator=gen)  # i.i.d. from q
    tokens = torch.cat([torch.zeros(TRIALS, 1, dtype=torch.long), kids], 1)
    return tokens, P_LOGITS.expand(TRIALS, KIDS + 1, VOCAB), tree, Q.expand(TRIALS, KIDS + 1, VOCAB)


def test_sampled_children_first_token_follows_target():
    gen = torch.Generator().manual_seed(0)
    hist = emitted_histogram(*sampled_children_case(gen), gen)
    assert total_variation(hist, torch.softmax(P_LOGITS, -1)) < 0.02


def test_sampled_children_without_residual_is_biased(no_residual):
    gen = torch.Generator().manual_seed(0)
    hist = emitted_histogram(*sampled_children_case(gen), gen)
    assert total_variation(hist, torch.softmax(P_LOGITS, -1)) > 0.1


def test_topk_children_first_token_follows_target():
    gen = torch.Generator().manual_seed(1)
    tree = Tree.from_parents([-1] + [0] * KIDS)
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), Q.topk(KIDS).indices]).expand(TRIALS, -1)
    logits = P_LOGITS.expand(TRIALS, KIDS + 1, VOCAB)
    p = torch.softmax(P_LOGITS, -1)
    assert total_variation(emitted_histogram(tokens, logits, tree, None, gen), p) < 0.02
    # verifying deterministic top-k drafts as if they were samples from q is not lossless
    draft = Q.expand(TRIALS, KIDS + 1, VOCAB)
    assert total_variation(emitted_histogram(tokens, logits, tree, draft, gen), p) > 0.1


def test_sampled_second_level_follows_target():
    """Two levels of i.i.d. sampled children; the second emitted token, given the first was drafted child x,
    follows p(. | x) (fresh coins per level, q and p taken at the accepted node)."""
    gen = torch.Generator().manual_seed(2)
    p_table = 2 * torch.randn(VOCAB, VOCAB, generator=gen)  # target logits given the node's token
    q_table = torch.softmax(p_table + torch.randn(VOCAB, VOCAB, generator=gen), -1)  # a roughly aligned drafter
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 2, 2])
    tokens = torch.zeros(TRIALS, 7, dtype=torch.long)
    tokens[:, 1:3] = torch.multinomial(q_table[0], 2 * TRIALS, replacement=True, generator=gen).view(TRIALS, 2)
    for child, kids in ((1, slice(3, 5)), (2, slice(5, 7))):
        tokens[:, kids] = torch.multinomial(q_table[tokens[:, child]], 2, replacement=True, generator=gen)
    second, first, emitted_two = emitted(tokens, p_table[tokens], tree, q_table[tokens], gen, depth=2)
    x = int(torch.mode(first[first >= 0]).values)  # the most often accepted first token
    hist = histogram(second[emitted_two & (first == x)], VOCAB)
    assert total_variation(hist, torch.softmax(p_table[x], -1)) < 0.04


def test_sampled_verification_respects_top_p():
    gen = torch.Generator().manual_seed(3)
    tokens, logits, tree, draft = sampled_children_case(gen)
    coins = reference.draw_coins(tree, TRIALS, gen)
    accept_len, nodes, bonus = reference.verify_sampled(tokens, logits, tree, coins, draft_probs=draft, top_p=0.5)
    first = torch.where(accept_len > 0, tokens.gather(1, nodes[:, 1:2].clamp(min=0)).squeeze(1), bonus)
    assert set(first.tolist()) <= {0, 1}  # p = (.40, .24, .09, .05, .03, .15): top-p 0.5 keeps tokens 0 and 1


@pytest.mark.parametrize("n,vocab", [(1, 6), (7, 100), (20, 6), (20, 100)])
def test_sampled_kernel_matches_twin(n, vocab):
    gen = torch.Generator().manual_seed(n * vocab)
    b = 8
    tree = stack_trees([random_tree(n, gen) for _ in range(b)])
    logits = torch.randn(b, n, vocab, generator=gen)
    q = torch.softmax(logits + torch.randn(b, n, vocab, generator=gen), -1)  # drafter close to the target
    tokens = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(b, n)
    coins = reference.draw_coins(tree, b, gen)
    for draft in (q, None):
        want = reference.verify_sampled(tokens, logits, tree, coins, draft, temperature=0.8, top_p=0.9)
        got = kernels.verify_sampled(tokens, logits, tree, coins, draft, temperature=0.8, top_p=0.9)
        for w, g in zip(want, got):
            assert torch.equal(w, g)


# ------------------------------------------------------------------------------------------------------- KV commit


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_kv_commit_moves_exactly_the_accepted_rows(kind):
    b, hkv, prefix, n, d = 2, 2, 5, 8, 16
    rows = torch.arange(prefix + n + 2, dtype=torch.float32)  # cache row r holds the value r everywhere
    k = rows[None, None, :, None].repeat(b, hkv, 1, d)
    v = -k.clone()
    accepted = torch.tensor([[0, 2, 5, 7], [0, 1, 3, -1]])  # overlapping moves: row 2 is read then overwritten
    new_len = kernels.get_ops(kind).kv_commit([k], [v], prefix, accepted)
    assert new_len.tolist() == [prefix + 4, prefix + 3]
    want0 = torch.cat([rows[:prefix], torch.tensor([0.0, 2, 5, 7]) + prefix, rows[prefix + 4 :]])
    want1 = torch.cat([rows[:prefix], torch.tensor([0.0, 1, 3]) + prefix, rows[prefix + 3 :]])
    assert torch.equal(k[0, :, :, 0], want0.expand(hkv, -1)) and torch.equal(k[1, :, :, 0], want1.expand(hkv, -1))
    assert torch.equal(v, -k)


def test_kv_commit_kernel_matches_twin_per_request_prefix():
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 2, 30, 24, generator=gen) for _ in range(4)]
    twins = [c.clone() for c in caches]
    prefix = torch.tensor([3, 9])
    accepted = torch.tensor([[0, 4, 6, 11, -1], [0, 1, 2, 3, 4]])
    want = reference.kv_commit(twins[:2], twins[2:], prefix, accepted)
    got = kernels.kv_commit(caches[:2], caches[2:], prefix, accepted)
    assert torch.equal(want, got) and all(torch.equal(a, b) for a, b in zip(caches, twins))


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_kv_commit_ragged_rows_close_the_gap_to_the_shared_tree_block(kind):
    """A ragged batch: both rows' tree blocks start at row 9 (after the longest prefix), row 1's prefix is 4 long; the
    accepted rows move to each row's own prefix end."""
    b, hkv, d, start = 2, 2, 16, 9
    rows = torch.arange(start + 6, dtype=torch.float32)
    k = rows[None, None, :, None].repeat(b, hkv, 1, d)
    v = -k.clone()
    accepted = torch.tensor([[0, 1, 4], [0, 2, -1]])
    new_len = kernels.get_ops(kind).kv_commit([k], [v], torch.tensor([9, 4]), accepted, tree_start=start)
    assert new_len.tolist() == [12, 6]
    assert k[0, 0, 9:12, 0].tolist() == [9.0, 10.0, 13.0]
    assert k[1, 0, :6, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 9.0, 11.0]
    assert torch.equal(k[1, 0, 6:, 0], rows[6:])  # past new_len: untouched, stale
    assert torch.equal(v, -k)


def test_kv_commit_refuses_a_tree_block_before_the_prefix_end():
    k = torch.zeros(1, 1, 8, 4)
    with pytest.raises(ValueError, match="tree_start"):
        reference.kv_commit([k], [k.clone()], 5, torch.tensor([[0, 1]]), tree_start=3)


# ------------------------------------------------------------------------------------------- HF AttentionInterface


def tiny_llama():
    from tiny import tiny_llama as build

    return build(max_position_embeddings=128)


@torch.inference_mode()
def test_hf_tree_attention_matches_per_path_and_masked_eager():
    from transformers import DynamicCache

    model = tiny_llama()
    name = kernels.register_tree_attention()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (1, 9), generator=gen)
    tree = Tree.from_parents(HAND_PARENTS)
    tokens = torch.randint(0, 256, (1, tree.num_nodes), generator=gen)
    positions = tree.positions(prefix.shape[1])[None]

    def tree_logits(attn: str, mask=None) -> torch.Tensor:
        model.set_attn_implementation(attn)
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix, cache=cache, use_cache=True)  # prefill: causal SDPA fallback for `name`
        assert cache.get_seq_length() == prefix.shape[1]
        return model(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache).logits[0]

    with kernels.tree_context(tree.mask_bits):
        got = tree_logits(name)
    model.set_attn_implementation("sdpa")
    for i in range(tree.num_nodes):
        path = tree.dense_mask()[i].nonzero().squeeze(-1)
        want = model(input_ids=torch.cat([prefix, tokens[:, path]], 1)).logits[0, -1]
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)
    mask = torch.zeros(1, 1, tree.num_nodes, prefix.shape[1] + tree.num_nodes)
    mask[..., prefix.shape[1] :] = torch.where(tree.dense_mask(), 0.0, torch.finfo(torch.float32).min)
    torch.testing.assert_close(got, tree_logits("eager", mask), atol=1e-4, rtol=1e-4)
    # without a tree context the registered function is plain causal attention
    plain = model(input_ids=prefix).logits
    model.set_attn_implementation(name)
    torch.testing.assert_close(model(input_ids=prefix).logits, plain)


def test_hf_tree_attention_refuses_what_the_kernel_does_not_compute():
    """Soft-capping, a sliding window the keys reach past, attention sinks: an error naming it, not wrong logits."""
    from transformers import AttentionInterface

    from eval.kernels.hf import tree_context

    attend = AttentionInterface()[kernels.register_tree_attention()]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 16, generator=gen), torch.randn(1, 2, 8, 16, generator=gen)
    bits = Tree.from_parents([-1, 0, 0]).mask_bits
    sinks = torch.nn.Module()
    sinks.sinks = torch.zeros(4)
    with tree_context(bits):
        for module, kwargs, what in (
            (torch.nn.Module(), {"softcap": 30.0}, "logit soft-capping"),
            (torch.nn.Module(), {"sliding_window": 4}, "a sliding window of 4 keys \\(8 keys here\\)"),
            (sinks, {}, "attention sinks"),
        ):
            with pytest.raises(ValueError, match=f"uses {what}.*, which the kernel does not compute; .*=reference"):
                attend(module, q, k, k, None, **kwargs)
        out, _ = attend(torch.nn.Module(), q, k, k, None, sliding_window=8)  # a window the keys stay inside
        want = reference.tree_attention(q, k[:, :, :5], k[:, :, :5], k[:, :, 5:], k[:, :, 5:], bits, 16**-0.5)
        torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_gpu_benchmark_runs_through_on_the_cpu():
    """`benchmarks/gpu_kernels.sh` runs in a short, rare GPU loan: its --smoke mode (every section, tiny shapes, the
    interpreter) must run through here, so that a crash is not found there."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}  # the script runs its caller's Python
    proc = subprocess.run(["bash", "benchmarks/gpu_kernels.sh", "--smoke"], env=env, capture_output=True, text=True,
                          cwd=root, timeout=900)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "gpu_kernels/failed_checks: 0 (goal == 0)" in proc.stdout and "crashed" not in proc.stdout
    assert "splits=1:" in proc.stdout and "check lowrank_topk" in proc.stdout


@pytest.mark.slow
def test_the_gpu_benchmark_runs_the_python_that_calls_it(tmp_path):
    """`benchmarks/gpu_kernels.sh` runs `$PYTHON` (else python3 on the PATH), not a Python of its own choosing (it
    took `.venv/bin/python` whenever one existed, whoever called it)."""
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "ran $0 with $*"\n')
    fake.chmod(0o755)
    for env in ({"PYTHON": str(fake)}, {"PATH": f"{tmp_path}:{os.environ['PATH']}"}):
        if "PATH" in env:
            (tmp_path / "python3").symlink_to(fake)
        proc = subprocess.run(["bash", "benchmarks/gpu_kernels.sh", "--smoke"], env={**os.environ, **env},
                              capture_output=True, text=True, cwd=root, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        ran = "python" if "PYTHON" in env else "python3"
        assert f"ran {tmp_path / ran} with benchmarks/gpu_kernels.py --smoke" in proc.stdout


@pytest.mark.slow
def test_importing_the_kernels_leaves_the_interpreter_alone():
    """The Triton interpreter is a choice of the entry point (`python -m eval`, tests/conftest.py), never a side effect
    of importing `eval.kernels`: imported without TRITON_INTERPRET it stays unset (and `get_ops("triton")` then needs
    a GPU)."""
    import pathlib
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, eval.kernels as k; print(os.environ.get('TRITON_INTERPRET'), k.INTERPRET)"
    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0 and proc.stdout.split() == ["None", "False"], proc.stderr[-2000:]


# -------------------------------------------------------------------------------------------- NVIDIA compilation

COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from eval.kernels import attention, commit, lowrank, verify

SHARED = 232448  # bytes of shared memory a block may use on sm_90 (H100/H200): more fails at the first launch

def compile_sm90(fn, types, consts, **options):
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options=options)
    assert kernel.metadata.shared <= SHARED, (fn.__name__, consts, kernel.metadata.shared)

# the launch wrapper's blocks: BLOCK_P 32 for fp32 past head dim 64 and for head dim 256
for dt, cast, block_p, block_d in (("bf16", False, 64, 128), ("fp32", True, 32, 128), ("bf16", False, 32, 256)):
    ptrs = {n: "*" + dt for n in ("Q", "KP", "VP", "KT", "VT", "OUT")}
    ptrs.update(BITS="*i32", PLEN="*i32", O_PART="*fp32", L_PART="*fp32", qk_scale="fp32")
    blocks = dict(BLOCK_M=64, BLOCK_P=block_p, BLOCK_N=32, BLOCK_D=block_d)
    for ragged in (False, True):
        consts = dict(HKV=8, GROUP=4, NUM_SPLITS=4, CAST_F32=cast, RAGGED=ragged, **blocks)
        compile_sm90(attention._tree_attention_kernel, ptrs, consts)
# the two-stage head's screen in bf16, as launched (one pipeline stage), up to 1024-row tiles (fp32 takes ~50 s each
# to compile: its tiles up to 512 rows fit, 1024 rows do not, which the wrapper refuses on a GPU)
ptrs = {"U": "*bf16", "A": "*bf16", "PERM": "*i64", "S_OUT": "*fp32", "I_OUT": "*i64"}
for block_v in (512, 1024):
    consts = dict(CAST_F32=False, K=16, BLOCK_N=max(16, lowrank.TILE_SCORES // block_v), BLOCK_V=block_v, BLOCK_R=64)
    compile_sm90(lowrank._lowrank_tile_topk_kernel, ptrs, consts, num_stages=1)
# and the tiles evaluation screens with (eval.heads: 256 rows, halved down to 16 for small heads), with the largest
# row block the wrapper gives them; fp32 at 16 rows only (256-row fp32 tiles fit in 80 KB, but take ~2 min to compile)
for dt, cast, block_v in (("bf16", False, 16), ("bf16", False, 256), ("fp32", True, 16)):
    ptrs = {"U": "*" + dt, "A": "*" + dt, "PERM": "*i64", "S_OUT": "*fp32", "I_OUT": "*i64"}
    consts = dict(CAST_F32=cast, K=16, BLOCK_N=64, BLOCK_V=block_v, BLOCK_R=64)
    compile_sm90(lowrank._lowrank_tile_topk_kernel, ptrs, consts, num_stages=1)
compile_sm90(attention._merge_splits_kernel, {"O_PART": "*fp32", "L_PART": "*fp32", "OUT": "*bf16"},
             dict(NUM_SPLITS=4, BLOCK_R=32, BLOCK_D=128))
compile_sm90(commit._kv_commit_kernel, {"CACHE": "*bf16", "NODES": "*i64", "PREFIX": "*i64", "START": "*i64"},
             dict(HKV=8, WIDTH=5, BLOCK_D=128), num_warps=1)
stats = {"LOGITS": "*bf16", "ARGMAX": "*i64", "LSE": "*fp32", "LOG_THR": "*fp32", "inv_temp": "fp32",
         "log_eps": "fp32", "log_delta": "fp32"}
compile_sm90(verify._row_stats_kernel, stats, dict(TYPICAL=True, BLOCK_V=1024))
path = {a: "*i64" for a in ("TOKENS", "PARENTS", "DEPTH", "ARGMAX", "ACCEPT_LEN", "ACCEPTED", "BONUS")}
path.update(BITS="*i32", LOGITS="*bf16", LSE="*fp32", LOG_THR="*fp32", inv_temp="fp32")
compile_sm90(verify._longest_path_kernel, path, dict(WIDTH=5, TYPICAL=True, BLOCK_N=64, BLOCK_W=16))
walk = {a: "*i64" for a in ("TOKENS", "FIRST_CHILD", "NEXT_SIBLING", "ACCEPT_LEN", "ACCEPTED", "BONUS")}
walk.update(P="*fp32", Q="*bf16", RES="*fp32", COINS="*fp32")
for sampled in (True, False):
    compile_sm90(verify._sampled_walk_kernel, walk, dict(SAMPLED=sampled, BLOCK_V=2048), num_warps=8)
print("compiled")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs compile the kernels for real")
def test_kernels_compile_for_nvidia(tmp_path):
    """Ahead-of-time compilation for sm_90 with the bundled ptxas: catches what the interpreter accepts but NVIDIA
    codegen rejects (dot tile sizes, dtype mixes), with no GPU."""
    import pathlib
    import subprocess
    import sys

    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("triton wheel without ptxas")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    root = pathlib.Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_a_coin_next_to_one_never_draws_a_token_of_probability_zero(kind):
    """The inverse-CDF draw compares against u × total; summed in another order than the running sum, the total can
    exceed the sum's last value by a few ulps, and a coin within a few ulps of 1 then found no index (the kernel took
    the last one, whatever its mass). Here top-p removes the last token: the draw must not pick it."""
    vocab = 64
    tree = Tree.from_parents([-1, 0])
    for seed in (60, 93, 110):  # cases where the two sums end a few ulps apart
        gen = torch.Generator().manual_seed(seed)
        logits = 3 * torch.randn(1, 1, vocab, generator=gen)
        logits[..., -1] = -30.0
        logits = logits.expand(1, 2, vocab).contiguous()
        tokens = torch.tensor([[0, int(logits[0, 0].argmin())]])  # a child of probability 0 after top-p
        coins = torch.zeros(1, 2, 2)
        coins[:, :, 0] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
        p = reference.target_probs(logits, 1.0, 0.95)
        accept_len, _, bonus = kernels.get_ops(kind).verify_sampled(tokens, logits, tree, coins, None, 1.0, 0.95)
        assert accept_len.tolist() == [0] and p[0, 0, bonus[0]] > 0, (seed, bonus.tolist())


@pytest.mark.parametrize("kind", ["reference", "triton"])
def test_typical_never_accepts_a_node_without_a_token(kind):
    tree = Tree.from_parents([-1, 0, 0])
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, 0] = 5.0  # token 0 is the target's overwhelming choice at the root
    tokens = torch.tensor([[0, -1, 3]])  # node 1 has no token (-1, e.g. an unfilled static tree): it is not token 0
    accept_len, nodes, _ = kernels.get_ops(kind).verify_typical(tokens, logits, tree)
    assert accept_len.tolist() == [0] and nodes.tolist()[0][0] == 0
