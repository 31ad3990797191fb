"""A training run's checkpoints as every stage finds them: which are complete, the newest, the state each records.

    newest = latest_checkpoint(run_dir)          # <run_dir>/checkpoints/step-XXXXXX, or None
    step = read_state(newest)["step"]            # trainer_state.json, without torch

`train.checkpoint` writes checkpoints (and reads their tensors back to resume); export, evaluation (whether an
export is of the run's newest checkpoint) and `recipes/run.py` only find them and read their state. Here, below train
and eval, so that evaluation reads them without importing train. JSON only: imports neither torch nor accelerate.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or not what this version writes; the message names it."""


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; CheckpointError naming it when it is missing or torn."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing (an incomplete checkpoint, or one written by an older specdraft that saved pickles)"
        ) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg}): truncated?") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}): truncated?") from None


def read_state(path: str | Path) -> dict:
    """trainer_state.json of a checkpoint (no collective calls)."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
    return read_json(path / STATE_FILE)
