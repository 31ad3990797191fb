"""The recipe-set preflight (recipes/preflight.py, `recipes/run.py SET --check`, and before every run's first step):
each configuration error is one line naming the file and key, found in seconds with no model forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_run import METHODS, POCKET, recipe
from tiny import save_chat_target

from recipes.preflight import check_set

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def recipe_set(tmp_path) -> tuple[Path, dict]:
    """A set of the three tiny recipes on a saved 2-layer chat target, as test_run's (self-distillation writes the
    training file)."""
    target = tmp_path / "target"
    save_chat_target(target, POCKET)
    prompt = {"id": "q0", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}
    for name in ("train.jsonl", "heldout.jsonl"):
        (tmp_path / name).write_text(json.dumps(prompt) + "\n")
    for method in METHODS:
        (tmp_path / f"{method}.yaml").write_text(yaml.safe_dump(recipe(method, tmp_path, target)))
    spec = {
        "target": str(target),
        "selfdistill": [{"prompts": str(tmp_path / "train.jsonl"), "out": str(tmp_path / "out" / "selfdistill.jsonl")}],
        "recipes": {m: str(tmp_path / f"{m}.yaml") for m in METHODS},
    }
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path, spec


def edit(path: Path, section: str, key: str, value) -> None:
    conf = yaml.safe_load(path.read_text())
    conf[section][key] = value
    path.write_text(yaml.safe_dump(conf))


def problems(root: Path, spec: dict, overrides: tuple[str, ...] = ()) -> list[str]:
    return check_set(spec, root, spec["recipes"], list(overrides), shipped=False)


def test_a_set_made_for_its_target_has_no_problems(recipe_set):
    assert problems(*recipe_set) == []


def test_layers_beyond_the_target_are_named_before_anything_runs(recipe_set):
    root, spec = recipe_set
    edit(root / "eagle3.yaml", "drafter", "feature_layers", [0, 7, -1])
    (found,) = problems(root, spec)
    assert str(root / "eagle3.yaml") in found and "drafter.feature_layers" in found
    # a command-line override reaches every recipe of the set, and is checked as well
    assert any("data.layers" in p for p in problems(root, spec, ("data.layers=[0,5,-1]",)))


def test_prompts_of_another_set_and_missing_files_are_named(recipe_set):
    root, spec = recipe_set
    edit(root / "eagle2.yaml", "eval", "prompts", "recipes/smollm2/prompts/heldout.jsonl")
    edit(root / "medusa1.yaml", "data", "train_files", [str(root / "nowhere.jsonl")])
    found = problems(root, spec)
    assert len(found) == 2
    assert "eval.prompts" in found[0] and "belongs to the recipe set 'smollm2'" in found[0]
    assert "data.train_files[0]" in found[1] and "no step of the set writes it" in found[1]


def test_a_target_without_chat_template_or_another_target_is_named(recipe_set):
    root, spec = recipe_set
    config = json.loads((root / "target" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (root / "target" / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "target" / "chat_template.jinja").unlink(missing_ok=True)
    edit(root / "eagle2.yaml", "target", "path", str(ROOT / "recipes/pocket/target"))
    found = problems(root, spec)
    assert any("no chat template" in p for p in found)
    assert any(str(root / "eagle2.yaml") in p and "target.path" in p and "not the set's target" in p for p in found)


@pytest.mark.slow
def test_run_check_and_a_run_stop_in_seconds_before_any_step(recipe_set):
    root, _ = recipe_set
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([sys.executable, "recipes/run.py", str(root), "--check"], cwd=ROOT, env=env,
                        capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0 and "3 recipe(s) checked" in ok.stdout, ok.stderr[-2000:]
    edit(root / "eagle3.yaml", "drafter", "draft_vocab", 10**9)
    start = time.monotonic()
    bad = subprocess.run(
        [sys.executable, "recipes/run.py", str(root)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert time.monotonic() - start < 60 and bad.returncode != 0
    assert "drafter.draft_vocab" in bad.stderr and bad.stderr.strip().endswith("1 problem(s)")
    assert not (root / "out").exists()  # no step ran: self-distillation would have written there
