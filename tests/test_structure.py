"""The packages' structure, read from their source: which stage may import which, and no code probes a drafter or a
config for what it has (each declares it: `models.methods.Method`, the config's own fields and methods)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rundir", "models", "schema", "data", "train", "export", "eval", "recipes")

OURS_ALL = set(PACKAGES)
FORBIDDEN = {
    "rundir": OURS_ALL - {"rundir"},  # locks and checkpoints found: the standard library only
    "models": OURS_ALL - {"models"},  # drafters and the target stand alone: torch and transformers only
    "schema": OURS_ALL - {"schema", "models", "rundir"},  # the recipe: method declarations and output checks
    "data": {"train", "export", "eval", "recipes"},  # below train and eval: the held-out split, shards
    "train": {"export", "eval", "recipes"},  # the loop writes checkpoints; export reads them, train never exports
    "export": {"eval", "recipes"},  # fits the two-stage head's factors through models, never eval
    "eval": {"train", "export", "recipes"},  # an export read through models, checkpoints found through rundir
    "recipes": set(),  # the pipeline driver runs every stage
}
"""package -> packages of ours its modules may not import: every stage may import `rundir`, `models` and `schema`;
`schema` only `models` and `rundir`."""


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in a module, at its top or inside a function; `from pkg import name`
    gives `pkg.name` (a module or a name: both are what is taken from pkg)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def test_imports_run_downward():
    """rundir <- models <- schema <- data <- train <- export, and eval beside train and export: no exceptions, the
    recipe schema included (it is a package of its own, below data)."""
    wrong = []
    for path in sources(*PACKAGES):
        package = path.relative_to(ROOT).parts[0]
        for line, name in imports(path):
            if name.split(".")[0] in FORBIDDEN[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not wrong, "imports against the direction of the stages:\n" + "\n".join(wrong)


def test_every_package_is_placed():
    """Every package of ours at the top of the repository is in the table above, so none escapes the scan."""
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert ours == OURS_ALL, f"packages not in FORBIDDEN: {ours ^ OURS_ALL}"


def test_the_scan_sees_imports():
    """The scan above reads lazy imports too (a guard that it is not vacuous)."""
    names = {name for _, name in imports(ROOT / "eval/heads.py")}
    assert "eval.kernels.lowrank.tile_survivors" in names and "models.lm_head.compute_factors" in names


OURS = re.compile(r"\b(drafter|drafters|cfg|recipe|method)\b")
"""An expression naming a drafter, one of our configs, a recipe or a method declaration."""


def calls(path: Path, name: str) -> list[ast.Call]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def test_no_hasattr_probing():
    """A drafter declares what it is in its `Method` entry and its config's fields; a config declares what the target
    bounds (`target_sized`), whether it borrows the target's lm_head, what rebuilds it without its inputs; every recipe
    section declares `validate`; third-party objects are asked their type (DeepSpeed's ZeRO stage) or their children."""
    found = [f"{path.relative_to(ROOT)}:{call.lineno}: {ast.unparse(call)}" for path in sources(*PACKAGES)
             for call in calls(path, "hasattr")]  # fmt: skip
    assert not found, "hasattr probes (declare it, or ask the type):\n" + "\n".join(found)


@pytest.mark.parametrize("where", [PACKAGES, ("benchmarks",)])
def test_no_getattr_probing_of_drafters_or_configs(where):
    """`getattr(x, "name", default)` on a drafter, a config, a recipe or a method: what it has is declared, so it
    is read as a field. getattr on third-party objects (transformers configs' optional fields, tokenizers,
    DeepSpeed's optimizers) is not ours to declare."""
    wrong = []
    for path in sources(*where):
        for call in calls(path, "getattr"):
            if len(call.args) == 3 and OURS.search(ast.unparse(call.args[0])):
                wrong.append(f"{path.relative_to(ROOT)}:{call.lineno}: {ast.unparse(call)}")
    assert not wrong, "getattr probes of our objects:\n" + "\n".join(wrong)


MAX_LINES = 500


def test_no_source_file_over_500_lines():
    """A module a reader takes in whole: past 500 lines a file holds more than one concern, and is split by them."""
    long = [
        f"{p.relative_to(ROOT)}: {n}" for p in sources(*PACKAGES) if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"source files over {MAX_LINES} lines:\n" + "\n".join(long)
