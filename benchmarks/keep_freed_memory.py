"""What keeping freed memory (`models.host.keep_freed_memory`) saves a CPU training step.

    .venv/bin/python -m benchmarks.keep_freed_memory [RECIPE] [key=value ...] [--steps 6] [--rounds 2] [--threads 2]

Runs the drafter's training step (forward, backward, AdamW step) of the recipe on its feature shards in child
processes, alternately with glibc's own settings (`SPECDRAFT_MALLOC=default`) and with freed memory kept, the same
batches in the same order in each; a child times its steps after one warm-up step. Prints per-step wall-clock, user
and system CPU seconds and page faults (medians over the rounds); the goal line compares the wall-clock of a step.
Default recipe: SmolLM2's EAGLE-3.1 (`recipes/smollm2/eagle3.yaml target.dtype=float32`), whose feature set is
extracted (and has its target statistics) already. Run it on an otherwise idle machine. Goal: ≤ 0.9 of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(recipe_path: str, overrides: list[str], steps: int) -> None:
    import torch
    from accelerate import Accelerator

    from benchmarks.step_setup import drafter_on_features, first_batches
    from models.host import keep_freed_memory
    from schema.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    accelerator = Accelerator(cpu=True)
    kept = keep_freed_memory(accelerator.device)
    drafter, dataset, _ = drafter_on_features(recipe, accelerator)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=recipe.train.lr)
    batches = iter(first_batches(recipe, dataset, steps + 1))
    records = []
    for i in range(steps + 1):
        batch = next(batches)
        torch.manual_seed(i)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        drafter(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if i:  # the first step warms up
            records.append({"wall": t1 - t0, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                            "faults": r1.ru_minflt - r0.ru_minflt})  # fmt: skip
    print(json.dumps({"kept": kept, "steps": records}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="recipes/smollm2/eagle3.yaml")
    parser.add_argument("overrides", nargs="*", default=["target.dtype=float32"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.recipe, args.overrides, args.steps)
        return
    results: dict[str, list[dict]] = {"glibc's settings": [], "kept": []}
    for _ in range(args.rounds):
        for name, setting in (("glibc's settings", "default"), ("kept", "")):
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "SPECDRAFT_MALLOC": setting}
            command = [sys.executable, "-m", "benchmarks.keep_freed_memory", args.recipe, *args.overrides,
                       "--steps", str(args.steps), "--child"]  # fmt: skip
            out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"benchmarks.keep_freed_memory: the child failed:\n{out.stderr[-2000:]}")
            report = json.loads(out.stdout.strip().splitlines()[-1])
            if report["kept"] != (name == "kept"):
                raise SystemExit(f"benchmarks.keep_freed_memory: {name}: the child reports kept={report['kept']}")
            results[name].extend(report["steps"])
    setup = f"{args.steps} steps x {args.rounds} rounds, {args.threads} threads"
    print(f"{args.recipe} {' '.join(args.overrides)}: {setup}")
    median = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    for name, m in median.items():
        print(f"  {name:<17} wall {m['wall']:6.2f} s  user {m['user']:6.2f} s  sys {m['sys']:6.2f} s  "
              f"page faults {m['faults']:>10,.0f}  (medians per step)")  # fmt: skip
    ratio = median["kept"]["wall"] / median["glibc's settings"]["wall"]
    print(f"keep_freed_memory/step: {ratio:.2f} (goal <= 0.9)")


if __name__ == "__main__":
    main()
