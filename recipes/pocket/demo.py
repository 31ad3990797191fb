"""The whole pipeline on the bundled pocket target, on CPU, in under 15 minutes: `make demo-pocket`.

    python recipes/pocket/demo.py [--target recipes/pocket/target] [--out artifacts/demo] [--threads 1]

Steps, each a subprocess with its log under OUT/logs/ (re-run to resume: self-distillation and extraction keep what is
complete and refuse outputs of other settings; training and evaluation are skipped once done with these recipes):
  1. self-distil: the pocket target continues training prompts greedily   (python -m data.selfdistill)
  2. extract: the target's last hidden state over those samples            (python -m data.extract)
  3. train + export an EAGLE-2 drafter and Medusa-1 heads                  (python -m train, python -m export)
  4. evaluate both on held-out prompts: plain vs speculative vs prompt lookup (python -m eval)
then one table: method, tree, τ, speedup vs plain and vs transformers' prompt lookup, lossless ✓/✗.

Recipes: recipes/pocket/eagle2.yaml and recipes/pocket/medusa1.yaml (data sizes, steps, trees). Trees are
small on purpose: on a CPU verifying a token costs nearly as much as generating one, so a big tree does not
pay for itself as it does on a GPU. Decoding runs single-threaded by default: for batch-1 decoding of a
10M-parameter model a second thread mostly adds synchronisation (and the timings get noisier). Training is
single-threaded too by default: on a shared machine a second spinning thread can halve its speed; on an idle
one `--train-threads 2` saves about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from eval.report import lossless_mark, markdown_table
from recipes.run import read_recipe
from recipes.steps import banner, clear_report, run_step, skip, trained

ROOT = Path(__file__).resolve().parents[2]

RECIPES = {"eagle2": "recipes/pocket/eagle2.yaml", "medusa1": "recipes/pocket/medusa1.yaml"}
DEFAULT_TARGET, DEFAULT_OUT = "recipes/pocket/target", "artifacts/demo"
SELFDISTILL_PROMPTS = 2048
SELFDISTILL_TOKENS = 96


def followup_parser(description: str, default_out: str) -> argparse.ArgumentParser:
    """Command line of the scripts that run after the demo on its outputs (large_trees.py, medusa2_compare.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--demo", default=DEFAULT_OUT, help="the output directory of a finished `make demo-pocket`")
    parser.add_argument("--out", default=default_out, help="where every output goes (gitignored)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for training and decoding")
    parser.add_argument("--prompts", type=int, default=20, help="held-out prompts per evaluation")
    return parser


def followup_setup(name: str, args: argparse.Namespace, needed: list[Path]) -> tuple[dict[str, str], Path]:
    """Check that the demo's outputs a follow-up needs exist; create OUT/logs. -> (subprocess env, log dir)."""
    for path in needed:
        if not (ROOT / path).is_file():
            sys.exit(f"{name}: {path} is missing: run `make demo-pocket` first (or pass --demo)")
    log_dir = ROOT / args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}, log_dir


