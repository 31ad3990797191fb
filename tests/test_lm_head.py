"""models/lm_head.py (frequency-aware SVD factors) and eval/heads.py (the two-stage head that screens with them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import reset_accelerate

from eval.heads import TwoStageHead
from models.lm_head import FACTORS_DIR, LowRankHead, factorize, hidden_moment, token_weights

V, D = 512, 64


def random_head(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, D, generator=g)  # (V, d)


def test_full_rank_factors_reproduce_the_head():
    w = random_head()
    weights = token_weights(torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(1)))
    moment = hidden_moment(torch.randn(1000, D) * torch.linspace(0.1, 10, D))
    # the weighted fit goes through a Cholesky factor of a moment with condition number 1e4 (and a multi-threaded
    # SVD whose rounding varies from run to run): float32 leaves it a few 1e-4 off, the plain SVD 1e-5
    for f, tol in ((factorize(w, rank=D), 1e-4), (factorize(w, rank=D, weights=weights, hidden_moment=moment), 1e-3)):
        assert f.a.shape == (V, D) and f.b.shape == (D, D)
        torch.testing.assert_close(f.a @ f.b, w, atol=tol, rtol=tol)


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
    from tiny import drafted_trees, tiny_llama

    from eval.baselines import plain_generate
    from eval.decode import DecodeSettings
    from eval.eagle_proposer import EagleProposer
    from eval.heads import TwoStageProjection
    from methods.eagle2.config import EagleConfig
    from methods.eagle2.model import EagleDrafter
    from models.common import TargetParts

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
        tokens, trees[name] = drafted_trees(model, proposer, prompt, settings)
        assert tokens == plain
    assert trees["all"] == trees["full"]
    assert trees["few"] != trees["full"]


def test_native_export_stores_the_two_stage_factors_that_eval_reads(tmp_path, monkeypatch):
    from data.extract import main as extract_main
    from eval.heads import two_stage_projections
    from export.write import export, load_run
    from schema.recipe import load_recipe
    from train.loop import train

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    features, run = tmp_path / "features", tmp_path / "run"
    overrides = [f"data.features_dir={features}", f"train.output_dir={run}", "train.max_steps=2", "eval.head=two_stage",
                 "eval.head_rank=16", "eval.head_candidates=32"]  # fmt: skip
    extract_main(["recipes/tiny/eagle2.yaml", *overrides])
    reset_accelerate()
    train(load_recipe("recipes/tiny/eagle2.yaml", overrides))
    out = export(run)
    factors = LowRankHead.load(out / FACTORS_DIR)
    assert factors.rank == 16 and factors.a.shape == (8192, 16)
    recipe, target, drafter = load_run(run)
    (projection,), source = two_stage_projections(recipe, str(out), drafter, 8192, fit_data=None)
    assert source == str(out / FACTORS_DIR) and projection.head.candidates == 32
    torch.testing.assert_close(projection.head.a, factors.a)
    reset_accelerate()


# ------------------------------------------------------------------------------------------------
# Every drafter's draft heads: EAGLE-3's own head over its draft vocabulary, Medusa's heads


def _drafters(model):
    """An EAGLE-2 drafter, an EAGLE-3 drafter over 64 random draft tokens, 4 Medusa heads: weights off their init;
    the EAGLE drafters' stored layers are [0, 1, -1], so the last hidden state is not the first slot."""
    from tiny import perturbed

    from methods.eagle2.config import EagleConfig
    from methods.eagle2.model import EagleDrafter
    from methods.eagle3.config import Eagle3Config
    from methods.eagle3.model import Eagle3Drafter
    from methods.medusa1.config import MedusaConfig
    from methods.medusa1.model import MedusaHeads
    from models.common import TargetParts

    def parts(layers):
        return TargetParts(model.config, model.model.embed_tokens, model.lm_head, layers)

    torch.manual_seed(0)
    eagle3 = Eagle3Drafter(Eagle3Config(feature_layers=[0, 1, -1], draft_vocab=64, ttt_steps=3), parts([0, 1, -1]))
    eagle3.set_draft_vocab(torch.randperm(256, generator=torch.Generator().manual_seed(1))[:64], init_head=True)
    return {
        "eagle2": perturbed(EagleDrafter(EagleConfig(), parts([0, 1, -1]))),
        "eagle3": perturbed(eagle3),
        "medusa": perturbed(MedusaHeads(MedusaConfig(num_heads=4), parts([-1]))),
    }


def _sample(model, layers, seed=0):
    from tiny import make_samples, sample_hidden

    ids, mask = make_samples([14], seed=seed)[0]
    return {"input_ids": ids, "hidden": sample_hidden(model, ids, layers), "loss_mask": mask > 0}


