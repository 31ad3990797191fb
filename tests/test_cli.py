"""The `specdraft` command (recipes/cli.py): each subcommand runs its module as `python -m` would, from any
directory, with the module's one-line errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.cli import COMMANDS, ROOT


def specdraft(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_every_subcommand_names_a_module_or_file_that_exists():
    for name, target in COMMANDS.items():
        assert (ROOT / target).is_file() if target.endswith(".py") else importlib.util.find_spec(target), name
    assert {"run", "synthesize", "selfdistill", "extract", "train", "export", "eval", "import"} <= COMMANDS.keys()


@pytest.mark.slow
def test_subcommands_run_their_module_from_any_directory(tmp_path):
    listing = specdraft("--help", cwd=tmp_path)
    assert listing.returncode == 0 and all(name in listing.stdout for name in COMMANDS)
    unknown = specdraft("nope", cwd=tmp_path)
    assert unknown.returncode != 0 and "unknown subcommand 'nope'" in unknown.stderr
    helped = specdraft("train", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--stop-after" in helped.stdout
    missing = specdraft("chatsets", "nope.json", "--out", "out", cwd=tmp_path)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert missing.stderr.strip() == "error: nope.json: no such file (or a packaged dataset name: sharegpt)"
    bad = specdraft("train", str(tmp_path / "none.yaml"), cwd=tmp_path)
    assert bad.returncode != 0 and "none.yaml" in bad.stderr.strip().splitlines()[-1]
