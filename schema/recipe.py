"""Recipe schema: YAML -> typed, validated dataclasses.

    recipe = load_recipe("recipes/tiny/eagle2.yaml", overrides=["train.lr=1e-3"])

A recipe has seven sections: `target`, `data`, `drafter`, `train`, `eval`, `export`, `logging`.
Every section is a dataclass of `schema.sections` or `schema.evaluation` (the drafter section is the config class
of the chosen method, from `methods.METHODS`; loading a recipe imports no torch); this module assembles and
cross-checks them. Unknown keys, wrong types and impossible values fail at load time with one line naming the key
and the file (`RecipeError`); the checks that every field gets from its annotation, and the command-line overrides,
are `schema.parse`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from methods import METHODS
from models.typed import build_dataclass
from rundir.lock import NotADirectory, check_output_path
from schema.evaluation import EvalConfig
from schema.parse import RecipeError, YAMLTooLarge, apply_overrides, safe_load, yaml_problem
from schema.sections import (
    MAX_STEP_TOKENS,
    DataConfig,
    ExportConfig,
    LoggingConfig,
    TargetConfig,
    TrainConfig,
    check_at_most,
)

LATER_SETTINGS: dict[str, dict[str, Any]] = {"data": {"max_loss_tokens": None, "max_repeat_run": None}}
"""Settings added after runs existed, with the value that keeps the earlier behaviour: hashed only when set to
something else, so that checkpoints made before them still resume and export. A method's own such fields are its
entry's `later_fields` (`methods.method.Method`)."""


def later_settings(method: str) -> dict[str, dict[str, Any]]:
    """The settings added after runs existed, by section, with their earlier values: LATER_SETTINGS and `method`'s
    own fields of that kind (its `Method` entry's `later_fields`). Where a record made before them (a checkpoint's
    hash, a report's recipe.yaml) lacks one, it held the earlier value."""
    return {**LATER_SETTINGS, "drafter": dict(METHODS[method].later_fields)}


