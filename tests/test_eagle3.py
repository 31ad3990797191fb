"""EAGLE-3 drafter on a tiny random Llama target: training-time test against drafting, the draft vocabulary,
the loss against a hand computation, packing invariance, the EAGLE-3.1 switches, and lossless drafting.

    .venv/bin/pytest tests/test_eagle3.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from tiny import drafted_trees, make_batch, make_samples, reset_accelerate, sample_hidden
from tiny import tiny_llama as tiny_target

from data.extract import main as extract_main
from data.heldout import read_heldout
from data.loader import BatchLoader
from data.shards import FeatureDataset
from data.vocab_counts import frequent_loss_tokens
from eval.baselines import plain_generate
from eval.decode import DecodeSettings, speculative_generate
from eval.eagle_proposer import EagleProposer
from eval.proposal import DecodeState, VocabProjection
from eval.proposers import build_proposer
from export.gates import check as gate_check
from export.imports import main as imports_main
from export.write import export, load_run
from methods import METHODS
from methods.eagle3 import layouts as eagle3_layouts
from methods.eagle3.config import Eagle3Config
from methods.eagle3.gates import compare, drafter_logits, eagle3_inputs
from methods.eagle3.imports import import_eagle3
from methods.eagle3.model import Eagle3Drafter
from models.common import DraftBatch, TargetParts
from models.io import ExportError, load_draft_vocab, load_drafter, save_draft_vocab
from models.target import load_target
from rundir.checkpoints import latest_checkpoint
from schema.recipe import load_recipe, recipe_from_dict
from train import TrainingError, loop
from train.checkpoint import DRAFTER_FILE, METRICS_FILE
from train.loop import MIN_IN_VOCAB, draft_vocab_warning, train

torch.set_num_threads(1)
LAYERS = [0, 1, -1]  # stored hidden states: embeddings, layer 1's input, the last one
VOCAB = 256


def drafter_for(model, seed: int = 0, vocab: int = 200, **kw) -> Eagle3Drafter:
    """A drafter with every weight random (norms too) over a draft vocabulary of `vocab` random target tokens."""
    torch.manual_seed(seed)
    cfg = Eagle3Config(feature_layers=[0, 1, -1], draft_vocab=vocab, **kw)
    drafter = Eagle3Drafter(cfg, TargetParts(model.config, model.model.embed_tokens, model.lm_head, LAYERS))
    drafter.set_draft_vocab(torch.randperm(VOCAB)[:vocab], init_head=False)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


@pytest.fixture(scope="module")
def setup():
    model = tiny_target()
    samples = make_samples([11, 8, 13])
    padded = make_batch(model, samples, LAYERS, rows=[[0], [1], [2]], width=13)
    packed = make_batch(model, samples, LAYERS, rows=[[0, 1], [2]], width=20)
    return model, samples, padded, packed


DEEP = {"num_layers": 3, "norm_output": True}  # the layers after the first: plain Llama layers, a cache each
SWITCHES = [{}, {"fc_norm": True, "norm_output": True}, {"norm_before_residual": True, "ttt_steps": 5}, DEEP]


@pytest.mark.parametrize("kw", SWITCHES)
def test_training_time_test_is_what_drafting_computes(setup, kw):
    """Unrolled step j at position t == drafting j tokens ahead from prefix t with the true tokens: the target's
    features up to t through the cache, then the drafter's own outputs, one position a step."""
    model, _, padded, _ = setup
    drafter = drafter_for(model, **kw)
    steps = drafter.unroll(padded)
    assert len(steps) == drafter.cfg.ttt_steps
    row, T = 2, 13
    ids = padded["input_ids"][row : row + 1]
    feats = padded["hidden"][row : row + 1].flatten(2)  # (1, T, 3·d): layers 0, 1, -1 in feature_layers order
    for t in (3, 7):
        cache = drafter.new_cache()
        logits, hidden = drafter.step(feats[:, : t + 1], ids[:, 1 : t + 2], torch.arange(t + 1)[None], cache)
        for j in range(drafter.cfg.ttt_steps):
            if t + j + 1 >= T:
                break
            if j > 0:
                token, pos = ids[:, t + j + 1 : t + j + 2], torch.tensor([[t + j]])
                logits, hidden = drafter.step(hidden[:, -1:], token, pos, cache, from_target=False)
            want = drafter.draft_logits(steps[j][row, t])
            torch.testing.assert_close(logits[0, -1], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [*SWITCHES[:2], DEEP])
