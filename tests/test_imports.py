"""Imports of SafeAILab EAGLE-1/2 and FasterDecoding Medusa checkpoints (`python -m export.imports`).

Round trips: a drafter exported to `eagle` / `medusa` (through `export.write.export`, gate included) and imported
back computes the original drafter's logits. Bad checkpoints: one `error:` line naming the file and field, nothing
written at --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import perturbed

from export import write as export_mod
from export.gate_parts import MEDUSA_PT, MEDUSA_SAFETENSORS
from export.imports import import_checkpoint, main, resolve_target
from methods.eagle2.config import EagleConfig
from methods.eagle2.gates import eagle_inputs
from methods.eagle2.model import EagleDrafter
from methods.medusa1.config import MedusaConfig
from methods.medusa1.gates import medusa_hidden
from methods.medusa1.model import MedusaHeads
from models.io import EXPORT_MARKER, ExportError, load_drafter, save_native
from schema.recipe import load_recipe

pytestmark = pytest.mark.usefixtures("at_root")

ROOT = Path(__file__).resolve().parents[1]
EAGLE_RECIPE = "recipes/tiny/eagle2.yaml"
MEDUSA_RECIPE = "recipes/tiny/medusa1.yaml"


@pytest.fixture(scope="module")
def target():
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    yield resolve_target(EAGLE_RECIPE)  # the tiny recipes share their target
    mp.undo()


def exported(fmt: str, drafter, recipe_file: str, overrides: list[str], target, out: Path, monkeypatch) -> Path:
    """`export.write.export` of `drafter` (as if trained with `recipe_file` + overrides) to `fmt` at `out`, as another
    project's trainer would leave it: the layout's files, without this project's marker (its checksums)."""
    recipe = load_recipe(recipe_file, overrides)
    monkeypatch.setattr(export_mod, "load_run", lambda run_dir, checkpoint=None: (recipe, target, drafter))
    out = export_mod.export(out.parent / "run", out, fmt=fmt)
    (out / EXPORT_MARKER).unlink()
    return out


PLAIN = ["drafter.fc_norm=false", "drafter.post_norm=false"]


@pytest.fixture(scope="module")
def eagle_drafter(target):
    return perturbed(EagleDrafter(EagleConfig(fc_norm=False, post_norm=False), target.parts([-1])))


@pytest.fixture(scope="module")
def medusa_drafter(target):
    return perturbed(MedusaHeads(MedusaConfig(num_heads=5), target.parts([-1])))


def eagle_logits(drafter, target) -> torch.Tensor:
    batch, _, _ = eagle_inputs(drafter, target.config.vocab_size)
    with torch.no_grad():
        return drafter.logits(drafter.predict_features(batch))


def medusa_logits(drafter, target) -> torch.Tensor:
    with torch.no_grad():
        return drafter.head_logits(medusa_hidden(drafter, target.config.hidden_size))


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_eagle_round_trip(weights, target, eagle_drafter, tmp_path, monkeypatch):
    src = exported("eagle", eagle_drafter, EAGLE_RECIPE, PLAIN, target, tmp_path / "eagle", monkeypatch)
    if weights == "bin":  # SafeAILab's older checkpoints: a torch.save'd state dict
        torch.save(load_file(str(src / "model.safetensors")), src / "pytorch_model.bin")
        (src / "model.safetensors").unlink()
    main([str(src), "--format", "eagle", "--target", EAGLE_RECIPE, "--out", str(tmp_path / "native")])
    native = load_drafter(tmp_path / "native", target)
    assert native.cfg.fc_bias and not native.cfg.fc_norm and not native.cfg.post_norm
    assert native.cfg.feature_layers == [-1]
    assert torch.equal(eagle_logits(native, target), eagle_logits(eagle_drafter, target))
    config = json.loads((tmp_path / "native" / "config.json").read_text())
    assert config["method"] == "eagle2" and config["recipe"]["format"] == "eagle"


def test_eagle_without_fc_bias_and_two_layers(target, tmp_path, monkeypatch):
    drafter = perturbed(EagleDrafter(EagleConfig(fc_norm=False, post_norm=False, fc_bias=False, num_layers=2),
                                     target.parts([-1])), seed=3)  # fmt: skip
    overrides = [*PLAIN, "drafter.fc_bias=false", "drafter.num_layers=2"]
    src = exported("eagle", drafter, EAGLE_RECIPE, overrides, target, tmp_path / "eagle", monkeypatch)
    native = load_drafter(import_checkpoint(src, "eagle", target, tmp_path / "native"), target)
    assert not native.cfg.fc_bias and native.cfg.num_layers == 2
    assert torch.equal(eagle_logits(native, target), eagle_logits(drafter, target))