@dataclass
class Recipe:
    target: TargetConfig
    data: DataConfig
    drafter: Any
    """The method's config dataclass (`methods.METHODS[method].config`); has a `method` field."""
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    source: str = "<memory>"
    """File the recipe was loaded from (not a YAML key)."""
    overrides: tuple[str, ...] = ()
    """The `section.key=value` overrides it was loaded with (not a YAML key)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        out.pop("overrides")
        return out

    def command(self, module: str) -> str:
        """`python -m MODULE` on this recipe as it was loaded (file and overrides), for hints a user can paste."""
        return " ".join(["python -m", module, *(shlex.quote(arg) for arg in (self.source, *self.overrides))])

    def save(self, path: str | Path) -> None:
        """Write the resolved recipe (YAML) next to an output."""
        Path(path).write_text(f"# resolved from {self.source}\n" + yaml.safe_dump(self.to_dict(), sort_keys=False))

    def hashed_settings(self, *sections: str) -> dict[str, Any]:
        """What `section_hash` hashes: the sections' settings, less those that cannot change what was built."""
        settings = self.to_dict()
        chosen = {s: settings[s] for s in sections}
        if "data" in chosen:  # a check, not a setting: hashed as its former default, so older checkpoints still match
            chosen["data"]["verify_checksums"] = False
            if chosen["data"]["storage_dtype"] != "pca":  # pca's settings mean nothing to other dtypes: unhashed
                chosen["data"].pop("storage_bits")
                chosen["data"].pop("storage_fit_tokens")
        for section, fields in later_settings(self.drafter.method).items():
            for key, earlier in fields.items():
                if section in chosen and chosen[section][key] == earlier:
                    del chosen[section][key]
        return chosen

    def section_hash(self, *sections: str) -> str:
        """Stable hash of some sections, used to refuse reusing outputs built from other settings."""
        blob = json.dumps(self.hashed_settings(*sections), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def dotted_settings(recipe: dict[str, Any], sections: typing.Iterable[str]) -> dict[str, Any]:
    """A recipe mapping's `sections` as flat `section.key` -> value (nested mappings walked, lists kept whole), in
    the recipe's order: what refusals compare to name the first setting that differs."""
    flat: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        else:
            flat[key] = value

    for section in sections:
        walk(recipe.get(section) or {}, section)
    return flat


SECTIONS: dict[str, type] = {
    "target": TargetConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "export": ExportConfig,
    "logging": LoggingConfig,
}


# --------------------------------------------------------------------------------------------
# Loading


def recipe_from_dict(raw: dict, source: str = "<memory>") -> Recipe:
    """Validate a raw mapping into a Recipe; errors name `source` and the key."""

    def err(key: str, msg: str) -> typing.NoReturn:
        raise RecipeError(f"{source}: {key}: {msg}")

    if not isinstance(raw, dict):
        err("<top>", "a recipe must be a mapping of sections")
    unknown = sorted(set(raw) - set(SECTIONS) - {"drafter"})
    if unknown:
        err(unknown[0], f"unknown section (known: drafter, {', '.join(SECTIONS)})")
    for required in ("target", "data", "drafter"):
        if required not in raw:
            err(required, "section is required")
    sections = {name: build_dataclass(cls, raw.get(name), name, err) for name, cls in SECTIONS.items()}
    drafter_raw = raw["drafter"]
    if not isinstance(drafter_raw, dict) or "method" not in drafter_raw:
        err("drafter.method", f"is required (one of {sorted(METHODS)})")
    method = drafter_raw["method"]
    if method not in METHODS:
        err("drafter.method", f"unknown method {method!r} (known: {sorted(METHODS)})")
    drafter = build_dataclass(METHODS[method].config, drafter_raw, "drafter", err)
    recipe = Recipe(drafter=drafter, source=source, **sections)
    _check_cross_section(recipe, err)
    return recipe


def _check_sizes(recipe: Recipe, err) -> None:
    """Sizes that span sections or depend on the target: the tokens one training step holds, and token counts and
    vocabulary sizes within the target's max_position_embeddings and vocab_size (when its config is readable)."""
    train, data, ev = recipe.train, recipe.data, recipe.eval
    if train.batch_size * train.grad_accum * data.max_len > MAX_STEP_TOKENS:
        err(
            "train.batch_size",
            f"train.batch_size x train.grad_accum x data.max_len = {train.batch_size} x {train.grad_accum} x "
            f"{data.max_len} tokens per process and step, more than the upper bound ({MAX_STEP_TOKENS})",
        )
    positions = recipe.target.size("max_position_embeddings")
    if positions is not None:
        what = "the target's max_position_embeddings"
        check_at_most(err, "data.max_len", data.max_len, positions, what)
        check_at_most(err, "eval.max_new_tokens", ev.max_new_tokens, positions, what)
        check_at_most(err, "eval.tree_total_tokens", ev.tree_total_tokens, positions, what)
        for i, n in enumerate(ev.context_lengths):
            check_at_most(err, f"eval.context_lengths[{i}]", n, positions, what)
    vocab = recipe.target.size("vocab_size")
    if vocab is not None:
        what = "the target's vocab_size"
        check_at_most(err, "train.loss_vocab", train.loss_vocab, vocab, what)
        for key in ("draft_vocab", "tree_top_k", "head_candidates"):
            check_at_most(err, f"eval.{key}", getattr(ev, key), vocab, what)
    hidden = recipe.target.size("hidden_size")
    if hidden is not None and ev.head == "two_stage":
        check_at_most(err, "eval.head_rank", ev.head_rank, hidden, "the target's hidden_size")


def _check_cross_section(recipe: Recipe, err) -> None:
    """Constraints that span sections: sizes (`_check_sizes`), layers in range, drafter needs vs stored features,
    what the method declares (`methods`: the trees it drafts, online-only training), then the method's own
    limits."""
    _check_sizes(recipe, err)
    n_layers = recipe.target.num_layers
    if n_layers is not None:
        for i, layer in enumerate(recipe.data.layers):
            if not -1 <= layer <= n_layers:
                err(f"data.layers[{i}]", f"layer {layer} out of range for a {n_layers}-layer target (-1..{n_layers})")
    method = METHODS[recipe.drafter.method]
    # offline, the shards hold data.layers; online, the training step computes exactly those (methods that run the
    # target themselves, e.g. Medusa-2, take what they need)
    for layer in recipe.drafter.feature_layers:
        if layer not in recipe.data.layers and not method.online_only:
            err("drafter.feature_layers", f"layer {layer} is not stored in data.layers={recipe.data.layers}")
    if recipe.eval.tree not in method.trees:
        err("eval.tree", f"{recipe.eval.tree}: a {method.name} drafter drafts {', '.join(method.trees)} trees")
    if method.online_only and not recipe.train.online:
        err("train.online", f"{method.name} runs the target inside its training step: set train.online: true")
    recipe.drafter.check_recipe(recipe, err)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""What a hub id looks like (`name` or `org/name`): a path of another shape that does not exist is a typo."""


def _check_model_dir(path: str, key: str, err, config: bool) -> None:
    p = Path(path)
    if p.is_dir():
        if config and not (p / "config.json").is_file():
            err(key, f"{path} is not a Hugging Face model directory (no config.json)")
        return
    if p.exists():
        err(key, f"{path} is a file, not a model directory")
    parent = p.parent
    if not _HUB_ID.fullmatch(path) or ".." in path or (parent != Path(".") and parent.is_dir()):
        err(key, f"no such directory {path}")  # `runs/x` with a local `runs/`: a typo, not the hub's org `runs`


def check_inputs(recipe: Recipe, keys: typing.Iterable[str]) -> None:
    """Refuse missing inputs of the keys a stage reads before any heavy work (RecipeError naming the key and the
    file). Keys: `target.path`, `target.tokenizer` (local directories; a name shaped like a hub id is left to the
    hub), `data.train_files`, `eval.prompts`, `drafter` (the method's own inputs, its config's `check_inputs`), and
    the output directories `train.output_dir`, `data.features_dir` (refused when they are, or lie under, a file)."""

    def err(key: str, msg: str) -> typing.NoReturn:
        raise RecipeError(f"{recipe.source}: {key}: {msg}")

    for key in keys:
        if key == "target.path" and recipe.target.path is not None:
            _check_model_dir(recipe.target.path, key, err, config=True)
        elif key == "target.tokenizer" and recipe.target.tokenizer is not None:
            _check_model_dir(recipe.target.tokenizer, key, err, config=False)
        elif key == "data.train_files":
            for i, file in enumerate(recipe.data.train_files):
                if not Path(file).is_file():
                    err(f"data.train_files[{i}]", f"no such file {file}")
        elif key == "eval.prompts":
            if recipe.eval.prompts is None:
                err(key, "is required (a JSONL file of prompts)")
            if not Path(recipe.eval.prompts).is_file():
                err(key, f"no such file {recipe.eval.prompts}")
        elif key == "drafter":
            recipe.drafter.check_inputs(err)
        elif key in ("train.output_dir", "data.features_dir"):  # outputs: a directory to create or reuse
            value = recipe.train.output_dir if key == "train.output_dir" else recipe.data.features_dir
            if value is not None:
                try:
                    check_output_path(value, key)
                except NotADirectory as exc:
                    raise RecipeError(f"{recipe.source}: {exc}") from None


def load_recipe(path: str | Path, overrides: list[str] | None = None, inputs: typing.Iterable[str] = ()) -> Recipe:
    """Load, override and validate a YAML recipe; then check the input files of `inputs` (see `check_inputs`)."""
    path = Path(path)
    source = str(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.yaml"))
        raise RecipeError(
            f"{source}: a directory, not a recipe file" + (f" (it holds {', '.join(found)})" if found else "")
        )
    if not path.is_file():
        raise RecipeError(f"{source}: no such recipe file")
    try:
        raw = safe_load(path.read_text(encoding="utf-8")) or {}
    except YAMLTooLarge as exc:
        raise RecipeError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: not valid YAML: {yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise RecipeError(f"{source}: not UTF-8 text (byte {byte:#04x} at offset {exc.start})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: <top>: a recipe must be a mapping of sections, got {type(raw).__name__}")
    recipe = recipe_from_dict(apply_overrides(raw, overrides or [], source), source)
    recipe.overrides = tuple(overrides or ())
    check_inputs(recipe, inputs)
    return recipe