def test_packed_and_padded_give_the_same_unrolled_outputs_and_loss(setup, kw):
    model, _, padded, packed = setup
    drafter = drafter_for(model, **kw)
    a, b = drafter.unroll(padded), drafter.unroll(packed)
    for j in range(len(a)):  # sample 1 sits at positions 11..18 of packed row 0; steps past its end differ
        torch.testing.assert_close(b[j][0, 11 : 19 - j - 1], a[j][1, : 8 - j - 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drafter(padded)["loss"], drafter(packed)["loss"], atol=1e-5, rtol=1e-5)


def test_loss_matches_hand_computation(setup):
    """Σ_j 0.8^j Σ_t CE(softmax of the target's logits restricted to the draft vocabulary, draft logits) / #loss
    tokens, over positions whose target top-1 is a draft token; the others count only in acc@1."""
    model, samples, padded, _ = setup
    drafter = drafter_for(model, vocab=120, ttt_steps=3)
    steps = drafter.unroll(padded)
    ids_of = drafter.draft_ids
    total, n_loss = 0.0, sum(float(m.sum()) for _, m in samples)
    for j, normed in enumerate(steps):
        for b, (ids, mask) in enumerate(samples):
            T = len(ids)
            for t in range(T - j - 1):
                if mask[t + j + 1] == 0:
                    continue
                logits_t = model.lm_head(padded["hidden"][b, t + j + 1, 2])
                if int(logits_t.argmax()) not in ids_of.tolist():
                    continue
                p = logits_t[ids_of].softmax(-1)
                q = drafter.draft_logits(normed[b, t]).log_softmax(-1)
                total += 0.8**j * float(-(p * q).sum().detach())
    out = drafter(padded)
    assert 0 < float(out["in_vocab"]) < 1  # some positions are left out: the test covers both branches
    assert float(out["loss"].detach()) == pytest.approx(total / n_loss, rel=1e-4)


def test_a_batch_shorter_than_the_unrolled_steps_reports_every_step(setup):
    """A micro-batch of T <= ttt_steps tokens still runs all ttt_steps steps (the later ones with nothing to predict):
    processes that all-reduce the metrics, or gather ZeRO-3 shards per layer call, must agree on both. Its loss is
    that of the steps that have targets."""
    model, samples, _, _ = setup
    short = make_batch(model, [(ids[:5], mask[:5]) for ids, mask in samples], LAYERS, rows=[[0], [1], [2]], width=5)
    full = drafter_for(model, ttt_steps=7)(short)
    assert {f"step{j}/acc@1" for j in range(1, 7)} <= full.keys()
    assert all(float(full[f"step{j}/loss_ce"]) == 0.0 for j in (4, 5, 6))  # T = 5: no target 6 or more tokens ahead
    cut = drafter_for(model, ttt_steps=4)(short)
    torch.testing.assert_close(full["loss"], cut["loss"])


@pytest.mark.parametrize("layers", [1, 2])
def test_gradients_reach_every_trained_tensor_through_the_unrolled_steps(setup, layers):
    model, _, padded, _ = setup
    drafter = drafter_for(model, vocab=VOCAB, ttt_steps=3, num_layers=layers).train()
    drafter(padded)["loss"].backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in model.parameters())  # the target stays frozen
    assert set(drafter.trainable_state_dict()) == {n for n, _ in drafter.named_parameters()} | {"d2t", "t2d"}
    assert not any(n.startswith(("embed", "_")) for n in drafter.state_dict())


def test_draft_vocabulary_offsets_membership_and_head_start(setup):
    model = setup[0]
    drafter = drafter_for(model, vocab=4)
    drafter.set_draft_vocab(torch.tensor([200, 7, 31, 90]), init_head=True)
    assert drafter.draft_ids.tolist() == [7, 31, 90, 200]  # sorted: d2t offsets grow, engines index in order
    assert drafter.d2t.tolist() == [7, 30, 88, 197]  # target id = draft id + d2t[draft id]
    assert drafter.t2d.sum() == 4 and drafter.t2d[[7, 31, 90, 200]].all()
    assert torch.equal(drafter.lm_head.weight, model.lm_head.weight[[7, 31, 90, 200]])
    with pytest.raises(ValueError, match="drafter.draft_vocab: 4 distinct tokens needed, got 3"):
        drafter.set_draft_vocab(torch.tensor([1, 2, 2, 3]), init_head=False)


def test_its_own_head_takes_the_head_learning_rate(setup):
    from schema.sections import TrainConfig
    from train.optim import param_groups

    drafter = drafter_for(setup[0])
    groups = param_groups(drafter, TrainConfig(lr=1e-3, head_lr_mult=0.1))
    head = [g for g in groups if any(p is drafter.lm_head.weight for p in g["params"])]
    assert len(head) == 1 and len(head[0]["params"]) == 1 and head[0]["lr"] == pytest.approx(1e-4)
    assert all(g["lr"] == 1e-3 for g in groups if g is not head[0])


def test_default_feature_layers_are_low_mid_high():
    assert Eagle3Config().resolved_layers(30) == [2, 15, 27]
    assert Eagle3Config().resolved_layers(8) == [2, 4, 5]
    with pytest.raises(ValueError, match="a 6-layer target has no distinct low/mid/high"):
        Eagle3Config().resolved_layers(6)
    assert Eagle3Config(feature_layers=[0, 1, -1]).resolved_layers(2) == [0, 1, -1]


def recipe(**drafter) -> dict:
    return {
        "target": {"random_init": {"model_type": "llama", "num_hidden_layers": 8}, "tokenizer": "x"},
        "data": {"train_files": ["x.jsonl"], "layers": [2, 4, 5, -1], "features_dir": "f"},
        "drafter": {"method": "eagle3", **drafter},
    }


def test_recipe_checks_the_stored_layers_and_the_vocabulary_settings():
    assert recipe_from_dict(recipe()).drafter.draft_vocab == 32000
    with pytest.raises(Exception, match=r"data.layers: must store the drafter's layers \[2, 4, 5\] and -1; missing"):
        recipe_from_dict({**recipe(), "data": {"train_files": ["x.jsonl"], "layers": [4, 5, -1]}})
    assert recipe_from_dict({**recipe(draft_vocab=200), "eval": {"draft_vocab": 100}}).eval.draft_vocab == 100
    with pytest.raises(Exception, match=r"eval.draft_vocab: 300 is more than .* \(drafter.draft_vocab: 200\)"):
        recipe_from_dict({**recipe(draft_vocab=200), "eval": {"draft_vocab": 300}})
    with pytest.raises(Exception, match="drafter.ttt_steps: must be >= 1"):
        recipe_from_dict(recipe(ttt_steps=0))
    with pytest.raises(Exception, match="drafter.num_layers: must be >= 1"):
        recipe_from_dict(recipe(num_layers=0))
    with pytest.raises(Exception, match=r"drafter.num_layers: 9 is more than the target's num_hidden_layers \(8\)"):
        recipe_from_dict(recipe(num_layers=9))


def test_num_layers_came_later_and_is_hashed_only_when_set():
    """Runs trained before `drafter.num_layers` existed (one layer) keep their recipe hash, so they still resume and
    export; two layers is another drafter, and EAGLE-2's num_layers (there from the start) stays hashed."""
    hashed = lambda raw: recipe_from_dict(raw).hashed_settings("drafter")["drafter"]  # noqa: E731
    one, two = hashed(recipe()), hashed(recipe(num_layers=2))
    assert "num_layers" not in one and two["num_layers"] == 2 and {**one, "num_layers": 2} == two
    assert recipe_from_dict(recipe()).section_hash("drafter") != recipe_from_dict(recipe(num_layers=2)).section_hash(
        "drafter"
    )
    eagle2 = {**recipe(), "data": {"train_files": ["x.jsonl"], "layers": [-1]}, "drafter": {"method": "eagle2"}}
    assert hashed(eagle2)["num_layers"] == 1