def times(value: float | None, suffix: str = "×") -> str:
    """A report figure for the table; "n/a" where the recipe's baselines did not measure it."""
    return "n/a" if value is None else f"{value:.2f}{suffix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="pocket target directory (HF format)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where every output goes (gitignored)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for decoding (self-distil, eval)")
    parser.add_argument("--train-threads", type=int, default=1, help="for extraction and training")
    parser.add_argument("--prompts", type=int, default=SELFDISTILL_PROMPTS, help="self-distillation prompts")
    args = parser.parse_args()

    target, out = Path(args.target), Path(args.out)
    if not (ROOT / target / "config.json").is_file():
        sys.exit(
            f"demo: no pocket target at {target} (config.json missing): pretrain it with recipes/pocket/pretrain.py"
        )
    out_abs = ROOT / out
    log_dir = out_abs / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    train_env = {**env, "OMP_NUM_THREADS": str(args.train_threads)}
    py = sys.executable

    # The recipes' paths are the defaults; other --target / --out values reach every step as overrides.
    def overrides(method: str) -> list[str]:
        out_keys = [
            f"data.train_files=[{out}/selfdistill.jsonl]",
            f"data.features_dir={out}/features",
            f"train.output_dir={out}/{method}",
            f"eval.output_dir={out}/{method}/eval",
        ]
        default_target, default_out = target == Path(DEFAULT_TARGET), out == Path(DEFAULT_OUT)
        return ([] if default_target else [f"target.path={target}"]) + ([] if default_out else out_keys)

    start = time.perf_counter()
    banner(f"1/4 self-distillation: the target continues {args.prompts} training prompts ({SELFDISTILL_TOKENS} tokens)")
    # Self-distillation and extraction always run: they keep what is complete and refuse outputs made with other
    # prompts, settings or another target (more prompts extend the answers, and the features follow).
    cmd = [py, "-m", "data.selfdistill", "--target", str(target), "--prompts", "recipes/pocket/prompts/train.jsonl"]
    cmd += ["--out", str(out / "selfdistill.jsonl"), "--limit", str(args.prompts), "--seed", "0"]
    cmd += ["--max-new-tokens", str(SELFDISTILL_TOKENS), "--batch-size", "32", "--dtype", "float32"]
    run_step("selfdistill", cmd, log_dir, env)

    banner("2/4 feature extraction (shared by both drafters: same target, data and layers)")
    run_step("extract", [py, "-m", "data.extract", RECIPES["eagle2"], *overrides("eagle2")], log_dir, train_env)

    for method, recipe in RECIPES.items():
        banner(f"3/4 train + export {method} ({recipe})")
        run_dir = out / method
        if trained(ROOT / run_dir, int(read_recipe(recipe)["train"]["max_steps"])):
            skip(f"{run_dir}/export")
            continue
        resume = ["train.resume=auto"]  # continues an interrupted run from its last checkpoint
        run_step(f"train-{method}", [py, "-m", "train", recipe, *overrides(method), *resume], log_dir, train_env)
        run_step(f"export-{method}", [py, "-m", "export", str(run_dir)], log_dir, env)

    for method, recipe in RECIPES.items():
        banner(f"4/4 eval {method}: plain vs speculative vs prompt lookup on held-out prompts")
        report, export = out_abs / method / "eval" / "report.json", out_abs / method / "export" / "config.json"
        newest_input = max(export.stat().st_mtime, (ROOT / recipe).stat().st_mtime)
        if report.is_file() and report.stat().st_mtime > newest_input:  # newer than the drafter and the recipe
            skip(f"{out}/{method}/eval/report.json")
            continue
        clear_report(out_abs / method / "eval")
        run_step(f"eval-{method}", [py, "-m", "eval", recipe, *overrides(method)], log_dir, env)

    rows, reports = [], [json.loads((out_abs / m / "eval" / "report.json").read_text()) for m in RECIPES]
    for method, r in zip(RECIPES, reports):
        rows.append(
            [
                method,
                r["tree"],
                times(r["accept_len"], ""),
                times(r["speedup_vs_plain"]),
                times(r["speedup_vs_prompt_lookup"]),
                f"{lossless_mark(r)} ({r['lossless_prompts']})",
            ]
        )
    any_report = reports[0]
    n, tokens = any_report["num_prompts"], any_report["max_new_tokens"]
    banner(f"pocket demo: {n} held-out prompts, up to {tokens} new tokens each, greedy decoding")
    header = ["method", "tree", "τ", "speedup vs plain", "vs prompt lookup", "lossless"]
    print(markdown_table(header, rows))
    print(
        f"\nplain decoding {times(any_report['tokens_per_s']['plain'], ' tok/s')}; transformers prompt lookup "
        f"{times(any_report.get('prompt_lookup_vs_plain'))} plain. Reports: {out}/<method>/eval/report.md (+ .png). "
        f"Total {time.perf_counter() - start:.0f}s."
    )


if __name__ == "__main__":
    main()
