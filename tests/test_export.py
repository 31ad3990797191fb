"""Export -> reload round trips: `pytest tests/test_export.py`.

Tiny drafters are trained for two steps on the tiny recipes, exported with `python -m train.export`
and rebuilt with `models.io.load_drafter` (what eval uses): outputs must be identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file, save_file

from data.extract import main as extract_main
from data.loader import BatchLoader
from data.shards import FeatureDataset
from models.io import CONFIG_FILE, WEIGHTS_FILE, ExportError, load_drafter
from models.target import load_target
from train.config import load_recipe
from train.export import export, load_run
from train.export import main as export_main
from train.loop import train

ROOT = Path(__file__).resolve().parents[1]


def reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two-step runs of both tiny recipes on shared features."""
    root = tmp_path_factory.mktemp("export")
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    features = root / "features"
    extract_main(["recipes/tiny/eagle2.yaml", f"data.features_dir={features}"])
    out = {}
    for method in ("eagle2", "medusa1"):
        reset_accelerate()
        out[method] = root / method
        overrides = [f"data.features_dir={features}", f"train.output_dir={out[method]}", "train.max_steps=2"]
        train(load_recipe(f"recipes/tiny/{method}.yaml", overrides))
    reset_accelerate()
    yield out
    mp.undo()


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def a_batch(run: Path) -> dict:
    recipe = load_recipe(run / "recipe.yaml")
    return next(BatchLoader(FeatureDataset(recipe.data.features_dir), batch_size=4, shuffle=False).batches())


@pytest.mark.parametrize("method", ["eagle2", "medusa1"])
def test_native_round_trip_gives_identical_outputs(method, runs, tmp_path):
    out = export(runs[method], tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]  # no pickle anywhere
    _, target, trained = load_run(runs[method])
    reloaded = load_drafter(out, target)
    assert type(reloaded) is type(trained) and not reloaded.training
    batch = a_batch(runs[method])
    with torch.no_grad():
        want, got = trained(batch), reloaded(batch)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key
        hidden = batch["hidden"][:, :, 0]  # (B, T, d): the last hidden state
        if method == "medusa1":
            assert torch.equal(trained.head_logits(hidden), reloaded.head_logits(hidden))
        else:
            assert torch.equal(
                trained.logits(trained.predict_features(batch)), reloaded.logits(reloaded.predict_features(batch))
            )


def test_config_and_tensors(runs, tmp_path):
    out = export(runs["eagle2"], tmp_path / "export")
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["method"] == "eagle2" and config["stored_layers"] == [-1]
    assert config["drafter"]["feature_layers"] == [-1] and config["target"]["num_layers"] == 2
    assert config["recipe"]["train"]["max_steps"] == 2
    _, _, trained = load_run(runs["eagle2"])
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert tensors.keys() == trained.trainable_state_dict().keys()
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)


def test_include_target_weights(runs, tmp_path):
    out = export(runs["eagle2"], tmp_path / "export", include_target_weights=True)
    tensors = load_file(str(out / WEIGHTS_FILE))
    assert {"embed_tokens.weight", "lm_head.weight"} <= tensors.keys()
    _, target, _ = load_run(runs["eagle2"])
    load_drafter(out, target)  # frozen tensors equal to the target's are accepted


def test_strict_loading(runs, tmp_path):
    out = export(runs["medusa1"], tmp_path / "export")
    recipe, target, _ = load_run(runs["medusa1"])
    tensors = load_file(str(out / WEIGHTS_FILE))

    missing = dict(tensors)
    missing.pop(next(iter(missing)))
    save_file(missing, str(out / WEIGHTS_FILE))
    with pytest.raises(ExportError, match="missing tensors"):
        load_drafter(out, target)

    save_file({**tensors, "blocks.9.layers.0.weight": torch.zeros(1)}, str(out / WEIGHTS_FILE))
    with pytest.raises(ExportError, match="unexpected"):
        load_drafter(out, target)

    save_file(tensors, str(out / WEIGHTS_FILE))
    other = load_target(**{**vars(recipe.target), "seed": 1})
    with pytest.raises(ExportError, match="target.weights_sha256"):
        load_drafter(out, other)


def test_cli(runs, tmp_path, capsys):
    export_main([str(runs["medusa1"]), "--out", str(tmp_path / "cli")])
    assert "exported" in capsys.readouterr().out
    assert (tmp_path / "cli" / WEIGHTS_FILE).is_file()
    with pytest.raises(SystemExit, match="no such recipe file"):
        export_main([str(tmp_path / "cli"), "--out", str(tmp_path / "x")])
