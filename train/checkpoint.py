"""Checkpoints of a training run: save, find, prune, resume.

    <output_dir>/recipe.yaml        the resolved recipe
    <output_dir>/metrics.jsonl      one line per optimizer step
    <output_dir>/checkpoints/step-000500/
        (accelerate save_state: model, optimizer, RNG states, registered objects such as the scheduler)
        drafter.safetensors         trainable drafter tensors, gathered (what `train.export` reads)
        trainer_state.json          step, recipe hash, world size, tokens seen
        loader_state_<rank>.json    data position of each process

A checkpoint is written under `step-XXXXXX.tmp` and renamed once every process has finished, so a
directory named `step-XXXXXX` is always complete; only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator

from models.io import write_safetensors

STATE_FILE = "trainer_state.json"
DRAFTER_FILE = "drafter.safetensors"
RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


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


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    step: int,
    state: dict,
    loader_state: dict,
    drafter_tensors: dict[str, torch.Tensor],
    keep: int,
) -> Path:
    """Write checkpoint `step` (collective: every process calls it); return its directory.

    `drafter_tensors` (full, gathered) is only written by the main process.
    """
    final = checkpoints_root(output_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    (tmp / f"loader_state_{accelerator.process_index}.json").write_text(json.dumps(loader_state))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_safetensors(drafter_tensors, tmp / DRAFTER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def read_state(path: str | Path) -> dict:
    """trainer_state.json of a checkpoint (no collective calls)."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
    return json.loads((path / STATE_FILE).read_text())


def load_checkpoint(accelerator: Accelerator, path: str | Path) -> tuple[dict, dict]:
    """Restore everything `save_checkpoint` saved (collective); return (trainer state, this rank's loader state).

    The caller checks `read_state(path)` first (same recipe, same number of processes).
    """
    path = Path(path)
    state = read_state(path)
    accelerator.load_state(str(path))
    loader_state = json.loads((path / f"loader_state_{accelerator.process_index}.json").read_text())
    return state, loader_state
