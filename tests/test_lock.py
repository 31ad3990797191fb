"""rundir.lock: one writer per output, a refusal naming the directory and its holder, nothing left behind, and a
killed holder's lock released by the kernel (training, extraction and export use it: their tests refuse real runs)."""

from __future__ import annotations

import os
import signal

import pytest

from rundir.lock import LOCK_FILE, DirectoryLocked, NotADirectory, acquire, directory_lock, release


def test_a_second_writer_is_refused_naming_the_directory_and_the_holder(tmp_path):
    run = tmp_path / "run"
    held = acquire(run, "training", key="r.yaml: train.output_dir")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
    with pytest.raises(DirectoryLocked) as refused:
        acquire(run, "training", key="r.yaml: train.output_dir")
    message = str(refused.value)
    assert message.startswith(f"r.yaml: train.output_dir: {run}: another training is writing there (pid {os.getpid()}")
    assert "\n" not in message
    release(held)
    assert not list(run.iterdir())  # the lock file goes with the lock
    with directory_lock(run, "training"):  # free again
        pass


def test_a_lock_beside_guards_a_directory_replaced_whole_or_a_file(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("records\n")
    with directory_lock(out, "self-distillation", key="--out", beside=True):
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".out.jsonl{LOCK_FILE}", "out.jsonl"]
        with pytest.raises(DirectoryLocked, match=rf"^--out: {out}: another self-distillation"):
            acquire(out, "self-distillation", key="--out", beside=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_an_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("mine")
    for path, why in ((tmp_path / "file", "is a file"), (tmp_path / "file" / "run", "lies under")):
        with pytest.raises(NotADirectory, match=rf"^train.output_dir: {path} {why}"):
            acquire(path, "training", key="train.output_dir")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_killed_holders_lock_blocks_nothing(tmp_path):
    """The kernel drops a process's flock however it ends: the lock file it leaves behind is taken again at once."""
    run = tmp_path / "run"
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child holds the lock until it is killed
        try:
            acquire(run, "training")
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1"
    with pytest.raises(DirectoryLocked, match=rf"\(pid {child}:"):
        acquire(run, "training")
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    assert (run / LOCK_FILE).exists()  # left behind by the killed holder
    release(acquire(run, "training"))
