"""The target's next-token statistics at every loss position of a feature set, computed once for all the training runs
that read it: the target's top-1 token and the log-normaliser (logsumexp) of its logits over the whole vocabulary.

    python -m data.target_stats RECIPE [section.key=value ...]    # after `python -m data.extract RECIPE`

Drafters with their own draft vocabulary (EAGLE-3, P-EAGLE) learn at each loss position the target's distribution
over the K draft tokens, its probability mass there and whether its top-1 token is one of them. Without these
statistics every training step applies the target's whole LM head to the stored last hidden states (on SmolLM2,
49,152 rows for a draft vocabulary of 8,000: 2.7 s of a one-thread step of about 16 s on a CPU, against 0.47 s for
the draft rows); with them, a step applies only the K draft rows: the mass is exp(logsumexp over the K rows − the
stored logsumexp). The numbers are the same (up to the order of floating-point sums).

They are stored beside the shards, in `FEATURES_DIR/target-stats/`: per shard `stats-00000.safetensors` (`top1`
int64 and `lse` float32 over the shard's tokens; -1 and NaN where the shard has no loss) and `index.json`, which
binds each file to its shard's sha256 and to the sha256 of the target's LM head as loaded (weights, dtype and shape),
with the file's own sha256. A run stopped midway resumes at the first shard without statistics; a shard extracted
again gets new ones. Training uses them when every shard has statistics for its target's head and says so in one
line; otherwise it computes the statistics every step, as without them, and says why (`attach`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from data.files import durable_replace, file_sha256, write_json_atomic

STATS_DIR = "target-stats"
INDEX = "index.json"
KEYS = ("target_top1", "target_lse")
"""What a sample and a batch carry when statistics are attached: (T,) / (B, T) int64 top-1 ids and float32 lse."""
ROWS = 2048
"""Positions through the head at a time: (ROWS, V) float32 logits stay small (400 MB for V = 49,152)."""


def head_sha256(head: nn.Module) -> str:
    """What the statistics were computed with: the LM head's weight bytes, dtype and shape."""
    weight = head.weight.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{weight.dtype}:{tuple(weight.shape)}".encode())
    digest.update(weight.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def head_statistics(head: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) last hidden states -> the target's top-1 ids (n,) int64 and logsumexp (n,) float32 over its vocabulary."""
    top1, lse = [], []
    for part in rows.split(ROWS):
        full = head(part.to(head.weight.device, head.weight.dtype)).float()  # (n, V)
        top1.append(full.argmax(-1).cpu())
        lse.append(full.logsumexp(-1).cpu())
    if not top1:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    return torch.cat(top1), torch.cat(lse)


def _stats_dir(features_dir: str | Path) -> Path:
    return Path(features_dir) / STATS_DIR


def _read_index(features_dir: str | Path) -> dict[str, Any] | None:
    path = _stats_dir(features_dir) / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable statistics index ({exc.__class__.__name__}); delete it") from None
    if not isinstance(index, dict) or not isinstance(index.get("shards"), dict):
        raise ValueError(f"{path}: not a statistics index (want an object with 'shards'); delete it")
    return index


def shard_statistics(dataset, s: int, head: nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics over every token of shard `s` of a `data.shards.FeatureDataset`: computed at its loss positions
    from the stored layer `layer` (-1, the last hidden state); -1 / NaN elsewhere."""
    entry = dataset.shards[s]
    n = entry["num_tokens"]
    top1, lse = torch.full((n,), -1, dtype=torch.int64), torch.full((n,), float("nan"))
    index = dataset.layers.index(layer)
    first = sum(len(e["sample_ids"]) for e in dataset.shards[:s])
    start = 0
    for i in range(first, first + len(entry["sample_ids"])):
        sample = dataset[i]
        at = sample["loss_mask"] > 0
        if at.any():
            t, v = head_statistics(head, sample["hidden"][:, index][at].float())
            top1[start : start + len(at)][at], lse[start : start + len(at)][at] = t, v
        start += len(at)
    return top1, lse


def compute(dataset, head: nn.Module, progress: bool = True) -> tuple[int, int]:
    """Write the statistics of every shard of `dataset` (a `FeatureDataset` storing layer -1) that has none for this
    head yet; returns (shards computed, shards kept). Resumable: the index is rewritten after each shard."""
    from tqdm import tqdm

    if -1 not in dataset.layers:
        raise ValueError(f"{dataset.directory}: stores layers {dataset.layers}, not -1 (the last hidden state)")
    out = _stats_dir(dataset.directory)
    out.mkdir(exist_ok=True)
    head_hash = head_sha256(head)
    try:
        index = _read_index(dataset.directory)
    except ValueError:
        index = None  # unreadable: rebuilt from nothing
    if index is None or index.get("head_sha256") != head_hash:
        index = {"head_sha256": head_hash, "dtype": str(head.weight.dtype).removeprefix("torch."), "shards": {}}
    done = kept = 0
    for s, entry in enumerate(tqdm(dataset.shards, desc="target statistics", unit="shard", disable=not progress)):
        if _entry_problem(dataset.directory, entry, index["shards"].get(entry["file"])) is None:
            kept += 1
            continue
        top1, lse = shard_statistics(dataset, s, head, -1)
        name = f"stats-{s:05d}.safetensors"
        tmp = out / f"{name}.tmp"
        save_file({"top1": top1, "lse": lse}, str(tmp))
        durable_replace(tmp, out / name)
        record = {"file": name, "shard_sha256": entry["sha256"], "sha256": file_sha256(out / name)}
        index["shards"][entry["file"]] = record
        write_json_atomic(out / INDEX, index)
        done += 1
    return done, kept


def _entry_problem(directory: Path, shard: dict[str, Any], entry: Any) -> str | None:
    """Why `entry` (the index's record for `shard`) is not usable statistics for it, or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or "/" in entry["file"]:
        return f"no statistics for {shard['file']}"
    if entry.get("shard_sha256") != shard["sha256"]:
        return f"the statistics of {shard['file']} were computed for another version of it"
    path = _stats_dir(directory) / entry["file"]
    if not path.is_file():
        return f"{path} is missing"
    if file_sha256(path) != entry.get("sha256"):
        return f"{path} does not match its sha256 in {INDEX} (changed since it was written)"
    return None


def attach(dataset, head: nn.Module) -> str:
    """Attach the stored statistics of `dataset` (a `FeatureDataset`) for this head, so that its samples carry
    `target_top1` / `target_lse`; returns one line saying whether they are used, and why not."""
    where = _stats_dir(dataset.directory)
    hint = "each step computes them (`python -m data.target_stats RECIPE` stores them once)"
    try:
        index = _read_index(dataset.directory)
    except ValueError as exc:
        return f"{exc}: {hint}"
    if index is None:
        return f"{dataset.directory}: no stored target statistics: {hint}"
    if index.get("head_sha256") != head_sha256(head):
        return f"{where / INDEX}: computed for another LM head (or dtype) than this target's: {hint}"
    stats = []
    for shard in dataset.shards:
        entry = index["shards"].get(shard["file"])
        problem = _entry_problem(dataset.directory, shard, entry)
        if problem is not None:
            return f"{where}: {problem}: {hint}"
        path = where / entry["file"]
        with safe_open(str(path), framework="pt") as f:
            top1, lse = f.get_tensor("top1"), f.get_tensor("lse")
        if top1.shape != (shard["num_tokens"],) or lse.shape != (shard["num_tokens"],):
            return f"{path}: holds {tuple(top1.shape)} positions, its shard {shard['num_tokens']}: {hint}"
        stats.append((top1, lse))
    dataset.attach_statistics(stats)
    return f"{where}: the target's stored top-1 and logsumexp at every loss position (a step applies K head rows)"


def main(argv: list[str] | None = None) -> None:
    from accelerate import Accelerator

    from data.extract import feature_identity
    from data.shards import FeatureDataset, FeatureMismatchError
    from models.target import load_placed_target
    from rundir.lock import directory_lock
    from schema.recipe import RecipeError, load_recipe

    parser = argparse.ArgumentParser(prog="python -m data.target_stats", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides, inputs=("target.path", "target.tokenizer", "data.features_dir"))
    data = recipe.data
    if data.features_dir is None:
        raise RecipeError(f"{recipe.source}: data.features_dir: is required (the feature set to add statistics to)")
    if -1 not in data.layers:
        raise RecipeError(f"{recipe.source}: data.layers: {data.layers} stores no -1 (the last hidden state)")
    with directory_lock(data.features_dir, "target statistics", f"{recipe.source}: data.features_dir"):
        target = load_placed_target(dataclasses.asdict(recipe.target), Accelerator())
        try:
            expect = feature_identity(target, data) | {"dtype": data.storage_dtype}
            dataset = FeatureDataset(data.features_dir, expect=expect)
        except (FeatureMismatchError, FileNotFoundError) as exc:
            raise RecipeError(f"{recipe.source}: data.features_dir: {exc}") from None
        done, kept = compute(dataset, target.lm_head)
    print(f"{_stats_dir(data.features_dir)}: target statistics for {done} shard(s) computed, {kept} kept")


if __name__ == "__main__":
    import sys

    from models.target import TargetError
    from rundir.lock import DirectoryLocked
    from schema.recipe import RecipeError

    try:
        main()
    except (RecipeError, TargetError, DirectoryLocked, ValueError) as exc:
        sys.exit(f"error: {exc}")
