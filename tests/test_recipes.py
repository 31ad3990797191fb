"""Every shipped recipe loads; bad recipes fail with one line naming the file and the key.

pytest tests/test_recipes.py
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from methods import METHODS
from schema.recipe import RecipeError, load_recipe
from train.__main__ import main as train_main

ROOT = Path(__file__).resolve().parents[1]
ALL_YAML = sorted((ROOT / "recipes").rglob("*.yaml"))
SPECDRAFT = [p for p in ALL_YAML if "drafter" in (yaml.safe_load(p.read_text()) or {})]
ACCELERATE = sorted((ROOT / "recipes/accelerate").glob("*.yaml"))


def test_recipes_are_found():
    assert {"eagle2.yaml", "medusa1.yaml"} <= {p.name for p in SPECDRAFT if p.parent.name == "tiny"}
    assert len(SPECDRAFT) >= 5 and len(ACCELERATE) == 6


@pytest.mark.parametrize("path", SPECDRAFT, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_recipe_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = load_recipe(path.relative_to(ROOT))
    assert recipe.drafter.method in METHODS


@pytest.mark.parametrize("path", SPECDRAFT + ACCELERATE, ids=lambda p: str(p.relative_to(ROOT)))
def test_header_is_the_command_that_runs_it(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# "), first
    command = first[2:]
    assert str(path.relative_to(ROOT)) in command, f"{path}: header does not name the file: {first}"
    assert any(word in command for word in ("-m train", "-m data.extract", "-m eval")), first


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_config_loads(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1


# The 7-8B EAGLE-3 recipes: the published setup, and the same data and steps as the EAGLE-2 recipe they sit beside
EAGLE3_8B = sorted((ROOT / "recipes/eagle3").glob("*.yaml"))
HUB_LAYERS = {"meta-llama/Llama-3.1-8B-Instruct": 32, "Qwen/Qwen2.5-7B-Instruct": 28}  # num_hidden_layers


@pytest.mark.parametrize("path", EAGLE3_8B, ids=lambda p: p.name)
def test_eagle3_recipes_follow_the_published_setup_at_eagle2_budget(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = load_recipe(path.relative_to(ROOT))
    d = recipe.drafter
    assert (d.method, d.ttt_steps, d.step_decay, d.draft_vocab) == ("eagle3", 7, 0.8, 32000)
    assert d.fc_norm and d.norm_output and recipe.train.online
    layers = HUB_LAYERS[recipe.target.path]
    assert d.feature_layers == dataclasses.replace(d, feature_layers=[]).resolved_layers(layers)  # low / mid / high
    assert recipe.data.layers == [*d.feature_layers, -1]
    eagle2 = load_recipe(f"recipes/eagle2/{path.name}")
    assert eagle2.target.path == recipe.target.path
    same = ("hf_dataset", "hf_split", "format", "max_len", "heldout_fraction")
    assert [getattr(recipe.data, k) for k in same] == [getattr(eagle2.data, k) for k in same]
    budget = ("max_steps", "batch_size", "grad_accum", "packing")
    assert [getattr(recipe.train, k) for k in budget] == [getattr(eagle2.train, k) for k in budget]


def test_eagle3_recipes_are_found():
    assert {p.name for p in EAGLE3_8B} == {"llama3.1-8b-instruct.yaml", "qwen2.5-7b-instruct.yaml"}


# --------------------------------------------------------------------------------------------
# Bad recipes: one line, naming the file and the key

TINY = ROOT / "recipes/tiny/medusa1.yaml"
BAD = {
    "unknown key": (["train.learning_rate=0.1"], "train.learning_rate", "unknown key"),
    "unknown section": (["optimizer.lr=0.1"], "optimizer", "unknown section"),
    "wrong type": (["train.max_steps=ten"], "train.max_steps", "expected int"),
    "wrong list type": (["data.layers=last"], "data.layers", "expected a list"),
    "impossible value": (["train.batch_size=0"], "train.batch_size", "must be >= 1"),
    "warmup past the end": (["train.warmup_steps=1000"], "train.warmup_steps", "must be in"),
    "layer out of range": (["data.layers=[5]"], "data.layers[0]", "out of range"),
    "unknown method": (["drafter.method=medusa3"], "drafter.method", "unknown method"),
    "tree deeper than heads": (["eval.tree=chain", "eval.tree_depth=9"], "eval.tree_depth", "exceeds"),
    "missing dataset": (["data.train_files=[]"], "data.train_files", "no dataset"),
    "draft vocabulary below top-k": (["eval.draft_vocab=4", "eval.tree_top_k=8"], "eval.draft_vocab", ">= tree_top_k"),
    "export format not written": (["export.format=tensorrt"], "export.format", "must be one of"),
    "no held-out batches": (["train.eval_batches=0"], "train.eval_batches", "must be >= 1"),
    "extraction batch": (["data.extract_batch_tokens=0"], "data.extract_batch_tokens", "must be >= 1"),
    "tree top-k": (["eval.tree_top_k=0"], "eval.tree_top_k", "must be >= 1"),
    "unknown tree": (["eval.tree=bushy"], "eval.tree", "must be one of"),
    "unknown baseline": (["eval.baselines=[plane]"], "eval.baselines", "unknown ['plane']"),
    "empty eval batches": (["eval.batch_size=0"], "eval.batch_size", "must be >= 1"),
    "prompt lookup in a batch": (["eval.batch_size=4"], "eval.batch_size", "eval.baselines=[plain]"),
    # sizes: each bounded at load time, against the target where its config says (the tiny target: 2 layers, 8192
    # tokens; max_position_embeddings set by the case) and always against a documented upper bound
    "endless decoding": (["eval.max_new_tokens=1000000000000"], "eval.max_new_tokens", "more than the upper bound"),
    "decoding past the target's positions": (
        ["target.random_init.max_position_embeddings=256", "eval.max_new_tokens=300"],
        "eval.max_new_tokens",
        "300 is more than the target's max_position_embeddings (256)",
    ),
    "a tree past the target's positions": (
        ["target.random_init.max_position_embeddings=256", "eval.tree_total_tokens=300"],
        "eval.tree_total_tokens",
        "max_position_embeddings (256)",
    ),
    "sequences past the target's positions": (
        ["target.random_init.max_position_embeddings=64"],
        "data.max_len",
        "128 is more than the target's max_position_embeddings (64)",
    ),
    "a huge context": (
        ["eval.context_lengths=[0,1000000000000]", "eval.context_source=c.jsonl"],
        "eval.context_lengths[1]",
        "upper bound",
    ),
    "huge batch": (["train.batch_size=1000000000000"], "train.batch_size", "more than the upper bound (4096)"),
    "huge accumulation": (["train.grad_accum=1000000000000"], "train.grad_accum", "upper bound (4096)"),
    "huge step": (
        ["train.batch_size=4096", "train.grad_accum=4096"],
        "train.batch_size",
        "tokens per process and step",
    ),
    "huge eval batch": (["eval.batch_size=1000000000000", "eval.baselines=[plain]"], "eval.batch_size", "upper bound"),
    "huge sequences": (["data.max_len=1000000000000"], "data.max_len", "upper bound"),
    "huge shards": (["data.shard_tokens=1000000000000"], "data.shard_tokens", "upper bound"),
    "huge extraction batches": (["data.extract_batch_tokens=1000000000000"], "data.extract_batch_tokens", "upper"),
    "huge heads": (["drafter.num_heads=1000000000000"], "drafter.num_heads", "more than the upper bound (64)"),
    "huge head blocks": (["drafter.num_layers=1000000000000"], "drafter.num_layers", "upper bound (64)"),
    "head blocks past the target's layers": (
        ["drafter.num_layers=3"],
        "drafter.num_layers",
        "3 is more than the target's num_hidden_layers (2)",
    ),
    "huge tree": (["eval.tree_total_tokens=1000000000000"], "eval.tree_total_tokens", "upper bound"),
    "deep tree": (["eval.tree_depth=1000000000000"], "eval.tree_depth", "upper bound (64)"),
    "wide tree": (["eval.tree_top_k=1000000000000"], "eval.tree_top_k", "upper bound"),
    "draft vocabulary past the target's": (
        ["eval.draft_vocab=9000"],
        "eval.draft_vocab",
        "9000 is more than the target's vocab_size (8192)",
    ),
    "loss vocabulary past the target's": (["train.loss_vocab=9000"], "train.loss_vocab", "vocab_size (8192)"),
    "mc_sim_7b_63 over a tiny draft vocabulary": (
        ["drafter.num_heads=4", "eval.tree=mc_sim_7b_63", "eval.tree_top_k=4", "eval.draft_vocab=4"],
        "eval.draft_vocab",
        "top 10",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_names_file_and_key(case, tmp_path):
    overrides, key, phrase = BAD[case]
    path = tmp_path / "bad.yaml"
    path.write_text(TINY.read_text())
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: {key}:"), message
    assert phrase in message, message


def test_bad_recipe_file_content(tmp_path):
    """Errors in the file itself (not overrides) name it too."""
    raw = yaml.safe_load(TINY.read_text())
    raw["train"]["lr"] = "fast"
    path = tmp_path / "typed.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError, match=rf"^{path}: train\.lr: expected float"):
        load_recipe(path)


def test_cli_prints_one_line_and_exits(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(TINY.read_text())
    with pytest.raises(SystemExit) as info:
        train_main([str(path), "drafter.num_heads=0"])
    assert info.value.code == f"error: {path}: drafter.num_heads: must be >= 1, got 0"


def test_exponent_without_dot_is_a_float():
    """YAML 1.1 reads `1e-2` as a string; the schema still takes it as the number a user meant, also inside
    `target.random_init` (which goes to a transformers config as it is)."""
    recipe = load_recipe(TINY, ["train.lr=1e-2", "train.weight_decay=0", "target.random_init.rms_norm_eps=1e-5"])
    assert recipe.train.lr == 0.01 and isinstance(recipe.train.weight_decay, float)
    assert recipe.target.random_init["rms_norm_eps"] == 1e-5 and recipe.target.random_init["model_type"] == "llama"


def test_yaml_readings_a_user_did_not_mean(tmp_path):
    """An unquoted `no` (YAML 1.1: false) is the documented mixed_precision value; an empty section takes
    overrides like an absent one."""
    assert load_recipe(TINY, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    path = tmp_path / "empty-section.yaml"
    path.write_text(TINY.read_text() + "\nexport:\n")
    assert load_recipe(path, ["export.format=eagle"]).export.format == "eagle"


def test_eagle_refuses_medusa_trees():
    eagle = ROOT / "recipes/tiny/eagle2.yaml"
    with pytest.raises(
        RecipeError, match="eval.tree: mc_sim_7b_63: a eagle2 drafter drafts auto, dynamic, chain, cost trees"
    ):
        load_recipe(eagle, ["eval.tree=mc_sim_7b_63"])


def test_a_yaml_error_names_where_it_is_and_where_its_construct_started(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: [1\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value) == (
        f"{path}: not valid YAML: line 3, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow "
        "sequence started at line 2, column 7)"
    )


EAGLE3 = ROOT / "recipes/tiny/eagle3.yaml"  # a 4-layer target of 8192 tokens


@pytest.mark.parametrize(
    "overrides, key, phrase",
    [
        (["drafter.draft_vocab=9000"], "drafter.draft_vocab", "9000 is more than the target's vocab_size (8192)"),
        (["drafter.draft_vocab=1000000000000"], "drafter.draft_vocab", "upper bound"),
        (["drafter.ttt_steps=1000000000000"], "drafter.ttt_steps", "more than the upper bound (64)"),
    ],
)
def test_eagle3_sizes_are_bounded(overrides, key, phrase):
    with pytest.raises(RecipeError, match=rf"^{EAGLE3}: {key}: .*{re.escape(phrase)}"):
        load_recipe(EAGLE3, overrides)


def test_eagle_drafter_layers_are_bounded_by_the_targets():
    eagle = ROOT / "recipes/tiny/eagle2.yaml"  # a 2-layer target
    with pytest.raises(RecipeError, match=r"drafter.num_layers: 3 is more than the target's num_hidden_layers \(2\)"):
        load_recipe(eagle, ["drafter.num_layers=3"])
    assert load_recipe(eagle, ["drafter.num_layers=2"]).drafter.num_layers == 2


NINE = "[" + ", ".join(["*a"] * 9) + "]"
BOMB = (
    "[&a [1, 1, 1, 1, 1, 1, 1, 1, 1], "
    + ", ".join(f"&{name} " + NINE.replace("a", below) for below, name in zip("abcdefgh", "bcdefghi"))
    + "]"
)
"""A 'billion laughs': nine levels of nine aliases, over 9**9 numbers once expanded (in 300 bytes of YAML)."""


def test_an_alias_bomb_is_refused_at_load(tmp_path):
    """Nested aliases expand exponentially; anything quoting or saving the value (here: the wrong-type message
    quoting it) would never finish. Refused as the file is read, in one line naming it and where; a recipe may
    still use aliases within reason."""
    path = tmp_path / "bomb.yaml"
    text = TINY.read_text()
    line = text.splitlines().index("  max_steps: 20") + 1
    path.write_text(text.replace("  max_steps: 20", f"  max_steps: {BOMB}"))
    with pytest.raises(RecipeError, match=rf"^{path}: line {line}, column \d+: aliases expand this node to more than"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"override 'train.max_steps=.*: aliases expand"):
        load_recipe(TINY, [f"train.max_steps={BOMB}"])
    path.write_text(text + "loop: &l [*l]\n")
    with pytest.raises(RecipeError, match=rf"^{path}: line \d+, column \d+: a node that contains itself"):
        load_recipe(path)
    path.write_text(text.replace("  max_steps: 20", "  max_steps: &n 20\n  keep_checkpoints: *n"))
    assert load_recipe(path).train.keep_checkpoints == 20