def test_a_report_of_before_num_layers_is_replaced_by_the_same_evaluation(tmp_path):
    """An evaluation report whose recipe.yaml predates `drafter.num_layers` (no such key) was made with one layer: the
    same evaluation replaces it, a 2-layer drafter's is refused naming the setting."""
    import yaml

    from eval import EvalError
    from eval.run import check_output_dir

    recipe = load_recipe(RECIPE)
    out = tmp_path / "eval"
    out.mkdir()
    (out / "report.json").write_text("{}\n")
    saved = yaml.safe_load(yaml.safe_dump(recipe.to_dict()))
    del saved["drafter"]["num_layers"]
    (out / "recipe.yaml").write_text(yaml.safe_dump(saved))
    check_output_dir(recipe, str(out))
    with pytest.raises(EvalError, match=r"other settings \(drafter.num_layers: 1 there, 2 in "):
        check_output_dir(load_recipe(RECIPE, ["drafter.num_layers=2"]), str(out))


@pytest.mark.parametrize("tree,layers", [("dynamic", 1), ("chain", 1), ("dynamic", 3)])
def test_drafting_over_the_own_vocabulary_keeps_greedy_output(setup, tree, layers):
    model = setup[0]
    drafter = drafter_for(model, vocab=64, num_layers=layers)
    vocab = VocabProjection.trained(drafter.lm_head, drafter.draft_ids, VOCAB)
    top_k, total = (3, 8) if tree == "dynamic" else (1, 4)
    proposer = EagleProposer(drafter, depth=3, top_k=top_k, total_tokens=total, draft_vocab=vocab)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = DecodeSettings(max_new_tokens=20)
    tokens, drafted = drafted_trees(model, proposer, prompt, settings)
    assert tokens == plain_generate(model, prompt, settings).tokens
    allowed = set(drafter.draft_ids.tolist())
    assert drafted and all(set(t[1:]) <= allowed for t in drafted)


