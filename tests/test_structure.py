"""The packages' structure, read from their source: which stage may import which, and no code probes a drafter or a
config for what it has (each declares it: `methods.Method`, the config's own fields and methods)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rundir", "models", "methods", "schema", "data", "train", "export", "eval", "recipes")

OURS_ALL = set(PACKAGES)
FORBIDDEN = {
    "rundir": OURS_ALL - {"rundir"},  # locks and checkpoints found: the standard library only
    "methods": OURS_ALL - {"methods"},  # the entries and their configs: declarations, the standard library only
    "models": OURS_ALL - {"models", "methods"},  # the target and the drafters' building blocks, the native export
    "schema": OURS_ALL - {"schema", "models", "methods", "rundir"},  # the recipe: method declarations, output checks
    "data": {"train", "export", "eval", "recipes"},  # below train and eval: the held-out split, shards
    "train": {"export", "eval", "recipes"},  # the loop writes checkpoints; export reads them, train never exports
    "export": {"eval", "recipes"},  # fits the two-stage head's factors through models, never eval
    "eval": {"train", "export", "recipes"},  # an export read through models, checkpoints found through rundir
    "recipes": set(),  # the pipeline driver runs every stage
}
"""package -> packages of ours its modules may not import: methods' entries (the registry) <- models <- schema <-
data <- train <- export, eval beside train and export; every stage may import `rundir`, `methods`, `models` and
`schema`. A method folder's parts are the exception the
next table makes: they are loaded by path (`methods.resolve`), at the top."""

PART_FORBIDDEN = {"train", "recipes"}
"""What a method's parts (its model, layouts, gates, importers: every module of `methods/<name>/` but `__init__.py`
and `config.py`) may not import: they build on models, the export helpers and the evaluation contract; training
reaches them only through the entry."""


def is_entry(path: Path) -> bool:
    """A module of `methods` the registry loads: the package's own modules (the entry type, the shared config limits,
    the named trees), each folder's `__init__.py` and `config.py`; the rest of a folder are its parts."""
    rel = path.relative_to(ROOT / "methods")
    return len(rel.parts) == 1 or rel.name in ("__init__.py", "config.py")


def is_part(name: str) -> bool:
    """`name` (a dotted import) reaches into a method's parts: `methods.<folder>.<module>` other than `config`."""
    parts = name.split(".")
    folder = len(parts) >= 3 and (ROOT / "methods" / parts[1]).is_dir()
    return parts[0] == "methods" and folder and parts[2] != "config"


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
    """rundir <- methods (entries) <- models <- schema <- data <- train <- export, and eval beside train and export;
    the methods' parts on top: no exceptions, the recipe schema included (a package of its own, below data)."""
    wrong = []
    for path in sources(*PACKAGES):
        package = path.relative_to(ROOT).parts[0]
        part = package == "methods" and not is_entry(path)
        for line, name in imports(path):
            if name.split(".")[0] in (PART_FORBIDDEN if part else FORBIDDEN[package]):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not wrong, "imports against the direction of the stages:\n" + "\n".join(wrong)


def test_method_parts_are_loaded_by_path():
    """No module but a method's own parts imports a method's model, layouts, gates or importers: train, export and
    eval reach them through the entry's paths, so a new method adds a folder and its name, never an import
    elsewhere; and an entry never imports its parts (loading the registry imports no torch)."""
    wrong = []
    for path in sources(*PACKAGES):
        inside = path.is_relative_to(ROOT / "methods") and not is_entry(path)
        for line, name in imports(path):
            if is_part(name) and not inside:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not wrong, "imports of a method's parts (name them by path in its entry):\n" + "\n".join(wrong)


@pytest.mark.slow
def test_the_registry_imports_no_torch():
    """The recipe schema loads every method's entry: that must not import torch (a recipe check runs in a second)."""
    out = subprocess.run([sys.executable, "-c", "import sys, methods, schema.recipe; print('torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.strip() == "False"


@pytest.mark.parametrize("package", ["train", "export", "eval", "data", "schema"])
def test_no_stage_asks_which_method_it_has(package):
    """No stage compares a method's name or kind with a literal (`cfg.method == "peagle"`, `method.proposer in
    ("eagle", "parallel")`): what a method does, its entry declares. Comparing two names (an export's method against
    the recipe's) is a check, not a dispatch."""
    wrong = []
    for path in sources(package):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            asks = any(isinstance(s, ast.Attribute) and s.attr in ("method", "proposer") for s in sides)
            if asks and any(isinstance(s, (ast.Constant, ast.Tuple, ast.List, ast.Set)) for s in sides):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


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


@pytest.mark.parametrize("where", [PACKAGES, ("benchmarks", "tests")])
def test_no_hasattr_probing(where):
    """A drafter declares what it is in its `Method` entry and its config's fields; a config declares what the target
    bounds (`target_sized`), whether it borrows the target's lm_head, what rebuilds it without its inputs; every recipe
    section declares `validate`; third-party objects are asked their type (DeepSpeed's ZeRO stage) or their children."""
    found = [f"{path.relative_to(ROOT)}:{call.lineno}: {ast.unparse(call)}" for path in sources(*where)
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
