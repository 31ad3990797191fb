"""A recipe set checked before anything heavy runs: `recipes/run.py SET --check`, and always before its first step.

In seconds and without a model forward: every recipe of the set loads (its schema, and its layers, sizes and draft
vocabulary against the target's config.json, as `schema.recipe.load_recipe` checks them), trains for the set's
target, reads only files that exist or that a step of the set writes first, and evaluates on prompts of its own
set; the target has a tokenizer and a chat template; the set's prompt files exist. Each problem is one line naming
the file and key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schema.parse import RecipeError
from schema.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def _resolved(path: str | Path) -> Path:
    path = Path(path)
    return (path if path.is_absolute() else ROOT / path).resolve()


def missing(path: str | Path, made: set[Path]) -> bool:
    """Neither there nor written by a step of the set."""
    where = _resolved(path)
    return not where.is_file() and where not in made


def produced(spec: dict[str, Any]) -> set[Path]:
    """Files a step of the set writes before training and evaluation read them."""
    files = {_resolved(job["out"]) for job in spec.get("selfdistill") or []}
    for chatset in spec.get("chatsets") or []:
        out = _resolved(chatset["out"])  # data.chatsets writes OUT/train.jsonl, OUT/heldout.jsonl, ...
        files |= {out / name for name in ("train.jsonl", "heldout.jsonl", "train-conversations.jsonl")}
    if spec.get("synthesize"):
        files.add(_resolved(spec["synthesize"]["out"]))
    return files


def target_problems(target: Path) -> list[str]:
    if not (target / "config.json").is_file():
        return []  # fetched by the set's first step, or reported by the driver
    problems = []
    if not any((target / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        problems.append(f"{target}: no tokenizer (tokenizer.json or tokenizer.model)")
    template = (target / "chat_template.jinja").is_file()
    try:
        template = template or bool(json.loads((target / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        pass
    if not template:
        problems.append(
            f"{target}: no chat template (chat_template.jinja, or chat_template in tokenizer_config.json): "
            "self-distillation and evaluation format prompts with it"
        )
    return problems


def recipe_problems(
    path: str, overrides: list[str], set_dir: Path, target: Path, made: set[Path], only_eval: bool = False
) -> list[str]:
    """What is wrong with one recipe of the set; [] when nothing is."""
    try:
        recipe = load_recipe(ROOT / path, list(overrides))
    except RecipeError as exc:
        return [str(exc)]
    problems = []
    if recipe.target.path is not None and _resolved(recipe.target.path) != target.resolve():
        problems.append(f"{path}: target.path: {recipe.target.path} is not the set's target ({target})")
    if not only_eval:
        for i, name in enumerate(recipe.data.train_files):
            if missing(name, made):
                problems.append(
                    f"{path}: data.train_files[{i}]: {name} does not exist and no step of the set writes it"
                )
    prompts = recipe.eval.prompts
    if prompts:
        where = _resolved(prompts)
        if missing(where, made):
            problems.append(f"{path}: eval.prompts: {prompts} does not exist and no step of the set writes it")
        recipes_root = (ROOT / "recipes").resolve()
        if where.is_relative_to(recipes_root) and not where.is_relative_to(set_dir.resolve()):
            other = where.relative_to(recipes_root).parts[0]
            problems.append(
                f"{path}: eval.prompts: {prompts} belongs to the recipe set {other!r}, not this one: the evaluation "
                "would measure another target's prompts; give this set's held-out prompts"
            )
    return problems


def check_set(
    spec: dict[str, Any], set_dir: Path, recipes: dict[str, str], overrides: list[str], shipped: bool
) -> list[str]:
    """Every problem of the set (pipeline.yaml already parsed by the driver), [] when it may run."""
    target = _resolved(spec["target"])
    made = produced(spec)
    problems = target_problems(target)
    general = spec.get("general")
    if general and missing(general["prompts"], made):
        problems.append(f"{set_dir / 'pipeline.yaml'}: general.prompts: {general['prompts']} does not exist")
    for job in [] if shipped else spec.get("selfdistill") or []:  # --shipped runs no data step
        if missing(job["prompts"], made):
            problems.append(f"{set_dir / 'pipeline.yaml'}: selfdistill: prompts {job['prompts']} does not exist")
    for path in recipes.values():
        problems += recipe_problems(path, overrides, set_dir, target, made, only_eval=shipped)
    return problems
