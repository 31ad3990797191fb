"""Test-suite setup shared by every test file.

The `slow` marker (pyproject.toml) is on every test that spawns `python -m ...` / `accelerate launch` subprocesses
or takes more than about 20 s: `make test-fast` leaves them out (`-m "not slow"`), `make test` (what CI runs) runs
them all. Tests mark themselves with `@pytest.mark.slow`; the ones in files other people were editing when the marker
came are named in SLOW below instead (move them to decorators when you next edit those files).
"""

import os
from pathlib import Path

import pytest
import torch

# The Triton kernels run under the interpreter when there is no GPU; it has to be chosen before `eval.kernels` is
# imported, and nothing in the package chooses it on import (`python -m eval` does, for its own process).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


SLOW = {
    "test_eval.py": {"test_eval_two_processes_split_and_gather"},
    "test_selfdistill.py": {"test_two_processes_write_the_records_of_one"},
    "test_synthesize.py": {
        "test_two_processes_write_the_candidates_of_one",
        "test_a_target_without_chat_template_is_one_line",
    },
}
"""file -> test functions that launch subprocesses (marked `slow` here, not in their files)."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(item, "originalname", item.name) in SLOW.get(item.path.name, ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def at_root(monkeypatch):
    """Run in the repository root (recipes name repository-relative files) with accelerate's state fresh before and
    after: a test takes it by name, or a file with `pytestmark = pytest.mark.usefixtures("at_root")`."""
    from tiny import reset_accelerate  # imported here, after the Triton interpreter is chosen above

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    reset_accelerate()
    yield
    reset_accelerate()