@pytest.mark.parametrize("kw", [*SWITCHES[:2], DEEP])
def test_the_proposer_drafts_what_training_unrolls(setup, kw):
    """A batch of two prompts of different lengths drafted as chains by the evaluation's proposer, over two rounds
    (the second after each row accepted part of its chain): the logits of every draft step, and so every drafted
    token, are those of the unrolled step that training computes for it (the chain fed back as the true tokens).
    Ties the proposer's catch-up, cache cropping and ragged rows to training; greedy losslessness holds whatever
    is drafted, so it cannot."""
    model = setup[0]
    depth = 5
    drafter = drafter_for(model, **{**kw, "ttt_steps": depth})
    vocab = VocabProjection.trained(drafter.lm_head, drafter.draft_ids, VOCAB)
    proposer = EagleProposer(drafter, depth=depth, top_k=1, total_tokens=depth + 1, draft_vocab=vocab)
    proposer.reset(2)
    drafted_logits = []  # per drafter call this round: (B, 1, K) at each row's drafting position
    step = drafter.step

    def recording_step(*args, **kwargs):
        logits, hidden = step(*args, **kwargs)
        drafted_logits.append(logits)
        return logits, hidden

    drafter.step = recording_step

    def hidden(tokens: torch.Tensor) -> torch.Tensor:  # (1, L) -> the target's stored layers (1, L, 3, d)
        return sample_hidden(model, tokens[0], LAYERS)[None]

    def unrolled_logits(tokens: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:  # -> (depth, K)
        seq = torch.cat([tokens, chain[None]], dim=1)
        T = seq.shape[1]
        ones = torch.ones(1, T)
        batch = DraftBatch(
            input_ids=seq,
            loss_mask=ones,
            attention_mask=ones.long(),
            position_ids=torch.arange(T)[None],
            hidden=hidden(seq),
        )
        t = tokens.shape[1] - 2  # the last cached position: its unrolled step j drafts chain[j]
        return torch.stack([drafter.draft_logits(normed[0, t]) for normed in drafter.unroll(batch)])

    gen = torch.Generator().manual_seed(9)
    rows = [torch.randint(0, VOCAB, (1, 7), generator=gen), torch.randint(0, VOCAB, (1, 12), generator=gen)]
    cached = [0, 0]  # target positions whose features the proposer has seen
    for paths in [[0, 1], [0, 1, 2, 3]], None:  # round 1, then round 2 after these accepted paths (root first)
        drafted_logits.clear()
        states = [DecodeState(tokens=t, new_hidden=hidden(t[:, :-1])[:, c:]) for t, c in zip(rows, cached)]
        chains = [tree.tokens[1:] for tree in proposer.propose(states)]
        assert len(drafted_logits) == depth  # the catch-up, then one call per further step
        for b, (tokens, chain) in enumerate(zip(rows, chains)):
            want = unrolled_logits(tokens, chain)
            torch.testing.assert_close(
                torch.stack([logits[b, 0] for logits in drafted_logits]), want, atol=2e-5, rtol=1e-5
            )
            assert chain.tolist() == drafter.draft_ids[want.argmax(-1)].tolist()
        if paths is None:
            break
        proposer.commit(paths)
        cached = [t.shape[1] - 1 for t in rows]
        roots = torch.tensor([[5], [9]])  # the target's next token after each accepted path
        rows = [torch.cat([t, c[None, : len(p) - 1], r[None]], dim=1) for t, c, p, r in zip(rows, chains, paths, roots)]


def test_eval_draft_vocab_drafts_among_the_most_frequent_of_its_own_tokens(setup):
    """`eval.draft_vocab: N` on an EAGLE-3 drafter keeps those N of its own head's rows (an equal-cost pruned head);
    N tokens outside its draft vocabulary are refused."""
    model = setup[0]
    drafter = drafter_for(model, vocab=64)
    ev = recipe_from_dict(recipe(draft_vocab=64)).eval
    ev = type(ev)(**{**vars(ev), "tree": "dynamic", "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 8})
    subset = drafter.draft_ids[torch.randperm(64, generator=torch.Generator().manual_seed(2))[:16]]
    proposer, desc = build_proposer(METHODS["eagle3"], drafter, ev, calibrate=None, draft_vocab=subset)
    assert desc.endswith("own draft vocab 64, draft vocab 16") and proposer.vocab.size == 16
    rows = torch.searchsorted(drafter.draft_ids, subset)
    h = torch.randn(2, 64)
    torch.testing.assert_close(proposer.vocab(h), drafter.draft_logits(h)[:, rows])
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = DecodeSettings(max_new_tokens=20)
    tokens, drafted = drafted_trees(model, proposer, prompt, settings)
    assert tokens == plain_generate(model, prompt, settings).tokens
    assert drafted and all(set(t[1:]) <= set(subset.tolist()) for t in drafted)
    outside = torch.nonzero(~drafter.t2d).flatten()[:3]
    with pytest.raises(ValueError, match="eval.draft_vocab: 19 tokens, not all among its own 64 draft"):
        build_proposer(METHODS["eagle3"], drafter, ev, calibrate=None, draft_vocab=torch.cat([subset, outside]))


# ------------------------------------------------------------------------------------------------
# The training pipeline: extract -> train (offline and online) -> resume -> export -> draft

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/tiny/eagle3.yaml"
QUIET = ["train.eval_every=0", "train.save_every=0", "train.log_every=1", "logging.tracker=none"]


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eagle3") / "features"
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    extract_main([str(RECIPE), f"data.features_dir={out}"])
    mp.undo()
    reset_accelerate()
    return out


def tiny_recipe(features: Path, out: Path, *overrides: str):
    return load_recipe(RECIPE, [f"data.features_dir={features}", f"train.output_dir={out}", *QUIET, *overrides])


def test_offline_and_online_runs_choose_the_same_draft_vocabulary_and_train(features, tmp_path, at_root, capsys):
    """Offline (feature shards) and online (the target computes hidden states in the loop) runs keep the same draft
    vocabulary beside their checkpoints, the most frequent loss tokens of the training split (the held-out samples
    left out), and both train every tensor. A random target's top-1 tokens mostly fall outside the data's frequent
    tokens: the run says so once, at its held-out evaluation."""
    common = ["train.max_steps=2", "train.lr=0.01", "train.warmup_steps=0"]
    train(tiny_recipe(features, tmp_path / "off", *common))
    printed = capsys.readouterr().out
    assert printed.count("of held-out loss positions have the target's top-1 token inside the draft vocabulary") == 1
    assert "(drafter.draft_vocab=128); the others give no loss" in printed
    reset_accelerate()
    train(tiny_recipe(features, tmp_path / "on", *common, "train.online=true"))
    vocab = load_draft_vocab(tmp_path / "off")
    heldout = read_heldout(tmp_path / "off")
    assert heldout and sorted(read_heldout(tmp_path / "on")) == sorted(heldout)  # the same split
    assert torch.equal(vocab, frequent_loss_tokens(FeatureDataset(features), 128, skip_ids=heldout))
    assert torch.equal(load_draft_vocab(tmp_path / "on"), vocab)
    for run in ("off", "on"):
        r = load_recipe(tmp_path / run / "recipe.yaml")
        target = load_target(**vars(r.target))
        set_seed(r.train.seed)  # the drafter exactly as training initialised it
        initial = Eagle3Drafter(r.drafter, target.parts(r.data.layers))
        initial.set_draft_vocab(vocab, init_head=True)
        after = trained(tmp_path / run)
        assert after.keys() == {name for name, _ in initial.named_parameters()}
        for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"):
            assert not torch.equal(after[name], initial.state_dict()[name]), f"{run}: {name} did not change"


def test_first_records_trains_on_a_prefix_of_the_data_with_the_whole_heldout_split(features, tmp_path, at_root):
    """train.first_records: the training batches hold only samples of the first N records, the held-out split is the
    whole data's, and the draft vocabulary is counted on the samples trained on."""
    whole = tiny_recipe(features, tmp_path / "all")
    part = tiny_recipe(features, tmp_path / "part", "train.first_records=6", "drafter.draft_vocab=16")
    target = load_target(**vars(whole.target))
    accelerator = Accelerator(cpu=True)
    train_all, _, heldout_all = loop.build_loaders(whole, target, accelerator)
    train_part, _, heldout_part = loop.build_loaders(part, target, accelerator)
    ids = FeatureDataset(features).sample_ids
    assert heldout_part == heldout_all
    assert [ids[i] for i in train_part.indices] == [ids[i] for i in train_all.indices if ids[i] < 6]
    assert 0 < len(train_part.indices) < len(train_all.indices)
    reset_accelerate()
    train(tiny_recipe(features, tmp_path / "part", "train.first_records=6", "drafter.draft_vocab=16"))
    unused = [i for i in ids if i >= 6 or i in read_heldout(tmp_path / "part")]
    assert torch.equal(load_draft_vocab(tmp_path / "part"), frequent_loss_tokens(FeatureDataset(features), 16, unused))
    assert not torch.equal(
        load_draft_vocab(tmp_path / "part"), frequent_loss_tokens(FeatureDataset(features), 16, heldout_all)
    )


def trained(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(run) / DRAFTER_FILE))


def losses(run: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (run / METRICS_FILE).read_text().splitlines()]


def test_stop_and_resume_reproduces_the_uninterrupted_run(features, tmp_path, at_root, monkeypatch):
    """... and keeps the draft vocabulary the run recorded, even where counting the data now gives another (new data,
    another counting rule): the checkpoint's head rows belong to the recorded tokens."""
    common = ["train.max_steps=4", "train.save_every=2", "drafter.input_noise=0.05"]
    train(tiny_recipe(features, tmp_path / "a", *common))
    reset_accelerate()
    assert train(tiny_recipe(features, tmp_path / "b", *common), stop_after=2).name == "step-000002"
    reset_accelerate()
    recorded = load_draft_vocab(tmp_path / "b")
    monkeypatch.setattr(loop, "frequent_loss_tokens", lambda *args: torch.arange(1000, 1128))
    train(tiny_recipe(features, tmp_path / "b", *common, "train.resume=auto"))
    assert torch.equal(load_draft_vocab(tmp_path / "b"), recorded)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    a, b = trained(tmp_path / "a"), trained(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_native_export_reloads_to_identical_logits_and_drafts_losslessly(features, tmp_path, at_root):
    train(tiny_recipe(features, tmp_path / "run", "train.max_steps=3"))
    out = export(tmp_path / "run")
    recipe, target, drafter = load_run(tmp_path / "run")
    loaded = load_drafter(out, target)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    # the run's draft tokens, most frequent first, ship too: eval.draft_vocab then needs no shards
    assert torch.equal(load_draft_vocab(out), load_draft_vocab(tmp_path / "run"))
    batch = next(BatchLoader(FeatureDataset(features), [0, 1], batch_size=2, max_len=128).batches())
    with torch.no_grad():
        for x, y in zip(loaded.unroll(batch), drafter.unroll(batch)):
            assert torch.equal(loaded.draft_logits(x), drafter.draft_logits(y))
    proposer, desc = build_proposer(METHODS["eagle3"], loaded, recipe.eval, calibrate=None)
    assert desc.endswith("own draft vocab 128")
    prompt = torch.tensor([[5, 17, 300, 42, 9, 11]])
    settings = DecodeSettings(max_new_tokens=16)
    assert speculative_generate(target.model, proposer, prompt, settings).tokens == (
        plain_generate(target.model, prompt, settings).tokens
    )


def test_a_replaced_draft_vocabulary_is_refused_by_resume_and_export(features, tmp_path, at_root):
    """The head rows of a checkpoint belong to the tokens recorded beside it; a `draft_vocab.safetensors` replaced
    since (another tool, another run) would map them to other tokens: resuming and exporting refuse it, naming it."""
    run = tmp_path / "run"
    train(tiny_recipe(features, run, "train.max_steps=4"), stop_after=2)
    reset_accelerate()
    recorded = load_draft_vocab(run)
    save_draft_vocab(run, recorded.flip(0))  # the same tokens in another order: other rows for each
    with pytest.raises(TrainingError, match=r"draft_vocab.safetensors: not the draft vocabulary .*step-000002 was"):
        train(tiny_recipe(features, run, "train.max_steps=4", "train.resume=auto"))
    with pytest.raises(ExportError, match=r"draft_vocab.safetensors: not the draft vocabulary .*step-000002 was"):
        export(run)
    reset_accelerate()
    save_draft_vocab(run, recorded)
    train(tiny_recipe(features, run, "train.max_steps=4", "train.resume=auto"))
    assert export(run).is_dir()


def test_a_draft_vocabulary_larger_than_the_data_is_refused_in_one_line(features, tmp_path, at_root):
    with pytest.raises(TrainingError, match=r"drafter.draft_vocab: 8000 asked, the training split has \d+ distinct"):
        train(tiny_recipe(features, tmp_path / "run", "train.max_steps=2", "drafter.draft_vocab=8000"))


# ------------------------------------------------------------------------------------------------
# Engine layouts: each passes its consumer's load gate; what a consumer would read wrong is caught


@pytest.fixture(scope="module")
def run(features, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eagle3-run") / "run"
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    reset_accelerate()
    train(tiny_recipe(features, out, "train.max_steps=3"))
    reset_accelerate()
    mp.undo()
    return out


@pytest.mark.parametrize("fmt", ["speculators", "vllm", "sglang"])
def test_engine_layouts_pass_their_consumers_gate(fmt, run, tmp_path):
    out = export(run, tmp_path / fmt, fmt=fmt)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    _, target, drafter = load_run(run)
    assert torch.equal(tensors["d2t"], drafter.d2t) and torch.equal(tensors["t2d"], drafter.t2d)
    assert tensors["lm_head.weight"].shape == (128, 64) and tensors["fc.weight"].shape == (64, 3 * 64)
    if fmt == "sglang":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 128
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # outputs of layers 0..2
        assert any(k.startswith("midlayer.") for k in tensors) and "embed_tokens.weight" not in tensors
    else:
        assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # inputs of layers 1..3
        assert config["transformer_layer_config"]["vocab_size"] == 8192
        assert config["speculators_config"]["verifier"]["name_or_path"] == "random_init:llama"
        assert torch.equal(tensors["embed_tokens.weight"], target.embed_tokens.weight)
        assert any(k.startswith("layers.0.") for k in tensors)


def broken(out: Path, edit) -> None:
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    edit(config, tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))


@pytest.mark.parametrize(
    "fmt,edit,why",
    [
        ("speculators", lambda c, t: c.pop("norm_before_residual"), "no norm_before_residual"),
        ("speculators", lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), "differ by"),
        ("speculators", lambda c, t: t.update(d2t=t["d2t"] + torch.arange(128)), "d2t"),
        ("sglang", lambda c, t: t.update({k.replace("midlayer.", "layers.0."): t.pop(k) for k in list(t)
                                          if k.startswith("midlayer.")}), "midlayer.self_attn.q_proj.weight missing"),
        # SGLang captures outputs of layers 0..L-2: on this 4-layer target, shifted ids leave that range
        ("sglang", lambda c, t: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]), "out of range"),
        # vLLM and SGLang build dynamic NTK RoPE with a fixed base, not transformers' length-dependent one
        ("speculators", lambda c, t: c["transformer_layer_config"].update(rope_scaling={"type": "dynamic",
                                                                                        "factor": 2.0}), "'dynamic'"),
        ("sglang", lambda c, t: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}), "'dynamic'"),
    ],
)  # fmt: skip
def test_gates_catch_what_a_consumer_reads_wrong(fmt, edit, why, run, tmp_path):
    out = export(run, tmp_path / fmt, fmt=fmt)
    broken(out, edit)
    recipe, target, drafter = load_run(run)
    with pytest.raises(ExportError, match=why):
        gate_check(fmt, out, recipe, target, drafter)


