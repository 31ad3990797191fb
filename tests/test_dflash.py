"""DFlash drafter on a tiny random Llama target: each training block against the same block run alone on its sample's
prefix, packing, the proposer's incremental context against a fresh one, lossless speculative decoding, the recipe
checks, the tiny recipe's training, resume and exports (native, and the speculators layout vLLM reads).

    .venv/bin/pytest tests/test_dflash.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import drafted_trees, make_batch, make_samples, reset_accelerate, sample_hidden
from tiny import tiny_llama as tiny_target

from data.extract import main as extract_main
from data.loader import BatchLoader
from data.shards import FeatureDataset
from eval.baselines import plain_generate
from eval.decode import DecodeSettings, speculative_generate
from eval.proposal import DecodeState
from eval.proposers import build_proposer
from eval.trees import chain, medusa_tree
from export.gates import check as gate_check
from export.write import export, load_run
from methods import METHODS
from methods.dflash.config import DFlashConfig
from methods.dflash.model import DFlashDrafter
from methods.dflash.proposer import DFlashProposer, dflash_calibration
from models.common import TargetParts
from models.io import ExportError, load_drafter
from rundir.checkpoints import latest_checkpoint
from schema.recipe import RecipeError, load_recipe, recipe_from_dict
from train.checkpoint import DRAFTER_FILE, METRICS_FILE
from train.loop import train

torch.set_num_threads(1)
LAYERS = [0, 1, -1]  # stored hidden states: embeddings, layer 1's input, the last one
VOCAB = 256
MASK = 3
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/tiny/dflash.yaml"
QUIET = ["train.eval_every=0", "train.save_every=0", "train.log_every=1", "logging.tracker=none"]


def drafter_for(model, seed: int = 0, **kw) -> DFlashDrafter:
    """A drafter with every weight random, norms too."""
    torch.manual_seed(seed)
    cfg = DFlashConfig(**{"feature_layers": [0, 1], "num_layers": 2, "block_size": 5, "mask_token_id": MASK, **kw})
    drafter = DFlashDrafter(cfg, TargetParts(model.config, model.model.embed_tokens, model.lm_head, LAYERS))
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


def alone(drafter: DFlashDrafter, hidden: torch.Tensor, ids: torch.Tensor, a: int) -> torch.Tensor:
    """The block anchored at `a` of one sample, run by itself on the context of positions 0 .. a-1: slots 1.. (K, d)."""
    c = drafter.context(hidden[None, :a])
    context = drafter.context_kv(c, torch.arange(a)[None])
    return drafter.draft_block(ids[a : a + 1], a, context)[0]


@pytest.mark.parametrize("kw", [{}, {"tie_k_norm": False, "num_layers": 3}])
def test_each_training_block_is_the_block_run_alone(setup, kw):
    """The batched training blocks (every anchor of padded and packed rows) see exactly their sample's context before
    their anchor and their own block: each equals the block run alone, as the proposer runs it."""
    model, samples, padded, packed = setup
    drafter = drafter_for(model, **kw)
    for batch, rows in ((padded, [[0], [1], [2]]), (packed, [[0, 1], [2]])):
        anchors, valid, _ = drafter.anchors(batch, limit=64)
        with torch.no_grad():
            normed, labels, labelled = drafter.blocks(batch, anchors, valid)
        checked = 0
        for b, row in enumerate(rows):
            starts = [0]
            for s in row[:-1]:
                starts.append(starts[-1] + len(samples[s][0]))
            for i in range(int(valid[b].sum())):
                a = int(anchors[b, i])
                s = max(j for j, st in enumerate(starts) if st <= a)
                ids, _ = samples[row[s]]
                hidden = sample_hidden(model, ids, LAYERS)
                with torch.no_grad():
                    want = alone(drafter, hidden, ids, a - starts[s])
                torch.testing.assert_close(normed[b, i, 1:], want, atol=2e-5, rtol=2e-5)
                k = labelled[b, i].nonzero().flatten()
                assert torch.equal(labels[b, i, k], ids[a - starts[s] + k])
                checked += 1
        assert checked >= 20


def test_packed_and_padded_give_the_same_loss_and_gradients_reach_every_layer(setup):
    model, _, padded, packed = setup
    drafter = drafter_for(model)
    losses = [drafter(batch)["loss"] for batch in (padded, packed)]  # eval mode: every anchor, in order
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    losses[0].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters() if p.requires_grad)
    assert "layers.1.self_attn.k_norm.weight" not in dict(drafter.named_parameters())  # tied: trained once


def test_chunked_cross_entropy_gives_the_same_loss_and_gradients(setup, monkeypatch):
    """Past one chunk of slots the logits are recomputed in the backward instead of kept: the same loss and
    gradients."""
    import methods.dflash.model as model_mod

    model, _, padded, _ = setup
    grads = []
    for chunk in (model_mod.CE_CHUNK, 7):
        monkeypatch.setattr(model_mod, "CE_CHUNK", chunk)
        drafter = drafter_for(model)
        loss = drafter(padded)["loss"]
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b)


def test_the_proposer_keeps_its_context_across_rounds(setup):
    """Round two, with the features of three more verified positions appended to the row's context, drafts what a
    fresh proposer given every position at once drafts."""
    model = setup[0]
    drafter = drafter_for(model)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    hidden = sample_hidden(model, ids[0], LAYERS)[None]  # (1, 12, 3, d)
    kept, fresh = DFlashProposer(drafter, chain(4)), DFlashProposer(drafter, chain(4))
    kept.depth_topk([DecodeState(tokens=ids[:, :9], new_hidden=hidden[:, :8])])
    second = kept.depth_topk([DecodeState(tokens=ids, new_hidden=hidden[:, 8:11])])
    once = fresh.depth_topk([DecodeState(tokens=ids, new_hidden=hidden[:, :11])])
    assert torch.equal(second[0], once[0])
    torch.testing.assert_close(second[1], once[1])
    with torch.no_grad():
        want = model.lm_head(alone(drafter, hidden[0], ids[0], 11)).argmax(-1)
    assert torch.equal(once[0][0, :, 0], want)


@pytest.mark.parametrize("tree", ["chain", "branching"])
def test_speculative_decoding_equals_plain_greedy(setup, tree):
    model = setup[0]
    drafter = drafter_for(model)
    shape = chain(4) if tree == "chain" else medusa_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], 4)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    settings = DecodeSettings(max_new_tokens=24)
    tokens, drafted = drafted_trees(model, DFlashProposer(drafter, shape), prompt, settings)
    assert tokens == plain_generate(model, prompt, settings).tokens
    assert drafted and all(len(t) == shape.num_nodes for t in drafted)


def test_calibration_measures_each_slot_and_builds_the_proposer(setup):
    model, samples, _, _ = setup

    class Target:  # what the calibration reads of a target
        device = torch.device("cpu")

        @staticmethod
        def hidden_states(ids, layers):
            return sample_hidden(model, ids[0], layers)[None]

    drafter = drafter_for(model)
    acc = dflash_calibration(drafter, Target, [(ids, mask > 0) for ids, mask in samples], top_k=3)
    assert acc.shape == (4, 3) and float(acc.min()) >= 0 and float(acc.max()) <= 1
    ev = recipe_from_dict(recipe()).eval
    ev = type(ev)(**{**vars(ev), "tree": "calibrated", "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 8})
    fake = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]])
    proposer, desc = build_proposer(METHODS["dflash"], drafter, ev, calibrate=lambda k: fake[:, :k])
    assert isinstance(proposer, DFlashProposer) and desc == "calibrated d3 n8, block 5"


def recipe(**drafter) -> dict:
    return {
        "target": {
            "random_init": {"model_type": "llama", "num_hidden_layers": 8, "vocab_size": 1000},
            "tokenizer": "y",
        },
        "data": {"train_files": ["x.jsonl"], "layers": [2, 4, 5], "features_dir": "f"},
        "drafter": {"method": "dflash", "feature_layers": [2, 4, 5], **drafter},
        "eval": {"tree": "chain", "tree_depth": 4},
    }


@pytest.mark.parametrize(
    "drafter,overrides,why",
    [
        ({"feature_layers": [4, 2, 5]}, {}, "drafter.feature_layers: must be hidden-state indices >= 0 in ascending"),
        (
            {"feature_layers": [2, 4, 8]},
            {"data": {"train_files": ["x.jsonl"], "layers": [2, 4, 8], "features_dir": "f"}},
            "drafter.feature_layers: .* the engines capture hidden states 0..7",
        ),
        ({"feature_layers": [2, 3, 5]}, {}, r"drafter.feature_layers: layer 3 is not stored in data.layers"),
        ({"block_size": 1}, {}, "drafter.block_size: must be >= 2"),
        ({"block_size": 4}, {}, "eval.tree_depth: 4 exceeds the tokens one forward drafts"),
        ({"mask_token_id": 1000}, {}, "drafter.mask_token_id: 1000 is not below the target's vocab_size"),
        ({}, {"eval": {"tree": "chain", "tree_depth": 4, "draft_vocab": 100}}, "eval.draft_vocab: a dflash drafter"),
    ],
)
def test_recipe_checks(drafter, overrides, why):
    recipe_from_dict(recipe())
    with pytest.raises(RecipeError, match=why):
        recipe_from_dict({**recipe(**drafter), **overrides})


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dflash") / "features"
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    extract_main([str(RECIPE), f"data.features_dir={out}"])
    mp.undo()
    reset_accelerate()
    return out


def tiny_recipe(features: Path, out: Path, *overrides: str):
    return load_recipe(RECIPE, [f"data.features_dir={features}", f"train.output_dir={out}", *QUIET, *overrides])


def losses(run: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (run / METRICS_FILE).read_text().splitlines()]


def test_stop_and_resume_reproduces_the_uninterrupted_run(features, tmp_path, at_root):
    """The anchors are drawn at random each step: a resumed run draws the same ones (the RNG state is checkpointed)."""
    common = ["train.max_steps=4", "train.save_every=2", "drafter.max_anchors=4"]
    train(tiny_recipe(features, tmp_path / "a", *common))
    reset_accelerate()
    train(tiny_recipe(features, tmp_path / "b", *common), stop_after=2)
    reset_accelerate()
    train(tiny_recipe(features, tmp_path / "b", *common, "train.resume=auto"))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert losses(tmp_path / "a")[-1] < losses(tmp_path / "a")[0]
    a = load_file(str(latest_checkpoint(tmp_path / "a") / DRAFTER_FILE))
    b = load_file(str(latest_checkpoint(tmp_path / "b") / DRAFTER_FILE))
    assert "fc.weight" in a and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def run(features, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dflash-run") / "run"
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    reset_accelerate()
    train(tiny_recipe(features, out, "train.max_steps=3"))
    reset_accelerate()
    mp.undo()
    return out


def test_native_export_reloads_to_identical_logits_and_drafts_losslessly(run, features, tmp_path):
    out = export(run, tmp_path / "native")
    recipe, target, drafter = load_run(run)
    loaded = load_drafter(out, target)
    batch = next(BatchLoader(FeatureDataset(features), [0, 1], batch_size=2, max_len=128).batches())
    with torch.no_grad():
        assert torch.equal(loaded(batch)["loss"], drafter.eval()(batch)["loss"])
    proposer, desc = build_proposer(METHODS["dflash"], loaded, recipe.eval, calibrate=None)
    assert desc == "chain d3, block 4"
    prompt = torch.tensor([[5, 17, 300, 42, 9, 11]])
    settings = DecodeSettings(max_new_tokens=16)
    assert speculative_generate(target.model, proposer, prompt, settings).tokens == (
        plain_generate(target.model, prompt, settings).tokens
    )


@pytest.mark.parametrize("fmt", ["speculators", "vllm"])
def test_speculators_layout_is_what_vllms_dflash_reads(fmt, run, tmp_path):
    out = export(run, tmp_path / fmt, fmt=fmt)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    _, _, drafter = load_run(run)
    assert config["speculators_model_type"] == "dflash" and config["mask_token_id"] == 2
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3] and config["sliding_window_non_causal"] is True
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert torch.equal(tensors["layers.1.self_attn.k_norm.weight"], tensors["layers.0.self_attn.k_norm.weight"])
    names = set(drafter.trainable_state_dict()) | {"layers.1.self_attn.k_norm.weight"}
    assert set(tensors) == names and not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)


@pytest.mark.parametrize(
    "edit,why",
    [
        (lambda c, t: c.update(sliding_window_non_causal=False), "attends causally inside the block"),
        (lambda c, t: c.pop("mask_token_id"), "no mask_token_id"),
        (lambda c, t: c.update(mask_token_id=5), "differ by"),
        (lambda c, t: c.update(aux_hidden_state_layer_ids=[0, 1, 2]), "differ by"),
        (lambda c, t: t["layers.1.self_attn.k_norm.weight"].mul_(1.5), "differ by"),
        (lambda c, t: t.update({"verifier_norm.weight": torch.ones(64)}), "vLLM's DFlash has no such parameter"),
    ],
)
def test_the_gate_catches_what_vllm_would_read_wrong(edit, why, run, tmp_path):
    out = export(run, tmp_path / "spec", fmt="speculators")
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    edit(config, tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    recipe, target, drafter = load_run(run)
    with pytest.raises(ExportError, match=why):
        gate_check("speculators", out, recipe, target, drafter)
