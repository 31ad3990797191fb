"""eval/kernels/lowrank.py: the fused low-rank screen with a local top-k per vocabulary tile, against its twin.

Runs the Triton kernel under the interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from eval.kernels.lowrank import lowrank_topk, lowrank_topk_reference, tile_topk, tile_topk_reference


def inputs(n: int, vocab: int, r: int, seed: int, integer: bool = False):
    """u (N, r), a_shuffled (V, r), perm (V,). integer: small integers, so every score is exact in fp32 (any order of
    summation) and many are tied: the tie-breaking is then checked exactly."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        u = torch.randint(-2, 3, (n, r), generator=g).float()
        a = torch.randint(-2, 3, (vocab, r), generator=g).float()
    else:
        u, a = torch.randn(n, r, generator=g), torch.randn(vocab, r, generator=g)
    return u, a, torch.randperm(vocab, generator=g)


@pytest.mark.parametrize(
    "n,vocab,r,block_v,k_local,candidates",
    [
        (5, 300, 16, 32, 4, 20),  # N < block, V % block_v = 12
        (37, 1000, 32, 64, 8, 50),  # N past one row block, tail of 40
        (20, 515, 64, 128, 16, 64),  # tail of 3 < k_local: padded survivors
        (16, 256, 48, 16, 3, 48),  # r not a power of two, V a multiple of block_v
        (3, 200, 20, 16, 16, 200),  # k_local = block_v and C = V: everything survives
    ],
)
@pytest.mark.parametrize("integer", [False, True])
def test_kernel_matches_twin(n, vocab, r, block_v, k_local, candidates, integer):
    u, a, perm = inputs(n, vocab, r, seed=n * 1000 + vocab, integer=integer)
    s_k, t_k = tile_topk(u, a, perm, block_v, k_local)
    s_r, t_r = tile_topk_reference(u, a, perm, block_v, k_local)
    assert s_k.shape == s_r.shape == (n, -(-vocab // block_v), min(k_local, block_v))
    assert torch.equal(t_k, t_r)  # same per-tile survivors, same order (ties: lower shuffled index first)
    torch.testing.assert_close(s_k, s_r, atol=1e-5, rtol=1e-5)
    scores, ids = lowrank_topk(u, a, perm, block_v, k_local, candidates)
    want_scores, want_ids = lowrank_topk_reference(u, a, perm, block_v, k_local, candidates)
    assert scores.shape == ids.shape == (n, candidates) and ids.dtype == torch.int64
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-5)
    assert bool((scores[:, :-1] >= scores[:, 1:]).all())  # sorted, best first
    assert bool((ids >= 0).all())  # never a padding survivor
    # the scores are those of the ids' tokens: u·A[token]ᵀ with A in token order
    a_tokens = torch.empty_like(a)
    a_tokens[perm] = a
    torch.testing.assert_close(scores, torch.gather(u @ a_tokens.T, 1, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_tile_covering_k_gives_the_exact_global_topc(kernels):
    n, vocab, r, block_v, candidates = 9, 333, 32, 32, 40
    u, a, perm = inputs(n, vocab, r, seed=1)
    a_tokens = torch.empty_like(a)
    a_tokens[perm] = a
    want_scores, want_ids = (u @ a_tokens.T).topk(candidates, dim=-1)
    for k_local in (block_v, block_v + 5):  # k_local past the tile is clamped to it
        scores, ids = lowrank_topk(u, a, perm, block_v, k_local, candidates, kernels=kernels)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_true_top1_is_always_a_candidate(kernels):
    n, vocab, r, block_v = 40, 700, 16, 64
    u, a, perm = inputs(n, vocab, r, seed=2)
    a_tokens = torch.empty_like(a)
    a_tokens[perm] = a
    top1 = (u @ a_tokens.T).argmax(dim=-1)
    for k_local, candidates in ((1, 1), (1, 5), (2, 3)):
        _, ids = lowrank_topk(u, a, perm, block_v, k_local, candidates, kernels=kernels)
        assert torch.equal(ids[:, 0], top1)  # the global maximum is its tile's maximum, and the best survivor


def test_tile_local_semantics_drop_a_crowded_tiles_extra_tokens():
    """A tile holding more than k_local of the global top-C keeps only k_local of them: not the global top-C."""
    vocab, r, block_v = 64, 16, 16
    u = torch.ones(1, r)
    a = torch.zeros(vocab, r)
    a[:4] = 1.0  # shuffled rows 0..3 (all in tile 0) score 16, everything else 0
    perm = torch.arange(vocab).flip(0)
    for kernels in ("triton", "reference"):
        scores, ids = lowrank_topk(u, a, perm, block_v, 2, 4, kernels=kernels)
        assert ids[0, :2].tolist() == [63, 62]  # tile 0's best two: shuffled rows 0, 1 -> tokens 63, 62
        assert scores[0].tolist() == [16.0, 16.0, 0.0, 0.0]  # rows 2, 3 lost to the tile's k_local
        assert ids[0, 2:].tolist() == [63 - 16, 63 - 17]  # then tile 1's first rows (16, 17), lower index first


def test_permutation_maps_back_to_token_ids():
    """Shuffling A's rows by any permutation gives the same tokens, when every row survives; an identity
    permutation returns shuffled indices themselves."""
    n, vocab, r, block_v, candidates = 6, 160, 16, 16, 25
    u, a_tokens, _ = inputs(n, vocab, r, seed=3)
    want = (u @ a_tokens.T).topk(candidates, dim=-1).indices
    for seed in (0, 1):
        perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
        for kernels in ("triton", "reference"):
            _, ids = lowrank_topk(u, a_tokens[perm], perm, block_v, block_v, candidates, kernels=kernels)
            assert torch.equal(ids, want)
            _, local = lowrank_topk(u, a_tokens[perm], perm, block_v, 1, 5, kernels=kernels)
            shuffled = (u @ a_tokens[perm].T).view(n, -1, block_v).argmax(-1)  # each tile's best shuffled row
            tile_best = perm[shuffled + torch.arange(vocab // block_v) * block_v]  # their tokens
            assert bool((local[:, :, None] == tile_best[:, None, :]).any(-1).all())  # candidates are tile maxima
    _, ids = lowrank_topk(u, a_tokens, torch.arange(vocab), block_v, block_v, candidates)
    assert torch.equal(ids, want)


def test_half_inputs_match_the_twin():
    u, a, perm = inputs(12, 300, 32, seed=4)
    u, a = u.half(), a.half()
    scores, ids = lowrank_topk(u, a, perm, 64, 4, 16)
    want_scores, want_ids = lowrank_topk_reference(u, a, perm, 64, 4, 16)
    assert scores.dtype == torch.float32 and torch.equal(ids, want_ids)
    torch.testing.assert_close(scores, want_scores, atol=1e-4, rtol=1e-4)


def test_bad_arguments_name_themselves():
    u, a, perm = inputs(4, 100, 16, seed=5)
    with pytest.raises(ValueError, match="block_v"):
        lowrank_topk(u, a, perm, 24, 4, 10)
    with pytest.raises(ValueError, match="k_local"):
        lowrank_topk(u, a, perm, 16, 0, 10)
    assert lowrank_topk(u, a, perm, 16, 2, 14)[1].shape == (4, 14)  # 6 full tiles x 2 + min(2, 4) = 14 survivors
    with pytest.raises(ValueError, match="candidates"):
        lowrank_topk(u, a, perm, 16, 2, 15, kernels="reference")
    with pytest.raises(ValueError, match="perm"):
        lowrank_topk(u, a, perm[:-1], 16, 2, 10)
    with pytest.raises(ValueError, match="kernels"):
        lowrank_topk(u, a, perm, 16, 2, 10, kernels="cuda")


# ---------------------------------------------------------------------------------------- the hook in eval/heads.py


def test_two_stage_head_tiled_screen_matches_the_torch_path():
    """TwoStageHead(kernels="triton" | "reference"): the same candidates (in the same order) and exact logits as the
    default torch stage 1 when every row survives its tile; with a small k_local the true top-1 stays a candidate."""
    from eval.heads import TwoStageHead
    from models.lm_head import factorize

    g = torch.Generator().manual_seed(6)
    vocab, d = 400, 48  # V % block_v = 16
    w = torch.randn(vocab, d, generator=g)
    factors = factorize(w, rank=16)
    h = torch.randn(2, 5, d, generator=g)
    plain = TwoStageHead(w, factors, candidates=40)
    want_ids, want_logits = plain(h)
    for kernels in ("triton", "reference"):
        tiled = TwoStageHead(w, factors, candidates=40, kernels=kernels, block_v=32, k_local=32)
        ids, logits = tiled(h)
        assert ids.shape == (2, 5, 40)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(tiled.topk(h, k=4)[0], plain.topk(h, k=4)[0])
        screen = TwoStageHead(w, factors, candidates=8, kernels=kernels, block_v=32, k_local=1, seed=3)
        ids, _ = screen(h)
        approx_top1 = ((h @ factors.b.T) @ factors.a.T).argmax(-1)
        assert torch.equal(ids[..., 0], approx_top1)
    with pytest.raises(ValueError, match="candidates"):
        TwoStageHead(w, factors, candidates=40, kernels="reference", block_v=32, k_local=2)  # 12·2 + 2 = 26
    with pytest.raises(ValueError, match="kernels"):
        TwoStageHead(w, factors, candidates=40, kernels="cuda")
    with pytest.raises(ValueError, match="perm"):
        TwoStageHead(w, factors, 40, kernels="reference", block_v=32, k_local=4, perm=torch.zeros(vocab).long())


@pytest.mark.parametrize("rows,candidates,block_v", [(400, 40, 128), (64, 32, 32), (40, 40, 16), (8192, 256, 256)])
def test_eval_two_stage_heads_screen_through_the_kernel_or_its_twin(rows, candidates, block_v, tmp_path):
    """`eval.head: two_stage`: stage 1 runs on `eval.kernels`, the Triton kernel (here under the interpreter) or its
    twin, over tiles of 256 rows keeping 16, halved while fewer than `head_candidates` rows survive (16 at least: a
    tl.dot tile compiles on GPUs); both give the same candidates, in the same order, and the same exact logits."""
    from types import SimpleNamespace

    from eval.heads import two_stage_projections
    from models.lm_head import DraftHead, LowRankHead, factorize
    from schema.evaluation import EvalConfig

    g = torch.Generator().manual_seed(rows)
    d, vocab = 48, max(rows, 512)
    w = torch.randn(rows, d, generator=g)
    token_ids = None if rows == vocab else torch.randperm(vocab, generator=g)[:rows].sort().values
    head = DraftHead("factors", w, token_ids, inputs=None)
    drafter = SimpleNamespace(draft_heads=lambda: [head])
    factorize(w, rank=16).save(tmp_path / "lm_head")  # the export's factors: nothing is fitted here
    h = torch.randn(3, 5, d, generator=g)
    out = {}
    for kernels in ("triton", "reference"):
        ev = EvalConfig(head="two_stage", head_rank=16, head_candidates=candidates, kernels=kernels)
        (projection,), _ = two_stage_projections(SimpleNamespace(eval=ev, source="r"), str(tmp_path), drafter, vocab,
                                                 fit_data=None)  # fmt: skip
        screen = projection.head
        assert (screen.kernels, screen.block_v, screen.k_local) == (kernels, block_v, 16)
        out[kernels] = screen(h), projection(h)
    (ids, logits), laid_out = out["triton"]
    (want_ids, want_logits), want_laid_out = out["reference"]
    assert ids.shape == (3, 5, candidates) and torch.equal(ids, want_ids)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(laid_out, want_laid_out)  # (3, 5, V), -inf off the candidates
    factors = LowRankHead.load(tmp_path / "lm_head")
    approx_top1 = ((h @ factors.b.T) @ factors.a.T).argmax(-1)  # the global best of the screen always survives
    assert torch.equal(ids[..., 0], approx_top1)
