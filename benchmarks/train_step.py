"""Training-step overhead of the loop machinery over a bare drafter step.

    .venv/bin/python -m benchmarks.train_step [--method eagle2] [--steps 30] [--rounds 3] [--threads 1]

Setup: 200 synthetic conversations (~250 tokens each), features extracted from a random-init Llama
(4 layers, d=256, vocab 8192) into bf16 shards; the drafter trains on packed batches of 4 rows x 512
tokens.
Each round times, interleaved,
(a) the bare step: `drafter(batch)["loss"].backward()`, gradient clipping, AdamW step, scheduler
    step, zero_grad, on the same batches pre-collated in memory;
(b) the real thing: `train.loop.train` (accelerate, loader reading the shards, token counting and
    reduction, accumulation bookkeeping, metrics, progress bar, metrics.jsonl), timed from one
    optimizer step to the next through a wrapper around `Stepper.train_step` (set-up, the final
    evaluation and checkpoint are outside the timed span).
Per-step time = median over the steps after a warm-up; the best round of each is compared. Both
wall-clock and process CPU time are measured; the goal line uses CPU time, because on a shared
machine other jobs' load makes wall-clock rounds vary while the work this process does per step is
what the machinery adds. Goal: loop / bare <= 1.10.

Checksums: each round also times (c) opening the same features as training does (`FeatureDataset`, which hashes
every shard: `data.verify_checksums`, the default) against opening them with `verify_checksums=False`, process CPU
time, page cache warm (as it is after extraction; cold, the hashing reads the shards from disk once and the first
epoch then finds them cached). One epoch of training costs (b)'s per-step CPU time x the optimizer steps of one
pass over the training split. Goal: the hashing (c) costs < 3% of that epoch. The hashing happens once per run,
however many epochs follow; with N processes each hashes 1/N of the shards and trains on 1/N of the rows, so the
share is the same.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed

from data.extract import main as extract_main
from data.loader import BatchLoader
from data.shards import FeatureDataset
from methods import METHODS
from models.target import load_target
from schema.recipe import load_recipe
from train import loop
from train.optim import build_optimizer, build_scheduler

ROOT = Path(__file__).resolve().parents[1]
TARGET = ["hidden_size=256", "intermediate_size=704", "num_hidden_layers=4", "num_attention_heads=8"]
ROWS, SEQ, WARMUP = 4, 512, 5


def write_conversations(path: Path, n: int = 200) -> None:
    rng = random.Random(0)
    words = "the a model drafts tokens while its target verifies them quickly and every step counts".split()
    say = lambda k: " ".join(rng.choice(words) for _ in range(k))
    with open(path, "w") as f:
        for i in range(n):
            turns = [
                {"from": "human", "value": say(rng.randint(10, 40))},
                {"from": "gpt", "value": say(rng.randint(100, 200))},
            ]
            f.write(json.dumps({"id": i, "conversations": turns}) + "\n")


def reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def per_step(marks: list[tuple[float, float]]) -> tuple[float, float]:
    """Median (wall, cpu) seconds between consecutive marks, after the warm-up."""
    walls = [b[0] - a[0] for a, b in zip(marks, marks[1:])][WARMUP:]
    cpus = [b[1] - a[1] for a, b in zip(marks, marks[1:])][WARMUP:]
    return statistics.median(walls), statistics.median(cpus)


def mark() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def bare_steps(recipe, steps: int) -> tuple[float, float]:
    """The drafter's own forward + backward + optimizer step on in-memory batches, as train() builds it."""
    target = load_target(**vars(recipe.target))
    set_seed(recipe.train.seed)
    drafter = METHODS[recipe.drafter.method].module()(recipe.drafter, target.parts(recipe.data.layers))
    optimizer = build_optimizer(drafter, recipe.train)
    scheduler = build_scheduler(optimizer, recipe.train)
    cfg = recipe.train
    ds = FeatureDataset(recipe.data.features_dir)
    train_idx, _ = ds.split(recipe.data.heldout_fraction, cfg.seed)
    loader = BatchLoader(
        ds, train_idx, batch_size=cfg.batch_size, packing=cfg.packing, max_len=recipe.data.max_len, seed=cfg.seed
    )
    source = loader.batches()
    batches = [next(source) for _ in range(steps)]
    params = [p for p in drafter.parameters() if p.requires_grad]
    marks = []
    for batch in batches:
        marks.append(mark())
        drafter(batch)["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    marks.append(mark())
    return per_step(marks)


def loop_steps(recipe) -> tuple[float, float]:
    """`train.loop.train`, marked at the start of every optimizer step."""
    marks = []
    original = loop.Stepper.train_step

    def timed(self, micro_batches):
        marks.append(mark())
        return original(self, micro_batches)

    loop.Stepper.train_step = timed
    try:
        reset_accelerate()
        loop.train(recipe)
    finally:
        loop.Stepper.train_step = original
        reset_accelerate()
    return per_step(marks)


def open_features(directory: Path) -> tuple[float, float]:
    """CPU seconds to open the features (header and size checks only, then also every shard's sha256)."""
    cpu = time.process_time()
    FeatureDataset(directory, verify_checksums=False)
    plain = time.process_time() - cpu
    cpu = time.process_time()
    FeatureDataset(directory)  # the default, as training opens them
    return plain, time.process_time() - cpu


def steps_per_epoch(recipe) -> int:
    """Optimizer steps in one pass over the training split, as the loop's loader plans it (one process)."""
    cfg = recipe.train
    ds = FeatureDataset(recipe.data.features_dir, verify_checksums=False)
    train_idx, _ = ds.split(recipe.data.heldout_fraction, cfg.seed)
    loader = BatchLoader(
        ds, train_idx, batch_size=cfg.batch_size, packing=cfg.packing, max_len=recipe.data.max_len, seed=cfg.seed
    )
    return len(loader) // cfg.grad_accum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="eagle2", choices=["eagle2", "medusa1"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        features = Path(tmp) / "features"
        write_conversations(Path(tmp) / "chat.jsonl")
        target = [f"target.random_init.{kv}" for kv in TARGET]
        data = [
            f"data.train_files=[{Path(tmp) / 'chat.jsonl'}]", f"data.features_dir={features}",
            "data.storage_dtype=bfloat16", f"data.max_len={SEQ}", "data.heldout_fraction=0.05",
        ]  # fmt: skip
        extract_main([str(ROOT / "recipes/tiny/eagle2.yaml"), *target, *data])
        reset_accelerate()
        manifest = json.loads((features / "manifest.json").read_text())
        bare, full, opens = [], [], []
        for r in range(args.rounds):
            overrides = [
                *target, *data, f"train.output_dir={Path(tmp) / f'run{r}'}", f"train.max_steps={args.steps}",
                "train.packing=true", f"train.batch_size={ROWS}", "train.grad_accum=1",
                "train.eval_every=0", "train.save_every=0", "train.log_every=10", "logging.tracker=none",
            ]  # fmt: skip
            recipe = load_recipe(ROOT / f"recipes/tiny/{args.method}.yaml", overrides)
            bare.append(bare_steps(recipe, args.steps))
            full.append(loop_steps(recipe))
            opens.append(open_features(features))
            print(
                f"round {r}: bare {bare[-1][0] * 1e3:.1f} ms/step ({bare[-1][1] * 1e3:.1f} cpu-ms), "
                f"loop {full[-1][0] * 1e3:.1f} ms/step ({full[-1][1] * 1e3:.1f} cpu-ms), "
                f"open {opens[-1][0] * 1e3:.1f} cpu-ms plain, {opens[-1][1] * 1e3:.1f} cpu-ms verified",
                flush=True,
            )
        epoch_steps = steps_per_epoch(recipe)
    best_bare = min(b[1] for b in bare), min(b[0] for b in bare)
    best_full = min(f[1] for f in full), min(f[0] for f in full)
    print(
        f"{args.method} on a random Llama d=256, {ROWS}x{SEQ} packed tokens/step, {torch.get_num_threads()} thread(s); "
        f"best of {args.rounds}: bare {best_bare[0] * 1e3:.1f} cpu-ms/step ({best_bare[1] * 1e3:.1f} ms wall), "
        f"loop {best_full[0] * 1e3:.1f} cpu-ms/step ({best_full[1] * 1e3:.1f} ms wall); "
        f"wall-clock ratio {best_full[1] / best_bare[1]:.2f}"
    )
    hashing = min(o[1] for o in opens) - min(o[0] for o in opens)
    epoch = epoch_steps * best_full[0]
    print(
        f"checksums: {manifest['total_bytes']:,} bytes in {len(manifest['shards'])} shards, "
        f"{manifest['num_tokens']:,} tokens; best of {args.rounds}: hashing at open {hashing * 1e3:.1f} cpu-ms "
        f"({manifest['total_bytes'] / hashing / 1e9:.2f} GB/s); one epoch = {epoch_steps} steps x "
        f"{best_full[0] * 1e3:.1f} cpu-ms = {epoch:.2f} cpu-s"
    )
    print(f"train/step_overhead: {best_full[0] / best_bare[0]:.2f} (goal <= 1.10)")
    print(f"train/checksum_share: {hashing / epoch:.4f} (goal < 0.03)")


if __name__ == "__main__":
    main()
