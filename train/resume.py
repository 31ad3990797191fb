"""Resumption bookkeeping of a training run: which checkpoint to continue from (and whether it fits the recipe),
saving and restoring the run's full state, and the metrics lines a crash left past the last checkpoint.

    path = checkpoint_to_resume(recipe, accelerator)       # before any heavy work; None: a fresh run
    state = restore_run(accelerator, model, optimizer, scheduler, loader, path, seed)   # after accelerator.prepare
    truncate_metrics(out_dir / METRICS_FILE, state["step"])
    save_run(accelerator, model, optimizer, scheduler, recipe, step, loader, tokens_seen)   # every process

The checkpoint files themselves (layout, atomic writes, pruning) are `train.checkpoint`'s; the name-keyed model and
optimizer state is `train.state`'s. A run resumes only under the same target / data / drafter settings and the same
batch plan (`batch_plan`), on any number of processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from models.io import draft_vocab_sha256, load_draft_vocab
from rundir.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, read_state
from schema.recipe import Recipe, RecipeError, dotted_settings, load_recipe
from train import TrainingError
from train.checkpoint import RECIPE_FILE, load_checkpoint, save_checkpoint
from train.state import gather_state, restore_state, rng_state, set_rng_state


def truncate_metrics(path: Path, step: int) -> None:
    """Drop lines past `step` (a run that died after its last checkpoint), and a last line torn by the crash,
    before appending again. A torn line anywhere else is refused: the file was edited."""
    if not path.is_file():
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                print(f"{path}:{number}: dropped a torn last line (the run was killed while writing it)")
                continue
            raise TrainingError(f"{path}:{number}: not a JSON line; move the file away to resume") from None
        if record["step"] <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def _what_differs(path: Path, saved: dict[str, Any], recipe: Recipe) -> str:
    """The first target/data/drafter key whose value differs from the one the checkpoint was trained with, read from
    the run's recipe.yaml (when that is the recipe the checkpoint records); else the sections."""
    sections = ("target", "data", "drafter")
    generic = f"other target/data/drafter settings than {recipe.source}"
    try:
        trained = load_recipe(path.parent.parent / RECIPE_FILE)
    except (RecipeError, OSError):
        return generic
    if trained.section_hash(*sections) != saved["recipe_hash"]:
        return generic
    before, now = dotted_settings(trained.to_dict(), sections), dotted_settings(recipe.to_dict(), sections)
    skip = {"data.verify_checksums"}  # a check, not a setting (not part of the hash)
    key = next((k for k in [*before, *now] if k not in skip and before.get(k) != now.get(k)), None)
    return generic if key is None else f"{key}={before.get(key)!r}, {recipe.source} has {now.get(key)!r}"


def checkpoint_to_resume(recipe: Recipe, accelerator: Accelerator) -> Path | None:
    """The checkpoint to resume from, if any, checked before any heavy work."""
    cfg = recipe.train
    existing = list_checkpoints(cfg.output_dir)
    if cfg.resume is None:
        if existing:
            raise TrainingError(
                f"{cfg.output_dir} already holds checkpoints ({existing[-1].name}): pass --resume "
                "(train.resume=auto) to continue, or choose another train.output_dir"
            )
        return None
    if cfg.resume == "auto":
        path = latest_checkpoint(cfg.output_dir)
        if path is None:
            return None
    elif not Path(cfg.resume).is_dir():
        raise TrainingError(f"{recipe.source}: train.resume: no checkpoint directory {cfg.resume}")
    else:
        path = Path(cfg.resume)
    try:
        saved = read_state(path)
    except CheckpointError as exc:
        raise TrainingError(str(exc)) from None
    if saved["recipe_hash"] != recipe.section_hash("target", "data", "drafter"):
        raise TrainingError(
            f"{path}: saved with {_what_differs(path, saved, recipe)}; resume with the recipe it was "
            "trained with (see its recipe.yaml), or start a new run in another train.output_dir"
        )
    plan, want = saved.get("batch_plan", {}), batch_plan(recipe, accelerator.num_processes)
    changed = sorted(k for k in want if plan.get(k, want[k] if k in LATER_PLAN_KEYS else None) != want[k])
    if "global_batch" in changed:
        raise TrainingError(
            f"{path}: saved with a global batch of {plan.get('global_batch')} rows (train.batch_size x "
            f"train.grad_accum x {saved['world_size']} processes), resuming with {want['global_batch']} "
            f"({recipe.train.batch_size} x {recipe.train.grad_accum} x {accelerator.num_processes}): set "
            "train.grad_accum (or train.batch_size) so the product is the same"
        )
    if changed:
        raise TrainingError(
            f"{path}: saved with train.{changed[0]}={plan.get(changed[0])}, {recipe.source} has {want[changed[0]]}; "
            "the saved data position only means something in the same batch plan (and the seed also picks the "
            "held-out split)"
        )
    kept, want = saved.get("optimizer_settings"), optimizer_settings(recipe)  # absent in older checkpoints
    changed = sorted(k for k in want if kept is not None and kept.get(k) != want[k])
    if changed:
        key = changed[0]
        raise TrainingError(
            f"{path}: saved with train.{key}={kept.get(key)!r}, {recipe.source} has {want[key]!r}: the restored "
            "optimizer keeps the saved setting; resume with it, or start a new run in another train.output_dir "
            "(train.max_steps and train.warmup_steps may change: the schedule follows the recipe)"
        )
    newer = [p for p in existing if _step_of(p) > saved["step"] and p.resolve() != path.resolve()]
    if newer:
        raise TrainingError(
            f"{cfg.output_dir} holds checkpoints newer than {path} ({', '.join(p.name for p in newer)}): "
            "continuing from an older one would mix two runs and prune the wrong checkpoints; move them away "
            "first, or resume into another train.output_dir"
        )
    if "data" not in saved:
        raise TrainingError(
            f"{path}: written by an older specdraft (accelerate's pickled state, which is never loaded): "
            "start a new run, or export this checkpoint with `python -m export`"
        )
    return path