@pytest.mark.parametrize("weights", ["safetensors", "pt"])
def test_medusa_round_trip(weights, target, medusa_drafter, tmp_path, monkeypatch):
    overrides = ["drafter.num_heads=5"]
    src = exported("medusa", medusa_drafter, MEDUSA_RECIPE, overrides, target, tmp_path / "medusa", monkeypatch)
    if weights == "pt":
        (src / MEDUSA_SAFETENSORS).unlink()
    main([str(src), "--format", "medusa", "--target", MEDUSA_RECIPE, "--out", str(tmp_path / "native")])
    native = load_drafter(tmp_path / "native", target)
    assert native.cfg.num_heads == 5 and native.cfg.num_layers == 1 and not native.cfg.share_lm_head
    assert torch.equal(medusa_logits(native, target), medusa_logits(medusa_drafter, target))


def test_medusa_with_three_heads_and_a_shared_two_layer_block(target, tmp_path):
    """A FasterDecoding checkpoint of `[ResBlock] * 2`: one block under two names, applied twice."""
    d, V = target.config.hidden_size, target.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for h in range(3):
        w, b = torch.randn(d, d, generator=gen) * 0.05, torch.randn(d, generator=gen) * 0.05
        for layer in range(2):
            tensors[f"{h}.{layer}.linear.weight"], tensors[f"{h}.{layer}.linear.bias"] = w.clone(), b.clone()
        tensors[f"{h}.2.weight"] = torch.randn(V, d, generator=gen) * 0.05
    src = tmp_path / "src"
    src.mkdir()
    torch.save(tensors, src / MEDUSA_PT)
    (src / "config.json").write_text(json.dumps({"medusa_num_layers": 2, "base_model_name_or_path": "x"}))
    native = load_drafter(import_checkpoint(src, "medusa", target, tmp_path / "native"), target)
    assert native.cfg.num_heads == 3 and native.cfg.num_layers == 2
    hidden = medusa_hidden(native, d)
    for h in range(3):
        x = hidden
        for _ in range(2):
            x = x + torch.nn.functional.silu(x @ tensors[f"{h}.0.linear.weight"].T + tensors[f"{h}.0.linear.bias"])
        torch.testing.assert_close(native.head(h + 1, hidden), x @ tensors[f"{h}.2.weight"].T)


# --------------------------------------------------------------------------------------------
# Bad checkpoints: one line naming the file and field, nothing at --out


@pytest.fixture
def eagle_src(target, eagle_drafter, tmp_path, monkeypatch) -> Path:
    return exported("eagle", eagle_drafter, EAGLE_RECIPE, PLAIN, target, tmp_path / "eagle", monkeypatch)


@pytest.fixture
def medusa_src(target, medusa_drafter, tmp_path, monkeypatch) -> Path:
    overrides = ["drafter.num_heads=5"]
    return exported("medusa", medusa_drafter, MEDUSA_RECIPE, overrides, target, tmp_path / "medusa", monkeypatch)


def refused(src: Path, fmt: str, out: Path, *parts: str) -> str:
    with pytest.raises(SystemExit) as err:
        main([str(src), "--format", fmt, "--target", EAGLE_RECIPE, "--out", str(out)])
    msg = str(err.value)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
    return msg


