"""One writer per output directory: an advisory lock (`fcntl.flock`) on a lock file, held while a step writes.

    with directory_lock(run_dir, "training", key="train.output_dir"):    # inside the directory it guards
        ...                                                              # a second writer gets DirectoryLocked
    with directory_lock(out, "export", beside=True):                    # <parent>/.<name>.specdraft.lock
        ...                                                              # (replaced whole, or a file)

The lock file is `<directory>/.specdraft.lock` (or, with `beside=True`, `.<name>.specdraft.lock` next to it, for
outputs renamed into place whole, such as exports, or single files), removed when released. The kernel drops a
`flock` when its process ends however it ends (killed, crashed), so a lock file a killed process left behind never
blocks anything: only a live process holding it does. The file records the holder's pid and command for the
refusal message.

Several processes of one `accelerate launch` write one output together: only the main process takes the lock, and
the others learn its verdict before any of them writes (`shared_verdict`, or the stage's own gather), so a second
launch stops on every process with the same line. `check_output_path` refuses an output path that is (or lies
under) an existing file, naming it, before anything tries to create it.

Self-distillation and prompt synthesis (`data/selfdistill.py`, `data/synthesize.py`) write one JSONL file and lock
it with a lock file beside it (`.<out name>.specdraft.lock`); training, self-distillation, synthesis and evaluation
take their lock with `acquire_for_all` (`lock_for_all` around a block): on the main process only, every other
process told its verdict through the process group, so that a second launch stops on all of its processes with the
same line. This module imports nothing heavy.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".specdraft.lock"


class DirectoryLocked(RuntimeError):
    """Another live process writes this output; the message names the directory, the holder and what to do."""


class NotADirectory(ValueError):
    """An output directory's path is an existing file (or lies under one); the message names it."""


def lock_path(directory: str | Path, beside: bool = False) -> Path:
    """The lock file guarding `directory`: inside it, or (`beside`) next to it."""
    directory = Path(directory)
    if beside:
        return directory.parent / f".{directory.name}{LOCK_FILE}"
    return directory / LOCK_FILE


def check_output_path(path: str | Path, key: str) -> None:
    """Refuse (NotADirectory, `key: path: ...`) an output directory that is an existing file, a symbolic link to
    nothing, or lies under an existing file: creating it would fail with a traceback."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise NotADirectory(f"{key}: {path} is a symbolic link to nothing; give a directory")
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is a file" if candidate == path else f"lies under {candidate}, which is a file"
                raise NotADirectory(f"{key}: {path} {where}, not a directory; choose another path")
            return


def acquire(directory: str | Path, what: str, key: str | None = None, beside: bool = False) -> int:
    """Take the lock for `directory` (created if missing; with `beside`, only its parent is, and `directory` may
    also be a file, such as a JSONL output) and return its file descriptor (`release` it); DirectoryLocked when
    another process holds it, NotADirectory when the directory (or, with `beside`, its parent) cannot be one."""
    directory = Path(directory)
    path = lock_path(directory, beside)
    check_output_path(path.parent, key or str(path.parent))
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.read(fd, 4096).decode("utf-8", "replace").strip()
            finally:
                os.close(fd)
            named = f"{key}: " if key else ""
            raise DirectoryLocked(
                f"{named}{directory}: another {what} is writing there ({holder or 'a live process'}, lock {path}); "
                "wait for it to finish, or choose another directory"
            ) from None
        try:  # the holder before us removes the file as it releases it: ours must still be the one at `path`
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode())
    _held[fd] = path
    return fd


_held: dict[int, Path] = {}
"""Lock files this process holds, by descriptor: removed as they are released."""


def release(fd: int) -> None:
    """Drop a lock `acquire` took, removing its file first (while still held, so that no other process can hold a
    lock on a file that is no longer the one at its path: `acquire` checks that)."""
    path = _held.pop(fd, None)
    try:
        if path is not None:
            path.unlink(missing_ok=True)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextmanager
def directory_lock(
    directory: str | Path, what: str, key: str | None = None, beside: bool = False, take: bool = True
) -> Iterator[None]:
    """Hold `directory`'s lock for the block (`take=False`: a no-op, for processes other than the main one)."""
    if not take:
        yield
        return
    fd = acquire(directory, what, key, beside)
    try:
        yield
    finally:
        release(fd)


def shared_verdict(problem: str | None, gather) -> str | None:
    """The first non-None problem of any process, on every process: `gather` is a collective that returns every
    process's item in a list (accelerate's `gather_object` on a one-item list). Each process must call it."""
    found = [p for p in gather([problem]) if p is not None]
    return found[0] if found else None


def acquire_for_all(
    directory: str | Path, what: str, key: str | None, is_main: bool, gather, beside: bool = False
) -> int | None:
    """`acquire` on the main process of a launch, its verdict shared with every process (`shared_verdict`, through
    `gather`; None for a single process): returns the lock to `release` on the main process, None on the others, or
    raises DirectoryLocked / NotADirectory on every process with the main process's message. Every process calls it."""
    fd, problem, kind = None, None, DirectoryLocked
    if is_main:
        try:
            fd = acquire(directory, what, key, beside)
        except (DirectoryLocked, NotADirectory) as exc:
            problem, kind = str(exc), type(exc)
    if gather is not None:
        shared = shared_verdict(problem, gather)
        if shared is not None and problem is None:  # another process's verdict: its kind is not known here
            problem = shared
    if problem is not None:
        if fd is not None:
            release(fd)
        raise kind(problem)
    return fd


@contextmanager
def lock_for_all(
    directory: str | Path,
    what: str,
    key: str | None,
    is_main: bool,
    gather,
    beside: bool = False,
    error: type[Exception] = DirectoryLocked,
) -> Iterator[None]:
    """`acquire_for_all` for the block, released after it; a refusal is raised as `error` (the stage's own one-line
    error) on every process."""
    try:
        fd = acquire_for_all(directory, what, key, is_main, gather, beside)
    except (DirectoryLocked, NotADirectory) as exc:
        raise error(str(exc)) from None
    try:
        yield
    finally:
        if fd is not None:
            release(fd)