def batch_plan(recipe: Recipe, world_size: int) -> dict[str, Any]:
    """What decides which samples each optimizer step reads (and the held-out split): a saved data position is
    only valid under the same. The global step (batch_size x grad_accum x processes) counts, not how it is split,
    so a run saved by 8 processes resumes on 4 with twice the accumulation. `online`: the positions a data
    position counts index the prepared records online and the length-sorted feature shards offline."""
    cfg = recipe.train
    return {
        "global_batch": cfg.batch_size * cfg.grad_accum * world_size,
        "packing": cfg.packing,
        "seed": cfg.seed,
        "online": cfg.online,
    }


LATER_PLAN_KEYS = {"online"}
"""Batch-plan keys added after checkpoints were first written: not checked against a checkpoint that lacks them."""


def optimizer_settings(recipe: Recipe) -> dict[str, Any]:
    """The settings a restored optimizer keeps from its checkpoint (group learning rates, weight decay, betas) or
    that change what the loss is (`loss_vocab`): a resume refuses other values rather than ignore them."""
    cfg = recipe.train
    return {
        "lr": cfg.lr,
        "head_lr_mult": cfg.head_lr_mult,
        "weight_decay": cfg.weight_decay,
        "betas": list(cfg.betas),
        "loss_vocab": cfg.loss_vocab,
    }


def scaler_state(accelerator) -> dict[str, Any] | None:
    """fp16 mixed precision's loss scale and its growth tracker (JSON numbers), or None without a scaler: a resumed
    run must skip the same overflowing steps as the uninterrupted one."""
    scaler = accelerator.scaler
    return None if scaler is None else scaler.state_dict()


def restore_scaler(accelerator, state: dict[str, Any] | None, path: Path) -> None:
    scaler = accelerator.scaler
    if scaler is None:
        return
    if state:
        scaler.load_state_dict(state)
    elif accelerator.is_main_process:
        print(
            f"{path}: holds no fp16 loss scale (saved without fp16, or by an older specdraft): starting from the "
            "initial scale"
        )


def _step_of(checkpoint: Path) -> int:
    return read_state(checkpoint)["step"]


def save_run(accelerator, model, optimizer, scheduler, recipe, step, loader, tokens_seen) -> Path:
    """Checkpoint step `step` with what resuming needs besides the tensors (recipe hash, batch plan, data position,
    world size, tokens seen). Every process calls it: gathering the state is a collective under ZeRO-3 / FSDP."""
    cfg = recipe.train
    state = {
        "recipe_hash": recipe.section_hash("target", "data", "drafter"),
        "batch_plan": batch_plan(recipe, accelerator.num_processes),
        "optimizer_settings": optimizer_settings(recipe),
        "grad_scaler": scaler_state(accelerator),
        "data": loader.state_dict(),
        "world_size": accelerator.num_processes,
        "tokens_seen": tokens_seen,
    }
    vocab = load_draft_vocab(cfg.output_dir)  # the tokens its head rows belong to: resume and export check them
    if vocab is not None:
        state["draft_vocab_sha256"] = draft_vocab_sha256(vocab)
    training = gather_state(accelerator, model, optimizer)  # collective under ZeRO-3 / FSDP
    path = save_checkpoint(
        accelerator, cfg.output_dir, step, state, training, scheduler.state_dict(), rng_state(), cfg.keep_checkpoints
    )
    if accelerator.is_main_process:
        tqdm.write(f"step {step}: checkpoint {path}")
    return path


def restore_run(accelerator, model, optimizer, scheduler, loader, path: Path, seed: int) -> dict:
    """Load checkpoint `path` into the prepared model, optimizer, scheduler and loader; return its trainer state."""
    try:
        saved = load_checkpoint(path, accelerator.process_index)
        restore_state(accelerator, model, optimizer, saved["params"], saved["moments"], saved["groups"])
        scheduler.load_state_dict(saved["scheduler"])
        loader.load_state_dict(saved["state"]["data"])
        restore_scaler(accelerator, saved["state"].get("grad_scaler"), path)
    except (CheckpointError, ValueError, KeyError, TypeError) as exc:
        raise TrainingError(f"{path}: cannot resume: {exc}") from None
    state = saved["state"]
    if saved["rng"] is not None and state["world_size"] == accelerator.num_processes:
        set_rng_state(saved["rng"])
    else:  # another number of processes: per-process random streams cannot carry over; reseed them per step
        set_seed(seed + 1_000_003 * state["step"] + accelerator.process_index)
        if accelerator.is_main_process:
            print(
                f"{path}: saved by {state['world_size']} processes, resuming on {accelerator.num_processes}: "
                "data position and optimizer state carry over exactly, random streams (dropout) are reseeded"
            )
    if accelerator.is_main_process:
        print(f"resumed from {path} at step {state['step']}")
    return state