def edit_safetensors(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_eagle_missing_tensor(eagle_src, tmp_path):
    edit_safetensors(eagle_src / "model.safetensors", lambda t: t.pop("layers.0.mlp.up_proj.weight"))
    refused(eagle_src, "eagle", tmp_path / "out", "model.safetensors", "missing tensors", "layers.0.mlp.up_proj")


def test_eagle_extra_tensor(eagle_src, tmp_path):
    edit_safetensors(eagle_src / "model.safetensors", lambda t: t.update({"norm.weight": torch.ones(64)}))
    refused(eagle_src, "eagle", tmp_path / "out", "model.safetensors", "extra tensors", "norm.weight")


def test_eagle_fc_bias_without_the_bias_key(eagle_src, tmp_path):
    config = json.loads((eagle_src / "config.json").read_text())
    config["bias"] = False  # then SafeAILab builds fc without a bias, and strict loading fails on fc.bias
    (eagle_src / "config.json").write_text(json.dumps(config))
    refused(eagle_src, "eagle", tmp_path / "out", "extra tensors", "fc.bias", "bias=false")


def test_eagle_bad_config(eagle_src, tmp_path):
    (eagle_src / "config.json").write_text('{"hidden_size": 64,')
    refused(eagle_src, "eagle", tmp_path / "out", "config.json", "not valid JSON")


def test_eagle_config_for_another_target(eagle_src, tmp_path):
    config = json.loads((eagle_src / "config.json").read_text())
    config["hidden_size"] = 4096
    (eagle_src / "config.json").write_text(json.dumps(config))
    refused(eagle_src, "eagle", tmp_path / "out", "config.json", "hidden_size is 4096", "target's is 64")


def test_eagle_rope_of_another_target(eagle_src, tmp_path):
    config = json.loads((eagle_src / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (eagle_src / "config.json").write_text(json.dumps(config))
    refused(eagle_src, "eagle", tmp_path / "out", "config.json", "rope_theta is 500000.0")


def test_eagle_embedding_of_another_target(eagle_src, tmp_path):
    edit_safetensors(
        eagle_src / "model.safetensors", lambda t: t.update({"embed_tokens.weight": torch.zeros(8192, 64)})
    )
    refused(eagle_src, "eagle", tmp_path / "out", "embed_tokens.weight differs from the target's")


def test_eagle_pickled_bin(eagle_src, tmp_path):
    (eagle_src / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(1), "args": argparse.Namespace(lr=1)}, eagle_src / "pytorch_model.bin")
    refused(eagle_src, "eagle", tmp_path / "out", "pytorch_model.bin", "weights_only=True")


def test_medusa_missing_tensor(medusa_src, tmp_path):
    edit_safetensors(medusa_src / MEDUSA_SAFETENSORS, lambda t: t.pop("4.1.weight"))
    refused(medusa_src, "medusa", tmp_path / "out", MEDUSA_SAFETENSORS, "missing tensors", "4.1.weight")


def test_medusa_extra_tensor(medusa_src, tmp_path):
    edit_safetensors(medusa_src / MEDUSA_SAFETENSORS, lambda t: t.update({"0.0.linear.scale": torch.zeros(64)}))
    refused(medusa_src, "medusa", tmp_path / "out", MEDUSA_SAFETENSORS, "extra tensors", "0.0.linear.scale")


def test_medusa_incomplete_head(medusa_src, tmp_path):
    """The file decides how many heads there are: a sixth head's block without its projection is incomplete."""
    edit_safetensors(medusa_src / MEDUSA_SAFETENSORS, lambda t: t.update({"5.0.linear.weight": torch.zeros(64, 64)}))
    refused(medusa_src, "medusa", tmp_path / "out", MEDUSA_SAFETENSORS, "missing tensors", "5.0.linear.bias")


def test_medusa_heads_come_from_the_file_not_the_config(medusa_src, target, tmp_path, capsys):
    """FasterDecoding's loader builds its heads whatever `medusa_num_heads` says, and its published configs say 2
    beside 5 heads' weights: the import takes the 5 in the file, with a note."""
    config = json.loads((medusa_src / "config.json").read_text())
    (medusa_src / "config.json").write_text(json.dumps(dict(config, medusa_num_heads=2)))
    native = load_drafter(import_checkpoint(medusa_src, "medusa", target, tmp_path / "native"), target)
    assert native.cfg.num_heads == 5
    assert "medusa_num_heads is 2, medusa_lm_head" in capsys.readouterr().err


def test_an_import_that_computes_other_logits_leaves_nothing(medusa_src, target, tmp_path, monkeypatch):
    """The last safety net: the reloaded native drafter against the consumer's reading of the source. A mapping bug
    (here: one head's projection scaled after the mapping) fails the import and writes nothing."""
    from methods.medusa1 import imports

    mapped = imports.import_medusa

    def buggy(*args):
        drafter, check = mapped(*args)
        with torch.no_grad():
            drafter.lm_heads[2].weight.mul_(1.01)
        return drafter, check

    monkeypatch.setattr(imports, "import_medusa", buggy)  # the importer the medusa1 entry names
    with pytest.raises(ExportError, match=r"medusa_lm_head\.\S+: the imported drafter's draft logits differ"):
        import_checkpoint(medusa_src, "medusa", target, tmp_path / "native")
    assert not (tmp_path / "native").exists() and not (tmp_path / "native.tmp").exists()


def test_medusa_bad_config(medusa_src, tmp_path):
    (medusa_src / "config.json").write_text(json.dumps({"medusa_num_layers": "one"}))
    refused(medusa_src, "medusa", tmp_path / "out", "config.json", "medusa_num_layers", "'one'")


def test_a_checkpoint_this_project_exported_is_imported_only_as_written(target, medusa_drafter, tmp_path, monkeypatch):
    """An engine-layout export of this project carries its marker: a file changed since is refused, naming it."""
    recipe = load_recipe(MEDUSA_RECIPE, ["drafter.num_heads=5"])
    monkeypatch.setattr(export_mod, "load_run", lambda run_dir, checkpoint=None: (recipe, target, medusa_drafter))
    src = export_mod.export(tmp_path / "run", tmp_path / "medusa", fmt="medusa")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"medusa_num_layers": 1}, indent=3))
    refused(src, "medusa", tmp_path / "out", "medusa/config.json: its bytes are not those", EXPORT_MARKER)


