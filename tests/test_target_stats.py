"""The target's stored statistics (`data.target_stats`): what they hold, that EAGLE-3 / P-EAGLE training computes the
same loss, metrics and gradients from them as from the whole head, that a run trains the same with and without them,
and that a stored set is resumed, verified and refused for another head."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from tiny import reset_accelerate

from data import target_stats
from data.extract import main as extract_main
from data.loader import BatchLoader
from data.shards import FeatureDataset
from methods import METHODS
from methods.eagle3.model import Eagle3Drafter
from models.target import load_target
from schema.recipe import RecipeError, load_recipe
from train import loop
from train.loop import train

pytestmark = pytest.mark.usefixtures("at_root")

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/tiny/eagle3.yaml"
QUIET = ["train.eval_every=0", "train.save_every=0", "train.log_every=1"]


@pytest.fixture(scope="module", params=["float32", "fp8_e4m3"])
def features(request, tmp_path_factory) -> Path:
    """Tiny EAGLE-3 features in several shards, plain or encoded, with their target statistics stored."""
    out = tmp_path_factory.mktemp(f"stats-{request.param}") / "features"
    settings = [f"data.features_dir={out}", "data.shard_tokens=1024", f"data.storage_dtype={request.param}"]
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    extract_main([str(RECIPE), *settings])
    reset_accelerate()
    target_stats.main([str(RECIPE), *settings])
    mp.undo()
    reset_accelerate()
    return out


def recipe_for(features: Path, *overrides: str):
    storage = json.loads((features / "manifest.json").read_text())["dtype"]
    return load_recipe(RECIPE, [f"data.features_dir={features}", f"data.storage_dtype={storage}", *overrides])


def tiny_target(features: Path):
    return load_target(**vars(recipe_for(features).target))


def test_the_stored_statistics_are_the_heads_top1_and_logsumexp_at_every_loss_position(features):
    head = tiny_target(features).lm_head
    dataset = FeatureDataset(features)
    assert len(dataset.shards) > 1
    assert "computed" not in target_stats.attach(dataset, head)
    assert dataset.statistics is not None
    last = dataset.layers.index(-1)
    for i in range(len(dataset)):
        sample = dataset[i]
        at = sample["loss_mask"] > 0
        logits = head(sample["hidden"][:, last].float()).float()
        assert torch.equal(sample["target_top1"][at], logits[at].argmax(-1))
        torch.testing.assert_close(sample["target_lse"][at], logits[at].logsumexp(-1))
        assert (sample["target_top1"][~at] == -1).all() and sample["target_lse"][~at].isnan().all()


def drafter_for(recipe, target) -> Eagle3Drafter:
    torch.manual_seed(0)
    drafter = Eagle3Drafter(recipe.drafter, target.parts(recipe.data.layers))
    # half of the head rows are the target's top-1 tokens at loss positions: the kept positions are not empty
    top1 = torch.cat([s["target_top1"][s["target_top1"] >= 0] for s in stored_samples(recipe)])
    frequent = top1.unique()[: recipe.drafter.draft_vocab // 2]
    rest = torch.tensor([v for v in range(target.config.vocab_size) if v not in set(frequent.tolist())])
    drafter.set_draft_vocab(torch.cat([frequent, rest[: recipe.drafter.draft_vocab - len(frequent)]]), init_head=True)
    return drafter.train()


def stored_samples(recipe):
    dataset = FeatureDataset(recipe.data.features_dir)
    target_stats.attach(dataset, load_target(**vars(recipe.target)).lm_head)
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("loss", ["kl", "lk_hybrid"])
def test_a_step_from_the_stored_statistics_computes_what_the_whole_head_computes(features, loss):
    recipe = recipe_for(features, f"drafter.loss={loss}", "drafter.input_noise=0")
    target = tiny_target(features)
    stored, plain = FeatureDataset(features), FeatureDataset(features)
    target_stats.attach(stored, target.lm_head)
    batches = []
    for dataset in (stored, plain):
        loader = BatchLoader(dataset, batch_size=4, packing=True, max_len=128, shuffle=False, read_ahead=False)
        batches.append(next(iter(loader.epoch(0))))
    assert set(target_stats.KEYS) <= batches[0].keys() and not set(target_stats.KEYS) & batches[1].keys()
    results = []
    for batch in batches:
        drafter = drafter_for(recipe, target)
        out = drafter(batch)
        out["loss"].backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        results.append(({k: float(v.detach()) for k, v in out.items()}, grads))
    (metrics_a, grads_a), (metrics_b, grads_b) = results
    assert metrics_a["in_vocab"] > 0.1 and metrics_a["loss"] > 0
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-5, abs=1e-7), key
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)


def losses(run: Path) -> list[float]:
    return [json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_trains_the_same_with_and_without_stored_statistics_and_says_which(features, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(features, bare, ignore=shutil.ignore_patterns(target_stats.STATS_DIR))
    steps = ["train.max_steps=3", "train.lr=0.01", "train.warmup_steps=0", *QUIET]
    train(recipe_for(features, f"train.output_dir={tmp_path / 'stored'}", *steps))
    printed = capsys.readouterr().out
    assert "the target's stored top-1 and logsumexp at every loss position" in printed
    reset_accelerate()
    train(recipe_for(bare, f"train.output_dir={tmp_path / 'online'}", *steps))
    printed = capsys.readouterr().out
    assert f"{bare}: no stored target statistics: each step computes them" in printed
    assert losses(tmp_path / "stored") == pytest.approx(losses(tmp_path / "online"), rel=1e-4)


def test_a_rerun_keeps_what_is_stored_and_redoes_a_missing_or_changed_file(features, tmp_path):
    copy = tmp_path / "features"
    shutil.copytree(features, copy)
    stats = copy / target_stats.STATS_DIR
    index = json.loads((stats / target_stats.INDEX).read_text())
    before = {f.name: f.read_bytes() for f in stats.glob("stats-*")}
    head = tiny_target(features).lm_head
    n = len(before)
    assert target_stats.compute(FeatureDataset(copy), head, progress=False) == (0, n)
    (stats / "stats-00001.safetensors").unlink()
    raw = bytearray((stats / "stats-00000.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (stats / "stats-00000.safetensors").write_bytes(bytes(raw))
    dataset = FeatureDataset(copy)
    line = target_stats.attach(dataset, head)
    assert "stats-00000.safetensors does not match its sha256 in index.json" in line and dataset.statistics is None
    assert target_stats.compute(FeatureDataset(copy), head, progress=False) == (2, n - 2)
    assert {f.name: f.read_bytes() for f in stats.glob("stats-*")} == before
    assert json.loads((stats / target_stats.INDEX).read_text()) == index


def test_statistics_of_another_head_or_another_shard_are_not_used(features, tmp_path):
    copy = tmp_path / "features"
    shutil.copytree(features, copy)
    other = load_target(**(vars(recipe_for(features).target) | {"seed": 1})).lm_head
    dataset = FeatureDataset(copy)
    assert "computed for another LM head (or dtype) than this target's" in target_stats.attach(dataset, other)
    assert dataset.statistics is None
    index_path = copy / target_stats.STATS_DIR / target_stats.INDEX
    index = json.loads(index_path.read_text())
    index["shards"]["shard-00002.safetensors"]["shard_sha256"] = "0" * 64  # as if the shard were extracted again
    index_path.write_text(json.dumps(index))
    line = target_stats.attach(FeatureDataset(copy), tiny_target(features).lm_head)
    assert "the statistics of shard-00002.safetensors were computed for another version of it" in line


def test_the_loop_attaches_statistics_only_where_the_method_reads_them(features, monkeypatch):
    target, recipe = tiny_target(features), recipe_for(features)
    assert METHODS["eagle3"].target_statistics and METHODS["peagle"].target_statistics
    for reads in (True, False):
        entry = dataclasses.replace(METHODS["eagle3"], target_statistics=reads)
        monkeypatch.setitem(loop.METHODS, "eagle3", entry)
        loader, _, _ = loop.build_loaders(recipe, target, Accelerator(cpu=True))
        assert (loader.samples.statistics is not None) == reads
        assert bool(loader.statistics) == reads
        reset_accelerate()


def test_the_command_names_the_key_of_what_it_cannot_use(tmp_path):
    with pytest.raises(RecipeError, match=r"eagle3.yaml: data.features_dir: .*missing: no manifest.json"):
        target_stats.main([str(RECIPE), f"data.features_dir={tmp_path / 'missing'}"])
    with pytest.raises(RecipeError, match=r"data.layers: .*-1 must be stored"):
        target_stats.main([str(RECIPE), f"data.features_dir={tmp_path}", "data.layers=[1,2,3]"])
