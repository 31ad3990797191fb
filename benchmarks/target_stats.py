"""What the target's stored statistics save an EAGLE-3 / P-EAGLE training step (`data.target_stats`).

    .venv/bin/python -m benchmarks.target_stats [RECIPE] [key=value ...] [--batches 4] [--rounds 2]

Reads the recipe's feature set (its statistics stored: `python -m data.target_stats RECIPE` first) and times, on one
thread, the drafter's training step (`drafter(batch)["loss"].backward()`) on the same batches with the statistics
(the K draft rows of the target's head) and without them (the whole head), interleaved, each batch alternately first;
process CPU time, so that other jobs on the machine do not move the figures. The losses of the two must agree.
Default recipe: SmolLM2's EAGLE-3.1 (`recipes/smollm2/eagle3.yaml target.dtype=float32`). Goal: a step with the
statistics costs at most 0.9 of one without.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from accelerate import Accelerator

from benchmarks.step_setup import drafter_on_features, first_batches
from data.shards import FeatureDataset
from schema.recipe import load_recipe


def step_seconds(drafter, batch) -> tuple[float, float]:
    """(process CPU seconds of one forward + backward, its loss)."""
    drafter.zero_grad(set_to_none=True)
    start = time.process_time()
    out = drafter(batch)
    out["loss"].backward()
    return time.process_time() - start, float(out["loss"].detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="recipes/smollm2/eagle3.yaml")
    parser.add_argument("overrides", nargs="*", default=["target.dtype=float32"])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(args.recipe, args.overrides)
    drafter, stored, line = drafter_on_features(recipe, Accelerator(cpu=True))
    if stored.statistics is None:
        raise SystemExit(f"benchmarks.target_stats: {line}")
    plain = FeatureDataset(recipe.data.features_dir, verify_checksums=False)
    batches = [first_batches(recipe, dataset, args.batches) for dataset in (stored, plain)]
    step_seconds(drafter, batches[1][0])  # warm-up
    times: dict[str, list[float]] = {"stored": [], "whole head": []}
    for r in range(args.rounds):
        for i in range(args.batches):
            order = [("stored", batches[0][i]), ("whole head", batches[1][i])]
            results = {}
            for name, batch in order if (r + i) % 2 == 0 else order[::-1]:
                torch.manual_seed(i)  # the same input noise for both
                seconds, loss = step_seconds(drafter, batch)
                times[name].append(seconds)
                results[name] = loss
            if abs(results["stored"] - results["whole head"]) > 1e-4 * abs(results["whole head"]):
                raise SystemExit(f"benchmarks.target_stats: batch {i}: losses differ: {results}")
    tokens = statistics.mean(int(b["attention_mask"].sum()) for b in batches[1])
    print(f"{recipe.source}: {args.batches} batches x {args.rounds} rounds, ~{tokens:.0f} tokens a batch, one thread")
    for name, values in times.items():
        print(f"  {name:<10} {statistics.median(values):7.2f} s a step (median of {len(values)})")
    ratio = statistics.median(times["stored"]) / statistics.median(times["whole head"])
    print(f"target_stats/step: {ratio:.2f} (goal <= 0.9)")


if __name__ == "__main__":
    main()