@pytest.mark.parametrize("name", ["eagle2", "eagle3", "medusa"])
def test_every_draft_head_reads_what_its_projection_reads_and_is_fitted_to_it(name):
    """`draft_heads()`: one head for EAGLE (EAGLE-3's rows are its draft tokens), one per Medusa head. The fitting
    inputs are what the projection reads where its loss is taken (EAGLE-3: every unrolled step j at the positions
    whose token t+j+1 is a loss token; Medusa head k: those whose token t+k+1 is), the drafter's train/eval mode is
    left as it was, and `compute_factors` is the frequency- and moment-weighted SVD of exactly those inputs and the
    counts of the head's own tokens."""
    from tiny import tiny_llama

    from models.lm_head import compute_factors

    model = tiny_llama()
    drafter = _drafters(model)[name]
    heads = drafter.draft_heads()
    sample, other = _sample(model, drafter.stored_layers), _sample(model, drafter.stored_layers, seed=5)
    loss = sample["loss_mask"]
    assert [h.name for h in heads] == (["factors"] if name != "medusa" else [f"factors-head{k}" for k in range(1, 5)])
    for k, head in enumerate(heads, 1):
        inputs = head.inputs(sample)
        if name == "eagle3":
            assert head.token_ids.tolist() == drafter.draft_ids.tolist() and head.weight.shape == (64, 64)
            batch = {"input_ids": sample["input_ids"][None], "attention_mask": torch.ones(1, 14, dtype=torch.long),
                     "position_ids": torch.arange(14)[None], "hidden": sample["hidden"][None]}  # fmt: skip
            steps = drafter.unroll(batch)
            expect = torch.cat([out[0][: -j - 1][loss[j + 1 :]] for j, out in enumerate(steps)])
            assert len(steps) == 3 and inputs.shape == expect.shape
            torch.testing.assert_close(inputs, expect)
            for training in (True, False):
                drafter.train(training)
                head.inputs(sample)
                assert drafter.training is training
            drafter.eval()
        elif name == "medusa":
            torch.testing.assert_close(inputs, drafter.head_state(k, sample["hidden"][: -k - 1, 0][loss[k + 1 :]]))
            assert head.weight is drafter.projection(k).weight and head.token_ids is None
        else:
            torch.testing.assert_close(inputs, sample["hidden"][:, 2][loss])  # slot of -1 in [0, 1, -1]
        counts = torch.randint(0, 50, (256,), generator=torch.Generator().manual_seed(k))
        factors = compute_factors(head, [sample, other], counts, rank=8)
        mine = counts if head.token_ids is None else counts[head.token_ids]
        moment = hidden_moment(torch.cat([inputs, head.inputs(other)]))
        expect = factorize(head.weight.detach().float(), 8, weights=token_weights(mine), hidden_moment=moment)
        torch.testing.assert_close(factors.a @ factors.b, expect.a @ expect.b)


def test_eagle3_two_stage_over_its_own_head_drafts_among_candidates_and_keeps_greedy_output():
    """Candidates = the whole draft vocabulary: the own head's trees exactly; fewer: other trees, every drafted
    token a draft-vocabulary token, the same greedy output."""
    from tiny import drafted_trees, tiny_llama

    from eval.baselines import plain_generate
    from eval.decode import DecodeSettings
    from eval.eagle_proposer import EagleProposer
    from eval.heads import TwoStageProjection
    from eval.proposal import VocabProjection

    model = tiny_llama()
    drafter = _drafters(model)["eagle3"]
    (head,) = drafter.draft_heads()
    factors = factorize(head.weight, rank=8)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = DecodeSettings(max_new_tokens=16)
    plain = plain_generate(model, prompt, settings).tokens
    runs = {}
    for name, candidates in (("few", 6), ("all", 64), ("own", None)):
        if candidates is None:
            vocab = VocabProjection.trained(drafter.lm_head, drafter.draft_ids, 256)
        else:
            vocab = TwoStageProjection(TwoStageHead(head.weight, factors, candidates), 256, head.token_ids)
        tokens, runs[name] = drafted_trees(model, EagleProposer(drafter, 3, 3, 8, vocab), prompt, settings)
        assert tokens == plain
    assert runs["all"] == runs["own"] and runs["few"] != runs["own"]
    allowed = set(drafter.draft_ids.tolist())
    assert all(set(tree[1:]) <= allowed for tree in runs["few"])


