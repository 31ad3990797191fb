"""Every reader of what a user hands the project, fuzzed: damaged copies of real inputs must be read or refused with
one line naming the file, never crash with another exception, and a refused write leaves nothing complete-looking.

    .venv/bin/python -m pytest tests/test_fuzz.py                     # bounded: what `make test` runs
    make fuzz                                                          # the long run (SPECDRAFT_FUZZ=long)

Inputs: recipes and `key=value` overrides, prompt and answer JSONL, chat datasets, kinds and pipeline YAML, feature
manifests and shard files, safetensors files, the `config.json` of exports and imports, and checkpoints. Each starts
from a real, valid file and is damaged by hypothesis (bytes flipped, cut, inserted, repeated; JSON values replaced by
others of any type). The bounded run is derandomized, so `make test` sees the same examples every time; the long run
draws new ones. What the long runs found, and what was fixed, is in docs/testing.md.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import reset_accelerate, save_chat_target

from data.chat import ChatTemplateError, DataError
from data.chatsets import ChatSetError, Filters, build
from data.selfdistill import SelfDistillError, read_prompts
from data.shards import FeatureDataset, FeatureMismatchError
from data.synthesize import SynthesizeError, read_kinds
from models.io import ExportError, load_drafter, read_safetensors
from models.target import TargetError, load_target
from rundir.checkpoints import CheckpointError
from schema.parse import RecipeError
from schema.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
POCKET = ROOT / "recipes" / "pocket" / "target"
LONG = os.environ.get("SPECDRAFT_FUZZ") == "long"
settings.register_profile(
    "bounded", max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
settings.register_profile("long", max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
FUZZ = settings.get_profile("long" if LONG else "bounded")


# ------------------------------------------------------------------------------------------------ damage


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """`data` with one to three edits: a byte flipped, a cut, bytes inserted, a span deleted or repeated."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "delete", "repeat"]))
        i = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "flip" and out:
            out[i] = draw(st.integers(0, 255))
        elif kind == "cut":
            del out[i:]
        elif kind == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=16) | st.sampled_from([b"{", b"[", b'"', b"\n", b"\xff"]))
        elif kind == "delete":
            del out[i : i + draw(st.integers(1, 32))]
        elif kind == "repeat":
            out[i:i] = out[i : i + draw(st.integers(1, 64))]
    return bytes(out)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def replaced(draw, value):
    """`value` (parsed JSON) with one value somewhere in it replaced by another of any type, or a key removed."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        out = dict(value)
        if draw(st.booleans()):
            del out[key]
        else:
            out[key] = draw(replaced(value[key]))
        return out
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], draw(replaced(value[i])), *value[i + 1 :]]
    return draw(JSON_VALUES)


def one_line(call: Callable[[], object], errors: tuple[type[BaseException], ...], names: str) -> None:
    """`call()` either succeeds or raises one of `errors` with one line that names `names` (a file or key)."""
    try:
        call()
    except errors as exc:
        message = str(exc)
        assert message.strip() and "\n" not in message.strip(), f"not one line: {message!r}"
        assert "Traceback" not in message
        assert names in message, f"{names!r} not named in {message!r}"


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Valid inputs to damage: a tiny recipe, prompts, answers, a chat dataset, kinds, a pipeline, feature shards, an
    export, a checkpoint."""
    from data import target_stats
    from data.extract import main as extract_main
    from export.write import export
    from train.loop import train

    torch.set_num_threads(1)
    w = tmp_path_factory.mktemp("fuzz")
    save_chat_target(w / "target", POCKET)
    chats = (ROOT / "tests" / "fixtures" / "tiny-chat.jsonl").read_text().splitlines()[:16]
    (w / "answers.jsonl").write_text("\n".join(chats) + "\n")
    (w / "prompts.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Count to {i}."}]}) + "\n"
                for i in range(4))
    )  # fmt: skip
    (w / "chats.json").write_text(json.dumps([json.loads(c) for c in chats], indent=2))
    (w / "kinds.yaml").write_text((ROOT / "recipes" / "smollm2" / "prompts" / "synth_kinds.yaml").read_text())
    raw = yaml.safe_load((ROOT / "recipes" / "tiny" / "eagle3.yaml").read_text())
    raw["target"]["tokenizer"] = str(POCKET)
    raw["data"] |= {"train_files": [str(w / "answers.jsonl")], "features_dir": str(w / "features")}
    raw["drafter"]["draft_vocab"] = 32
    raw["train"] |= {"output_dir": str(w / "run"), "max_steps": 2, "save_every": 1, "eval_every": 0}
    (w / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    pipeline = yaml.safe_load((ROOT / "recipes" / "smollm2" / "pipeline.yaml").read_text())
    pipeline["recipes"] = {"eagle3": "recipes/tiny/eagle3.yaml"}
    (w / "set").mkdir()
    (w / "set" / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    cwd = Path.cwd()
    os.chdir(ROOT)
    try:
        extract_main([str(w / "recipe.yaml")])
        target_stats.main([str(w / "recipe.yaml")])
        train(load_recipe(w / "recipe.yaml"))
        export(w / "run", w / "export")
        export(w / "run", w / "export-speculators", fmt="speculators")
    finally:
        os.chdir(cwd)
        reset_accelerate()
    return {"w": w}


def fresh(world: dict[str, Path], name: str, tmp: Path) -> Path:
    """A private copy of one of the world's files or directories, to damage."""
    src = world["w"] / name
    dst = tmp / name
    shutil.rmtree(dst, ignore_errors=True)
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return dst


# ------------------------------------------------------------------------------------------------ recipes


@FUZZ
@given(data=st.data())
def test_damaged_recipes_are_read_or_refused_in_one_line(world, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("recipe") / "recipe.yaml"
    path.write_bytes(data.draw(damaged((world["w"] / "recipe.yaml").read_bytes())))
    one_line(lambda: load_recipe(path), (RecipeError,), str(path))


KEYS = ["train.lr", "train.max_steps", "train.betas", "data.layers", "drafter.ttt_steps", "drafter.loss", "eval.tree",
        "eval.tree_depth", "target.random_init.hidden_size", "data.max_len", "train.first_records", "nosuch.key",
        "train", "drafter.draft_vocab", "eval.prompts", "data.storage_bits"]  # fmt: skip


@FUZZ
@given(key=st.sampled_from(KEYS), value=st.text(max_size=24) | st.integers().map(str) | st.floats().map(str))
def test_any_override_is_applied_or_refused_in_one_line_naming_it(world, key, value):
    one_line(lambda: load_recipe(world["w"] / "recipe.yaml", [f"{key}={value}"]), (RecipeError,), key.split(".")[0])


# ------------------------------------------------------------------------------------------------ data files


@FUZZ
@given(data=st.data())
def test_damaged_prompt_files_are_read_or_refused_in_one_line(world, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_bytes(data.draw(damaged((world["w"] / "prompts.jsonl").read_bytes())))
    one_line(lambda: read_prompts(path, None), (SelfDistillError,), str(path))


@FUZZ
@given(data=st.data())
def test_damaged_answer_files_are_prepared_or_refused_in_one_line(world, tmp_path_factory, data):
    from transformers import AutoTokenizer

    from data.prepare import prepare_dataset

    path = tmp_path_factory.mktemp("answers") / "answers.jsonl"
    lines = (world["w"] / "answers.jsonl").read_text().splitlines()
    if data.draw(st.booleans()):
        path.write_bytes(data.draw(damaged("\n".join(lines).encode())))
    else:  # structurally damaged: one record's values replaced
        i = data.draw(st.integers(0, len(lines) - 1))
        lines[i] = json.dumps(data.draw(replaced(json.loads(lines[i]))))
        path.write_text("\n".join(lines) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(world["w"] / "target")
    cfg = load_recipe(world["w"] / "recipe.yaml", [f"data.train_files=[{path}]"]).data
    one_line(lambda: prepare_dataset(cfg, tokenizer), (DataError, ChatTemplateError), str(path))


@FUZZ
@given(data=st.data())
def test_damaged_chat_datasets_are_read_or_refused_and_leave_no_report(world, tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("chats")
    path = tmp / "chats.json"
    raw = (world["w"] / "chats.json").read_bytes()
    if data.draw(st.booleans()):
        path.write_bytes(data.draw(damaged(raw)))
    else:
        path.write_text(json.dumps(data.draw(replaced(json.loads(raw)))))
    try:
        build(path, tmp / "out", [], Filters(), 0.1)
    except ChatSetError as exc:
        assert str(exc).startswith(str(path)) and "\n" not in str(exc), str(exc)
        assert not (tmp / "out" / "report.json").exists()  # the report, written last, says the splits are whole


@FUZZ
@given(data=st.data())
def test_damaged_kinds_files_are_read_or_refused_in_one_line(world, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("kinds") / "kinds.yaml"
    raw = (world["w"] / "kinds.yaml").read_bytes()
    if data.draw(st.booleans()):
        path.write_bytes(data.draw(damaged(raw)))
    else:
        path.write_text(yaml.safe_dump(data.draw(replaced(yaml.safe_load(raw)))))
    one_line(lambda: read_kinds(path), (SynthesizeError,), str(path))


@FUZZ
@given(data=st.data())
def test_damaged_pipelines_are_read_or_refused_in_one_line(world, tmp_path_factory, data):
    from recipes.run import load_pipeline

    directory = tmp_path_factory.mktemp("set")
    raw = (world["w"] / "set" / "pipeline.yaml").read_bytes()
    if data.draw(st.booleans()):
        (directory / "pipeline.yaml").write_bytes(data.draw(damaged(raw)))
    else:
        (directory / "pipeline.yaml").write_text(yaml.safe_dump(data.draw(replaced(yaml.safe_load(raw)))))
    try:
        load_pipeline(directory)
    except SystemExit as exc:
        message = str(exc.code)
        assert message.startswith("run: ") and "\n" not in message.strip(), message
        assert str(directory / "pipeline.yaml") in message or "pipeline.yaml" in message, message


def test_a_pipeline_whose_answer_file_is_not_a_path_is_refused_in_one_line(world, tmp_path):
    """Found by the long run (2026-12-06): a `selfdistill` job whose `out` is a list ended in a TypeError."""
    from recipes.run import load_pipeline

    spec = yaml.safe_load((world["w"] / "set" / "pipeline.yaml").read_bytes())
    job = spec["selfdistill"][0] if isinstance(spec["selfdistill"], list) else spec["selfdistill"]
    job["out"] = [job["out"]]
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SystemExit, match=r"pipeline\.yaml: selfdistill.*: out: expected a file path, got \["):
        load_pipeline(tmp_path)


# ------------------------------------------------------------------------------------------------ features, weights


@FUZZ
@given(data=st.data())
def test_damaged_feature_sets_are_opened_or_refused_in_one_line(world, tmp_path_factory, data):
    features = fresh(world, "features", tmp_path_factory.mktemp("features"))
    victim = data.draw(st.sampled_from(sorted(p.name for p in features.iterdir() if p.is_file())))
    raw = (features / victim).read_bytes()
    if victim.endswith(".json") and data.draw(st.booleans()):
        (features / victim).write_text(json.dumps(data.draw(replaced(json.loads(raw)))))
    else:
        (features / victim).write_bytes(data.draw(damaged(raw[:4096])) + raw[4096:])

    def read() -> None:
        ds = FeatureDataset(features)
        for i in range(len(ds)):
            ds[i]

    one_line(read, (FeatureMismatchError, FileNotFoundError), str(features))


@FUZZ
@given(data=st.data())
def test_damaged_target_statistics_are_used_only_when_intact(world, tmp_path_factory, data):
    """A damaged statistics index or file never stops training: it is refused in one line naming the directory (the
    run then computes the statistics itself), or, where the damage left what training reads intact, used as stored."""
    from data import target_stats

    features = fresh(world, "features", tmp_path_factory.mktemp("features"))
    stats = features / target_stats.STATS_DIR
    head = load_target(**vars(load_recipe(world["w"] / "recipe.yaml").target)).lm_head
    intact = FeatureDataset(features)
    assert "stored top-1" in target_stats.attach(intact, head)
    victim = stats / data.draw(st.sampled_from(sorted(p.name for p in stats.iterdir())))
    raw = victim.read_bytes()
    if victim.suffix == ".json" and data.draw(st.booleans()):
        victim.write_text(json.dumps(data.draw(replaced(json.loads(raw)))))
    else:
        victim.write_bytes(data.draw(damaged(raw)))
    dataset = FeatureDataset(features)
    line = target_stats.attach(dataset, head)
    assert line.strip() and "\n" not in line.strip() and str(features) in line
    if dataset.statistics is None:
        assert "each step computes them" in line
    else:
        for (top1, lse), (want_top1, want_lse) in zip(dataset.statistics, intact.statistics):
            assert torch.equal(top1, want_top1) and torch.equal(lse.nan_to_num(), want_lse.nan_to_num())


@FUZZ
@given(data=st.data())
def test_damaged_safetensors_are_read_or_refused_in_one_line(world, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("weights") / "model.safetensors"
    raw = (world["w"] / "export" / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")  # the length, then the JSON header: damage those
    path.write_bytes(data.draw(damaged(raw[:header])) + raw[header:])
    one_line(lambda: read_safetensors(path), (ExportError,), str(path))


@FUZZ
@given(data=st.data())
def test_damaged_export_configs_are_loaded_or_refused_in_one_line(world, tmp_path_factory, data):
    from models.target import load_target

    export = fresh(world, "export", tmp_path_factory.mktemp("export"))
    (export / ".specdraft-export").unlink()  # the contents behind the checksums: a config edited by hand
    config = json.loads((export / "config.json").read_text())
    if data.draw(st.booleans()):
        (export / "config.json").write_text(json.dumps(data.draw(replaced(config))))
    else:
        (export / "config.json").write_bytes(data.draw(damaged((export / "config.json").read_bytes())))
    recipe = load_recipe(world["w"] / "recipe.yaml")
    target = load_target(**vars(recipe.target))
    one_line(lambda: load_drafter(export, target), (ExportError, TargetError), str(export))


def test_an_export_config_without_feature_layers_for_a_small_target_is_refused_in_one_line(world, tmp_path):
    """Found by the long run (2026-12-06): an EAGLE-3 export whose `feature_layers` is emptied falls back to the
    low / mid / high layers, which a 4-layer target does not have: the drafter's own ValueError, not the export's."""
    from models.target import load_target

    export = fresh(world, "export", tmp_path / "export")
    (export / ".specdraft-export").unlink()
    config = json.loads((export / "config.json").read_text())
    config["drafter"]["feature_layers"] = []
    (export / "config.json").write_text(json.dumps(config))
    target = load_target(**vars(load_recipe(world["w"] / "recipe.yaml").target))
    with pytest.raises(ExportError, match=r"config\.json: drafter\.feature_layers: a 4-layer target has no distinct"):
        load_drafter(export, target)


@FUZZ
@given(data=st.data())
def test_damaged_import_configs_are_imported_or_refused_in_one_line(world, tmp_path_factory, data):
    from export.imports import import_checkpoint, resolve_target

    tmp = tmp_path_factory.mktemp("import")
    source = tmp / "speculators"
    shutil.copytree(world["w"] / "export-speculators", source)
    (source / ".specdraft-export").unlink()  # a checkpoint of another trainer, in the speculators layout
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(data.draw(replaced(config))))
    target = resolve_target(str(world["w"] / "recipe.yaml"))
    one_line(lambda: import_checkpoint(source, "speculators", target, tmp / "out"), (ExportError,), str(source))
    assert not (tmp / "out").exists() or (tmp / "out" / ".specdraft-export").is_file()


@pytest.mark.parametrize(("key", "value"), [("rms_norm_eps", [1e-5]), ("rope_scaling", ["linear"])])
def test_an_import_whose_layer_fields_have_the_wrong_type_is_refused_in_one_line(world, tmp_path, key, value):
    """Found by the long run (2026-12-06): `rms_norm_eps` a list ended in float()'s TypeError; `rope_scaling` a list
    would have ended in an AttributeError."""
    from export.imports import import_checkpoint, resolve_target

    source = tmp_path / "speculators"
    shutil.copytree(world["w"] / "export-speculators", source)
    (source / ".specdraft-export").unlink()
    config = json.loads((source / "config.json").read_text())
    config["transformer_layer_config"][key] = value
    (source / "config.json").write_text(json.dumps(config))
    target = resolve_target(str(world["w"] / "recipe.yaml"))
    with pytest.raises(ExportError, match=rf"config\.json: {key}: expected an? \w+ or nothing"):
        import_checkpoint(source, "speculators", target, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@FUZZ
@given(data=st.data())
def test_damaged_checkpoints_are_resumed_or_refused_in_one_line(world, tmp_path_factory, data):
    from rundir.checkpoints import latest_checkpoint, read_state

    run = fresh(world, "run", tmp_path_factory.mktemp("run"))
    checkpoint = latest_checkpoint(run)
    victim = checkpoint / data.draw(st.sampled_from(sorted(p.name for p in checkpoint.iterdir() if p.is_file())))
    raw = victim.read_bytes()
    victim.write_bytes(data.draw(damaged(raw[:4096])) + raw[4096:])

    def read() -> None:
        read_state(checkpoint)
        for f in checkpoint.glob("*.safetensors"):
            read_safetensors(f)

    one_line(read, (CheckpointError, ExportError), str(checkpoint))