def test_a_deeper_drafter_exports_every_layer_for_vllm_and_imports_back(features, tmp_path, at_root):
    """`drafter.num_layers: 2`: the speculators layout holds `layers.0.*` (EAGLE-3's layer) and `layers.1.*` (a plain
    Llama layer: d inputs, no hidden_norm) with `num_hidden_layers: 2`, and passes the vLLM / speculators readers'
    gate, which builds the layers from the config: a config that says one layer is caught. SGLang's EAGLE-3 drafter
    has one layer: refused, naming the field. Imported back, the checkpoint gives the trained drafter's logits."""
    train(tiny_recipe(features, tmp_path / "run", "train.max_steps=2", "drafter.num_layers=2"))
    recipe, target, drafter = load_run(tmp_path / "run")
    assert torch.equal(load_drafter(export(tmp_path / "run", tmp_path / "native"), target).layers["1"].mlp.up_proj
                       .weight, drafter.layers["1"].mlp.up_proj.weight)  # fmt: skip
    out = export(tmp_path / "run", tmp_path / "spec", fmt="speculators")
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * 64)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    assert "layers.1.hidden_norm.weight" not in tensors
    assert gate_check("speculators", out, recipe, target, drafter) <= 1e-4
    imported, _ = import_eagle3(config, tensors, out / "model.safetensors", target, speculators=True)
    inputs = eagle3_inputs(drafter, 4, 8192)
    torch.testing.assert_close(drafter_logits(imported, *inputs), drafter_logits(drafter, *inputs), atol=1e-5, rtol=0)
    broken(out, lambda c, t: c["transformer_layer_config"].update(num_hidden_layers=1))
    with pytest.raises(ExportError, match="speculators load gate: draft logits .* differ"):
        gate_check("speculators", out, recipe, target, drafter)
    with pytest.raises(ExportError, match=r"^export.format: sglang's EAGLE-3 drafter has one decoder layer \(drafter"):
        export(tmp_path / "run", tmp_path / "sglang", fmt="sglang")
    assert not (tmp_path / "sglang").exists()