def test_medusa_two_stage_heads_draft_among_their_candidates_and_keep_greedy_output():
    """One two-stage projection per Medusa head (4 heads, a tree 3 deep: the fourth is never drafted through):
    candidates = V gives the full heads' trees; fewer give other trees and the same greedy output."""
    from tiny import drafted_trees, tiny_llama

    from eval.baselines import plain_generate
    from eval.decode import DecodeSettings
    from eval.heads import TwoStageProjection
    from eval.static_proposers import MedusaProposer
    from eval.trees import medusa_tree

    model = tiny_llama()
    heads = _drafters(model)["medusa"]
    tree = medusa_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]], heads.cfg.num_heads)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = DecodeSettings(max_new_tokens=16)
    plain = plain_generate(model, prompt, settings).tokens
    runs = {}
    for name, candidates in (("few", 12), ("all", 256), ("full", None)):
        vocab = None
        if candidates is not None:
            vocab = [TwoStageProjection(TwoStageHead(h.weight, factorize(h.weight, rank=8), candidates), 256)
                     for h in heads.draft_heads()]  # fmt: skip
        tokens, runs[name] = drafted_trees(model, MedusaProposer(heads, tree, vocab), prompt, settings)
        assert tokens == plain
    assert runs["all"] == runs["full"] and runs["few"] != runs["full"]
    with pytest.raises(ValueError, match="eval.head_candidates: 2 tokens, fewer than the top 3"):
        MedusaProposer(heads, tree, [TwoStageProjection(TwoStageHead(heads.projection(1).weight,
                       factorize(heads.projection(1).weight, rank=8), 2), 256)] * 3)  # fmt: skip


def test_eagle3_export_stores_its_heads_factors_that_eval_reads(tmp_path, monkeypatch):
    """`eval.head: two_stage` on an EAGLE-3 run: the native export stores factors over its draft vocabulary's rows,
    and eval's projections read them (not recomputed) and draft target token ids."""
    from data.extract import main as extract_main
    from eval.heads import two_stage_projections
    from export.write import export, load_run
    from schema.recipe import load_recipe
    from train.loop import train

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    features, run = tmp_path / "features", tmp_path / "run"
    overrides = [f"data.features_dir={features}", f"train.output_dir={run}", "train.max_steps=2", "eval.head=two_stage",
                 "eval.head_rank=16", "eval.head_candidates=32", "train.eval_every=0"]  # fmt: skip
    extract_main(["recipes/tiny/eagle3.yaml", *overrides])
    reset_accelerate()
    try:
        train(load_recipe("recipes/tiny/eagle3.yaml", overrides))
        out = export(run)
    finally:
        reset_accelerate()
    recipe, target, drafter = load_run(run)
    factors = LowRankHead.load(out / FACTORS_DIR)
    assert factors.a.shape == (recipe.drafter.draft_vocab, 16)

    def refit():
        raise AssertionError("the stored factors should be read")

    (projection,), source = two_stage_projections(recipe, str(out), drafter, target.config.vocab_size, refit)
    assert source == str(out / FACTORS_DIR)
    torch.testing.assert_close(projection.head.a, factors.a)
    logits = projection(torch.randn(2, drafter.fc.out_features))  # (2, V) over target ids
    drafted = torch.isfinite(logits).nonzero()[:, 1]
    assert len(drafted) == 64 and drafter.t2d[drafted].all()


def test_unreadable_factors_are_named(tmp_path):
    """A factors file without `b`, or cut short, is refused naming the file (it used to be a bare safetensors error)."""
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'x.safetensors'}: no tensor 'b'"):
        LowRankHead.load(tmp_path, "x")
    (tmp_path / "y.safetensors").write_bytes(b"12")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'y.safetensors'}: not readable low-rank factors"):
        LowRankHead.load(tmp_path, "y")


def test_the_benchmark_gives_no_goal_figure_without_smollm2(tmp_path, monkeypatch, capsys):
    """`benchmarks/lm_head.py` without SmolLM2's head or its features says it cannot measure, gives the goal line as
    n/a and exits with status 1: it used to report a goal figure measured on random hidden states."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("lm_head_bench", Path(__file__).parents[1] / "benchmarks/lm_head.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "FEATURES", tmp_path / "features")  # absent
    monkeypatch.setattr(sys, "argv", ["lm_head", "--positions", "64", "--timed", "8", "--repeats", "1"])
    with pytest.raises(SystemExit) as stop:
        bench.main()
    assert stop.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cannot measure: ") and str(tmp_path / "features" / "manifest.json") in lines[0]
    assert lines[-1] == "lm_head/top1_recall_at_quarter_cost: n/a (goal >= 0.98)"
    assert not any("recall" in line for line in lines[:-1])  # no figure of any setting