def test_no_checkpoint_and_no_weights(tmp_path):
    refused(tmp_path / "nowhere", "medusa", tmp_path / "out", "nowhere", "no such checkpoint directory")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    refused(tmp_path / "empty", "eagle", tmp_path / "out", "no model.safetensors or pytorch_model.bin")


def test_an_existing_directory_is_not_overwritten(medusa_src, tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds files no export wrote"):
        main([str(medusa_src), "--format", "medusa", "--target", MEDUSA_RECIPE, "--out", str(other)])
    assert (other / "todo.txt").read_text() == "mine"
    before = sorted(p.name for p in medusa_src.iterdir())
    for out in (medusa_src, medusa_src / "native"):  # the checkpoint itself, or a directory inside it
        with pytest.raises(SystemExit, match="overlaps the checkpoint being imported"):
            main([str(medusa_src), "--format", "medusa", "--target", MEDUSA_RECIPE, "--out", str(out)])
    assert sorted(p.name for p in medusa_src.iterdir()) == before
    shutil.rmtree(other)


def test_a_checkpoint_in_another_layout_is_named_with_the_format_to_use(eagle_src, medusa_src, target, tmp_path):
    """A wrong --format used to fail on the first field the other layout lacks ("hidden_size is None")."""
    refused(eagle_src, "speculators", tmp_path / "a", "files are in the eagle layout", "import it with --format eagle")
    refused(medusa_src, "eagle", tmp_path / "b", "no model.safetensors or pytorch_model.bin")  # Medusa's own files
    config = json.loads((eagle_src / "config.json").read_text())
    (eagle_src / "config.json").write_text(json.dumps({**config, "transformer_layer_config": {}}))
    refused(eagle_src, "eagle3", tmp_path / "c", "files are in the speculators layout", "--format speculators")
    native = tmp_path / "native"
    save_native(native, perturbed(EagleDrafter(EagleConfig(), target.parts([-1]))), target)
    refused(native, "eagle", tmp_path / "d", "already a native export", f"eval.drafter={native}")


def test_a_second_import_into_the_same_directory_is_refused(eagle_src, eagle_drafter, target, tmp_path):
    """While another import writes --out (this test holds its lock, beside --out: --out is renamed into place whole),
    an import into it stops with one line naming --out and the holder, and stages nothing; once free, it imports,
    and no lock file stays behind."""
    from rundir.lock import acquire, release

    out = tmp_path / "out"
    held = acquire(out, "import", beside=True)
    try:
        msg = refused(eagle_src, "eagle", out, f"--out: {out}: another import is writing there (pid {os.getpid()}:")
        assert msg.startswith(f"error: --out: {out}")
    finally:
        release(held)
    main([str(eagle_src), "--format", "eagle", "--target", EAGLE_RECIPE, "--out", str(out)])
    assert torch.equal(eagle_logits(load_drafter(out, target), target), eagle_logits(eagle_drafter, target))
    assert not any(p.name.endswith(".specdraft.lock") for p in tmp_path.iterdir())