def test_speculators_export_of_a_bf16_target_names_the_trained_dtype(features, tmp_path, at_root):
    """A float32 drafter of a bf16 target stores the target's bf16 embedding beside its float32 tensors. The export
    says `dtype: float32`, and its gate holds it to float32's tolerance (its own head, no bf16 projection): without
    the field, transformers' from_pretrained (how the speculators package loads) would read every tensor in the
    first stored one's bf16, which the gate catches."""
    train(tiny_recipe(features, tmp_path / "run", "train.max_steps=2", "train.online=true", "target.dtype=bfloat16"))
    out = export(tmp_path / "run", tmp_path / "spec", fmt="speculators")
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert config["dtype"] == "float32"
    assert tensors["embed_tokens.weight"].dtype == torch.bfloat16 and tensors["fc.weight"].dtype == torch.float32
    recipe, target, drafter = load_run(tmp_path / "run")
    assert gate_check("speculators", out, recipe, target, drafter) <= 1e-4 * 100
    broken(out, lambda c, t: c.pop("dtype"))
    with pytest.raises(ExportError, match="every tensor is loaded in embed_tokens.weight's bfloat16"):
        gate_check("speculators", out, recipe, target, drafter)


def test_sglang_refuses_what_its_eagle3_layer_cannot_hold(features, tmp_path, at_root):
    train(tiny_recipe(features, tmp_path / "run", "train.max_steps=2", "drafter.norm_output=true"))
    with pytest.raises(ExportError, match="sglang's EAGLE-3 layer has no norm_output"):
        export(tmp_path / "run", tmp_path / "out", fmt="sglang")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    out = export(tmp_path / "run", tmp_path / "spec", fmt="speculators")  # speculators / vLLM hold EAGLE-3.1
    assert json.loads((out / "config.json").read_text())["norm_output"] is True


@pytest.mark.parametrize("fmt,fc_norm", [("speculators", True), ("sglang", False)])
def test_fused_layers_listed_out_of_order_are_exported_in_layer_order(fmt, fc_norm, features, tmp_path, at_root,
                                                                       monkeypatch):  # fmt: skip
    """Engines capture the auxiliary hidden states in layer order whatever order the config lists: the export sorts
    the ids and permutes fc's input blocks (and the FC-Norm weights) to match; an export that did not fails its gate."""
    train(tiny_recipe(features, tmp_path / "run", "train.max_steps=2", "drafter.feature_layers=[3,1,2]",
                      f"drafter.fc_norm={str(fc_norm).lower()}"))  # fmt: skip
    _, _, drafter = load_run(tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / fmt, fmt=fmt)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    ids = config["eagle_aux_hidden_state_layer_ids"] if fmt == "speculators" else (
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])  # fmt: skip
    assert ids == ([1, 2, 3] if fmt == "speculators" else [0, 1, 2])
    blocks = drafter.fc.weight.detach().view(64, 3, 64)
    assert torch.equal(tensors["fc.weight"].view(64, 3, 64), blocks[:, [1, 2, 0]])
    if fc_norm:
        assert all(
            torch.equal(tensors[f"fc_norm.{i}.weight"], drafter.fc_norm[j].weight) for i, j in enumerate([1, 2, 0])
        )
    monkeypatch.setattr(eagle3_layouts, "in_layer_order", lambda tensors, ids: ids)  # the listed order, unpermuted
    with pytest.raises(ExportError, match=r"load gate: .*captured in layer order"):
        export(tmp_path / "run", tmp_path / "unsorted", fmt=fmt)


