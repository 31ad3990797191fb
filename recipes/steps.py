"""What every pipeline driver does with a step (recipes/run.py, recipes/pocket/demo.py): run it as a subprocess with
its log, follow its progress on the console, and tell what is already done (a trained run, a complete file)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eval import REPORT_FILES
from rundir.checkpoints import latest_checkpoint, read_state

ROOT = Path(__file__).resolve().parents[1]


def banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 100 - len(text)), flush=True)


def clear_report(eval_dir: Path) -> None:
    """Delete an out-of-date report before evaluating again: eval refuses to replace a report made with other
    settings, and here the driver decided the old one is stale (another drafter, other overrides)."""
    for stale in REPORT_FILES:
        (eval_dir / stale).unlink(missing_ok=True)


def run_step(name: str, cmd: list[str], log_dir: Path, env: dict[str, str]) -> None:
    """Run one step as a subprocess, its output to a log file; on failure show the log's tail and stop."""
    log = log_dir / f"{name}.log"
    shown = log.relative_to(ROOT) if log.is_relative_to(ROOT) else log
    print(f"$ {' '.join(cmd)}\n  (log: {shown})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        code = follow(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT), log)
    if code != 0:
        tail = log.read_text().replace("\r", "\n").splitlines()[-25:]
        sys.exit("\n".join([*tail, f"run: step {name!r} failed (exit {code}); full log: {log}"]))
    last = last_line(log)
    print(f"  done in {time.perf_counter() - start:.0f}s" + (f": {last[:150]}" if last else ""), flush=True)


def last_line(log: Path) -> str | None:
    """The newest line of a log, progress bars included (tqdm rewrites its line with carriage returns)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else None


def follow(proc: subprocess.Popen, log: Path, every: float = 2.0, new_line_every: float = 60.0) -> int:
    """Wait for a step, showing on the console what its log shows last (a progress bar: done, rate, time left) with
    the time elapsed: one line rewritten in place on a terminal, a new line each `new_line_every` seconds when the
    console is a file. Returns the exit code."""
    tty, start, printed, shown_at = sys.stdout.isatty(), time.perf_counter(), None, float("-inf")
    while True:
        try:
            code = proc.wait(timeout=every)
        except subprocess.TimeoutExpired:
            code = None
        line, now = last_line(log), time.perf_counter()
        if line and line != printed and (tty or now - shown_at >= new_line_every or code is not None):
            elapsed = time.strftime("%H:%M:%S", time.gmtime(now - start))
            text = f"  [{elapsed}] {line}"
            if tty:
                width = shutil.get_terminal_size().columns - 1
                print("\r" + text[:width].ljust(width), end="", flush=True)
            elif code is None:  # the step's last line is printed once it ends
                print(text[:200], flush=True)
            printed, shown_at = line, now
        if code is not None:
            if tty and printed:
                print("\r" + " " * (shutil.get_terminal_size().columns - 1) + "\r", end="", flush=True)
            return code


def skip(what: str) -> None:
    print(f"  skipped: {what} is complete", flush=True)


def trained(run_dir: Path, max_steps: int) -> bool:
    """Whether the run reached `max_steps` and its export is newer than its last checkpoint (a larger
    train.max_steps resumes training; a newer checkpoint is exported again)."""
    export, last = run_dir / "export" / "config.json", latest_checkpoint(run_dir)
    if not export.is_file() or last is None:
        return False
    return read_state(last)["step"] >= max_steps and export.stat().st_mtime >= last.stat().st_mtime


def trained_steps(run_dir: Path) -> int | None:
    """The step of the run's newest checkpoint (what its export holds), None without one."""
    last = latest_checkpoint(run_dir)
    return None if last is None else read_state(last)["step"]


def records_in(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def shown(path: Path) -> str:
    """A path relative to the repository when it is inside it (provenance that does not name this machine)."""
    return str(path.relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
