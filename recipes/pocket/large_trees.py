"""The papers' large trees on the pocket target, after `make demo-pocket` (the second table of docs/pocket.md).

    python recipes/pocket/large_trees.py [--demo artifacts/demo] [--out artifacts/large-trees]

Reuses the demo's self-distilled data, features and EAGLE-2 export; trains one more Medusa-1 variant with 4 heads
(the named 63-node trees are 4 deep; the demo's heads are 3). Then evaluates on the demo's 20 held-out prompts:
  - EAGLE-2, dynamic tree depth 5, top-k 10, 60 tokens (the EAGLE-2 paper's setting), and depth 3, top-k 2, 6 tokens;
  - Medusa-1 (4 heads): Medusa's published 63-node tree `mc_sim_7b_63`, this project's `calibrated63` (grown from
    the Medusa paper's Vicuna-7B head accuracies), and a 64-node tree calibrated from these heads' measured accuracies.
Each step is a subprocess with its log under OUT/logs/; completed steps are skipped when re-run. Prints one table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from eval.report import lossless_mark, markdown_table  # noqa: E402
from recipes.pocket.demo import RECIPES, banner, clear_report, followup_parser, followup_setup, run_step, skip  # noqa: E402

EVALS = {  # name -> (method, recipe overrides)
    "eagle2-dynamic-d5-k10-n60": ("eagle2", ["eval.tree=dynamic", "eval.tree_depth=5", "eval.tree_top_k=10"]),
    "eagle2-dynamic-d3-k2-n6": ("eagle2", ["eval.tree=dynamic", "eval.tree_depth=3", "eval.tree_top_k=2"]),
    "medusa1-4heads-mc_sim_7b_63": ("medusa1", ["drafter.num_heads=4", "eval.tree=mc_sim_7b_63", "eval.tree_depth=4"]),
    "medusa1-4heads-calibrated63": ("medusa1", ["drafter.num_heads=4", "eval.tree=calibrated63", "eval.tree_depth=4"]),
    "medusa1-4heads-calibrated64": (
        "medusa1",
        ["drafter.num_heads=4", "eval.tree=calibrated", "eval.tree_depth=4", "eval.tree_top_k=4"],
    ),
}
TOTAL_TOKENS = {"eagle2-dynamic-d3-k2-n6": 6}  # eval.tree_total_tokens; 60 (EAGLE-2) or 64 (Medusa) otherwise


def main() -> None:
    args = followup_parser(__doc__.split("\n\n")[0], "artifacts/large-trees").parse_args()
    demo, out = Path(args.demo), Path(args.out)
    eagle_export = demo / "eagle2" / "export"
    needed = [demo / "selfdistill.jsonl", demo / "features" / "manifest.json", eagle_export / "config.json"]
    env, log_dir = followup_setup("large_trees", args, needed)
    py, start = sys.executable, time.perf_counter()
    data = [f"data.train_files=[{demo}/selfdistill.jsonl]", f"data.features_dir={demo}/features"]

    medusa_run = out / "medusa1-4heads"
    banner(f"train + export Medusa-1 with 4 heads ({RECIPES['medusa1']} drafter.num_heads=4)")
    if (ROOT / medusa_run / "export" / "config.json").is_file():
        skip(f"{medusa_run}/export")
    else:
        overrides = [*data, "drafter.num_heads=4", f"train.output_dir={medusa_run}", "train.resume=auto"]
        run_step("train-medusa1-4heads", [py, "-m", "train", RECIPES["medusa1"], *overrides], log_dir, env)
        run_step("export-medusa1-4heads", [py, "-m", "export", str(medusa_run)], log_dir, env)

    rows = []
    for name, (method, tree) in EVALS.items():
        drafter = eagle_export if method == "eagle2" else medusa_run / "export"
        report = ROOT / out / name / "report.json"
        banner(f"eval {name}")
        if report.is_file() and report.stat().st_mtime > (ROOT / drafter / "config.json").stat().st_mtime:
            skip(f"{out}/{name}/report.json")
        else:
            total = TOTAL_TOKENS.get(name, 60 if method == "eagle2" else 64)
            overrides = [*data, f"eval.drafter={drafter}", f"eval.output_dir={out}/{name}", *tree]
            overrides += [f"eval.tree_total_tokens={total}", f"eval.max_prompts={args.prompts}"]
            overrides += ["eval.draft_vocab=0"]  # the papers' trees draft over the whole vocabulary
            clear_report(report.parent)
            run_step(f"eval-{name}", [py, "-m", "eval", RECIPES[method], *overrides], log_dir, env)
        r = json.loads(report.read_text())
        label = method + (" (4 heads)" if method == "medusa1" else "")
        rows.append(
            [
                label,
                r["tree"],
                f"{r['accept_len']:.2f}",
                f"{r['speedup_vs_plain']:.2f}×",
                f"{lossless_mark(r)} {r['lossless_prompts']}",
            ]
        )
    banner("large trees on the pocket target (greedy)")
    print(markdown_table(["method", "tree", "τ", "vs plain (CPU)", "lossless"], rows))
    print(f"\nReports: {out}/<run>/report.md (+ .png). Total {time.perf_counter() - start:.0f}s.")


if __name__ == "__main__":
    main()