def test_vllm_layouts_refuse_other_than_three_fused_layers(features, tmp_path, at_root):
    train(tiny_recipe(features, tmp_path / "run", "train.max_steps=2", "drafter.feature_layers=[1,3]"))
    for fmt in ("speculators", "vllm"):
        with pytest.raises(ExportError, match=r"^drafter.feature_layers: vLLM's EAGLE-3 fc reads exactly 3 hidden "):
            export(tmp_path / "run", tmp_path / fmt, fmt=fmt)
    assert (export(tmp_path / "run", tmp_path / "native") / "config.json").is_file()


def test_engine_layouts_refuse_a_fused_state_no_engine_captures(features, tmp_path, at_root):
    """The last hidden state (after the final norm, `-1`) reaches HF's outputs only: neither vLLM (inputs of layers
    0..L-1) nor SGLang (outputs of layers 0..L-2) captures it, so an export for them is refused, naming the field."""
    train(tiny_recipe(features, tmp_path / "run", "train.max_steps=2", "drafter.feature_layers=[1,2,-1]"))
    for fmt, engine, first in (("speculators", "vllm", 0), ("sglang", "sglang", 1)):
        why = rf"^drafter.feature_layers: hidden state -1 \(index 4 of 0..4\) cannot be captured by {engine}, which "
        with pytest.raises(ExportError, match=why + rf"reads indices {first}..3 of a 4-layer target"):
            export(tmp_path / "run", tmp_path / fmt, fmt=fmt)
        assert not (tmp_path / fmt).exists()


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_imports_of_eagle3_checkpoints_reproduce_their_logits(fmt, run, tmp_path):
    """Our own exports stand in for external EAGLE-3 checkpoints: imported with the layout's reading rules (a shuffled
    draft vocabulary order included), the native drafter gives the drafter's logits."""
    out = export(run, tmp_path / fmt, fmt=fmt)
    _, target, trained = load_run(run)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))  # a checkpoint whose d2t is not sorted
    ids = trained.draft_ids[perm]
    tensors.update({"lm_head.weight": tensors["lm_head.weight"][perm], "d2t": ids - torch.arange(128)})
    imported, reader = import_eagle3(config, tensors, out / "model.safetensors", target, fmt == "speculators")
    assert imported.cfg.feature_layers == trained.cfg.feature_layers and torch.equal(imported.d2t, trained.d2t)
    result = compare(config, tensors, reader, target, imported.eval())
    assert (result.consumer - result.reference).abs().max() < 1e-4
    ours = compare(config, tensors, reader, target, trained)
    torch.testing.assert_close(result.reference, ours.reference, atol=1e-5, rtol=1e-5)
    tensors.pop("norm.weight")
    with pytest.raises(ExportError, match=r"missing tensors \['norm.weight'\]"):
        import_eagle3(config, tensors, out / "model.safetensors", target, fmt == "speculators")


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_eagle3_imports_name_what_does_not_fit_the_target(fmt, run, tmp_path):
    """Another RoPE or epsilon, aux ids the engine cannot capture, a speculators config without norm_before_residual
    (its two readers default it differently), a d2t of repeated ids, a t2d that disagrees: one line naming the field,
    before any logits are computed."""
    out = export(run, tmp_path / fmt, fmt=fmt)
    _, target, _ = load_run(run)
    L = target.config.num_hidden_layers
    weights = out / "model.safetensors"
    spec = fmt == "speculators"

    def refused(match: str, config_edit=None, tensor_edit=None) -> None:
        config, tensors = json.loads((out / "config.json").read_text()), load_file(str(weights))
        layer = config["transformer_layer_config"] if spec else config
        aux = config if spec else config["eagle_config"]
        if config_edit:
            config_edit(config, layer, aux)
        if tensor_edit:
            tensor_edit(tensors)
        with pytest.raises(ExportError, match=match) as err:
            import_eagle3(config, tensors, weights, target, spec)
        assert "\n" not in str(err.value)

    refused(r"config.json: config.json rope_theta is 500000.0, the target.s 10000", lambda c, layer, a: layer.update(
        rope_theta=500000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))  # fmt: skip
    refused(r"config.json: rms_norm_eps is 0.5, the target's", lambda c, layer, a: layer.update(rms_norm_eps=0.5))
    last = L - 1 if spec else L - 2  # vLLM: inputs of layers 0..L-1; SGLang: outputs of layers 0..L-2
    refused(rf"eagle_aux_hidden_state_layer_ids: \[{last + 1}\] out of range: .* ids 0..{last} of a {L}-layer",
            lambda c, layer, a: a.update(eagle_aux_hidden_state_layer_ids=[0, 1, last + 1]))  # fmt: skip
    refused(r"eagle_aux_hidden_state_layer_ids: \[1, 1, 2\] names a layer twice",
            lambda c, layer, a: a.update(eagle_aux_hidden_state_layer_ids=[1, 1, 2]))  # fmt: skip
    refused(r"d2t does not map 128 draft ids to distinct target ids", tensor_edit=lambda t: t.update(
        d2t=-torch.arange(128)))  # every draft id to target id 0  # fmt: skip
    refused(r"t2d does not mark exactly the target ids d2t maps to", tensor_edit=lambda t: t.update(
        t2d=t["t2d"].roll(1)))  # fmt: skip
    refused(r"num_hidden_layers: expected an integer >= 1, got '2'", lambda c, layer, a: layer.update(
        num_hidden_layers="2"))  # fmt: skip
    if spec:
        refused(r"no norm_before_residual: vLLM reads a missing one as true, the speculators package as false",
                lambda c, layer, a: c.pop("norm_before_residual"))  # fmt: skip
    else:  # a speculators checkpoint of two layers is read (test_a_deeper_drafter_...); SGLang's layout has one
        refused(r"num_hidden_layers is 2: SGLang's EAGLE-3 layout has one decoder layer", lambda c, layer, a:
                layer.update(num_hidden_layers=2))  # fmt: skip


