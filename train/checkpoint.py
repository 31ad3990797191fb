"""Checkpoints of a training run: save, find, prune, resume. JSON and safetensors only: never a pickle.

    <output_dir>/recipe.yaml        the resolved recipe
    <output_dir>/metrics.jsonl      one line per optimizer step
    <output_dir>/checkpoints/step-000500/
        drafter.safetensors         trainable drafter tensors, full, fp32 (what `export.write` reads)
        optimizer.safetensors       AdamW moments and step per parameter, "<name>/<key>", full
        optimizer.json              parameter groups: hyper-parameters and parameter names
        scheduler.json              the learning-rate schedule's state
        rng_<rank>.json             each process's RNG states (python, numpy, torch)
        trainer_state.json          step, recipe hash, batch plan, data position, world size, tokens seen

Everything but the RNG is full and keyed by name (see `train.state`), so a checkpoint resumes on
another number of processes or another backend. A checkpoint is written under `step-XXXXXX.tmp`
and renamed once every process has finished, so a directory named `step-XXXXXX` is always
complete; only the newest `keep` are kept. Finding checkpoints and reading their state (`latest_checkpoint`,
`read_state`) is `rundir.checkpoints`: export and evaluation read them too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from safetensors.torch import load_file

from models.io import write_safetensors
from rundir.checkpoints import STATE_FILE, CheckpointError, checkpoints_root, list_checkpoints, read_json, read_state

DRAFTER_FILE = "drafter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
GROUPS_FILE = "optimizer.json"
SCHEDULER_FILE = "scheduler.json"
RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"


def rng_file(rank: int) -> str:
    return f"rng_{rank}.json"


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1))


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    step: int,
    state: dict,
    training: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict]],
    scheduler_state: dict,
    rng: dict,
    keep: int,
) -> Path:
    """Write checkpoint `step` (collective: every process calls it); return its directory.

    `training` is `train.state.gather_state`'s (params, moments, groups), complete on the main process,
    which writes everything but the per-process RNG files.
    """
    final = checkpoints_root(output_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    (tmp / rng_file(accelerator.process_index)).write_text(json.dumps(rng))
    if accelerator.is_main_process:
        params, moments, groups = training
        write_safetensors(params, tmp / DRAFTER_FILE)
        write_safetensors(moments, tmp / OPTIMIZER_FILE)
        _write_json(tmp / GROUPS_FILE, groups)
        _write_json(tmp / SCHEDULER_FILE, scheduler_state)
        _write_json(tmp / STATE_FILE, {**state, "step": step})
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file; CheckpointError naming it when it is missing or torn."""
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing (an incomplete checkpoint, or one written by an older specdraft that saved pickles)"
        )
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors ({exc}): truncated or overwritten?") from None


def load_checkpoint(path: str | Path, rank: int) -> dict[str, Any]:
    """Everything `save_checkpoint` wrote, read and checked before anything is restored.

    Returns {"state", "params", "moments", "groups", "scheduler", "rng"}; "rng" is None when `rank`
    has no RNG file (the checkpoint was written by fewer processes).
    """
    path = Path(path)
    out = {
        "state": read_state(path),
        "params": read_tensors(path / DRAFTER_FILE),
        "moments": read_tensors(path / OPTIMIZER_FILE),
        "groups": read_json(path / GROUPS_FILE),
        "scheduler": read_json(path / SCHEDULER_FILE),
    }
    rng = path / rng_file(rank)
    out["rng"] = read_json(rng) if rng.is_file() else None
    return out
