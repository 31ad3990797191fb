"""models/lm_head.py: frequency-aware SVD factors and the two-stage head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.lm_head import LowRankHead, TwoStageHead, factorize, hidden_moment, token_weights

V, D = 512, 64


def random_head(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, D, generator=g)  # (V, d)


def test_full_rank_factors_reproduce_the_head():
    w = random_head()
    weights = token_weights(torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(1)))
    moment = hidden_moment(torch.randn(1000, D) * torch.linspace(0.1, 10, D))
    for f in (factorize(w, rank=D), factorize(w, rank=D, weights=weights, hidden_moment=moment)):
        assert f.a.shape == (V, D) and f.b.shape == (D, D)
        torch.testing.assert_close(f.a @ f.b, w, atol=1e-4, rtol=1e-4)


def test_all_candidates_give_the_full_heads_topk():
    w = random_head()
    head = TwoStageHead(w, factorize(w, rank=4), candidates=V)  # a poor screen, but it keeps everything
    h = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2))
    values, ids = head.topk(h, k=8)
    full_values, full_ids = (h @ w.T).topk(8, dim=-1)
    assert ids.shape == (3, 5, 8)
    assert torch.equal(ids, full_ids)
    torch.testing.assert_close(values, full_values)
    cand, logits = head(h)
    torch.testing.assert_close(logits, torch.gather(h @ w.T, -1, cand))  # exact logits of the candidates


def test_frequency_weighting_favours_frequent_tokens():
    w = random_head()
    counts = torch.zeros(V, dtype=torch.int64)
    frequent = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:32]
    counts[frequent] = 10_000  # a skewed vocabulary: 32 tokens carry nearly all the loss tokens
    rank = 24
    plain = factorize(w, rank)
    weighted = factorize(w, rank, weights=token_weights(counts))
    err = lambda f: (f.a @ f.b - w)[frequent].norm(dim=-1).mean()
    assert err(weighted) < 0.5 * err(plain)


def test_hidden_moment_fits_the_logits():
    # anisotropic hidden states, as after a final norm: a few channels carry most of the energy
    g = torch.Generator().manual_seed(4)
    gain = torch.ones(D)
    gain[:4] = 20.0
    h = torch.randn(2000, D, generator=g) * gain  # (N, d)
    w = random_head()
    plain = factorize(w, rank=16)
    aware = factorize(w, rank=16, hidden_moment=hidden_moment(h[:1000]))
    err = lambda f: ((h[1000:] @ (f.a @ f.b - w).T) ** 2).mean()  # held-out logit error
    assert err(aware) < 0.8 * err(plain)


def test_save_load_round_trip(tmp_path):
    f = factorize(random_head(), rank=16)
    f.save(tmp_path / "head")
    g = LowRankHead.load(tmp_path / "head")
    assert g.rank == 16 and torch.equal(g.a, f.a) and torch.equal(g.b, f.b)


def test_bad_arguments_name_themselves():
    w = random_head()
    with pytest.raises(ValueError, match="rank"):
        factorize(w, rank=D + 1)
    with pytest.raises(ValueError, match="rank"):
        factorize(w, rank=0)
    with pytest.raises(ValueError, match="hidden_moment"):
        factorize(w, rank=8, hidden_moment=torch.eye(D + 1))
    with pytest.raises(ValueError, match="weights"):
        factorize(w, rank=8, weights=torch.zeros(V))
    head = TwoStageHead(w, factorize(w, rank=8), candidates=4)
    with pytest.raises(ValueError, match="top_k"):
        head.topk(torch.randn(2, D), k=5)
    with pytest.raises(ValueError, match="candidates"):
        TwoStageHead(w, factorize(w, rank=8), candidates=V + 1)


def test_two_stage_projection_drafts_among_the_candidates_and_keeps_greedy_output():
    """The EAGLE proposer drafting through the two-stage head: every drafted token is one of its position's
    candidates, and with candidates = V the drafted trees equal the full head's."""
    from tiny import tiny_llama

    from eval.baselines import plain_generate
    from eval.decode import DecodeSettings, speculative_generate
    from eval.proposers import EagleProposer, TwoStageProjection
    from models.common import TargetParts
    from models.configs import EagleConfig
    from models.eagle import EagleDrafter

    model = tiny_llama()
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig(), TargetParts(model.config, model.model.embed_tokens, model.lm_head, [-1]))
    weight = model.lm_head.weight.detach()
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = DecodeSettings(max_new_tokens=16)
    plain = plain_generate(model, prompt, settings).tokens
    trees = {}
    for name, candidates in (("few", 12), ("all", 256), ("full", None)):
        vocab = None
        if candidates is not None:
            vocab = TwoStageProjection(TwoStageHead(weight, factorize(weight, rank=8), candidates), 256)
        proposer = EagleProposer(drafter.eval(), depth=3, top_k=3, total_tokens=8, draft_vocab=vocab)
        drafted = trees[name] = []
        propose = proposer.propose
        proposer.propose = lambda states, out=drafted, propose=propose: out.extend(t := propose(states)) or t
        assert speculative_generate(model, proposer, prompt, settings).tokens == plain
    assert [t.tokens.tolist() for t in trees["all"]] == [t.tokens.tolist() for t in trees["full"]]
    assert [t.tokens.tolist() for t in trees["few"]] != [t.tokens.tolist() for t in trees["full"]]


def test_native_export_stores_the_two_stage_factors_that_eval_reads(tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState, GradientState

    from data.extract import main as extract_main
    from eval.heads import FACTORS_DIR, two_stage_projection
    from train.config import load_recipe
    from train.export import export, load_run
    from train.loop import train

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    features, run = tmp_path / "features", tmp_path / "run"
    overrides = [f"data.features_dir={features}", f"train.output_dir={run}", "train.max_steps=2", "eval.head=two_stage",
                 "eval.head_rank=16", "eval.head_candidates=32"]  # fmt: skip
    extract_main(["recipes/tiny/eagle2.yaml", *overrides])
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train(load_recipe("recipes/tiny/eagle2.yaml", overrides))
    out = export(run)
    factors = LowRankHead.load(out / FACTORS_DIR)
    assert factors.rank == 16 and factors.a.shape == (8192, 16)
    recipe, _, drafter = load_run(run)
    projection, source = two_stage_projection(recipe, str(out), drafter.lm_head.weight)
    assert source == str(out / FACTORS_DIR) and projection.head.candidates == 32
    torch.testing.assert_close(projection.head.a, factors.a)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
