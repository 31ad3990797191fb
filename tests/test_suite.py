"""The test suite's own habits: every test that spawns subprocesses is marked `slow`, the marker is registered, and
`make test-fast` leaves the slow tests out while `make test` runs them all."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from conftest import SLOW

ROOT = Path(__file__).resolve().parents[1]
SPAWNS = {"run", "Popen", "call", "check_call", "check_output", "accelerate_launch", "launch"}
"""Calls that start a process: subprocess's functions, tests/tiny.py's `accelerate_launch`, and helpers named
`launch`."""


def _called(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "subprocess":
                names.add(f"subprocess.{f.attr}")
            elif isinstance(f, ast.Name):
                names.add(f.id)
    return names


def _is_slow_mark(node: ast.expr) -> bool:
    return "mark.slow" in ast.unparse(node)


def spawning_tests(path: Path) -> dict[str, bool]:
    """Test functions of a module that start a subprocess, directly or through the module's own helper functions,
    and whether each is marked slow (decorator, or the module's `pytestmark`)."""
    tree = ast.parse(path.read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    module_slow = any(
        isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
        and _is_slow_mark(n.value)
        for n in tree.body
    )  # fmt: skip

    def spawns(name: str, seen: frozenset[str] = frozenset()) -> bool:
        called = _called(functions[name])
        if any(c.startswith("subprocess.") and c.split(".")[1] in SPAWNS for c in called):
            return True
        if "accelerate_launch" in called:
            return True
        return any(c in functions and c not in seen and spawns(c, seen | {name}) for c in called)

    return {
        name: module_slow or any(_is_slow_mark(d) for d in node.decorator_list)
        for name, node in functions.items()
        if name.startswith("test_") and spawns(name)
    }


def test_every_test_that_spawns_a_subprocess_is_marked_slow():
    unmarked = []
    found = 0
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for name, marked in spawning_tests(path).items():
            found += 1
            if not marked and name not in SLOW.get(path.name, ()):
                unmarked.append(f"{path.name}::{name}")
    assert found >= 20  # the scan sees them at all
    assert not unmarked, f"spawn subprocesses without @pytest.mark.slow: {unmarked}"


def test_the_slow_marker_is_registered_and_only_test_fast_skips_it():
    pytest_section = (ROOT / "pyproject.toml").read_text().split("[tool.pytest.ini_options]")[1].split("\n[")[0]
    assert re.search(r'^markers = \[\s*"slow: ', pytest_section, re.M), pytest_section  # registered: no warning
    assert "slow" not in re.search(r"^addopts = (.*)$", pytest_section, re.M).group(1)  # plain pytest runs them all
    makefile = (ROOT / "Makefile").read_text()
    recipe = lambda target: re.search(rf"^{target}:.*\n\t(.*)$", makefile, re.M).group(1)  # noqa: E731
    assert recipe("test-fast").endswith('pytest -m "not slow"')
    full = recipe("test").split("python -m pytest", 1)
    assert len(full) == 2 and " -m " not in full[1] + " ", recipe("test")  # every test, on xdist's workers


@pytest.mark.slow
@pytest.mark.parametrize(
    "message,problem",
    [
        ("Locks on evaluation outputs\n\nWhy: a second run raced.\n", None),
        ("Short subject\n# a comment git strips\n", None),
        ("x" * 72 + "\n", None),
        ("x" * 73 + "\n\nbody\n", "the subject has 73 characters (at most 72)"),
        ("Subject\nbody without a blank line\n", "the second line must be blank"),
        ("\n\nbody\n", "the subject line is empty"),
    ],
)
def test_the_commit_message_hook_holds_subjects_to_72_characters(message, problem, tmp_path):
    """`make hooks` installs .githooks/commit-msg: it refuses (non-zero, one line) a long subject or a body glued to
    it, and passes a proper message."""
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    done = subprocess.run(["sh", str(ROOT / ".githooks" / "commit-msg"), str(path)], capture_output=True, text=True)
    if problem is None:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode != 0 and problem in done.stderr and done.stderr.count("\n") == 1, done.stderr