def test_import_command_round_trips_an_exported_checkpoint(run, tmp_path, at_root, capsys):
    out = export(run, tmp_path / "spec", fmt="speculators")
    imports_main([str(out), "--format", "speculators", "--target", str(RECIPE), "--out", str(tmp_path / "native")])
    _, target, trained = load_run(run)
    loaded = load_drafter(tmp_path / "native", target)
    inputs = eagle3_inputs(trained, 4, 8192)
    torch.testing.assert_close(drafter_logits(loaded, *inputs), drafter_logits(trained, *inputs), atol=1e-5, rtol=0)
    (out / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SystemExit, match="model.safetensors: its bytes are not those"):  # its marker's checksums
        imports_main([str(out), "--format", "speculators", "--target", str(RECIPE), "--out", str(tmp_path / "bad")])
    (out / ".specdraft-export").unlink()  # as another trainer's checkpoint: the file itself is refused
    with pytest.raises(SystemExit, match="model.safetensors: not a readable safetensors file"):
        imports_main([str(out), "--format", "speculators", "--target", str(RECIPE), "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.tmp").exists()


def test_draft_vocab_warning_only_below_the_threshold():
    recipe = load_recipe(RECIPE)
    assert draft_vocab_warning(MIN_IN_VOCAB, recipe) is None and draft_vocab_warning(0.97, recipe) is None
    warning = draft_vocab_warning(0.42, recipe)
    assert warning.startswith(f"warning: {RECIPE}: only 42% of held-out loss positions") and "\n" not in warning


def test_unrolled_attention_in_blocks_gives_the_same_outputs_and_gradients(setup, monkeypatch):
    """`ttt_attention` computed in blocks of 3 queries (several blocks, checkpointed) equals one block over the whole
    packed batch: outputs and every trained tensor's gradient."""
    from methods.eagle3 import model as eagle3

    model, _, _, packed = setup
    results = []
    for chunk in (1000, 3):
        monkeypatch.setattr(eagle3, "TTT_QUERY_CHUNK", chunk)
        drafter = drafter_for(model, ttt_steps=3, fc_norm=True).train()
        drafter.cfg = drafter.cfg.__class__(**{**drafter.cfg.__dict__, "input_noise": 0.0})
        out = drafter(packed)
        out["loss"].backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
        results.append((out["loss"].detach(), torch.stack([s.detach() for s in drafter.unroll(packed)]), grads))
    (loss_a, steps_a, grads_a), (loss_b, steps_b, grads_b) = results
    torch.testing.assert_close(steps_b, steps_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-7)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_unrolled_attention_memory_grows_linearly_with_length(monkeypatch):
    """The memory autograd keeps for the backward pass of `ttt_attention` (checkpointed blocks: their inputs, views
    of the whole keys) doubles when the sequence doubles; dense attention scores would quadruple."""
    from methods.eagle3.model import ttt_attention

    def saved_bytes(T: int) -> int:
        storages = {}  # block inputs are views of the whole keys: count each storage once

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        q = torch.randn(1, 2, T, 8, requires_grad=True)
        kv = [torch.randn(1, 2, T, 8, requires_grad=True) for _ in range(6)]
        seg, real = torch.ones(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.bool)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ttt_attention(q, kv[:3], kv[3:], seg, real)
        return sum(storages.values())

    small, large = saved_bytes(1024), saved_bytes(2048)
    assert 1.8 < large / small < 2.3, (small, large)


def test_a_windowed_drafter_sees_what_it_sees_over_the_last_positions_alone(setup):
    """With `window` W, the drafter's output at the last of L positions equals its output over the last W positions
    run alone from position 0 (RoPE scores depend on distances only): nothing further back reaches it. Without the
    window the two differ."""
    model = setup[0]
    drafter = drafter_for(model, fc_norm=True, norm_output=True)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 30), generator=gen)
    feats = sample_hidden(model, ids[0], LAYERS)[None, :, :3]  # (1, 30, 3, d): the fused layers' features
    W = 6

    def last_logits(start: int, window: int | None) -> torch.Tensor:
        n = ids.shape[1] - 1 - start
        positions = torch.arange(n)[None]
        logits, _ = drafter.step(feats[:, start:-1], ids[:, start + 1 :], positions, drafter.new_cache(), window=window)
        return logits[0, -1]

    whole, alone = last_logits(0, W), last_logits(29 - W, None)
    torch.testing.assert_close(whole, alone, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(last_logits(0, None), alone, atol=1e-3)


@pytest.mark.parametrize("window", [2, 5])
def test_windowed_drafting_stays_lossless(setup, window):
    """Cached prefix keys beyond the window are masked in the catch-up and in every tree step; greedy output is still
    plain decoding's, and a window wider than the whole sequence drafts exactly what no window drafts."""
    model = setup[0]
    drafter = drafter_for(model, vocab=64)
    vocab = VocabProjection.trained(drafter.lm_head, drafter.draft_ids, VOCAB)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = DecodeSettings(max_new_tokens=20)
    trees = {}
    for w in (window, 1000, None):
        proposer = EagleProposer(drafter, depth=3, top_k=3, total_tokens=8, draft_vocab=vocab, window=w)
        tokens, trees[w] = drafted_trees(model, proposer, prompt, settings)
        assert tokens == plain_generate(model, prompt, settings).tokens
    assert trees[1000] == trees[None] and trees[window] != trees[None]


def test_the_targets_distribution_in_row_chunks_gives_the_same_loss(setup, monkeypatch):
    from methods.eagle3 import model as eagle3

    model, _, _, packed = setup
    drafter = drafter_for(model)
    whole = drafter(packed)
    monkeypatch.setattr(eagle3, "TARGET_HEAD_ROWS", 3)
    chunked = drafter(packed)
    for key, value in whole.items():
        torch.testing.assert_close(chunked[key], value, msg=key)
